"""How the profiler times a call, shared by every kind of measurement.

Timed batches (:func:`time_local`), free-running windows where ranks share cores
(:func:`free_running`), a window of calls on each rank's clock (:func:`wall_per_call`),
whether the ranks share cores (:func:`ranks_share_cores`), progress lines, and the
error a failed measurement raises (:class:`ProfilingFailed`).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable


PREFIX = "[autoplan profile]"
WARMUP_CALLS = 2  # untimed calls before timing (first-touch allocation, connection set-up)
CALIBRATION_CALLS = 3  # calls timed to choose the iteration count of the timed batches
#: where ranks share cores, calls per timed batch at least: a batch spans from the first
#: rank's start to the last rank's end, and ranks that share cores leave the barrier up to a
#: scheduler slice apart (a quick 4-rank profile on 2 cores timed 2-call batches of its
#: larger matmuls, and priced the confirm models' step ~5% slower than with 8-call ones)
_MIN_SHARED_CALLS = 8
OVERRUN = 2.0  # stop repeating once a point has taken this many times its target
#: where ranks share cores, a rank's own work is timed in windows of at least this many
#: seconds (:func:`free_running`): their start and end skew, up to a scheduler slice each,
#: then moves a figure by ~3%
MIN_FREE_WINDOW_S = 0.15


def progress(message: str, start: float) -> None:
    print(f"{PREFIX} {time.perf_counter() - start:6.1f}s  {message}", file=sys.stderr, flush=True)


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def time_local(fn: Callable[[], Any], sync: Callable[[], None], target_s: float,
               repeats: int) -> float:
    """Best seconds per call of ``fn`` over ``repeats`` timed batches (no collectives)."""
    for _ in range(WARMUP_CALLS):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(CALIBRATION_CALLS):
        fn()
    sync()
    first = max((time.perf_counter() - t0) / CALIBRATION_CALLS, 1e-9)
    iters = max(1, min(10_000, int(target_s / repeats / first)))
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        elapsed = time.perf_counter() - t0
        best, spent = min(best, elapsed / iters), spent + elapsed
        if spent > OVERRUN * target_s:  # a loaded machine: keep the total bounded
            break
    return best


def tp_measured_in_pairs(world: int) -> bool:
    """Whether the CPU ranks' tensor-parallel figure is measured on pairs of ranks (every
    pair at once) rather than on each rank's one-rank mesh: wherever the ranks pair up
    (see :func:`measure_tp_overhead`)."""
    return world > 1 and world % 2 == 0


def ranks_share_cores(cuda: bool, world: int, threads: int) -> bool:
    """Whether the CPU ranks outnumber the cores (threads included) and take turns on them.

    There a timed batch's length depends on how the scheduler happened to share the
    cores, and a training step pays the usual share, not the luckiest: a collective's
    figure is then the mean over the timed batches (with :data:`_MIN_SHARED_CALLS` calls
    or more each), not the best batch, and a rank's own work is timed in free-running
    windows with every rank busy (:func:`free_running`).  Checked by
    ``benchmarks/local_truth.py --plain`` (the confirm models' single-process step on 4
    processes of 2 cores at once).
    """
    return not cuda and world * threads > usable_cores()


def free_running(fn: Callable[[], Any], sync: Callable[[], None], target_s: float,
                 agreed_mean: Callable[[float], float], barrier: Callable[[], None],
                 windows: int = 1) -> float:
    """Seconds per call of a rank's own work (no collective inside ``fn``) where ranks
    share cores: after a common start, each rank calls ``fn`` for a window of its own wall
    time, every rank busy as in a training step; the mean over the ranks, and of
    ``windows`` such windows (``target_s`` over them, :data:`MIN_FREE_WINDOW_S` each at
    least) the fastest.

    Batches timed from the first rank's start to the last rank's end (the collectives'
    way) add to every batch the skew with which ranks that take turns on the cores leave
    the barrier, up to a scheduler slice each (a few ms): on 4 ranks of 2 cores the quick
    profile's 20 ms batches read 256^3 fp32 matmuls at 31-36 GFLOP/s where every rank,
    free-running for a second, made 39-44, and the confirm models' steps ran their
    matmuls at 40-45 (benchmarks/local_truth.py --plain priced the step 8-22% slow).
    A window pays that skew once at each end: ``slice / window``.  Every window shares the
    cores as a step does; the fastest is kept because what else runs on the machine (other
    tenants of a VM's host) only ever adds time, as the measured steps it is compared
    with are their fastest."""
    windows = max(1, windows)
    window = max(target_s / windows, MIN_FREE_WINDOW_S)
    for _ in range(WARMUP_CALLS):
        fn()
    sync()
    best = math.inf
    for _ in range(windows):
        barrier()
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= window:
                break
        best = min(best, agreed_mean(elapsed / calls))   # the same on every rank
    return best


def wall_per_call(fn: Callable[[], Any], calls: int, barrier: Callable[[], None],
                  agreed_mean: Callable[[float], float]) -> float:
    """Seconds per call of ``fn`` after a warm-up call and a common start (``barrier``),
    each rank's clock over ``calls`` calls, the ranks' mean.  Every rank makes the same
    number of calls, so ``fn`` may run collectives (a window of each rank's own length,
    :func:`free_running`, may not)."""
    fn()
    barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return agreed_mean((time.perf_counter() - t0) / calls)


def calls_per_batch(target_s: float, repeats: int, first_s: float, shares_cores: bool) -> int:
    """Calls per timed batch: ``repeats`` batches fill ``target_s`` at ``first_s`` a call."""
    calls = min(10_000, int(target_s / repeats / max(first_s, 1e-9)))
    return max(_MIN_SHARED_CALLS if shares_cores else 1, calls)


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class ProfilingFailed(RuntimeError):
    """A rank failed or timed out; the message carries its traceback."""
