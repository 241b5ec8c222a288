"""The cost model against a real GPU: measured profile, step time and peak memory.

Two halves, because a GPU is lent only now and then and never to CI:

``--run`` (on a CUDA machine; ``--device cpu`` rehearses it on tiny shapes)
    1. ``autoplan profile --device cuda`` on every GPU of the machine (one is enough):
       matmuls per dtype, the memory copy, torch's fused attention (causal SDPA,
       forward and backward); the profile and its raw measurements go to ``--out``.
    2. Single-GPU training steps of :func:`autoplan.parallelize` programs, bf16
       (``Strategy(precision="bf16")``: the program of :mod:`autoplan.precision`; runs
       made before it, whose results name no ``precision_program``, ran bf16 autocast
       over fp32 weights and are priced as that program, :data:`PROGRAMS`),
       for the models of :data:`MODELS` (GPT and Llama shapes of 1-3B parameters) under
       recompute none / selective / full: ``WARMUP`` steps, then ``TIMED`` steps each
       timed between ``torch.cuda.synchronize()`` calls (the median is the measured step),
       and ``torch.cuda.max_memory_allocated()`` over the timed steps (after the warm-up,
       so the optimizer states exist).  Each model runs in its own process; a case that
       runs out of memory is recorded as such.  Results are written to
       ``--out/results.json`` after every case, so a run cut short keeps what it measured.

report (the default; no GPU needed)
    For each measured case, the estimate of :func:`autoplan.estimate` for the same model
    (traced on the meta device) and ``Strategy``, on clusters of one device:

    * ``shipped``: the shipped datasheet profile of the GPU (``--shipped``, default the
      run's GPU's, :func:`shipped_profile`) with the published-run calibration, what a
      user gets who has never profiled;
    * ``kernels``: the same profile with the measured kernel tables of
      :data:`KERNEL_TABLES` (``CostOptions.kernel_tables``, :mod:`autoplan.cost.kernels`:
      torch's kernels measured on the H100 of the layout run, so its H200 runs are held
      out from them);
    * ``measured``: the profile measured in step 1 (its own matmul, copy and attention
      figures, and the host's time per operator, which the cost model sets against the
      device's per layer; ``DeviceType.measured``, so no calibration on top).

    It prints measured and predicted step time and peak memory per case, with their
    errors; the memory prediction is the estimate's allocated bytes (model states,
    activations, buffers) without its allocator reserve, which is what
    ``max_memory_allocated`` counts.

    python benchmarks/gpu_truth.py --run --out gpu-run           # on the GPU machine (~4 min)
    python benchmarks/gpu_truth.py --run --precision bf16 --precision fp8 --model llama-1b
                                    # FP8 (torchao, autoplan.runtime.fp8) against bf16
    python benchmarks/gpu_truth.py          # report the committed runs (H100, H200)
    python benchmarks/gpu_truth.py --results benchmarks/gpu_truth/h100-2026-11-26
    python benchmarks/gpu_truth.py --run --device cpu --out /tmp/rehearsal   # tiny, on a CPU
    python benchmarks/gpu_truth.py --results /tmp/rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from autoplan.records import atomic_write_text  # noqa: E402
from _ranks import _free_port  # noqa: E402  (benchmarks/, this script's folder)

#: Models measured on the GPU: (name, family, config, sequence length, global batch,
#: micro-batch).  GPT: autoplan.models.GPT with GPT-3 XL's shape (Brown et al. 2020,
#: Table 2.1) and torch's fused attention.  Llama: Hugging Face LlamaForCausalLM with the
#: shapes of Llama 3.2 1B and 3B (meta-llama config.json: tied embeddings, 8 KV heads),
#: SDPA attention.
MODELS = {
    "gpt-1.3b": ("gpt", dict(vocab_size=51200, hidden=2048, heads=16, layers=24), 2048, 8, 4),
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8,
                               vocab_size=128256, tie_word_embeddings=True), 2048, 8, 4),
    "llama-3b": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                               num_attention_heads=24, num_key_value_heads=8,
                               vocab_size=128256, tie_word_embeddings=True), 2048, 4, 2),
}
# the 3B at one sequence a micro-batch, where its recompute none and selective fit 80 GB
MODELS["llama-3b-mb1"] = (*MODELS["llama-3b"][:4], 1)
#: The same families at rehearsal size (``--device cpu``): the code path, not the figures.
TINY = {
    "gpt-tiny": ("gpt", dict(vocab_size=256, hidden=64, heads=4, layers=2), 64, 4, 2),
    "llama-tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                 tie_word_embeddings=True), 64, 4, 2),
}
RECOMPUTE = ("none", "selective", "full")
#: ``--recompute`` may run only some of them (as ``AUTOPLAN_GPU_TRUTH_RECOMPUTE``, for the
#: model processes)
_RECOMPUTE_ENV = "AUTOPLAN_GPU_TRUTH_RECOMPUTE"
WARMUP = 3
TIMED = 6
PRECISION = "bf16"
#: ``--precision`` may run other recipes too (as ``AUTOPLAN_GPU_TRUTH_PRECISION``, for the
#: model processes): FP8 as torchao runs it, on GPUs with FP8 matmuls (emulated on a CPU
#: rehearsal)
_PRECISION_ENV = "AUTOPLAN_GPU_TRUTH_PRECISION"


def build_model(family: str, config: dict, seq_len: int, device: str):
    """The model on ``device`` (``"meta"`` for tracing), seeded."""
    import torch
    torch.manual_seed(0)
    with torch.device(device):
        if family == "gpt":
            from autoplan.models import GPT, GPTConfig
            return GPT(GPTConfig(seq_len=seq_len, attention="sdpa", **config))
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(max_position_embeddings=seq_len, **config)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg)


#: The cost options that describe the program a run measured, by its results'
#: ``precision_program``: ``"fsdp2"`` (FSDP2's mixed-precision policy, what
#: :func:`autoplan.parallelize` runs now: the ``autoplan`` stack as it is), or
#: ``"autocast"`` (runs made before 2026-11-28: bf16 as torch.autocast over fp32 weights,
#: with their 16-bit gradients and fp32 master copy counted as Rajbhandari et al. do)
PROGRAMS = {"fsdp2": {},
            "autocast": {"autocast": True, "master_weights": "optimizer",
                         "grad_reduce_dtype": "bf16"}}
#: The measured kernel tables the report's ``kernels`` column prices the shipped profile with
KERNEL_TABLES = "torch-eager"
#: What :func:`run_main` records: the program this code runs
PROGRAM = "fsdp2"


def run_options(results: dict):
    """The :class:`~autoplan.cost.CostOptions` of the program ``results`` measured."""
    from autoplan.cost import CostOptions
    return CostOptions(**PROGRAMS[results.get("precision_program", "autocast")])


def strategy(global_batch: int, micro_batch: int, recompute: str, precision: str = PRECISION):
    from autoplan import Strategy
    return Strategy(global_batch=global_batch, micro_batch=micro_batch, recompute=recompute,
                    precision=precision)


# ----------------------------------------------------------------------------- run


def _write_results(out: Path, results: dict) -> None:
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, sort_keys=True))


def _model_worker(name: str, spec: tuple, device: str, row_file: Path) -> int:
    """One model's cases in this process (one rank, world 1); appends a JSON line per case."""
    import torch
    import torch.distributed as dist
    from autoplan import trace
    from autoplan.runtime import parallelize

    family, config, seq_len, global_batch, micro_batch = spec
    cuda = device == "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    graph = trace(build_model(family, config, seq_len, "meta"), seq_len=seq_len)
    trace_s = time.perf_counter() - t0
    cases = [(precision, recompute)
             for precision in os.environ.get(_PRECISION_ENV, PRECISION).split(",")
             for recompute in os.environ.get(_RECOMPUTE_ENV, ",".join(RECOMPUTE)).split(",")]
    for precision, recompute in cases:
        row = {"model": name, "family": family, "recompute": recompute, "seq_len": seq_len,
               "global_batch": global_batch, "micro_batch": micro_batch, "trace_s": trace_s,
               "precision": precision}
        pm = None
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            model = build_model(family, config, seq_len, device)
            row["params"] = sum(p.numel() for p in model.parameters())
            pm = parallelize(model, strategy(global_batch, micro_batch, recompute, precision),
                             global_batch=global_batch, seq_len=seq_len, graph=graph,
                             fp8_emulate=not cuda)
            del model
            gen = torch.Generator().manual_seed(1)
            vocab = config.get("vocab_size")
            ids = torch.randint(0, vocab, (global_batch, seq_len), generator=gen).to(device)
            for _ in range(WARMUP):
                loss = pm.step(ids)
            sync()
            if cuda:
                row["allocated_before_bytes"] = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(TIMED):
                sync()
                t = time.perf_counter()
                loss = pm.step(ids)
                sync()
                times.append(time.perf_counter() - t)
            row.update(step_s=statistics.median(times), steps_s=times, loss=float(loss))
            if cuda:
                row.update(max_allocated_bytes=torch.cuda.max_memory_allocated(),
                           max_reserved_bytes=torch.cuda.max_memory_reserved())
                row["kernels"] = _kernel_breakdown(torch, lambda: pm.step(ids))
        except Exception as exc:  # noqa: BLE001 - recorded, and the next case goes on
            oom = type(exc).__name__ == "OutOfMemoryError"
            row["error"] = ("out of memory: " if oom else "") + f"{type(exc).__name__}: {exc}"[:600]
            if not oom:
                row["traceback"] = traceback.format_exc()[-3000:]
        finally:
            pm = model = None  # noqa: F841 - free the program before the next case
            if cuda:
                torch.cuda.empty_cache()
        with open(row_file, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[gpu_truth] {name} {precision} recompute={recompute}: "
              + (f"{row['step_s'] * 1e3:.1f} ms, peak {row.get('max_allocated_bytes', 0) / 2**30:.2f} GiB"
                 if "step_s" in row else row["error"][:200]), flush=True)
    dist.destroy_process_group()
    return 0


