"""The cost model against this machine: predicted vs measured step time of real runs.

1. Profile this machine (``autoplan profile --quick`` on 2 CPU processes), or
   load a profile given with ``--profile``.
2. Estimate a small GPT (autoplan.models) under four layouts on 2 processes:
   DP=2, TP=2, PP=2 (1F1B) and FSDP (ZeRO-3 over 2).
3. Run the same layouts for real with :func:`autoplan.runtime.parallelize`
   (gloo, fp32), a few warm-up steps then timed steps; the layouts alternate over
   a few rounds and each one's fastest step is its measured time (other jobs on
   a shared machine only ever add time).
4. Print predicted vs measured step time per layout and whether the predicted
   ranking of the layouts matches the measured one.

    python benchmarks/local_truth.py                 # profile, estimate, run (~1-2 min on 2 cores)
    python benchmarks/local_truth.py --profile p.yaml --no-run

The CPU profile has no fitted calibration (``calibration=None``): the
prediction uses only what the profiler measured on this machine, with no
communication overlapped (gloo on CPU runs collectives on the computing cores):
matmul and copy rates, the collectives, the host's time per dispatched operator, per
autograd node and per tensor-parallel (DTensor) linear (``op_overhead``: on a CPU it
adds to every operator of a micro-batch), and, with more ranks than cores, that the ranks share
them (``shared_cores``: a pipeline rank waiting in its bubble lends its core).

Memory (``--memory``): predicted vs measured peak memory per rank for DP, ZeRO-1/2/3,
TP, PP and recompute layouts on 2 and 4 processes (fp32; DP and ZeRO-3 also in bf16, which
parallelize runs as torch.autocast over the fp32 weights).  Measured: the peak of the
bytes of live tensor storages during one training step after a warm-up step (so the
optimizer states exist), counted by :class:`LiveBytes` (every storage alive at the step's
start, then every op's outputs until their storage is freed).  Predicted: the estimate's
per-rank allocated bytes (model states, activations, buffers) without the runtime
reserve and allocator fragmentation, which CPU tensors do not have; the memory estimate
does not depend on the device, so a profile of the A100 node with the world's number of
devices stands in for this machine.

    python benchmarks/local_truth.py --memory        # memory only (~3 min on 2 cores)

The compute alone (``--plain``): the confirm models' single-process training step
(no torch.distributed) on 4 processes at once, against the estimate on one device of
the 4-process profile, which was measured with every rank busy as these are.  It
separates what the device figures miss from what the distributed program adds.

    python benchmarks/local_truth.py --plain --profile p4.yaml   # ~1 min on 2 cores

Confirmation (``--confirm``): is the plan the search picks the fastest when run?  A small
GPT (``CONFIG``) and a small Llama (Hugging Face ``LlamaForCausalLM``, same sizes, 4 query
and 2 key/value heads, random init) on 4 CPU processes, global batch 8, fp32:

1. profile 4 ranks (``autoplan profile --quick --nproc 4 --repeat 3``: each figure the
   median of three runs; ``--keep-profile PATH`` keeps it, to price the pass's runs again
   later) or load ``--profile``;
2. ``autoplan.plan(..., top_k=100000, precision="fp32", options=GLOO_ON_CPU)`` ranks every
   layout its search keeps (the default calibration has no entry for a CPU, so the figures
   are the profile's own, as above); :func:`confirm_layouts` says which of them are run
   (the cap) and adds the ZeRO-2/3 and recompute options at the picked layout that the
   search's memory ladder never reaches when memory is plentiful;
3. layouts :func:`autoplan.parallelize` rejects are reported as not runnable with its
   reason; the others run each in its own launch of 4 fresh processes, as a user's job
   runs (``CONFIRM_LAYOUTS_PER_LAUNCH``; ``CONFIRM_WARMUP`` warm-up then ``CONFIRM_TIMED``
   timed steps each), over ``CONFIRM_ROUNDS`` rounds in alternating order, and a layout's
   measured step is its fastest (the CSV's ``launch_steps_s``: each launch's); a layout
   that fails or passes ``CONFIRM_LAYOUT_TIMEOUT_S`` is reported.  Each launch first times
   the profile's 256^3 fp32 matmul on every rank at once (``PROBE_N``): a layout's
   ``machine_speed`` says how fast the machine ran, against the profile, at the launch of
   its fastest step;
4. the layouts that measured faster than the pick (``CONFIRM_CONTENDERS`` at most) run
   again, each side by side with the pick (adjacent launches, alternating which goes
   first) over ``CONFIRM_PAIRED_ROUNDS`` rounds: the fastest layouts lie within a few
   percent of each other, about what one layout's step moves between passes of the
   machine, and a pair measured side by side shares its state;
5. per model: predicted and measured step and rank of each layout, the picked layout's
   step over the fastest one's (the median side-by-side ratio against each faster layout,
   1.000 where none measured faster; target <= 1.05), Spearman's rank correlation of
   predicted vs measured, and the machine's speed at the launches with its rank
   correlation to the layouts' error.

    python benchmarks/local_truth.py --confirm --csv rows.csv  # (~16-20 min on 2 cores)
    python benchmarks/local_truth.py --confirm --no-run --profile p.yaml   # enumeration only

Re-pricing (``--reprice CSV PROFILE``, repeatable): a pass kept with ``--csv`` and
``--keep-profile`` priced again with the code as it is now, each layout on the pass's own
profile: per pass, how many layouts lie within 15% and its misses; over several passes,
how near the machine's repeatability lets any price come (from three passes: each layout
priced by what it measured in the others), and the layouts whose error averages beyond
``SYSTEMATIC``.  A change to the cost model is
judged on several passes of the machine at once (a layout's step moves a few percent
between passes), without running anything (seconds).  This VM's passes are kept in
``benchmarks/confirm_passes/`` (its README says which code each ran).

    python benchmarks/local_truth.py --reprice a.csv a.yaml --reprice b.csv b.yaml   # seconds

``--host-split`` prices the layers' host work apart from their arithmetic where a pass's
profile states the reference blocks' timing at a second shape
(:data:`autoplan.hardware.profiler.HOST_SPLIT_NOT_APPLIED`: what profiles measure but do
not apply).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from autoplan.cost import CostOptions  # noqa: E402
from autoplan.models import GPTConfig  # noqa: E402
from autoplan.strategy import Strategy  # noqa: E402

CONFIG = GPTConfig(vocab_size=1024, seq_len=128, hidden=256, heads=4, layers=4)
GLOBAL_BATCH = 16
LAYOUTS = {
    "DP=2": Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH, precision="fp32"),
    "TP=2": Strategy(tp=2, micro_batch=2, global_batch=GLOBAL_BATCH, precision="fp32"),
    "PP=2 (1F1B)": Strategy(pp=2, micro_batch=2, global_batch=GLOBAL_BATCH, schedule="1f1b",
                            precision="fp32"),
    "FSDP (ZeRO-3)": Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH, zero=3,
                              precision="fp32"),
}
#: gloo on CPU runs its collectives on the cores that compute: nothing overlaps.
GLOO_ON_CPU = CostOptions(overlap_grad_reduce=False, overlap_param_gather=False,
                          tp_comm_overlap=False, pp_comm_overlap=False)
WARMUP_STEPS = 2
TIMED_STEPS = 5
#: Each layout runs this many times, alternating with the others; the fastest step over
#: all rounds is its measured time (on a shared machine other jobs only ever add time).
ROUNDS = 2


# ----------------------------------------------------------------------------- profile


def profile_machine(out: Path) -> Path:
    from autoplan.hardware import profiler
    status = profiler.main(["--quick", "--nproc", "2", "--device", "cpu", "--out", str(out),
                            "--name", "local-truth"])
    if status != 0:
        raise SystemExit(f"profiling failed (exit {status})")
    return out


def predict(profile: Path) -> dict[str, object]:
    from autoplan import trace
    from autoplan.cost import estimate
    from autoplan.hardware import load_cluster
    from autoplan.models import GPT
    cluster = load_cluster(str(profile))
    graph = trace(GPT(CONFIG), seq_len=CONFIG.seq_len)
    return {name: estimate(graph, cluster, s, calibration=None, options=GLOO_ON_CPU)
            for name, s in LAYOUTS.items()}


# ----------------------------------------------------------------------------- run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_worker(rank: int, world: int, port: int, outdir: str, strategy, work, *,
               model=None, global_batch: int | None = None) -> None:
    """One rank of a measurement: a gloo group, the small GPT (or ``model()``, built after
    seeding) laid out by ``strategy``, its fixed batch of ``global_batch`` (default
    ``GLOBAL_BATCH``) sequences, then ``work(pm, ids)``; an error is written to
    ``error<rank>.txt``, and the process ends with os._exit after tearing the group down
    (gloo can abort at exit)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    status = 0
    try:
        from autoplan.models import GPT
        from autoplan.runtime import parallelize
        batch = global_batch or GLOBAL_BATCH
        torch.manual_seed(0)
        pm = parallelize(model() if model else GPT(CONFIG), strategy, global_batch=batch,
                         seq_len=CONFIG.seq_len)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, CONFIG.vocab_size, (batch, CONFIG.seq_len), generator=gen)
        work(pm, ids)
    except BaseException as exc:  # report, then still tear down cleanly
        Path(outdir, f"error{rank}.txt").write_text(repr(exc))
        status = 1
    finally:
        try:
            dist.barrier()
            dist.destroy_process_group()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)


