"""A heterogeneous cluster on this machine: the speed-proportional plan vs the even one,
predicted gain vs measured gain.

1. Three processes of two speeds: processes 0 and 1 share one core
   (``cpu-shared``), process 2 has another core to itself (``cpu-alone``), pinned
   with ``os.sched_setaffinity`` (every thread of each process, gloo's too).
   Two busy processes on one core each get about half of it, so ``cpu-alone``
   is about 2x faster.
2. Profile them as they will train, all at once: each process runs fp32
   matmuls and a memory copy for the same wall-clock window while the others
   do the same (so a process never gets a core to itself because its neighbour
   finished early), and the three time gloo collectives together.  Each kind
   becomes a profile (:func:`autoplan.hardware.profiler._build_profile`, the
   slowest process of the kind deciding) whose nodes reach each other over the
   measured gloo links, and :func:`autoplan.compose_cluster` joins them: devices
   0, 1 ``cpu-shared``, device 2 ``cpu-alone``, i.e. process ``r`` is device ``r``.
3. Plan a small GPT with :func:`autoplan.plan` (the default search: replicas of
   different speeds get batches in proportion to their speed) and make the even
   plan of the same degrees (equal replica batches); price both with the cost
   model (no calibration fits CPUs; no communication overlapped: gloo runs it on
   the computing cores, as ``benchmarks/pick_rank.py`` prices it).
4. Run both plans with :func:`autoplan.parallelize` on the pinned processes, in one
   run, alternating in rounds so drift in machine load hits both alike; the
   measured step time of each is the median of its timed steps.

Target: the speed-proportional plan is faster than the even one, and the measured
gain (even / speed-proportional step time) is within 15% of the predicted gain.
Other jobs on a shared machine disturb the figures; the 1-minute load average
is printed with them.

    python benchmarks/heterogeneous.py            # ~1-2 minutes on 2 cores
    python benchmarks/heterogeneous.py --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO, REPO / "tests", REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from autoplan.models import GPTConfig  # noqa: E402
from _ranks import GLOO_ON_CPU  # noqa: E402

#: Process -> kind; processes of one kind share a core, the kinds get different cores.
KINDS = ("cpu-shared", "cpu-shared", "cpu-alone")
CONFIG = GPTConfig(vocab_size=1024, seq_len=128, hidden=256, heads=4, layers=4)
GLOBAL_BATCH = 24
#: Measured gain within this fraction of the predicted gain.
TARGET_REL_ERROR = 0.15

MATMUL_SIZES = (128, 256, 512)
COPY_BYTES = 32 * 2**20
COMM_SIZES = tuple(4**i * 2**10 for i in range(0, 8, 2))   # 1 KiB .. 4 MiB
#: Seconds each process runs one measurement window, all processes at once, and how
#: many windows (the median counts).
WINDOW_S = 0.2
REPEATS = 3


# ----------------------------------------------------------------------------- pinning
def core_of_kind(kinds: tuple[str, ...] = KINDS) -> dict[str, int]:
    """One core per kind, the first cores this process may run on."""
    cores = sorted(os.sched_getaffinity(0))
    names = list(dict.fromkeys(kinds))
    if len(cores) < len(names):
        raise SystemExit(f"{len(names)} kinds of process need {len(names)} cores; this process "
                         f"may use {len(cores)} ({cores})")
    return {k: cores[i] for i, k in enumerate(names)}


def _pin(core: int) -> None:
    """Pin every thread of this process (gloo's worker threads exist already) to ``core``;
    threads started later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:   # a thread that just ended
            pass


# ----------------------------------------------------------------------------- profile
def _windowed(fn, window_s: float, barrier) -> float:
    """Seconds per call of ``fn``: the median over :data:`REPEATS` windows of
    ``window_s`` wall-clock seconds each, every window started together on every
    process (``barrier``) and spent calling ``fn`` (so the processes of a core stay
    busy together; the median discounts a window that another job disturbed)."""
    fn()  # first touch
    per_call = []
    for _ in range(REPEATS):
        barrier()
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= window_s:
                break
        per_call.append(elapsed / calls)
    return statistics.median(per_call)


def _measure(rank: int, world: int, cores: dict[str, int]) -> dict[str, Any]:
    """Worker: pinned like training, this process's matmul and copy speed while every
    process measures at once, then gloo collectives over all of them (rank 0 keeps the
    slowest rank's time, as ``autoplan profile`` does)."""
    import torch
    import torch.distributed as dist

    from autoplan.hardware.profiler import _cpu_name, _physical_memory_bytes

    _pin(cores[KINDS[rank]])
    matmul = []
    for n in MATMUL_SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        matmul.append([n, _windowed(lambda: torch.matmul(a, b, out=out), WINDOW_S, dist.barrier)])
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    copy_s = _windowed(lambda: dst.copy_(src), WINDOW_S, dist.barrier)
    del src, dst

    def slowest(sec: float) -> float:
        t = torch.tensor([sec], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    far = world - 1   # p2p between a shared and the alone process: the pipeline hop
    # torch 2.13 renamed the tensor forms (the old names warn), as autoplan profile handles
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    comm: dict[str, list[list[float]]] = {}
    for size in COMM_SIZES:
        count = max(world, (size // 4) // world * world)
        full, shard, other = torch.ones(count), torch.ones(count // world), torch.empty(count)

        def p2p() -> None:
            if rank == 0:
                dist.send(full, far)
                dist.recv(full, far)
            elif rank == far:
                dist.recv(full, 0)
                dist.send(full, 0)

        ops = {"all_reduce": lambda: dist.all_reduce(full),
               "all_gather": lambda: all_gather(other, shard),
               "reduce_scatter": lambda: reduce_scatter(shard, full),
               "all_to_all": lambda: dist.all_to_all_single(other, full),
               "broadcast": lambda: dist.broadcast(full, 0),
               "p2p": p2p}
        for op, fn in ops.items():
            fn()
            t0 = time.perf_counter()
            fn()
            first = slowest(time.perf_counter() - t0)
            iters = max(1, min(200, int(WINDOW_S / 6 / max(first, 1e-9))))  # same on every rank
            best = math.inf
            for _ in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                best = min(best, slowest((time.perf_counter() - t0) / iters))
            comm.setdefault(op, []).append([count * 4, best / 2 if op == "p2p" else best])
    info = {"name": f"{KINDS[rank]}: {_cpu_name()}", "memory_bytes": _physical_memory_bytes()}
    return {"rank": rank, "matmul": {"fp32": matmul}, "copy_s": copy_s, "info": info,
            "comm": comm}


def build_cluster(measured: list[dict[str, Any]]):
    """The heterogeneous cluster of the measured processes: one node per kind, devices in
    process order; nodes talk over the measured gloo links (one machine), so each
    profile's network equals its node's links."""
    from autoplan.hardware import NodeGroup, compose_cluster
    from autoplan.hardware.profiler import _build_profile
    from autoplan.hardware.profiles import NetworkSpec, NetworkTopology

    world = len(measured)
    comm = measured[0]["comm"]
    groups = []
    for kind in dict.fromkeys(KINDS):
        ranks = [m for m in measured if KINDS[m["rank"]] == kind]
        if [m["rank"] for m in ranks] != [r for r, k in enumerate(KINDS) if k == kind]:
            raise SystemExit("processes of one kind must be consecutive (devices are numbered "
                             "node by node)")
        raw = {"ranks": ranks, "comm": comm, "world": world}
        profile, _ = _build_profile(kind, raw, cuda=False, nproc=world, threads=1,
                                    devices_per_node=len(ranks), quick=True,
                                    copy_bytes=COPY_BYTES)
        node = profile.node
        network = NetworkSpec(1, node.bw_unidir_bytes_per_s * len(ranks), node.latency_s,
                              NetworkTopology.SINGLE_SWITCH, 1.0, node.collective_efficiency,
                              source=f"gloo between processes of this machine: {node.source}",
                              latency_source=node.latency_source)
        profile = dataclasses.replace(
            profile, network=network,
            description=f"{len(ranks)} process(es) pinned to one core, measured together with "
                        f"the other {world - len(ranks)} by benchmarks/heterogeneous.py")
        groups.append(NodeGroup(profile, 1))
    return compose_cluster(groups, name="pinned-processes")


# ----------------------------------------------------------------------------- plans
def even_plan(plan):
    """``plan`` with equal replica batches (same degrees, micro-batch, layers)."""
    from autoplan.errors import ConfigError

    dp, mb, b = plan.dp, plan.micro_batch, plan.global_batch
    if b % (dp * mb):
        raise ConfigError(f"global_batch={b} does not split evenly over dp={dp} replicas of "
                          f"micro_batch={mb}; choose a global batch that is a multiple of {dp * mb}")
    return dataclasses.replace(plan, replica_batch=(b // dp,) * dp,
                               num_micro_batches=b // (dp * mb), estimate=None)


# ----------------------------------------------------------------------------- run
def _train(rank: int, world: int, cores: dict[str, int], graph: str, plans: dict[str, str],
           warmup: int, rounds: int, steps: int) -> dict[str, list[float]]:
    """Worker: pinned like training, build every plan's program, then time them in
    alternating rounds (rank 0's clock, between barriers)."""
    import torch
    import torch.distributed as dist

    from autoplan.graph import ModelGraph
    from autoplan.models import GPT
    from autoplan.plan import Plan
    from autoplan.runtime import parallelize

    _pin(cores[KINDS[rank]])
    g = ModelGraph.from_json(graph)
    programs = {}
    for name, text in plans.items():
        torch.manual_seed(0)
        programs[name] = parallelize(GPT(CONFIG), Plan.from_json(text), seq_len=CONFIG.seq_len,
                                     graph=g)
    ids = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len),
                        generator=torch.Generator().manual_seed(1))
    for pm in programs.values():
        for _ in range(warmup):
            pm.step(ids)
    times: dict[str, list[float]] = {name: [] for name in programs}
    for r in range(rounds):
        order = list(programs) if r % 2 == 0 else list(reversed(programs))
        for name in order:
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                programs[name].step(ids)
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
    return times


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds per plan")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan and round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds * args.steps < 10:
        ap.error("at least 10 timed steps per plan (--rounds x --steps)")
    import autoplan
    from autoplan.models import GPT
    from dist_harness import run

    t0 = time.perf_counter()
    world = len(KINDS)
    cores = core_of_kind()
    measured = run(_measure, world, cores, timeout=300)
    cluster = build_cluster(measured)
    t_profile = time.perf_counter() - t0
    kinds = {}
    for d in range(cluster.num_devices):
        t = cluster.device_type_of(d)
        kinds[KINDS[d]] = {"peak_gflops": t.peak("fp32") / 1e9,
                           "copy_gb_per_s": t.memory_bw_bytes_per_s / 1e9}
    if not args.json:
        print("processes: " + ", ".join(f"{r} {k} (core {cores[k]})" for r, k in enumerate(KINDS)))
        print("measured all at once: " + "; ".join(
            f"{k} fp32 matmul {v['peak_gflops']:.2f} GFLOP/s (best size), copy "
            f"{v['copy_gb_per_s']:.2f} GB/s" for k, v in kinds.items())
              + f"  (profiled in {t_profile:.0f} s)")

    import torch
    torch.manual_seed(0)
    graph = autoplan.trace(GPT(CONFIG), seq_len=CONFIG.seq_len)
    best = autoplan.plan(graph, cluster, global_batch=GLOBAL_BATCH, precision="fp32",
                         options=GLOO_ON_CPU)
    proportional = autoplan.Plan.from_json(best.to_json())
    plans = {"speed-proportional": proportional, "even": even_plan(proportional)}
    predicted = {k: autoplan.estimate_plan(graph, cluster, p, options=GLOO_ON_CPU,
                                           calibration=None).step_time_s
                 for k, p in plans.items()}
    if len(set(proportional.replica_batch)) == 1:
        print(f"the search chose {proportional.label()} with equal replica batches "
              f"{list(proportional.replica_batch)}: nothing to compare (target missed)")
        return 1
    times = run(_train, world, cores, graph.to_json(), {k: p.to_json() for k, p in plans.items()},
                args.warmup, args.rounds, args.steps, timeout=600)[0]
    measured_s = {k: statistics.median(v) for k, v in times.items()}
    gain_pred = predicted["even"] / predicted["speed-proportional"]
    gain_meas = measured_s["even"] / measured_s["speed-proportional"]
    rel = gain_meas / gain_pred - 1
    passed = gain_meas > 1 and abs(rel) <= TARGET_REL_ERROR
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")

    if args.json:
        print(json.dumps({"cores": cores, "device_types": kinds,
                          "plans": {k: p.to_json() for k, p in plans.items()},
                          "predicted_s": predicted, "step_times_s": times,
                          "measured_s": measured_s, "predicted_gain": gain_pred,
                          "measured_gain": gain_meas, "passed": passed}, indent=1))
        return 0 if passed else 1
    print(f"model: GPT {CONFIG.layers} layers, hidden {CONFIG.hidden}, seq {CONFIG.seq_len}, "
          f"vocab {CONFIG.vocab_size}; global batch {GLOBAL_BATCH}, fp32; "
          f"plan {proportional.label()}")
    n = len(times["even"])
    print(f"\n{'plan':<20} {'replica batches':>16} {'predicted s':>12} {'measured s':>11} "
          f"{'error':>7}   (median of {n} steps, 1-min load {load:.1f} on {os.cpu_count()} cores)")
    for k, p in plans.items():
        err = predicted[k] / measured_s[k] - 1
        print(f"{k:<20} {str(list(p.replica_batch)):>16} {predicted[k]:12.3f} "
              f"{measured_s[k]:11.3f} {err:+7.1%}")
    if gain_pred < 1:
        print("\nnote: the cost model prices the even split faster than the split the search "
              "chose (the search splits by peak matmul throughput, not by priced time)")
    print(f"\ngain (even / speed-proportional): predicted {gain_pred:.3f}, measured "
          f"{gain_meas:.3f} ({rel:+.1%})")
    print(f"target: speed-proportional faster than even and measured gain within "
          f"{TARGET_REL_ERROR:.0%} of predicted: {'PASS' if passed else 'MISS'}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
