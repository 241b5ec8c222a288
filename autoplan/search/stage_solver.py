"""The per-stage problem, solved with OR-Tools CP-SAT.

Given the blocks of a model, the pipeline ranks (each with its device, memory
capacity and micro-batches in flight) and the per-block cost of every
recompute option on every rank, choose how many blocks each rank holds and
which recompute option each of them uses, so that every rank fits its memory
and the slowest rank is as fast as possible.

Identical blocks are interchangeable, so the model counts blocks per (rank,
option) instead of placing each one: the blocks of rank ``p`` are the next
``sum_o n[p, o]`` blocks, which keeps every stage contiguous by construction.

Two exact solvers.  With at most three recompute options (none, selective, full: every
problem the search poses) :func:`solve_stage_problem` counts: rank by rank, the least
time of each number of blocks within its memory (:func:`_least_times`), then the least
bottleneck at which the ranks hold every block, the extra blocks taken off the fullest
ranks (about a millisecond, where CP-SAT took 10 to 300 on the problems of a GPT-3
replan).  Otherwise, and in the tests that check the two agree, OR-Tools CP-SAT
(:func:`solve_stage_problem_cp_sat`), which reads like an OR-Tools sample: data,
variables, constraints, objective, solve, extract.

Examples
--------
Two ranks, four blocks, one option; rank 1 is twice as slow: it gets fewer blocks.

>>> data = StageProblem(num_blocks=4, options=("none",),
...     time_us=((10,), (20,)), memory_mib=((1,), (1,)),
...     fixed_time_us=(0, 0), fixed_memory_mib=(0, 0), capacity_mib=(100, 100))
>>> sol = solve_stage_problem(data)
>>> sol.counts, sol.bottleneck_us
(((3,), (1,)), 30)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from ..errors import InfeasiblePlan

__all__ = ["StageProblem", "StageSolution", "solve_stage_problem",
           "solve_stage_problem_cp_sat", "memory_allows"]


@dataclass(frozen=True)
class StageProblem:
    """Integer data of one stage problem (times in microseconds, memory in MiB).

    ``time_us[p][o]`` / ``memory_mib[p][o]``: one block with option ``o`` on
    rank ``p`` (memory already multiplied by the micro-batches in flight and
    including its parameter, gradient and optimizer share).  ``fixed_*[p]``:
    what rank ``p`` holds besides blocks (embeddings, head, buffers, reserve).
    ``min_blocks``: each rank holds at least this many blocks.
    ``hint[p][o]``: a known solution (e.g. the even Megatron split), passed to
    the solver as a hint.
    """

    num_blocks: int
    options: tuple[str, ...]
    time_us: tuple[tuple[int, ...], ...]
    memory_mib: tuple[tuple[int, ...], ...]
    fixed_time_us: tuple[int, ...]
    fixed_memory_mib: tuple[int, ...]
    capacity_mib: tuple[int, ...]
    min_blocks: int = 1
    hint: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class StageSolution:
    counts: tuple[tuple[int, ...], ...]     # blocks per (rank, option)
    bottleneck_us: int
    status: str


def memory_allows(data: StageProblem) -> bool:
    """Whether the ranks can hold the blocks at all, each block at the option of least
    memory on its rank (at least ``min_blocks`` each): the memory constraints alone,
    without the solver.  False proves the problem infeasible.

    >>> memory_allows(StageProblem(num_blocks=4, options=("none", "full"),
    ...     time_us=((1, 2), (1, 2)), memory_mib=((3, 1), (3, 1)),
    ...     fixed_time_us=(0, 0), fixed_memory_mib=(0, 0), capacity_mib=(2, 1)))
    False
    """
    room = 0
    for p in range(len(data.capacity_mib)):
        free = data.capacity_mib[p] - data.fixed_memory_mib[p]
        least = min(data.memory_mib[p])
        most = data.num_blocks if least <= 0 else free // least
        if free < 0 or most < data.min_blocks:
            return False
        room += most
    return room >= data.num_blocks


def solve_stage_problem(data: StageProblem, *, max_deterministic_time_s: float = 2.0,
                        seed: int = 0) -> StageSolution:
    """Minimise the slowest rank's time subject to every rank's memory: by counting
    (exact) for up to three options, else with CP-SAT
    (:func:`solve_stage_problem_cp_sat`, with ``max_deterministic_time_s`` and ``seed``).

    Of the assignments with the least bottleneck, the counting one takes the extra
    blocks off the rank with the least memory left, then where they cost the most time,
    ties to the later rank.

    Raises
    ------
    InfeasiblePlan
        When no assignment fits.
    """
    if len(data.options) > 3:
        return solve_stage_problem_cp_sat(data, max_deterministic_time_s=max_deterministic_time_s,
                                          seed=seed)
    if not memory_allows(data) or len(data.capacity_mib) * data.min_blocks > data.num_blocks:
        raise _no_fit(data)
    n, ranks = data.num_blocks, range(len(data.capacity_mib))
    tables = [_least_times(data.time_us[p], data.memory_mib[p],
                           data.capacity_mib[p] - data.fixed_memory_mib[p], n) for p in ranks]
    # each rank's time with k blocks (inf where they do not fit), k = 0 .. n
    times = [data.fixed_time_us[p] + tables[p][0] for p in ranks]

    def held(limit: float) -> list[int]:
        """The most blocks each rank holds within ``limit`` microseconds (times rise with k)."""
        return [int(np.searchsorted(t, limit, side="right")) - 1 for t in times]

    def holds(limit: float) -> bool:
        most = held(limit)
        return min(most) >= data.min_blocks and sum(most) >= n

    candidates = np.unique(np.concatenate([t[np.isfinite(t)] for t in times]))
    lo, hi = 0, len(candidates) - 1
    if not holds(candidates[hi]):
        raise _no_fit(data)
    while lo < hi:                      # the least candidate time at which they hold all
        mid = (lo + hi) // 2
        if holds(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    bottleneck = candidates[lo]
    counts = held(bottleneck)
    # the extra blocks off the fullest rank (the least memory left), then where a block
    # costs the most time: of the solutions at the bottleneck, one that keeps clear of
    # the memory limit the engine checks it against
    def key(p: int) -> tuple:
        per = tables[p][1][counts[p]]
        used = data.fixed_memory_mib[p] + sum(k * m for k, m in zip(per, data.memory_mib[p]))
        return (data.capacity_mib[p] - used, -(times[p][counts[p]] - times[p][counts[p] - 1]),
                -p)

    extra = sum(counts) - n
    heap = [key(p) for p in ranks if counts[p] > data.min_blocks]
    heapq.heapify(heap)
    while extra > 0:
        p = -heapq.heappop(heap)[2]
        counts[p] -= 1
        extra -= 1
        if counts[p] > data.min_blocks:
            heapq.heappush(heap, key(p))
    per_option = tuple(tables[p][1][counts[p]] for p in ranks)
    worst = max(times[p][counts[p]] for p in ranks)
    return StageSolution(per_option, int(worst), "OPTIMAL")


def _no_fit(data: StageProblem) -> InfeasiblePlan:
    return InfeasiblePlan(f"no assignment of {data.num_blocks} blocks to "
                          f"{len(data.capacity_mib)} ranks, at least {data.min_blocks} each, "
                          "fits memory (even at each rank's least-memory option)",
                          binding="memory")


def _least_times(time_us: tuple[int, ...], memory_mib: tuple[int, ...], budget_mib: int,
                 n: int) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """The least time of ``k`` blocks on one rank within ``budget_mib``, for k = 0 .. n
    (inf where they do not fit), and the blocks per option that take it.

    An option no faster and no smaller than another is never needed.  Of the others,
    by memory from the most (the fastest) down: with ``c`` blocks at the smallest, the
    rest take the fastest option as often as the memory left allows and the middle one
    otherwise (one fewer of the fastest for one more of the middle saves memory and
    costs time), so the least time over ``c`` is exact.

    >>> t, per = _least_times((10, 13), (30, 10), 100, 4)   # none: 10 us, 30 MiB
    >>> t.tolist(), per[4]
    ([0.0, 10.0, 20.0, 30.0, 43.0], (3, 1))
    """
    opts = [o for o in range(len(time_us))
            if not any((time_us[q], memory_mib[q]) < (time_us[o], memory_mib[o])
                       and time_us[q] <= time_us[o] and memory_mib[q] <= memory_mib[o]
                       for q in range(len(time_us)) if q != o)]
    # equal (time, memory): the first only
    opts = [o for o in opts if not any((time_us[q], memory_mib[q]) == (time_us[o], memory_mib[o])
                                       for q in opts if q < o)]
    opts.sort(key=lambda o: (-memory_mib[o], time_us[o]))
    k = np.arange(n + 1, dtype=np.int64)[:, None]
    small = opts[-1]
    if len(opts) == 1:
        time = time_us[small] * k
        ok = memory_mib[small] * k <= budget_mib
        blocks = {small: k}
    else:
        c = np.arange(n + 1, dtype=np.int64)[None, :]       # blocks at the smallest
        rest = k - c
        fast = opts[0]
        middle = opts[1] if len(opts) == 3 else fast
        # memory left with the rest all at the middle option
        slack = budget_mib - memory_mib[small] * c - memory_mib[middle] * rest
        ok = (rest >= 0) & (slack >= 0)
        if len(opts) == 3:     # as many of the rest at the fastest as the slack allows
            a = np.minimum(rest, np.maximum(slack, 0) // (memory_mib[fast] - memory_mib[middle]))
        else:
            a = rest
        time = time_us[fast] * a + time_us[middle] * (rest - a) + time_us[small] * c
        blocks = {fast: a, small: np.broadcast_to(c, rest.shape)}
        if len(opts) == 3:
            blocks[middle] = rest - a
    time = np.where(ok, time, np.iinfo(np.int64).max)
    best = time.argmin(axis=1)                          # the fewest small ones on ties
    rows = np.arange(time.shape[0])
    least = time[rows, best].astype(float)
    least[time[rows, best] == np.iinfo(np.int64).max] = np.inf
    chosen = [np.broadcast_to(blocks[o], time.shape)[rows, best].tolist() if o in blocks
              else [0] * len(rows) for o in range(len(time_us))]
    per = list(zip(*chosen))
    return least, per


def solve_stage_problem_cp_sat(data: StageProblem, *, max_deterministic_time_s: float = 2.0,
                               seed: int = 0) -> StageSolution:
    """Minimise the slowest rank's time subject to every rank's memory, with CP-SAT.

    Raises
    ------
    InfeasiblePlan
        When no assignment fits (the solver proved it, or found nothing in time).
    """
    if not memory_allows(data):
        raise InfeasiblePlan(f"no assignment of {data.num_blocks} blocks to "
                             f"{len(data.capacity_mib)} ranks fits memory (even at each "
                             "rank's least-memory option)", binding="memory")
    ranks = range(len(data.capacity_mib))
    opts = range(len(data.options))
    model = cp_model.CpModel()

    # Variables: n[p, o] = blocks on rank p with option o.
    n = {(p, o): model.new_int_var(0, data.num_blocks, f"n[{p},{data.options[o]}]")
         for p in ranks for o in opts}
    horizon = max(data.fixed_time_us) + data.num_blocks * max(max(t) for t in data.time_us)
    bottleneck = model.new_int_var(0, horizon, "bottleneck_us")

    # Every block is placed exactly once.
    model.add(sum(n.values()) == data.num_blocks)
    for p in ranks:
        blocks_p = sum(n[p, o] for o in opts)
        # Each rank holds at least min_blocks blocks (no empty pipeline stage).
        model.add(blocks_p >= data.min_blocks)
        # Each rank fits its memory.
        model.add(data.fixed_memory_mib[p]
                  + sum(data.memory_mib[p][o] * n[p, o] for o in opts) <= data.capacity_mib[p])
        # The bottleneck is at least every rank's time.
        model.add(bottleneck >= data.fixed_time_us[p]
                  + sum(data.time_us[p][o] * n[p, o] for o in opts))

    # Objective: the slowest rank (the pipeline runs at its pace).
    model.minimize(bottleneck)
    if data.hint is not None:
        for p in ranks:
            for o in opts:
                model.add_hint(n[p, o], data.hint[p][o])

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1                 # reproducible
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = max_deterministic_time_s
    # Ctrl-C stops the whole plan (KeyboardInterrupt once the solve returns), not just this
    # solve: by default CP-SAT takes SIGINT itself and returns early, and the search went on
    solver.parameters.catch_sigint_signal = False
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasiblePlan(f"no assignment of {data.num_blocks} blocks to {len(ranks)} ranks "
                             f"fits memory ({solver.status_name(status)})", binding="memory")
    counts = tuple(tuple(int(solver.value(n[p, o])) for o in opts) for p in ranks)
    return StageSolution(counts, int(solver.value(bottleneck)), solver.status_name(status))