def _time_steps(pm, ids, warmup: int, timed: int) -> list[float]:
    """Wall time of ``timed`` training steps after ``warmup`` ones, each between barriers
    (the step of the slowest rank)."""
    import torch.distributed as dist
    times = []
    for i in range(warmup + timed):
        dist.barrier()
        t0 = time.perf_counter()
        pm.step(ids)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _worker(rank: int, world: int, port: int, name: str, outdir: str) -> None:
    def timed_steps(pm, ids) -> None:
        times = _time_steps(pm, ids, WARMUP_STEPS, TIMED_STEPS)
        if rank == 0:
            Path(outdir, "times.json").write_text(json.dumps(times))

    _in_worker(rank, world, port, outdir, LAYOUTS[name], timed_steps)


def _run_ranks(worker, world: int, name: str, timeout_s: float, read):
    """Spawn ``world`` processes ``worker(rank, world, port, name, outdir)``, join them by a
    common deadline (killing stragglers), raise the ranks' ``error*.txt`` reports, else
    return ``read(outdir)``."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, name, outdir))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = sorted(Path(outdir).glob("error*.txt"))
        if errors:
            raise RuntimeError(f"{name}: " + "; ".join(e.read_text() for e in errors))
        return read(Path(outdir))


def measure(name: str, timeout_s: float = 600.0) -> list[float]:
    """Timed step times of layout ``name`` on 2 processes (gloo)."""
    return _run_ranks(_worker, 2, name, timeout_s,
                      lambda out: json.loads((out / "times.json").read_text()))


def runtime_available() -> bool:
    try:
        from autoplan.runtime import parallelize  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- memory

#: Layouts whose memory is compared, with their process count (CONFIG; fp32, and three
#: in bf16).
MEMORY_LAYOUTS = {
    "DP=2": (2, Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH, precision="fp32")),
    "ZeRO-1 dp2": (2, Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH, zero=1,
                               precision="fp32")),
    "ZeRO-2 dp2": (2, Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH, zero=2,
                               precision="fp32")),
    "ZeRO-3 dp2": (2, Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH, zero=3,
                               precision="fp32")),
    "TP=2": (2, Strategy(tp=2, micro_batch=2, global_batch=GLOBAL_BATCH, precision="fp32")),
    "PP=2 1F1B": (2, Strategy(pp=2, micro_batch=2, global_batch=GLOBAL_BATCH, precision="fp32")),
    "DP=2 full rc": (2, Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH,
                                 recompute="full", precision="fp32")),
    "TP=2 sel rc": (2, Strategy(tp=2, micro_batch=2, global_batch=GLOBAL_BATCH,
                                recompute="selective", precision="fp32")),
    "ZeRO-3 dp4": (4, Strategy(dp=4, micro_batch=2, global_batch=GLOBAL_BATCH, zero=3,
                               precision="fp32")),
    "DP2 x TP2": (4, Strategy(dp=2, tp=2, micro_batch=2, global_batch=GLOBAL_BATCH,
                              precision="fp32")),
    "DP2 x PP2": (4, Strategy(dp=2, pp=2, micro_batch=2, global_batch=GLOBAL_BATCH,
                              precision="fp32")),
    "TP2 x PP2 full rc": (4, Strategy(tp=2, pp=2, micro_batch=2, global_batch=GLOBAL_BATCH,
                                      recompute="full", precision="fp32")),
    # bf16 as parallelize runs it: torch.autocast over the fp32 weights (CostOptions.autocast)
    "DP=2 bf16": (2, Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH, precision="bf16")),
    "ZeRO-3 dp2 bf16": (2, Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH, zero=3,
                                    precision="bf16")),
    "ZeRO-3 dp2 bf16 full rc": (2, Strategy(dp=2, micro_batch=2, global_batch=GLOBAL_BATCH,
                                            zero=3, recompute="full", precision="bf16")),
}
#: The issue's target for predicted vs measured peak memory per layout.
MEMORY_TARGET = 0.10


from autoplan.runtime.ledger import LiveBytes  # noqa: E402  (moved to the package)


def _memory_worker(rank: int, world: int, port: int, name: str, outdir: str) -> None:
    def peak_of_a_step(pm, ids) -> None:
        import torch.distributed as dist
        pm.step(ids)   # warm-up: the optimizer creates its states
        dist.barrier()
        with LiveBytes() as live:
            start = live.current
            pm.step(ids)
        Path(outdir, f"mem{rank}.json").write_text(json.dumps(
            {"peak_bytes": live.peak, "start_bytes": start, "pp_rank": pm.coords.get("pp", 0)}))

    _in_worker(rank, world, port, outdir, MEMORY_LAYOUTS[name][1], peak_of_a_step)


def measure_memory(name: str, timeout_s: float = 600.0) -> list[dict]:
    """Per rank: the peak live tensor bytes of one step of layout ``name`` and its pipeline rank."""
    world = MEMORY_LAYOUTS[name][0]
    return _run_ranks(_memory_worker, world, name, timeout_s,
                      lambda out: [json.loads((out / f"mem{r}.json").read_text())
                                   for r in range(world)])


def _memory_cluster(world: int, tmp: Path):
    """The shipped A100 node profile with ``world`` devices (memory does not depend on it)."""
    import yaml

    from autoplan.hardware import load_cluster
    from autoplan.hardware.profiles import shipped_profiles_dir
    data = yaml.safe_load((shipped_profiles_dir() / "a100-sxm4-80gb.yaml").read_text())
    data["name"] = f"a100-x{world}-memory-check"
    data["node"]["devices_per_node"] = world
    data["network"]["nics_per_node"] = world
    path = tmp / f"a100-x{world}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_cluster(str(path))


def predict_memory() -> dict[str, list[float]]:
    """Per layout: the predicted allocated bytes of each pipeline rank (no runtime reserve)."""
    from autoplan import trace
    from autoplan.cost import estimate
    from autoplan.models import GPT
    graph = trace(GPT(CONFIG), seq_len=CONFIG.seq_len)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {w: _memory_cluster(w, Path(tmp)) for w in {w for w, _ in MEMORY_LAYOUTS.values()}}
        for name, (world, s) in MEMORY_LAYOUTS.items():
            e = estimate(graph, clusters[world], s, calibration=None, options=GLOO_ON_CPU)
            out[name] = [(st.memory.total_bytes - st.memory.reserve_bytes,
                          st.memory.params_bytes + st.memory.optimizer_bytes) for st in e.stages]
    return out


def memory_main(names: list[str] | None = None) -> int:
    names = names or list(MEMORY_LAYOUTS)
    unknown = [n for n in names if n not in MEMORY_LAYOUTS]
    if unknown:
        print(f"unknown layout(s) {', '.join(map(repr, unknown))}; known: "
              + ", ".join(map(repr, MEMORY_LAYOUTS)), file=sys.stderr)
        return 2
    predicted = predict_memory()
    print(f"memory: GPT {CONFIG.layers} layers, hidden {CONFIG.hidden}, seq {CONFIG.seq_len}, "
          f"vocab {CONFIG.vocab_size}; global batch {GLOBAL_BATCH}, micro-batch 2, fp32 unless "
          "named bf16 (torch.autocast over fp32 weights, as parallelize runs it); "
          "peak live tensor bytes of one step after a warm-up step, worst rank; predicted "
          "without the runtime reserve")
    print("(columns 'between steps': parameters and optimizer states predicted, live bytes "
          "at the step's start measured; the rest of the peak is gradients, activations and "
          "buffers)")
    print(f"\n{'layout':<18} {'procs':>5} {'predicted MB':>13} {'measured MB':>12} {'error':>8}  "
          f"{'target':<7} {'between steps: predicted':>25} {'measured':>9}")
    errors = []
    for name in names:
        world = MEMORY_LAYOUTS[name][0]
        ranks = measure_memory(name)
        # the worst rank against the prediction for its pipeline rank
        worst = max(ranks, key=lambda r: abs(predicted[name][r["pp_rank"]][0] / r["peak_bytes"] - 1))
        (pred, pred_states), meas = predicted[name][worst["pp_rank"]], worst["peak_bytes"]
        err = (pred - meas) / meas
        errors.append(abs(err))
        ok = "ok" if abs(err) <= MEMORY_TARGET else f"> {MEMORY_TARGET:.0%}"
        print(f"{name:<18} {world:>5} {pred / 1e6:13.2f} {meas / 1e6:12.2f} {err:+8.1%}  {ok:<7} "
              f"{pred_states / 1e6:25.2f} {worst['start_bytes'] / 1e6:9.2f}")
    print(f"\nmean |error| {statistics.mean(errors):.1%}, worst {max(errors):.1%} "
          f"(target {MEMORY_TARGET:.0%})")
    return 0


# ----------------------------------------------------------------------------- confirm

#: The models of ``--confirm``: the small GPT above and a Llama of the same size with
#: grouped-query attention (4 query heads, 2 key/value heads: tp at most 2), random init.
CONFIRM_MODELS = ("gpt", "llama")
CONFIRM_WORLD = 4
CONFIRM_BATCH = 8
#: The picked plan should measure within this factor of the fastest measured layout.
CONFIRM_TARGET = 1.05
#: The issue's target for predicted vs measured step time per layout.
TIME_TARGET = 0.15
#: Layouts run besides the picked one's neighbourhood and each degree combination's best:
#: a uniform sample (fixed seed) of the rest of the search's ranked list, so that what is
#: run is not only what the cost model favours.  ``--all`` runs every layout instead.
CONFIRM_SAMPLE = 6
CONFIRM_SEED = 0
#: Rounds: each layout runs in ``CONFIRM_ROUNDS`` launches of fresh processes, and its
#: measured step is the fastest of all.  One layout's launches, each one's fastest step,
#: read a median 12% and a 90th percentile 29% apart in one pass (the slowest over the
#: fastest, 81 layouts, 3 launches each, 2026-11-26; the ranks' placement on the 2 cores
#: and other tenants): a third launch, ~6 min more a pass, brings the fastest nearer the
#: machine's own speed, which the profile's fastest windows measure.
CONFIRM_WARMUP, CONFIRM_TIMED, CONFIRM_ROUNDS = 2, 3, 3
#: The pick against the layouts that measured faster (at most ``CONFIRM_CONTENDERS``, the
#: fastest first): each pair runs in adjacent launches, in alternating order, over
#: ``CONFIRM_PAIRED_ROUNDS`` rounds, and the pick's step over the contender's is their median.
#: The fastest layouts of a model lie within a few percent of each other, and one layout's
#: step moves 5-8% between passes of the machine; a pair measured side by side shares the
#: machine's state.
CONFIRM_CONTENDERS, CONFIRM_PAIRED_ROUNDS = 4, 4
#: The machine's speed at each launch: before its layouts, every rank times the quick
#: profile's cold ``PROBE_N``^3 fp32 matmul as the profile times it where ranks share cores
#: (each free-running, the fastest of ``PROBE_WINDOWS`` windows of the ranks' mean); the
#: row's ``machine_speed`` is the profile's time for that matmul over the probe's (1: as
#: fast as when profiled).  The same work reads up to 20% apart minutes apart on this
#: machine (``benchmarks/step_cpu.py``), more than most layouts' error.
PROBE_N, PROBE_WINDOWS = 256, 2
#: A layout whose rank 0 reports nothing for this long (model build, warm-up and timed
#: steps; the first layout of a launch also spawns the ranks and traces) is killed.
CONFIRM_LAYOUT_TIMEOUT_S = 120.0


def _confirm_model(name: str):
    """One of ``CONFIRM_MODELS``, freshly initialised with seed 0 (the same on every rank)."""
    import torch
    torch.manual_seed(0)
    if name == "gpt":
        from autoplan.models import GPT
        return GPT(CONFIG)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=CONFIG.hidden,
                          intermediate_size=688, num_hidden_layers=CONFIG.layers,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=CONFIG.seq_len)
        cfg._attn_implementation = "eager"
        return LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model {name!r}; choose from {CONFIRM_MODELS}")


#: Runs of the quick profile whose figure-by-figure median the confirm pass prices with
#: (``autoplan profile --repeat``): single quick profiles of 4 ranks on 2 cores, taken
#: minutes apart, priced ten of the confirm layouts with a median standard deviation of
#: 5.8% (six profiles), three medians of three runs 4.1% (2026-11-26); ~2 min in all.
CONFIRM_PROFILE_RUNS = 3


def profile_machine_4(out: Path) -> Path:
    """``autoplan profile --quick --repeat CONFIRM_PROFILE_RUNS`` on ``CONFIRM_WORLD`` CPU
    processes (one device per rank, the RAM divided among them)."""
    from autoplan.hardware import profiler
    status = profiler.main(["--quick", "--nproc", str(CONFIRM_WORLD), "--device", "cpu",
                            "--repeat", str(CONFIRM_PROFILE_RUNS),
                            "--out", str(out), "--name", f"local-truth-{CONFIRM_WORLD}"])
    if status != 0:
        raise SystemExit(f"profiling failed (exit {status})")
    return out


def _layout_key(plan) -> tuple:
    return (plan.dp, plan.mesh.degree("tp"), plan.pp, plan.mesh.degree("cp"))


def _with_options(plan, zero: int, recompute):
    """``plan`` with every layer at ZeRO stage ``zero`` and every block at ``recompute``
    (embeddings and head never recompute, as in :meth:`Plan.from_strategy`)."""
    from dataclasses import replace

    from autoplan.graph import LayerKind
    from autoplan.strategy import Recompute
    kinds = {l.name: l.kind for l in plan.graph.layers}
    layers = tuple(replace(lp, zero=zero,
                           recompute=recompute if kinds[lp.name] is LayerKind.BLOCK else Recompute.NONE)
                   for lp in plan.layers)
    return replace(plan, layers=layers, estimate=None, runners_up=())


def confirm_layouts(graph, cluster, *, run_all: bool = False,
                    ladder_at: str | None = None) -> list[dict]:
    """The layouts to confirm: the search's picked plan and its ranked list, capped.

    Every layout the search ranks is kept when ``run_all``; otherwise (a documented cap, the
    same rule for every model): the picked plan; every other ranked layout at the picked
    degrees (dp, tp, pp, cp: micro-batch, ZeRO-0/1, sequence parallelism and schedule
    variants); each other degree combination's best-ranked layout; and ``CONFIRM_SAMPLE``
    more drawn uniformly (seed ``CONFIRM_SEED``) from the rest.  The search prices ZeRO-2/3
    and recompute only when nothing cheaper fits (its memory ladder), which never happens
    on this machine's RAM, so those options at the picked layout are added and priced by
    the same engine (source ``ladder``).  Each row: ``source``, ``plan`` (with its estimate),
    ``label``, ``predicted_s``, ``predicted_rank`` (1 = the search's pick).  ``ladder_at``:
    the label of a ranked layout to add those options at instead of the pick (a stored
    pass's pick, re-priced by code whose search picks another).
    """
    import random

    from autoplan import plan as search_plan
    from autoplan.cost import estimate_plan
    from autoplan.errors import AutoplanError
    from autoplan.strategy import Recompute
    picked = search_plan(graph, cluster, global_batch=CONFIRM_BATCH, top_k=100_000,
                         precision="fp32", options=GLOO_ON_CPU)
    ranked = [picked, *picked.runners_up]
    if picked.search_stats.time_limit_hit:
        print("warning: the search hit its time limit; its ranked list may be incomplete")
    rows = [{"source": "search", "plan": p, "search_rank": i + 1} for i, p in enumerate(ranked)]
    if not run_all:
        keep = {0}
        keep |= {i for i, r in enumerate(rows) if _layout_key(r["plan"]) == _layout_key(picked)}
        seen = set()
        for i, r in enumerate(rows):
            if _layout_key(r["plan"]) not in seen:
                seen.add(_layout_key(r["plan"]))
                keep.add(i)
        rest = [i for i in range(len(rows)) if i not in keep]
        keep |= set(random.Random(CONFIRM_SEED).sample(rest, min(CONFIRM_SAMPLE, len(rest))))
        print(f"{len(rows)} layouts ranked by the search; running {len(keep)}: the pick, "
              f"{sum(_layout_key(r['plan']) == _layout_key(picked) for r in rows)} at its degrees, "
              f"the best of each of {len(seen)} degree combinations, "
              f"{min(CONFIRM_SAMPLE, len(rest))} sampled from the other {len(rest)} "
              "(--all: every one)")
        rows = [rows[i] for i in sorted(keep)]
    # the options above the ladder's first rung, at the picked layout
    base = picked if ladder_at is None else next(
        (p for p in ranked if p.label() == ladder_at), picked)
    have = {(p.label(), p.describe()) for p in (r["plan"] for r in rows)}
    for zero in (0, 1, 2, 3):
        for rc in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL):
            try:
                p = _with_options(base, zero, rc)
                p = p.with_estimate(estimate_plan(graph, cluster, p, options=GLOO_ON_CPU))
            except AutoplanError as exc:   # e.g. what zero-bubble schedules cannot run
                rows.append({"source": "ladder", "plan": None, "label": f"{base.label()} "
                             f"zero{zero} rc-{rc.value}", "status": "not runnable",
                             "reason": f"{type(exc).__name__}: {exc}"})
                continue
            if (p.label(), p.describe()) not in have:
                have.add((p.label(), p.describe()))
                rows.append({"source": "ladder", "plan": p, "search_rank": None})
    labels: dict[str, int] = {}
    for r in rows:
        if r["plan"] is None:
            continue
        p = r["plan"]
        label = p.label()
        if label in labels:   # a refined plan: the same options, other blocks per stage
            label += " [" + "/".join(str(len(st.layers)) for st in p.stages) + " layers]"
        labels[label] = labels.get(label, 0) + 1
        r.update(label=label, predicted_s=p.estimate.step_time_s, status="", reason="")
    order = sorted((r for r in rows if r["plan"] is not None), key=lambda r: r["predicted_s"])
    for i, r in enumerate(order):
        r["predicted_rank"] = i + 1
    return rows


def check_runnable(model, graph, rows: list[dict]) -> None:
    """Mark the rows :func:`autoplan.parallelize` rejects before any collective (what it
    raises on every rank alike) as not runnable, with its reason."""
    import importlib

    from autoplan.errors import AutoplanError
    rt = importlib.import_module("autoplan.runtime.parallelize")  # the module, not the function
    for r in rows:
        if r["plan"] is None:
            continue
        try:
            plan = rt.resolve_plan(model, r["plan"], graph, world_size=CONFIRM_WORLD,
                                   global_batch=CONFIRM_BATCH)
            rt._check_program(model, graph, plan, graph.seq_len, True, None)
        except AutoplanError as exc:
            r["status"], r["reason"] = "not runnable", f"{type(exc).__name__}: {exc}"


def _speed_probe(torch, dist) -> float:
    """Seconds per call of the quick profile's cold ``PROBE_N``^3 fp32 matmul on this
    rank, timed as ``autoplan profile`` times it where ranks share cores (every rank at
    once, free-running; the fastest of ``PROBE_WINDOWS`` windows of the ranks' mean)."""
    from autoplan.hardware.profiler import (_COLD_BYTES, _MIN_FREE_WINDOW_S, _cold_matmul,
                                            _free_running)

    def agreed_mean(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0]) / dist.get_world_size()
    call = _cold_matmul(torch, PROBE_N, torch.float32, torch.device("cpu"), _COLD_BYTES)
    try:
        return _free_running(call, lambda: None, PROBE_WINDOWS * _MIN_FREE_WINDOW_S,
                             agreed_mean, dist.barrier, windows=PROBE_WINDOWS)
    finally:
        del call


def _error_chain(exc: BaseException) -> str:
    """``exc`` and the exceptions it was raised from, the innermost (the cause) first: a
    pipeline stage wraps its forward's error as "[Stage 0] failed to run forward", whose
    own message says nothing of why."""
    chain, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(f"{type(e).__name__}: {str(e).strip()}")
        e = e.__cause__ or e.__context__
    return " <- ".join(reversed(chain))


def _confirm_worker(rank: int, world: int, port: int, model_name: str, graph,
                    jobs: list[tuple[int, str]], outdir: str) -> None:
    """One rank of a launch: each job (index, plan JSON) in turn: lay the model out, warm-up
    steps, timed steps; rank 0 writes ``done<i>.json`` (step times) or ``skip<i>.txt`` (the
    plan rejected before any collective, on every rank alike).  ``graph``: the parent's
    capture of the model (tracing on every rank costs seconds each).  Any other error is written
    to ``error<i>_<rank>.txt`` and ends the process at once: a failed collective can leave
    the group broken, so the parent relaunches the remaining jobs in fresh processes."""
    import datetime
    import gc
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=CONFIRM_LAYOUT_TIMEOUT_S))
    from autoplan.errors import ConfigError, PlanMismatchError, StrategyError
    from autoplan.plan import Plan
    from autoplan.runtime import parallelize
    # a rank that dies in native code (no Python exception, so no error file) leaves its
    # stack here for the parent's report
    fault = open(Path(outdir, f"fault{rank}.txt"), "w")
    faulthandler.enable(fault)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (CONFIRM_BATCH, CONFIG.seq_len), generator=gen)
    probe = _speed_probe(torch, dist)
    if rank == 0:
        Path(outdir, "probe.json").write_text(json.dumps(probe))
    for i, text in jobs:
        try:
            pm = parallelize(_confirm_model(model_name), Plan.from_json(text),
                             global_batch=CONFIRM_BATCH, seq_len=CONFIG.seq_len, graph=graph)
        except (ConfigError, StrategyError, PlanMismatchError) as exc:
            if rank == 0:
                Path(outdir, f"skip{i}.txt").write_text(f"{type(exc).__name__}: {exc}")
            continue
        try:
            times = _time_steps(pm, ids, CONFIRM_WARMUP, CONFIRM_TIMED)
        except BaseException as exc:
            Path(outdir, f"error{i}_{rank}.txt").write_text(_error_chain(exc))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if rank == 0:
            Path(outdir, f"done{i}.json").write_text(json.dumps(times))
        del pm
        gc.collect()
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


