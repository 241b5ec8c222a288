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

Memory (``--memory``): predicted vs measured peak memory per rank for DP, ZeRO-1/2/3,
TP, PP and recompute layouts on 2 and 4 processes (fp32).  Measured: the peak of the
bytes of live tensor storages during one training step after a warm-up step (so the
optimizer states exist), counted by :class:`LiveBytes` (every storage alive at the step's
start, then every op's outputs until their storage is freed).  Predicted: the estimate's
per-rank allocated bytes (model states, activations, buffers) without the runtime
reserve and allocator fragmentation, which CPU tensors do not have; the memory estimate
does not depend on the device, so a profile of the A100 node with the world's number of
devices stands in for this machine.

    python benchmarks/local_truth.py --memory        # memory only (~3 min on 2 cores)
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


def _in_worker(rank: int, world: int, port: int, outdir: str, strategy, work) -> None:
    """One rank of a measurement: a gloo group, the small GPT laid out by ``strategy``, its
    fixed batch, then ``work(pm, ids)``; an error is written to ``error<rank>.txt``, and the
    process ends with os._exit after tearing the group down (gloo can abort at exit)."""
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
        pm = parallelize(GPT(CONFIG), strategy, global_batch=GLOBAL_BATCH, seq_len=CONFIG.seq_len)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len), generator=gen)
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


def _worker(rank: int, world: int, port: int, name: str, outdir: str) -> None:
    def timed_steps(pm, ids) -> None:
        import torch.distributed as dist
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

    _in_worker(rank, world, port, outdir, LAYOUTS[name], timed_steps)


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


# ----------------------------------------------------------------------------- memory

#: Layouts whose memory is compared, with their process count (fp32, CONFIG).
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
}
#: The issue's target for predicted vs measured peak memory per layout.
MEMORY_TARGET = 0.10


class LiveBytes:
    """Peak bytes of live tensor storages on this process (CPU has no allocator statistics).

    At entry every tensor the garbage collector can reach is counted (parameters,
    gradients, optimizer states, runtime buffers; a DTensor by its local shard); then a
    ``TorchDispatchMode`` counts the storage of every operator output, and a weak
    reference to each storage subtracts it when it is freed.  Temporaries an operator
    allocates and frees inside itself are not seen (nor are those inside a DTensor's
    dispatch): the peak is of what operators hand to each other.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._refs: dict[int, object] = {}

    def _add(self, t) -> None:
        import weakref

        import torch
        from torch.distributed.tensor import DTensor
        from torch._subclasses.fake_tensor import is_fake
        if isinstance(t, DTensor):
            t = t._local_tensor
        if not isinstance(t, torch.Tensor) or is_fake(t) or t.is_meta:
            return   # fake and meta tensors (left from capturing the model) hold no memory
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if st.device.type == "meta":
            return
        key = st._cdata
        if key in self._refs or st.nbytes() == 0:
            return
        n = st.nbytes()

        def freed(_ref, key=key, n=n) -> None:
            if self._refs.pop(key, None) is not None:
                self.current -= n

        self._refs[key] = weakref.ref(st, freed)
        self.current += n
        self.peak = max(self.peak, self.current)

    def __enter__(self) -> "LiveBytes":
        import gc

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        gc.collect()   # garbage is not memory in use
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # isinstance on some tracked objects warns
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    self._add(obj)
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    tracker._add(t)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


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
    import multiprocessing as mp
    world = MEMORY_LAYOUTS[name][0]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=_memory_worker, args=(r, world, port, name, outdir))
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
        return [json.loads(Path(outdir, f"mem{r}.json").read_text()) for r in range(world)]


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
    predicted = predict_memory()
    print(f"memory: GPT {CONFIG.layers} layers, hidden {CONFIG.hidden}, seq {CONFIG.seq_len}, "
          f"vocab {CONFIG.vocab_size}; global batch {GLOBAL_BATCH}, micro-batch 2, fp32; "
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
    args = ap.parse_args(argv)
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
