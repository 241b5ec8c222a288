"""Peak memory on CPU ranks: predicted vs measured per layout (target: within 10%).

A small GPT (``CONFIG``) laid out by :func:`autoplan.parallelize` under DP, ZeRO-1/2/3, TP,
PP and recompute layouts on 2 and 4 gloo processes (fp32; DP and ZeRO-3 also in bf16,
which parallelize runs as torch.autocast over the fp32 weights).

Measured: the peak of the bytes of live tensor storages during one training step after a
warm-up step (so the optimizer states exist), counted by
:class:`autoplan.runtime.ledger.LiveBytes` (every storage alive at the step's start, then
every operator's outputs until their storage is freed); the worst rank against the
prediction for its pipeline stage.  Predicted: the estimate's per-rank allocated bytes
(model states, activations, buffers) without the runtime reserve and allocator
fragmentation, which CPU tensors do not have.  The memory estimate does not depend on the
device, so a profile of the A100 node with the world's number of devices stands in for
this machine.

    python benchmarks/memory_cpu.py                      # every layout (~3 min on 2 cores)
    python benchmarks/memory_cpu.py "DP=2" "ZeRO-3 dp2"  # some of them
    python benchmarks/memory_cpu.py --list
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import GLOO_ON_CPU, _run_ranks, end_rank, error_chain, init_rank  # noqa: E402

from autoplan.models import GPTConfig  # noqa: E402
from autoplan.strategy import Strategy  # noqa: E402

CONFIG = GPTConfig(vocab_size=1024, seq_len=128, hidden=256, heads=4, layers=4)
GLOBAL_BATCH = 16
#: The target for predicted vs measured peak memory per layout.
MEMORY_TARGET = 0.10
#: A layout whose ranks have not finished by then is killed and reported.
TIMEOUT_S = 600.0


def _s(**kw) -> Strategy:
    kw.setdefault("precision", "fp32")
    return Strategy(micro_batch=2, global_batch=GLOBAL_BATCH, **kw)


#: Layouts whose memory is compared, with their process count.
MEMORY_LAYOUTS = {
    "DP=2": (2, _s(dp=2)),
    "ZeRO-1 dp2": (2, _s(dp=2, zero=1)),
    "ZeRO-2 dp2": (2, _s(dp=2, zero=2)),
    "ZeRO-3 dp2": (2, _s(dp=2, zero=3)),
    "TP=2": (2, _s(tp=2)),
    "PP=2 1F1B": (2, _s(pp=2)),
    "DP=2 full rc": (2, _s(dp=2, recompute="full")),
    "TP=2 sel rc": (2, _s(tp=2, recompute="selective")),
    "ZeRO-3 dp4": (4, _s(dp=4, zero=3)),
    "DP2 x TP2": (4, _s(dp=2, tp=2)),
    "DP2 x PP2": (4, _s(dp=2, pp=2)),
    "TP2 x PP2 full rc": (4, _s(tp=2, pp=2, recompute="full")),
    # bf16 as parallelize runs it: torch.autocast over the fp32 weights (CostOptions.autocast)
    "DP=2 bf16": (2, _s(dp=2, precision="bf16")),
    "ZeRO-3 dp2 bf16": (2, _s(dp=2, zero=3, precision="bf16")),
    "ZeRO-3 dp2 bf16 full rc": (2, _s(dp=2, zero=3, recompute="full", precision="bf16")),
}


def _memory_worker(rank: int, world: int, port: int, outdir: str, name: str) -> None:
    """One rank: the GPT laid out by layout ``name``, a warm-up step, then one step under
    LiveBytes; writes ``mem<rank>.json`` (or ``error<rank>.txt``)."""
    torch = init_rank(rank, world, port)
    status = 0
    try:
        import torch.distributed as dist

        from autoplan.models import GPT
        from autoplan.runtime import parallelize
        from autoplan.runtime.ledger import LiveBytes
        torch.manual_seed(0)
        pm = parallelize(GPT(CONFIG), MEMORY_LAYOUTS[name][1], global_batch=GLOBAL_BATCH,
                         seq_len=CONFIG.seq_len)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len), generator=gen)
        pm.step(ids)   # warm-up: the optimizer creates its states
        dist.barrier()
        with LiveBytes() as live:
            start = live.current
            pm.step(ids)
        Path(outdir, f"mem{rank}.json").write_text(json.dumps(
            {"peak_bytes": live.peak, "start_bytes": start, "pp_rank": pm.coords.get("pp", 0)}))
    except BaseException as exc:  # report, then still tear down
        Path(outdir, f"error{rank}.txt").write_text(error_chain(exc))
        status = 1
    end_rank(status)


def measure_memory(name: str) -> list[dict]:
    """Per rank: the peak live tensor bytes of one step of layout ``name``, the live bytes
    at its start and the rank's pipeline stage."""
    world = MEMORY_LAYOUTS[name][0]
    return _run_ranks(_memory_worker, world, (name,), TIMEOUT_S,
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


def predict_memory(names: list[str]) -> dict[str, list[tuple[float, float]]]:
    """Per layout, per pipeline stage: the predicted allocated bytes without the runtime
    reserve, and the parameters' and optimizer states' bytes among them."""
    from autoplan import trace
    from autoplan.cost import estimate
    from autoplan.models import GPT
    graph = trace(GPT(CONFIG), seq_len=CONFIG.seq_len)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {w: _memory_cluster(w, Path(tmp)) for w in {MEMORY_LAYOUTS[n][0] for n in names}}
        for name in names:
            world, s = MEMORY_LAYOUTS[name]
            e = estimate(graph, clusters[world], s, calibration=None, options=GLOO_ON_CPU)
            out[name] = [(st.memory.total_bytes - st.memory.reserve_bytes,
                          st.memory.params_bytes + st.memory.optimizer_bytes) for st in e.stages]
    return out


def worst_rank(predicted: list[tuple[float, float]], ranks: list[dict]) -> tuple[dict, float]:
    """The rank whose measured peak lies farthest from the prediction for its pipeline
    stage, and that error ((predicted - measured) / measured)."""
    def err(r: dict) -> float:
        return (predicted[r["pp_rank"]][0] - r["peak_bytes"]) / r["peak_bytes"]
    worst = max(ranks, key=lambda r: abs(err(r)))
    return worst, err(worst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("layouts", nargs="*", metavar="LAYOUT",
                    help="layouts to measure (default: every one; --list names them)")
    ap.add_argument("--list", action="store_true", help="name the layouts and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, (world, _) in MEMORY_LAYOUTS.items():
            print(f"{name!r}: {world} processes")
        return 0
    names = args.layouts or list(MEMORY_LAYOUTS)
    unknown = [n for n in names if n not in MEMORY_LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {', '.join(map(repr, unknown))}; known: "
                 + ", ".join(map(repr, MEMORY_LAYOUTS)))
    predicted = predict_memory(names)
    print(f"memory: GPT {CONFIG.layers} layers, hidden {CONFIG.hidden}, seq {CONFIG.seq_len}, "
          f"vocab {CONFIG.vocab_size}; global batch {GLOBAL_BATCH}, micro-batch 2, fp32 unless "
          "named bf16 (torch.autocast over fp32 weights, as parallelize runs it); peak live "
          "tensor bytes of one step after a warm-up step, worst rank; predicted without the "
          "runtime reserve")
    print("(columns 'between steps': parameters and optimizer states predicted, live bytes "
          "at the step's start measured)")
    print(f"\n{'layout':<24} {'procs':>5} {'predicted MB':>13} {'measured MB':>12} {'error':>8}  "
          f"{'target':<7} {'between steps: predicted':>25} {'measured':>9}")
    errors, failed = [], 0
    for name in names:
        world = MEMORY_LAYOUTS[name][0]
        try:
            ranks = measure_memory(name)
        except RuntimeError as exc:
            failed += 1
            print(f"{name:<24} {world:>5} failed: {exc}")
            continue
        worst, err = worst_rank(predicted[name], ranks)
        pred, pred_states = predicted[name][worst["pp_rank"]]
        errors.append(abs(err))
        ok = "ok" if abs(err) <= MEMORY_TARGET else f"> {MEMORY_TARGET:.0%}"
        print(f"{name:<24} {world:>5} {pred / 1e6:13.2f} {worst['peak_bytes'] / 1e6:12.2f} "
              f"{err:+8.1%}  {ok:<7} {pred_states / 1e6:25.2f} {worst['start_bytes'] / 1e6:9.2f}")
    if errors:
        within = sum(e <= MEMORY_TARGET for e in errors)
        print(f"\n{within} of {len(errors)} within {MEMORY_TARGET:.0%}; mean |error| "
              f"{statistics.mean(errors):.1%}, worst {max(errors):.1%}"
              + (f"; {failed} failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