#: Modules the launcher's fork server imports once, so that a launch of 4 ranks costs
#: forks (~1 s) rather than 4 interpreters importing torch on 2 cores (~5 s).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "autoplan.runtime", "transformers",
           "transformers.models.llama.modeling_llama"]


def _launcher():
    """A ``forkserver`` context preloading :data:`PRELOAD`: each launch forks fresh
    processes from a server that has imported torch but never run an op or made a thread."""
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


#: Layouts run per launch of ``CONFIRM_WORLD`` processes.  One: a process that has laid
#: out and run other layouts steps slower than a fresh one, as a user's job is (on 4
#: ranks over 2 cores, a DP=4 step 4% slower after 8 layouts; DP=4 and TP=4 steps 16%
#: and 22% slower half-way through a 41-layout launch than in fresh processes minutes
#: later; each layout leaves ~12 threads behind), which read as cost-model error.
CONFIRM_LAYOUTS_PER_LAUNCH = 1


def measure_many(model_name: str, graph, jobs: list[tuple[int, str]],
                 probes: dict[int, float] | None = None) -> dict[int, list[float] | str]:
    """Step times of each job (index, plan JSON) on ``CONFIRM_WORLD`` processes, launched
    ``CONFIRM_LAYOUTS_PER_LAUNCH`` at a time; a job that fails or passes
    ``CONFIRM_LAYOUT_TIMEOUT_S`` gets its reason (a string) and the rest continue in a
    fresh launch.  ``probes``, when given, gets each measured job's launch's
    :func:`_speed_probe` (seconds per call)."""
    from dataclasses import replace
    ctx = _launcher()
    graph = replace(graph, fx_graph=None)   # what parallelize keeps of a capture
    out: dict[int, list[float] | str] = {}
    pending = list(jobs)
    while pending:
        todo, pending = pending[:CONFIRM_LAYOUTS_PER_LAUNCH], pending[CONFIRM_LAYOUTS_PER_LAUNCH:]
        with tempfile.TemporaryDirectory() as outdir:
            port = _free_port()
            procs = [ctx.Process(target=_confirm_worker,
                                 args=(r, CONFIRM_WORLD, port, model_name, graph, todo, outdir))
                     for r in range(CONFIRM_WORLD)]
            for p in procs:
                p.start()
            last, reported = time.monotonic(), 0
            timed_out = False
            while any(p.is_alive() for p in procs):
                time.sleep(0.2)
                n = len(list(Path(outdir).glob("done*.json")) + list(Path(outdir).glob("skip*.txt")))
                if n != reported:
                    last, reported = time.monotonic(), n
                elif time.monotonic() - last > CONFIRM_LAYOUT_TIMEOUT_S:
                    timed_out = True
                    break
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            rest, blamed = [], False
            for i, text in todo:
                done, skip = Path(outdir, f"done{i}.json"), Path(outdir, f"skip{i}.txt")
                if done.exists():
                    out[i] = json.loads(done.read_text())
                    probe = Path(outdir, "probe.json")
                    if probes is not None and probe.exists():
                        probes[i] = json.loads(probe.read_text())
                elif skip.exists():
                    out[i] = "not runnable: " + skip.read_text()
                elif not blamed:   # the first job without a result is the one that failed
                    blamed = True
                    errs = sorted(Path(outdir).glob(f"error{i}_*.txt"))
                    # a rank that crashed in native code wrote its stack instead
                    faults = [f"rank {f.stem[5:]} crashed: {text[:300]}"
                              for f in sorted(Path(outdir).glob("fault*.txt"))
                              if (text := f.read_text().strip())]
                    out[i] = ("failed: " + "; ".join([*faults, *(e.read_text()[:300]
                                                                  for e in errs)])
                              if errs or faults
                              else f"failed: timed out after {CONFIRM_LAYOUT_TIMEOUT_S:.0f} s"
                              if timed_out else "failed: the ranks exited without a result")
                else:
                    rest.append((i, text))
            pending = rest + pending
    return out


