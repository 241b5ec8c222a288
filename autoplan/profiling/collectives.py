"""Collectives: their times over message sizes (:func:`measure_collectives`), the
``t = a + b S`` fit of them (:func:`fit_alpha_beta`), the p2p partners, the cost of a
collective after compute where ranks share cores (:func:`measure_arrival`), and the node of a
one-device profile (:func:`one_device_node`).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

from ..hardware.collectives import CollectiveOp, ring_coefficients
from ..hardware.profiles import (COLLECTIVE_OPS, CollectiveEfficiency, IntraNodeTopology,
                                 NodeSpec)
from .plan import MeasurementPlan
from .timing import fmt_bytes


#: CPU collectives are timed after a matmul of this shape (m, k, n): 134 MFLOP, about a
#: millisecond on one core, like the compute between a step's collectives
WORK_SHAPE = (256, 256, 1024)
WORK_FLOPS = 2 * math.prod(WORK_SHAPE)
#: floor of a collective's time after the compute is subtracted (noise can take it below 0)
MIN_COLLECTIVE_S = 1e-6


def collective_floor_s(op: str, nbytes: int, world: int, copy_bytes_per_s: float) -> float:
    """The least time a collective of ``nbytes`` can take on ranks that share host memory: the
    bytes each rank moves (the ring model's, :func:`ring_coefficients`; p2p's round trip
    twice the message) at the host's measured memory copy rate, and never under
    :data:`MIN_COLLECTIVE_S`.  A time after compute less the compute alone is the difference
    of two noisy figures: on a loaded host it can read near zero, and one such reading would
    fit a link faster than memory (CI measured 51.7 TB/s on 2 ranks of a 2-core VM).

    >>> collective_floor_s("all_reduce", 10**9, 2, 10e9)   # 2(n-1)/n = 1 x 1 GB at 10 GB/s
    0.1
    >>> collective_floor_s("p2p", 1000, 2, 10e9) == MIN_COLLECTIVE_S
    True
    """
    if op == "p2p":
        moved = 2.0 * nbytes   # timed as a round trip
    else:
        factor, _ = ring_coefficients(CollectiveOp(op), world)
        moved = factor * nbytes
    return max(MIN_COLLECTIVE_S, moved / copy_bytes_per_s)


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Fit ``t = a + b * S`` minimising the squared *relative* error; ``a >= 0``, ``b > 0``.

    Relative weighting lets the small sizes fix the latency and the large ones
    the bandwidth.  The times are first made non-decreasing in size (adjacent
    violators pooled to their mean): a collective does not get faster with more
    bytes, so a larger size measured faster is noise, and left in it could turn
    the slope negative and drop the latency of a latency-bound operation.

    Examples
    --------
    >>> a, b = fit_alpha_beta([1e3, 1e6, 1e9], [1e-5 + 1e-9 * s for s in (1e3, 1e6, 1e9)])
    >>> round(a, 9), round(b, 15)
    (1e-05, 1e-09)
    """
    if len(sizes) != len(times) or not sizes:
        raise ValueError("fit_alpha_beta needs as many times as sizes, at least one")
    sizes, times = _monotone(sizes, times)
    w = [1.0 / t for t in times]  # rows scaled by 1/t: minimise sum ((a + b s - t) / t)^2
    sww = sum(x * x for x in w)
    sws = sum(x * x * s for x, s in zip(w, sizes))
    sss = sum((x * s) ** 2 for x, s in zip(w, sizes))
    swt = sum(x * x * t for x, t in zip(w, times))
    sst = sum(x * x * s * t for x, s, t in zip(w, sizes, times))
    det = sww * sss - sws * sws
    a, b = (((sss * swt - sws * sst) / det, (sww * sst - sws * swt) / det)
            if len(sizes) >= 2 and det > 0 else (0.0, 0.0))
    if a < 0 or b <= 0:  # through the origin, or bandwidth from the largest size
        a = 0.0
        b = sst / sss if sst > 0 else 0.0
    if b <= 0:
        i = max(range(len(sizes)), key=lambda j: sizes[j])
        b = times[i] / sizes[i]
    return a, b