#: Kernel name fragments by kind, for the per-kind GPU time of one profiled step
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "attn")),
                ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul")),
                ("optimizer", ("adam", "multi_tensor", "foreach")))


def kernel_kind(name: str) -> str:
    """``attention``, ``matmul``, ``optimizer`` or ``other`` for a CUDA kernel's name.

    >>> kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32"), kernel_kind("flash_fwd_kernel")
    ('matmul', 'attention')
    """
    low = name.lower()
    for kind, parts in KERNEL_KINDS:
        if any(p in low for p in parts):
            return kind
    return "other"


def _kernel_breakdown(torch, step) -> dict:
    """GPU time per kernel kind over one step under torch.profiler, and the longest kernels
    (a diagnostic: a failure is recorded, not raised)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kinds: dict[str, float] = {}
        top = []
        for e in prof.key_averages():
            us = float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0))
            if us <= 0:
                continue
            kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0.0) + us * 1e-6
            top.append((us * 1e-6, e.count, e.key[:120]))
        top.sort(reverse=True)
        return {"seconds_by_kind": kinds, "top": top[:60], "wall_s": wall,
                "kernel_s": sum(kinds.values())}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def run_main(out: Path, device: str, models: list[str], timeout_s: float) -> int:
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_truth: --run --device cuda, but torch sees no CUDA device "
              "(rehearse with --device cpu)", file=sys.stderr)
        return 2
    zoo = TINY if device == "cpu" else MODELS
    unknown = [m for m in models if m not in zoo]
    if unknown:
        print(f"gpu_truth: unknown model {unknown[0]!r} for --device {device}; choose from "
              f"{sorted(zoo)}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"host": socket.gethostname(), "device": device,
                     "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "torch": torch.__version__, "precision": PRECISION,
                     "precision_program": PROGRAM,
                     "warmup": WARMUP, "timed": TIMED, "cases": []}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
        results["capability"] = list(torch.cuda.get_device_capability(0))
    try:
        import transformers
        results["transformers"] = transformers.__version__
    except ImportError:
        pass
    _write_results(out, results)

    # 1. the profile
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "autoplan.cli", "profile", "--device", device,
           "--nproc", "1", "--out", str(out / "profile.yaml"), "--name", f"measured-{device}",
           "--json"] + (["--quick"] if device == "cpu" else [])
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    sys.stderr.write(proc.stderr[-4000:])
    results["profile_s"] = time.perf_counter() - t0
    if proc.returncode == 0:
        measured = json.loads(proc.stdout)
        atomic_write_text(out / "profile-measurements.json",
                          json.dumps(measured["measurements"], indent=1, sort_keys=True))
    else:
        results["profile_error"] = (proc.stdout + proc.stderr)[-3000:]
    _write_results(out, results)

    # 2. the steps, one process per model
    rows = out / "cases.jsonl"
    rows.unlink(missing_ok=True)
    for name in models or list(zoo):
        t0 = time.perf_counter()
        code = subprocess.run([sys.executable, __file__, "--worker", name, "--device", device,
                               "--rows", str(rows)], cwd=REPO, timeout=timeout_s).returncode
        done = [json.loads(l) for l in rows.read_text().splitlines()] if rows.exists() else []
        results["cases"] = done
        if code != 0:
            results.setdefault("worker_errors", []).append(f"{name}: exit code {code}")
        results.setdefault("model_s", {})[name] = time.perf_counter() - t0
        _write_results(out, results)
    print(f"[gpu_truth] wrote {out / 'results.json'}", flush=True)
    return 0


# ----------------------------------------------------------------------------- report


def _device_cluster(path_or_name: str):
    from autoplan.hardware import load_cluster
    return load_cluster(path_or_name, nodes=1, devices_per_node=1)


def report_rows(results: dict, clusters: dict, zoo: dict,
                kernel_tables: dict | None = None) -> list[dict]:
    """Measured against each cluster's estimate, per case; ``kernel_tables`` maps a label to
    the measured kernel tables its estimate uses (``CostOptions.kernel_tables``)."""
    from dataclasses import replace

    from autoplan import estimate, trace
    graphs: dict = {}
    rows = []
    options = run_options(results)
    kernel_tables = kernel_tables or {}
    for case in results["cases"]:
        spec = zoo.get(case["model"])
        if spec is None:
            continue
        family, config, seq_len, global_batch, micro_batch = spec
        if case["model"] not in graphs:
            graphs[case["model"]] = trace(build_model(family, config, seq_len, "meta"),
                                          seq_len=seq_len)
        precision = case.get("precision", PRECISION)
        s = strategy(case["global_batch"], case["micro_batch"], case["recompute"], precision)
        kernels = case.get("kernels") or {}
        row = {"model": case["model"] + ("" if precision == PRECISION else f" {precision}"),
               "recompute": case["recompute"],
               "measured_s": case.get("step_s"), "measured_bytes": case.get("max_allocated_bytes"),
               "gpu_busy_s": kernels.get("kernel_s"), "error": case.get("error")}
        for label, cluster in clusters.items():
            e = estimate(graphs[case["model"]], cluster, s,
                         options=replace(options, kernel_tables=kernel_tables.get(label, "")))
            mem = e.stages[0].memory
            row[f"pred_{label}_s"] = e.step_time_s
            row[f"pred_{label}_bytes"] = mem.total_bytes - mem.reserve_bytes   # allocated
            row[f"pred_{label}_fits"] = e.fits
            row[f"pred_{label}_peak_bytes"] = e.peak_memory_bytes
        rows.append(row)
    return rows


#: A step the GPU bounds: its wall time within this factor of the GPU's busy time (the rest
#: is host-bound: the host dispatches slower than the GPU computes)
GPU_BOUND = 1.10


def gpu_bound(row: dict) -> bool:
    """Whether a reported case's wall step is within :data:`GPU_BOUND` of the GPU's busy
    time."""
    return bool(row["measured_s"] and row["gpu_busy_s"]
                and row["measured_s"] <= GPU_BOUND * row["gpu_busy_s"])


def _pct(pred: float | None, meas: float | None) -> str:
    if pred is None or not meas:
        return "   -  "
    return f"{(pred / meas - 1) * 100:+6.1f}%"


#: The committed GPU runs: on an H100 the one with every case (its profile beside it,
#: device figures only) and the later one with the host's time per operator in its
#: profile (under ``profiles/measured/``); on an H200 every case (where the 3B fits at
#: micro-batch 2), its profile beside it (host time, no memory-bound rates); and, on an
#: H200 and an H100, runs whose profiles time memory-bound operators by kind on the GPU,
#: broadcasts and layout copies too (``profiles/measured/``).  ``--results`` reports one;
#: without it, :data:`REPORTED`.
RUNS = REPO / "benchmarks" / "gpu_truth"
FIRST = RUNS / "h100-2026-11-26"
LATEST = RUNS / "h100-2026-11-26-host"
H200 = RUNS / "h200-2026-11-27"
LAYOUT = (RUNS / "h200-2026-11-27-layout", RUNS / "h100-2026-11-27-layout")
REPORTED = (LATEST, H200, *LAYOUT)
#: The shipped datasheet profile a run is compared with, by the GPU's name as torch gives
#: it (first match; ``--shipped`` overrides)
SHIPPED = (("H200", "h200-sxm-141gb"), ("H100", "h100-sxm5-80gb"),
           ("A100-SXM4-40GB", "a100-sxm4-40gb"), ("A100", "a100-sxm4-80gb"),
           ("B200", "b200-sxm-180gb"), ("V100", "v100-sxm2-32gb"))


def shipped_profile(gpu: str | None) -> str:
    """The shipped profile of :data:`SHIPPED` for a GPU named ``gpu``
    (``h100-sxm5-80gb`` for one it does not know)."""
    for key, name in SHIPPED:
        if key in (gpu or ""):
            return name
    return "h100-sxm5-80gb"


def _measured_profile(results_dir: Path, results: dict) -> Path | None:
    """The run's measured profile: ``profile.yaml`` beside its results, or the file its
    ``profile`` entry names (a committed run's, under ``profiles/measured/``)."""
    here = results_dir / "profile.yaml"
    if here.is_file():
        return here
    named = results.get("profile")
    return REPO / named if named and (REPO / named).is_file() else None


def report_main(results_dir: Path, shipped: str | None) -> int:
    from autoplan.errors import AutoplanError
    path = results_dir / "results.json"
    if not path.is_file():
        print(f"gpu_truth: no {path}; measure with --run --out {results_dir} first",
              file=sys.stderr)
        return 2
    try:
        results = json.loads(path.read_text())
        results["cases"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"gpu_truth: {path} is not a gpu_truth results file ({type(exc).__name__}: "
              f"{exc}); measure with --run --out {results_dir}", file=sys.stderr)
        return 2
    zoo = TINY if results.get("device") == "cpu" else MODELS
    clusters = {}
    try:
        if results.get("device") != "cpu":
            clusters["shipped"] = _device_cluster(shipped or shipped_profile(results.get("gpu")))
            clusters["kernels"] = clusters["shipped"]
        measured = _measured_profile(results_dir, results)
        if measured is not None:
            clusters["measured"] = _device_cluster(str(measured))
    except AutoplanError as exc:
        print(f"gpu_truth: {exc}", file=sys.stderr)
        return 2
    rows = report_rows(results, clusters, zoo, kernel_tables={"kernels": KERNEL_TABLES})
    print(f"{results.get('gpu', results.get('device'))}, torch {results.get('torch')}, "
          f"{results.get('when')}; {PRECISION}, one device; step = median of "
          f"{results.get('timed')} after {results.get('warmup')} warm-up")
    labels = list(clusters)
    gib = 2**30
    head = f"{'model':12s} {'recompute':9s} {'step ms':>8s} {'GPU busy':>8s} " + " ".join(
        f"{l + ' ms':>12s} {'err':>7s}" for l in labels) + f" {'peak GiB':>9s} " + " ".join(
        f"{l + ' GiB':>13s} {'err':>7s}" for l in labels)
    print(head)
    for r in rows:
        if r["measured_s"] is None:
            print(f"{r['model']:12s} {r['recompute']:9s} {'failed':>8s}  {r['error'][:60]}"
                  + "".join(f"  [{l}: {r['pred_' + l + '_peak_bytes'] / gib:.1f} GiB with its "
                            f"reserve, {'fits' if r['pred_' + l + '_fits'] else 'does not fit'}]"
                            for l in labels))
            continue
        busy = r["gpu_busy_s"]
        line = (f"{r['model']:12s} {r['recompute']:9s} {r['measured_s'] * 1e3:8.1f} "
                f"{busy * 1e3 if busy else float('nan'):8.1f} ")
        line += " ".join(f"{r['pred_' + l + '_s'] * 1e3:12.1f} {_pct(r['pred_' + l + '_s'], r['measured_s']):>7s}"
                         for l in labels)
        mb = r["measured_bytes"]
        line += f" {mb / gib if mb else float('nan'):9.2f} " + " ".join(
            f"{r['pred_' + l + '_bytes'] / gib:13.2f} {_pct(r['pred_' + l + '_bytes'], mb):>7s}" for l in labels)
        print(line)
    print("GPU busy: the kernels' time in one more step under torch.profiler (a step well "
          "above it is host-bound: the host dispatches slower than the GPU computes)")
    for l in labels:
        t = [abs(r["pred_" + l + "_s"] / r["measured_s"] - 1) for r in rows if r["measured_s"]]
        m = [abs(r["pred_" + l + "_bytes"] / r["measured_bytes"] - 1) for r in rows if r["measured_bytes"]]
        g = [abs(r["pred_" + l + "_s"] / r["gpu_busy_s"] - 1) for r in rows if r["gpu_busy_s"]]
        bound = [abs(r["pred_" + l + "_s"] / r["measured_s"] - 1) for r in rows
                 if r["measured_s"] and r["gpu_busy_s"] and gpu_bound(r)]
        if bound:
            print(f"{l}, the {len(bound)} steps the GPU bounds (within {GPU_BOUND - 1:.0%} of "
                  f"its busy time): mean |error| {statistics.fmean(bound) * 100:.1f}% "
                  f"(worst {max(bound) * 100:.1f}%)")
        if t:
            print(f"{l}: step time mean |error| {statistics.fmean(t) * 100:.1f}% "
                  f"(worst {max(t) * 100:.1f}%)"
                  + (f", against GPU busy {statistics.fmean(g) * 100:.1f}% "
                     f"(worst {max(g) * 100:.1f}%)" if g else "")
                  + (f"; peak memory mean |error| {statistics.fmean(m) * 100:.1f}% "
                     f"(worst {max(m) * 100:.1f}%)" if m else ""))
    return 0


_DEFAULT_OUT = Path("gpu-truth")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="measure (needs CUDA unless --device cpu)")
    p.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="--run's output folder")
    p.add_argument("--results", type=Path, default=None,
                   help="a --run output folder to report (default: the committed runs, "
                        + ", ".join(str(r.relative_to(REPO)) for r in REPORTED) + ")")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", action="append", default=[], help="only this model (repeatable)")
    p.add_argument("--shipped", default=None,
                   help="the shipped profile to compare with (default: the run's GPU's, "
                        "h100-sxm5-80gb for an H100, h200-sxm-141gb for an H200...)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per step of --run")
    p.add_argument("--precision", action="append", default=[],
                   choices=("bf16", "fp8", "fp8-rowwise"),
                   help="run these recipes (repeatable; default bf16): FP8 as torchao runs it")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        zoo = TINY if args.device == "cpu" else MODELS
        return _model_worker(args.worker, zoo[args.worker], args.device, args.rows)
    if args.precision:
        os.environ[_PRECISION_ENV] = ",".join(args.precision)
    if args.run:
        return run_main(args.out, args.device, args.model, args.timeout)
    if args.results is None and args.out == _DEFAULT_OUT:
        codes = []
        for run in REPORTED:
            print(f"== {run.relative_to(REPO)}")
            codes.append(report_main(run, args.shipped))
            print()
        return max(codes)
    return report_main(args.results or args.out, args.shipped)


if __name__ == "__main__":
    sys.exit(main())