def _pick(rows: list[dict]) -> int:
    """The index of the search's pick among the confirm's rows."""
    return next(i for i, r in enumerate(rows) if r["source"] == "search" and r.get("search_rank") == 1)


def _pair_the_pick(name: str, graph, rows: list[dict], measured: list[int]) -> None:
    """Measure the pick against the layouts that measured faster (:func:`pick_against`,
    ``CONFIRM_CONTENDERS`` at most, the fastest first) and set their ``paired_ratio``."""
    pick = _pick(rows)
    if not rows[pick].get("measured_s"):
        return
    faster = sorted((i for i in measured if rows[i]["measured_s"] < rows[pick]["measured_s"]),
                    key=lambda i: rows[i]["measured_s"])[:CONFIRM_CONTENDERS]

    def in_order(order: list[int]) -> list:   # a job per position: the pick repeats
        got = measure_many(name, graph, [(k, rows[i]["plan"].to_json()) for k, i in enumerate(order)])
        return [got.get(k) for k in range(len(order))]
    for i, ratio in pick_against(in_order, pick, faster, CONFIRM_PAIRED_ROUNDS).items():
        rows[i]["paired_ratio"] = ratio


def pick_against(measure, pick: int, contenders: list[int], rounds: int) -> dict[int, float | None]:
    """The pick's step over each contender's, measured side by side: in each of ``rounds``
    rounds, every (pick, contender) pair runs in adjacent launches, the pick first in even
    rounds and second in odd ones; a launch's step is its fastest timed step, and a pair's
    figure is the median over the rounds of the pick's step over the contender's (``None``
    where no round measured both).  ``measure(order)``: for each index of ``order`` (one
    may repeat), in that order, the step times of that layout's launch or a failure's reason
    (a string)."""
    ratios: dict[int, list[float]] = {c: [] for c in contenders}
    for k in range(rounds):
        order = [i for c in contenders for i in ((pick, c) if k % 2 == 0 else (c, pick))]
        if not order:
            break
        got = measure(order)
        for j, c in enumerate(contenders):
            p, v = got[2 * j:2 * j + 2] if k % 2 == 0 else got[2 * j:2 * j + 2][::-1]
            if isinstance(p, list) and isinstance(v, list) and p and v:
                ratios[c].append(min(p) / min(v))
    return {c: statistics.median(v) if v else None for c, v in ratios.items()}


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