def _monotone(sizes: list[float], times: list[float]) -> tuple[list[float], list[float]]:
    """``(sizes, times)`` sorted by size, the times made non-decreasing by pooling adjacent
    violators (the least-squares monotone fit).

    >>> _monotone([1, 2, 3, 4], [5.0, 3.0, 7.0, 6.0])
    ([1, 2, 3, 4], [4.0, 4.0, 6.5, 6.5])
    """
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    blocks: list[list[float]] = []      # [sum, count] per pooled block
    for i in order:
        blocks.append([times[i], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    pooled = [value for total, count in blocks for value in [total / count] * int(count)]
    return [sizes[i] for i in order], pooled


def p2p_partner(rank: int, world: int, *, every_pair: bool) -> int | None:
    """The rank that ``rank`` exchanges with in the profile's p2p timing: ranks 0 and 1 alone,
    or with ``every_pair`` every pair (0-1, 2-3, ...) at once; ``None``: it sits out (an odd
    world's last rank, or every rank past 1)."""
    partner = rank ^ 1 if every_pair else (1 - rank if rank < 2 else None)
    return partner if partner is not None and partner < world else None


def measure_collectives(torch, dist, rank: int, world: int, device, plan: MeasurementPlan,
                        timed: Callable[..., float], say: Callable[[str], None], *, cuda: bool,
                        shares_cores: bool, after_compute: bool,
                        work: Callable[[], None] | None,
                        copy_bytes_per_s: float) -> dict[str, list[tuple[int, float]]]:
    """Seconds per call of each collective (:data:`~autoplan.hardware.profiles.COLLECTIVE_OPS`)
    at each of the plan's message sizes, on every rank at once: ``op -> [(bytes, seconds)]``,
    p2p one way; none with one rank.  ``timed(fn, mean=True)`` is the mean of every timed
    call; with ``after_compute`` (a CPU whose ranks have cores of their own) each collective
    is timed after ``work`` (a :data:`WORK_SHAPE` matmul) less ``work`` alone, and where
    ``shares_cores`` p2p so, every pair of ranks at once (:func:`p2p_partner`); such a
    difference is held at :func:`collective_floor_s` (the host's ``copy_bytes_per_s``)."""
    # torch 2.13 renamed the tensor forms (the old names warn); older torch has only those
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    comm: dict[str, list[tuple[int, float]]] = {op: [] for op in COLLECTIVE_OPS}
    # one rank: no collective can run on this node (no other device to talk to)
    for size in plan.comm_sizes_bytes if world > 1 else ():
        count = max(world, (size // 4) // world * world)  # float32 elements, divisible by world
        nbytes = count * 4
        full = torch.ones(count, device=device)
        shard = torch.ones(count // world, device=device)
        other = torch.empty(count, device=device)

        partner = p2p_partner(rank, world, every_pair=shares_cores)

        def p2p() -> None:
            if partner is None:
                return
            if rank < partner:
                dist.send(full, partner)
                dist.recv(full, partner)
            else:
                dist.recv(full, partner)
                dist.send(full, partner)

        ops: dict[str, Callable[[], Any]] = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: all_gather(other, shard),
            "reduce_scatter": lambda: reduce_scatter(shard, full),
            "all_to_all": lambda: dist.all_to_all_single(other, full),
            "broadcast": lambda: dist.broadcast(full, 0),
            "p2p": p2p,
        }
        if not cuda:
            work_s = timed(work, mean=True)  # the matmul alone, in the same conditions
        for op, fn in ops.items():
            if not (after_compute or (shares_cores and op == "p2p")):
                sec = timed(fn, mean=True)
            else:  # after compute, less the compute
                sec = max(collective_floor_s(op, nbytes, world, copy_bytes_per_s),
                          timed(lambda: (work(), fn()), mean=True) - work_s)
            comm[op].append((nbytes, sec / 2 if op == "p2p" else sec))  # p2p: one way
        say("collectives " + fmt_bytes(nbytes) + ": " + ", ".join(
            f"{op} {comm[op][-1][1] * 1e6:.0f} us" for op in ops))
    return comm


#: The arrival cost (:func:`measure_arrival`): calls of the ``WORK_SHAPE`` matmul between
#: two collectives (about 10 ms on a CPU rank that shares its core, a transformer layer's
#: compute in the confirm models), calls per timed loop, and rounds of the three loops per
#: group.  One round's extra reads 0-3.6 ms on 4 ranks of 2 cores; the mean of 24 (12
#: rounds, world and pairs) read 0.97-1.42 ms in four launches, their median 0.70-1.37
#: (2026-11-26): the mean is kept, over 10 rounds (~10 s)
ARRIVAL_WORK_CALLS = 3
ARRIVAL_LOOP = 12
ARRIVAL_ROUNDS = 10


def measure_arrival(work: Callable[[], Any], collectives: Sequence[Callable[[], Any]],
                    barrier: Callable[[], None], agreed_mean: Callable[[float], float],
                    rounds: int = ARRIVAL_ROUNDS, loop: int = ARRIVAL_LOOP) -> float:
    """Seconds a small collective costs more after compute than back to back where ranks
    share cores: the mean over ``rounds`` rounds and each group's ``collectives`` (a tiny
    all-reduce over a group, every rank in one) of ``compute then collective`` less the
    compute alone less the collective back to back, each the ranks' mean of ``loop`` calls
    timed on each rank's own clock (the compute free-running, as a rank's own work is).

    Where ranks share cores they reach a collective a scheduler slice apart: the last one
    waits for a core while the first ones wait in the collective, and the call costs more
    than back to back (where the ranks are all in the collective's loop).  On 4 ranks of 2
    cores, a 16 B all-reduce after ~10 ms of matmuls cost 0.2-2.8 ms more per call than
    back to back (world and pairs alike; 2026-11-26), where the profile's collectives,
    timed back to back there, had not priced it.  The mean, not the median: a step pays
    every call's wait, the rare long ones included.  Clamped at 0."""
    for fn in (work, *collectives):
        fn()
    extras = []
    for _ in range(max(1, rounds)):
        for collective in collectives:
            times = []
            for fn in (work, collective, lambda: (work(), collective())):
                barrier()
                t0 = time.perf_counter()
                for _ in range(loop):
                    fn()
                times.append(agreed_mean((time.perf_counter() - t0) / loop))
            alone, back_to_back, after = times
            extras.append(after - alone - back_to_back)
    return max(0.0, statistics.fmean(extras))


def one_device_node(copy_bytes_per_s: float, how: str, cuda: bool) -> NodeSpec:
    """The node of a one-device profile: no collective can run on it, so none was measured;
    its link figures are the device's own copy bandwidth (what a one-rank collective moves
    through) and no latency, and are never used by a plan of one device."""
    why = (f"{how}: one device, so no collective was measured (none runs on a one-device "
           "node); the device's own copy bandwidth stands for the link")
    return NodeSpec(devices_per_node=1,
                    topology=IntraNodeTopology.UNIFORM if cuda else IntraNodeTopology.SHARED_MEMORY,
                    bw_unidir_bytes_per_s=copy_bytes_per_s, latency_s=0.0,
                    collective_efficiency=CollectiveEfficiency.uniform(1.0, why),
                    source=why, latency_source=why)
