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
communication overlapped (gloo on CPU runs collectives on the computing cores).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
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


def _worker(rank: int, world: int, port: int, name: str, outdir: str) -> None:
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
        torch.manual_seed(0)
        model = GPT(CONFIG)
        pm = parallelize(model, LAYOUTS[name], global_batch=GLOBAL_BATCH, seq_len=CONFIG.seq_len)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len), generator=gen)
        times = []
        for i in range(WARMUP_STEPS + TIMED_STEPS):
            dist.barrier()
            t0 = time.perf_counter()
            pm.step(ids)
            dist.barrier()
            if i >= WARMUP_STEPS:
                times.append(time.perf_counter() - t0)
        if rank == 0:
            Path(outdir, "times.json").write_text(json.dumps(times))
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


def measure(name: str, timeout_s: float = 600.0) -> list[float]:
    """Timed step times of layout ``name`` on 2 processes (gloo)."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, 2, port, name, outdir)) for r in range(2)]
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
        times = json.loads(Path(outdir, "times.json").read_text())
    return times


def runtime_available() -> bool:
    try:
        from autoplan.runtime import parallelize  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- main


def _ranking(values: dict[str, float]) -> list[str]:
    return sorted(values, key=lambda k: (values[k], k))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=None,
                    help="use this profile instead of profiling the machine")
    ap.add_argument("--no-run", action="store_true", help="estimate only")
    args = ap.parse_args(argv)
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