CSV_FIELDS = ("model", "label", "source", "search_rank", "predicted_s", "predicted_rank",
              "measured_s", "measured_rank", "error", "paired_ratio", "machine_speed",
              "launch_steps_s", "status", "reason")


def write_csv(path: Path, rows: list[dict]) -> None:
    """The rows to ``path``, written to a temporary name first, then renamed."""
    import csv
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    os.replace(tmp, path)


def _measure_profile(tmp: str, keep: Path | None) -> Path:
    """Profile the machine (:func:`profile_machine_4`) into ``keep``, where given (autoplan
    profile writes it under a temporary name, then renames it), else into ``tmp``."""
    path = profile_machine_4(keep or Path(tmp) / "local-truth-4.yaml")
    if keep is not None:
        print(f"kept the profile: {keep}")
    return path


def confirm_main(profile: Path | None, models: list[str], *, run: bool, run_all: bool,
                 csv_path: Path | None, keep_profile: Path | None = None) -> int:
    from autoplan import trace
    from autoplan.hardware import load_cluster
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        profile = profile or _measure_profile(tmp, keep_profile)
        cluster = load_cluster(str(profile))
    if cluster.num_devices != CONFIRM_WORLD:
        raise SystemExit(f"the profile has {cluster.num_devices} devices; --confirm needs "
                         f"{CONFIRM_WORLD} (autoplan profile --nproc {CONFIRM_WORLD})")
    all_rows = []
    for name in models:
        model = _confirm_model(name)
        graph = trace(model, seq_len=CONFIG.seq_len)
        print(f"\n=== {name}: {graph.title or graph.model}, {graph.num_params / 1e6:.2f} M parameters, "
              f"{CONFIG.layers} blocks, seq {CONFIG.seq_len}; global batch {CONFIRM_BATCH}, fp32, "
              f"{CONFIRM_WORLD} processes")
        rows = confirm_layouts(graph, cluster, run_all=run_all)
        check_runnable(model, graph, rows)
        runnable = [i for i, r in enumerate(rows) if r["plan"] is not None and not r["status"]]
        print(f"{len(rows)} layouts, {len(runnable)} runnable")
        if run and runnable:
            # per layout, each launch's fastest step and the machine's speed at that launch
            launches: dict[int, list[tuple[float, float | None]]] = {i: [] for i in runnable}
            reference = cluster.profile_of(0).device.matmul_time_s(2 * PROBE_N**3, "fp32")
            for k in range(CONFIRM_ROUNDS):   # alternate the order: drift hits all alike
                order = runnable if k % 2 == 0 else runnable[::-1]
                probes: dict[int, float] = {}
                got = measure_many(name, graph, [(i, rows[i]["plan"].to_json()) for i in order],
                                   probes)
                for i, v in got.items():
                    if isinstance(v, str):
                        rows[i]["status"], rows[i]["reason"] = v.split(":", 1)[0], v
                    elif v:
                        launches[i].append((min(v), reference / probes[i] if i in probes
                                            else None))
            for i in runnable:
                if not rows[i]["status"] and launches[i]:
                    # the fastest step of all, and the speed at its launch (the first, on ties)
                    rows[i]["measured_s"], rows[i]["machine_speed"] = min(
                        launches[i], key=lambda launch: launch[0])
                    rows[i]["launch_steps_s"] = ";".join(f"{t:.4f}" for t, _ in launches[i])
            measured = [i for i in runnable if rows[i].get("measured_s")]
            for rank, i in enumerate(sorted(measured, key=lambda i: rows[i]["measured_s"])):
                rows[i]["measured_rank"] = rank + 1
                r = rows[i]
                r["error"] = (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
            _pair_the_pick(name, graph, rows, measured)
        for r in rows:
            r["model"] = name
        _print_confirm(rows, run)
        all_rows += rows
    if csv_path is not None:
        write_csv(csv_path, all_rows)
        print(f"\nwrote {len(all_rows)} rows to {csv_path}")
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"({time.perf_counter() - t0:.1f} s; 1-min load average {load:.1f} on "
          f"{os.cpu_count()} cores)")
    return 0


def _print_confirm(rows: list[dict], run: bool) -> None:
    def fmt(v, spec):
        return f"{'-':>{spec[:-1].lstrip('+').split('.')[0]}}" if v is None else format(v, spec)

    print(f"\n{'layout':<44} {'source':<7} {'pred s':>7} {'p.rank':>6} {'meas s':>7} "
          f"{'m.rank':>6} {'error':>7} {'speed':>5}  status")
    shown = sorted(rows, key=lambda r: (r.get("measured_rank") or 10**6,
                                        r.get("predicted_rank") or 10**6))
    for r in shown:
        print(f"{r['label']:<44} {r['source']:<7} {fmt(r.get('predicted_s'), '7.3f')} "
              f"{fmt(r.get('predicted_rank'), '6d')} {fmt(r.get('measured_s'), '7.3f')} "
              f"{fmt(r.get('measured_rank'), '6d')} {fmt(r.get('error'), '+7.1%')} "
              f"{fmt(r.get('machine_speed'), '5.2f')}  "
              f"{r['reason'][:110] if r.get('reason') else ''}")
    picked = rows[_pick(rows)]
    measured = [r for r in rows if r.get("measured_s")]
    if not run:
        print(f"picked: {picked['label']} predicted {picked['predicted_s']:.3f} s "
              "(real runs skipped: --no-run)")
        return
    if not measured or not picked.get("measured_s"):
        print(f"picked: {picked['label']} was not measured ({picked.get('reason') or 'no run'})")
        return
    fastest = min(measured, key=lambda r: r["measured_s"])
    ratio = picked["measured_s"] / fastest["measured_s"]
    paired = [r for r in rows if r.get("paired_ratio") is not None]
    print(f"picked: {picked['label']} measured {picked['measured_s']:.3f} s; fastest measured: "
          f"{fastest['label']} {fastest['measured_s']:.3f} s; ratio {ratio:.3f}"
          + ("" if paired else f" (target <= {CONFIRM_TARGET}): "
             f"{'ok' if ratio <= CONFIRM_TARGET else 'missed'}"))
    if paired:
        for r in paired:
            print(f"  the pick against {r['label']}, side by side over {CONFIRM_PAIRED_ROUNDS} "
                  f"rounds: median ratio {r['paired_ratio']:.3f}")
        worst = max(paired, key=lambda r: r["paired_ratio"])
        ratio = max(1.0, worst["paired_ratio"])
        print(f"picked vs fastest, side by side: ratio {ratio:.3f}"
              f"{'' if ratio == 1.0 else ' (against ' + worst['label'] + ')'} "
              f"(target <= {CONFIRM_TARGET}): {'ok' if ratio <= CONFIRM_TARGET else 'missed'}")
    rho = spearman([r["predicted_s"] for r in measured], [r["measured_s"] for r in measured])
    mape = statistics.mean(abs(r["error"]) for r in measured)
    not_run = sum(1 for r in rows if r.get("status"))
    within = sum(abs(r["error"]) <= TIME_TARGET for r in measured)
    print(f"Spearman rank correlation, predicted vs measured, over {len(measured)} measured "
          f"layouts: {rho:+.2f}; mean |error| {mape:.1%}, median "
          f"{statistics.median(r['error'] for r in measured):+.1%}; {within} of {len(measured)} "
          f"within {TIME_TARGET:.0%} (target: every one); {not_run} not runnable or failed")
    for line in (speed_summary(measured), launch_summary(measured)):
        if line:
            print(line)


def speed_summary(measured: list[dict]) -> str | None:
    """One line on the machine's speed at the measured layouts' launches
    (``machine_speed``, :data:`PROBE_N`): its median and range, and its rank correlation
    with the layouts' error (positive: layouts measured while the machine ran slow read
    as priced fast).  ``None`` without probes."""
    pairs = [(r["machine_speed"], r["error"]) for r in measured
             if r.get("machine_speed") is not None and r.get("error") is not None]
    if not pairs:
        return None
    speeds = [p[0] for p in pairs]
    rho = spearman(speeds, [p[1] for p in pairs]) if len(pairs) > 2 else float("nan")
    # the measured step as if the machine had run at the profile's speed, assuming the whole
    # step slows with the matmul probe (on CPU ranks the collectives are the cores' work
    # too): a diagnostic, not the verdict
    scaled = [(1 + e) / v - 1 for v, e in pairs]
    return (f"machine speed at the launches ({PROBE_N}^3 fp32 matmuls, every rank at once, "
            f"over the profile's; 1 = as profiled), {len(pairs)} layouts: median "
            f"{statistics.median(speeds):.2f}, {min(speeds):.2f}-{max(speeds):.2f}; "
            f"Spearman with the error {rho:+.2f}; each step scaled by it to the profile's "
            f"speed: {sum(abs(e) <= TIME_TARGET for e in scaled)} of {len(scaled)} within "
            f"{TIME_TARGET:.0%}, median error {statistics.median(scaled):+.1%}")


def launch_summary(measured: list[dict]) -> str | None:
    """One line on how far apart one layout's launches ran (``launch_steps_s``, each
    launch's fastest step): the slowest launch's over the fastest's, its median and 90th
    percentile over the layouts and how many spread more than :data:`TIME_TARGET` -- the
    noise a single launch's step carries, against which the per-layout target is set.
    ``None`` where no layout ran more than once."""
    spreads = []
    for r in measured:
        steps = [float(t) for t in str(r.get("launch_steps_s") or "").split(";") if t]
        if len(steps) > 1:
            spreads.append(max(steps) / min(steps) - 1)
    if not spreads:
        return None
    spreads.sort()
    p90 = spreads[min(len(spreads) - 1, int(0.9 * len(spreads)))]
    return (f"one layout's launches (each one's fastest step; the measured step is the "
            f"fastest of all), the slowest over the fastest, {len(spreads)} layouts: median "
            f"+{statistics.median(spreads):.1%}, 90th percentile +{p90:.1%}, largest "
            f"+{spreads[-1]:.1%}; {sum(s > TIME_TARGET for s in spreads)} spread more than "
            f"{TIME_TARGET:.0%}")


# ----------------------------------------------------------------------------- plain

#: ``--plain``: micro-batches of the single-process step, and its warm-up and timed steps
PLAIN_BATCHES = (2, 4)
PLAIN_WARMUP, PLAIN_TIMED = 3, 10


#: The phases of the single-process step ``--plain`` times, in order.
PLAIN_PHASES = ("forward", "backward", "optimizer")


def _plain_worker(model_name: str, batch: int, queue) -> None:
    """One process training the confirm model alone (no torch.distributed): the median
    of :data:`PLAIN_TIMED` steps after the warm-up, whole and per phase (the forward with
    the loss, the backward, the AdamW step with ``zero_grad``), as a dict."""
    import torch

    from autoplan.runtime.adapters import is_hf, model_output
    from autoplan.runtime.cpu_heap import keep_cpu_heap
    from autoplan.runtime.loss import token_cross_entropy
    from autoplan.runtime.optim import default_optimizer
    torch.set_num_threads(1)
    keep_cpu_heap()   # as autoplan.parallelize keeps it on its CPU ranks
    try:
        torch.manual_seed(0)
        model = _confirm_model(model_name)
        opt = default_optimizer(model.parameters())   # parallelize's default
        ids = torch.randint(0, CONFIG.vocab_size, (batch, CONFIG.seq_len))
        hf = is_hf(model)

        def step() -> tuple[float, ...]:   # the model called as autoplan.parallelize calls it
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=False) if hf else model(ids)
            loss = token_cross_entropy(model_output(out), ids, shift=True)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            return t3 - t0, t1 - t0, t2 - t1, t3 - t2

        times = [step() for _ in range(PLAIN_WARMUP + PLAIN_TIMED)][PLAIN_WARMUP:]
        queue.put({key: statistics.median(t[i] for t in times)
                   for i, key in enumerate(("step",) + PLAIN_PHASES)})
    except BaseException as exc:   # report it to the parent instead of hanging it
        queue.put(f"{type(exc).__name__}: {exc}")


def measure_plain(model_name: str, batch: int, procs: int,
                  timeout_s: float = 600.0) -> list[dict[str, float]]:
    """Per process, the median seconds of the step and of each of :data:`PLAIN_PHASES`
    (keys ``step``, ``forward``, ...) of ``procs`` processes each training ``model_name``
    alone at micro-batch ``batch``, all at once (the condition a shared-core profile is
    measured in)."""
    import multiprocessing as mp
    import queue as queues

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    workers = [ctx.Process(target=_plain_worker, args=(model_name, batch, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        got = [out.get(timeout=timeout_s) for _ in workers]
    except queues.Empty:
        raise SystemExit(f"--plain: {model_name} at micro-batch {batch} did not finish in "
                         f"{timeout_s:.0f} s") from None
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    failed = [g for g in got if isinstance(g, str)]
    if failed:
        raise SystemExit(f"--plain: {model_name} at micro-batch {batch} failed: {failed[0]}")
    return got


def plain_phases(graph, cluster, batch: int, optimizer_s: float) -> dict[str, float]:
    """The single-process step's predicted seconds per phase (:data:`PLAIN_PHASES`): the
    forward and the backward summed over the layers (``CostEngine.model_compute_s``: the
    estimate's compute, one device, one micro-batch of ``batch``) and ``optimizer_s``."""
    from autoplan.cost.engine import CostEngine

    engine = CostEngine(graph, cluster, options=GLOO_ON_CPU, calibration=None)
    fwd, bwd = engine.model_compute_s(batch)
    return {"forward": fwd, "backward": bwd, "optimizer": optimizer_s}


#: Re-pricing stored passes (``--reprice``): a layout whose error averages beyond this over
#: the passes is listed as systematic (a layout's error moves about 4% between passes of
#: the machine, so one this far out misses the 15% target in about half of them).
SYSTEMATIC = 0.10


def _read_pass(csv_path: Path) -> list[dict]:
    """A confirm pass's measured rows (``--csv``): model, label and measured step.

    Raises
    ------
    ConfigError
        When the file cannot be read or is not a confirm CSV (:data:`CSV_FIELDS`)."""
    import csv

    from autoplan.errors import ConfigError
    try:
        with open(csv_path, newline="") as f:
            reader = csv.DictReader(f)
            missing = {"model", "label", "measured_s"} - set(reader.fieldnames or ())
            if missing:
                raise ConfigError(f"{csv_path}: not a confirm pass's CSV (no column "
                                  f"{', '.join(sorted(missing))}); write one with "
                                  "`local_truth.py --confirm --csv PATH`")
            rows = list(reader)
    except OSError as exc:
        raise ConfigError(f"{csv_path}: cannot read it ({exc.strerror or exc})") from None
    out = []
    for i, r in enumerate(rows, start=2):
        if not r["measured_s"]:
            continue                     # not runnable or failed in that pass
        try:
            measured = float(r["measured_s"])
        except ValueError:
            raise ConfigError(f"{csv_path}, line {i}: measured_s {r['measured_s']!r} is not "
                              "a number") from None
        if r["model"] not in CONFIRM_MODELS or not measured > 0:
            raise ConfigError(f"{csv_path}, line {i}: model {r['model']!r} with measured_s "
                              f"{measured!r}; expected one of {CONFIRM_MODELS} and a positive "
                              "step")
        out.append({"model": r["model"], "label": r["label"], "measured_s": measured,
                    "picked": r.get("search_rank") == "1"})
    return out


def reprice(passes: list[tuple[Path, Path]], models: list[str], graphs: dict | None = None,
            *, host_split: bool = False) -> list[dict]:
    """Price every measured layout of stored confirm passes again with this code.

    ``passes``: ``(csv, profile)`` pairs, each pass's rows (``--csv``) and the profile it
    measured (``--keep-profile``); ``graphs``: the traced confirm models by name (traced
    here if not given).  Each layout is priced as the pass priced it
    (:func:`confirm_layouts` on the pass's profile, every ranked layout; the profile's
    layer scales re-derived with this code from the reference timing it states,
    :func:`_rescaled`, with ``host_split`` its host work apart), so a change to the cost
    model can be judged on several passes of the machine rather than one.  One dict per
    pass: ``csv``, ``rows`` (``model``, ``label``, ``measured_s``, ``predicted_s`` and
    ``error``, or ``predicted_s`` ``None`` where the search no longer ranks the layout) and
    ``scales`` (:func:`_rescaled`).

    Raises
    ------
    ConfigError, ProfileError
        A pass whose CSV or profile cannot be read."""
    from autoplan import load_cluster, trace
    graphs = dict(graphs or {})
    out = []
    for csv_path, profile in passes:
        rows = [r for r in _read_pass(csv_path) if r["model"] in models]
        cluster = load_cluster(str(profile))
        cluster, scales = _rescaled(cluster, host_split)
        for name in sorted({r["model"] for r in rows}):
            if name not in graphs:
                graphs[name] = trace(_confirm_model(name), seq_len=CONFIG.seq_len)
            # the ZeRO and recompute options at the pass's own pick (the ladder)
            pick = next((r["label"] for r in rows if r["model"] == name and r["picked"]), None)
            priced = {r["label"]: r["predicted_s"]
                      for r in confirm_layouts(graphs[name], cluster, run_all=True,
                                               ladder_at=pick)
                      if r.get("predicted_s") is not None}
            for r in rows:
                if r["model"] == name:
                    p = priced.get(r["label"])
                    r["predicted_s"] = p
                    r["error"] = None if p is None else p / r["measured_s"] - 1
        out.append({"csv": csv_path, "rows": rows, "scales": scales})
    return out


#: How a CPU profile's source states the reference timing its layer scales came from
#: (:mod:`autoplan.hardware.profiler`: "... timed whole (X ms forward, Y ms backward").
_REFERENCE_TIMING = re.compile(r"timed whole \(([\d.]+) ms forward, ([\d.]+) ms backward")
#: and, since 2026-11-28, the same at a second shape ("; and on 1 x 128 tokens timed whole
#: (X ms forward, Y ms backward)", 1 x 32 since 2026-11-28-1100), which gives the host scales
_SMALL_TIMING = re.compile(r"and on (\d+) x (\d+) tokens timed whole "
                           r"\(([\d.]+) ms forward, ([\d.]+) ms backward")


def _rescaled(cluster, host_split: bool = False):
    """``(cluster, scales)``: a stored pass's one-profile ``cluster`` with its layer scales
    (``OpOverhead.layer_forward_scale`` / ``layer_backward_scale``: the reference blocks
    timed whole over their price from the profile's other figures) re-derived with this
    code's price from the reference timing its source states, as a profile measured now
    would have them (host work scaled as the arithmetic, ``OpOverhead.host_forward_scale``
    unset); with ``host_split``, fitted apart where its source states the timing at a second
    shape too, at that shape (the split :data:`autoplan.hardware.profiler.
    HOST_SPLIT_NOT_APPLIED` says profiles do not apply); ``scales`` ``((stored forward,
    backward), (re-derived ...), re-derived host scales or None)``, or the cluster as it is
    and ``None`` when the profile has no layer scales or states no timing."""
    import dataclasses

    from autoplan.hardware import NodeGroup, compose_cluster
    from autoplan.hardware.profiler import _REFERENCE_SMALL_SHAPE, _reference_scales
    profile = cluster.profile_of(0)
    overhead = profile.device.op_overhead
    if overhead is None or overhead.layer_forward_scale is None:
        return cluster, None
    source = " ".join(overhead.source.split())
    timing = _REFERENCE_TIMING.search(source)
    if timing is None:
        return cluster, None
    small = _SMALL_TIMING.search(source) if host_split else None
    seconds = [float(t) / 1e3 for t in timing.groups()]
    if small:       # (micro-batch, sequence, forward ms, backward ms)
        seconds += [float(t) / 1e3 for t in small.groups()[2:]]
    fwd, bwd, _, host = _reference_scales(
        profile.device, tuple(seconds),
        small_shape=(int(small.group(1)), int(small.group(2))) if small
        else _REFERENCE_SMALL_SHAPE)
    device = dataclasses.replace(profile.device, op_overhead=dataclasses.replace(
        overhead, layer_forward_scale=fwd, layer_backward_scale=bwd,
        host_forward_scale=host[0] if host else None,
        host_backward_scale=host[1] if host else None))
    # as load_cluster makes the cluster of a node profile
    rescaled = compose_cluster([NodeGroup(dataclasses.replace(profile, device=device),
                                          len(cluster.nodes))], name=cluster.name)
    return rescaled, ((overhead.layer_forward_scale, overhead.layer_backward_scale), (fwd, bwd),
                      host)


#: Passes ``--reprice`` needs to say how far the machine's own repeatability lets any
#: price come (:func:`repeatability`): each layout is priced by the others' measurements.
REPEATABILITY_PASSES = 3


def repeatability(passes: list[dict[tuple[str, str], float]]) -> list[dict]:
    """How near a price can come to what each pass measured, given how the same layouts
    measured in the other passes: each layout measured in at least two others is priced
    by their geometric mean, and again times the pass's own median ratio to those figures
    (the machine's speed in that pass, which no price made before it can know: a generous
    ceiling).  ``passes``: per pass, ``{(model, label): measured seconds}``.  Per pass a
    dict: ``keys`` (the layouts so priced), ``scale`` (that median ratio), ``within`` and
    ``within_scaled`` (how many of them lie within :data:`TIME_TARGET` of what they
    measured, priced without and with it).  On the 2-core AMD VM's five passes of
    2026-11-28, 304 and 337 of 361 (49-68 and 65-70 of 72-73 a pass); on four of the
    Xeon's, all 306 either way."""
    out = []
    for i, measured in enumerate(passes):
        others = [q for j, q in enumerate(passes) if j != i]
        mean = {}
        for key in sorted(measured):
            seen = [q[key] for q in others if key in q]
            if len(seen) >= 2:
                mean[key] = statistics.geometric_mean(seen)
        scale = statistics.median(measured[k] / mean[k] for k in mean) if mean else None

        def held(s: float) -> int:
            return sum(abs(s * mean[k] / measured[k] - 1) <= TIME_TARGET for k in mean)

        out.append({"keys": list(mean), "scale": scale, "within": held(1.0),
                    "within_scaled": held(scale) if mean else 0})
    return out


def reprice_main(passes: list[tuple[Path, Path]], models: list[str], *,
                 host_split: bool = False) -> int:
    """``--reprice``: each pass's count within :data:`TIME_TARGET` priced with this code
    (its profile's layer scales re-derived with it, :func:`_rescaled`), per model its
    median error, its misses; from :data:`REPEATABILITY_PASSES` passes, how near the
    machine's own repeatability lets any price come (:func:`repeatability`) against this
    code on the same layouts; then the layouts whose error averages beyond
    :data:`SYSTEMATIC` over the passes."""
    t0 = time.perf_counter()
    results = reprice(passes, models, host_split=host_split)
    by_layout: dict[tuple[str, str], list[float]] = {}
    for res in results:
        priced = [r for r in res["rows"] if r["error"] is not None]
        within = sum(abs(r["error"]) <= TIME_TARGET for r in priced)
        parts = []
        for name in models:
            errs = [r["error"] for r in priced if r["model"] == name]
            if errs:
                parts.append(f"{name} {sum(abs(e) <= TIME_TARGET for e in errs)}/{len(errs)} "
                             f"median {statistics.median(errs):+.1%}")
        unpriced = len(res["rows"]) - len(priced)
        print(f"{res['csv']}: {within} of {len(priced)} within {TIME_TARGET:.0%} priced with "
              f"this code ({'; '.join(parts) or 'no measured rows'})"
              + (f"; {unpriced} no longer ranked by the search" if unpriced else ""))
        if res["scales"] is not None:
            (f0, b0), (f1, b1), host = res["scales"]
            print(f"    layer scales re-derived from its reference timing: x{f0:.3f} forward, "
                  f"x{b0:.3f} backward as stored -> x{f1:.3f}, x{b1:.3f}"
                  + (f"; host work x{host[0]:.3f}, x{host[1]:.3f}" if host else ""))
        for r in sorted(priced, key=lambda r: r["error"]):
            if abs(r["error"]) > TIME_TARGET:
                print(f"    miss: {r['model']} {r['label']} {r['error']:+.1%}")
            by_layout.setdefault((r["model"], r["label"]), []).append(r["error"])
    if len(results) >= REPEATABILITY_PASSES:
        ceiling = repeatability([{(r["model"], r["label"]): r["measured_s"] for r in res["rows"]}
                                 for res in results])
        print("\nthe machine's own repeatability: each layout priced by its measurements in "
              "the other passes (their geometric mean; and times the pass's median ratio to "
              "them, its speed), against this code on the same layouts")
        for res, c in zip(results, ceiling):
            keys = set(c["keys"])
            ours = [r["error"] for r in res["rows"]
                    if (r["model"], r["label"]) in keys and r["error"] is not None]
            print(f"    {res['csv']}: {c['within']} of {len(keys)} within {TIME_TARGET:.0%} "
                  f"({c['within_scaled']} at the pass's speed); this code "
                  f"{sum(abs(e) <= TIME_TARGET for e in ours)} of {len(ours)}")
    if len(results) > 1:
        far = sorted(((statistics.mean(e), k, e) for k, e in by_layout.items()
                      if len(e) >= 2 and abs(statistics.mean(e)) > SYSTEMATIC),
                     key=lambda t: t[0])
        print(f"\nover the {len(results)} passes, layouts measured in two or more whose "
              f"error averages beyond {SYSTEMATIC:.0%}: {len(far) or 'none'}")
        for mean, (name, label), errs in far:
            print(f"    {name} {label}: mean {mean:+.1%} over {len(errs)} "
                  f"({min(errs):+.1%} to {max(errs):+.1%})")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


def plain_main(profile: Path | None, models: list[str], *, run: bool,
               keep_profile: Path | None = None) -> int:
    """The compute alone, without parallelism: the confirm models' single-process training
    step on each of ``CONFIRM_WORLD`` processes at once against the estimate on one device
    of the 4-process profile (measured with every rank busy, as these processes are).  What
    this misses, the device figures miss; what the confirm misses beyond it is the
    distributed program's own (collectives, wrappers' hooks, ranks waiting on each other)."""
    from autoplan import estimate, load_cluster, trace

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = profile or _measure_profile(tmp, keep_profile)
        cluster = load_cluster(str(path), devices_per_node=1)
    print(f"\nthe single-process step, {CONFIRM_WORLD} processes at once, fp32, seq "
          f"{CONFIG.seq_len}; predicted on one device of the {CONFIRM_WORLD}-process profile")
    print(f"{'model':<8} {'micro-batch':>11} {'predicted s':>12} {'measured s':>11} {'error':>8}"
          + "".join(f"  {p + ' pred/meas s, error':>30}" for p in PLAIN_PHASES))
    errors = []
    for name in models:
        graph = trace(_confirm_model(name), seq_len=CONFIG.seq_len)
        for b in PLAIN_BATCHES:
            strategy = Strategy(micro_batch=b, global_batch=b, precision="fp32")
            est = estimate(graph, cluster, strategy, calibration=None, options=GLOO_ON_CPU)
            pred = est.step_time_s
            phases = plain_phases(graph, cluster, b, est.breakdown["optimizer_s"])
            if not run:
                print(f"{name:<8} {b:>11} {pred:12.4f} {'-':>11} {'-':>8}"
                      + "".join(f"  {phases[p]:>12.4f} {'-':>8} {'-':>8}" for p in PLAIN_PHASES))
                continue
            got = measure_plain(name, b, CONFIRM_WORLD)
            meas = {k: statistics.median(g[k] for g in got) for k in got[0]}
            errors.append((pred - meas["step"]) / meas["step"])
            print(f"{name:<8} {b:>11} {pred:12.4f} {meas['step']:11.4f} {errors[-1]:+8.1%}"
                  + "".join(f"  {phases[p]:>12.4f} {meas[p]:8.4f} "
                            f"{(phases[p] - meas[p]) / meas[p]:+8.1%}" for p in PLAIN_PHASES))
    if errors:
        print(f"mean |error| {statistics.mean(abs(e) for e in errors):.1%} (median over the "
              f"processes of each one's median of {PLAIN_TIMED} steps)")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


# ----------------------------------------------------------------------------- main


def _ranking(values: dict[str, float]) -> list[str]:
    return sorted(values, key=lambda k: (values[k], k))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=None,
                    help="use this profile instead of profiling the machine")
    ap.add_argument("--no-run", action="store_true", help="estimate only")
    ap.add_argument("--memory", nargs="*", metavar="LAYOUT", default=None,
                    help="compare peak memory instead of step time (all layouts, or those named: "
                         + ", ".join(MEMORY_LAYOUTS) + ")")
    ap.add_argument("--confirm", action="store_true",
                    help=f"search a small GPT and a small Llama on {CONFIRM_WORLD} processes, run "
                         "the layouts the search ranks and compare the pick with the fastest")
    ap.add_argument("--models", nargs="+", choices=CONFIRM_MODELS, default=list(CONFIRM_MODELS),
                    help="with --confirm: the models (default: both)")
    ap.add_argument("--all", action="store_true",
                    help="with --confirm: run every ranked layout (no cap)")
    ap.add_argument("--csv", type=Path, default=None, help="with --confirm: write the rows here")
    ap.add_argument("--keep-profile", type=Path, default=None, metavar="PATH",
                    help="with --confirm or --plain: keep the profile the pass measures here "
                         "(to price its runs again later; not with --profile)")
    ap.add_argument("--reprice", nargs=2, action="append", metavar=("CSV", "PROFILE"),
                    type=Path, default=None,
                    help="price a stored confirm pass again with this code: its rows (--csv) "
                         "and the profile it measured (--keep-profile); repeat for several "
                         "passes")
    ap.add_argument("--host-split", action="store_true",
                    help="with --reprice: price the layers' host work apart from their "
                         "arithmetic where a pass's profile timed the reference blocks at two "
                         "shapes (the split profiles state but do not apply)")
    ap.add_argument("--plain", action="store_true",
                    help=f"the confirm models' single-process step on {CONFIRM_WORLD} processes "
                         "at once against one device of the profile: the compute alone")
    args = ap.parse_args(argv)
    if args.keep_profile is not None:
        if not (args.confirm or args.plain):
            ap.error("--keep-profile goes with --confirm or --plain (the passes that profile "
                     "the 4-process machine)")
        if args.profile is not None:
            ap.error("--keep-profile keeps the profile a pass measures; with --profile it "
                     "measures none (drop one of the two)")
        if not args.keep_profile.parent.is_dir():
            ap.error(f"--keep-profile {args.keep_profile}: no directory "
                     f"{args.keep_profile.parent} to write it in")
    if args.host_split and not args.reprice:
        ap.error("--host-split goes with --reprice (it re-prices stored passes)")
    if args.reprice:
        if args.confirm or args.plain or args.memory is not None or args.profile is not None:
            ap.error("--reprice prices stored passes with their own profiles: not with "
                     "--confirm, --plain, --memory or --profile")
        from autoplan.errors import AutoplanError
        try:
            return reprice_main([tuple(p) for p in args.reprice], args.models,
                                host_split=args.host_split)
        except AutoplanError as exc:
            print(f"local_truth.py: error: {exc}", file=sys.stderr)
            return 2
    if args.plain:
        return plain_main(args.profile, args.models, run=not args.no_run,
                          keep_profile=args.keep_profile)
    if args.confirm:
        return confirm_main(args.profile, args.models, run=not args.no_run, run_all=args.all,
                            csv_path=args.csv, keep_profile=args.keep_profile)
    if args.memory is not None:
        return memory_main(args.memory)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        profile = args.profile or profile_machine(Path(tmp) / "local-truth.yaml")
        estimates = predict(profile)
    predicted = {k: e.step_time_s for k, e in estimates.items()}
    print(f"model: GPT {CONFIG.layers} layers, hidden {CONFIG.hidden}, seq {CONFIG.seq_len}, "
          f"vocab {CONFIG.vocab_size}; global batch {GLOBAL_BATCH}, micro-batch 2, fp32, 2 processes")
    measured: dict[str, float] = {}
    if args.no_run:
        print("real runs skipped (--no-run)")
    elif not runtime_available():
        print("real runs skipped: the runtime (autoplan.runtime.parallelize) is not available yet")
    else:
        steps: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        for _ in range(ROUNDS):
            for name in LAYOUTS:
                steps[name] += measure(name)
        measured = {name: min(t) for name, t in steps.items()}
        spread = {name: statistics.median(t) / min(t) - 1 for name, t in steps.items()}
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = float("nan")
        print(f"measured: fastest of {ROUNDS} x {TIMED_STEPS} steps per layout; median is "
              + ", ".join(f"{k} +{v:.0%}" for k, v in spread.items())
              + f" above it (1-min load average {load:.1f} on {os.cpu_count()} cores)")
    print(f"\n{'layout':<16} {'predicted s':>12} {'measured s':>11} {'error':>8}  predicted breakdown")
    for name, e in estimates.items():
        top = sorted(((v, k[:-2]) for k, v in e.breakdown.items() if v > 0), reverse=True)[:3]
        parts = ", ".join(f"{k} {v / e.step_time_s:.0%}" for v, k in top)
        if name in measured:
            err = (predicted[name] - measured[name]) / measured[name]
            print(f"{name:<16} {predicted[name]:12.4f} {measured[name]:11.4f} {err:+8.1%}  {parts}")
        else:
            print(f"{name:<16} {predicted[name]:12.4f} {'-':>11} {'-':>8}  {parts}")
    print(f"\npredicted ranking (fastest first): {' < '.join(_ranking(predicted))}")
    if measured:
        print(f"measured ranking  (fastest first): {' < '.join(_ranking(measured))}")
        same = _ranking(predicted) == _ranking(measured)
        mape = statistics.mean(abs(predicted[k] - measured[k]) / measured[k] for k in measured)
        print(f"ranking matches: {same}; MAPE {mape:.1%}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
