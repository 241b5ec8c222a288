"""The per-stage problem, solved with OR-Tools CP-SAT.

Given the blocks of a model, the pipeline ranks (each with its device, memory
capacity and micro-batches in flight) and the per-block cost of every
recompute option on every rank, choose how many blocks each rank holds and
which recompute option each of them uses, so that every rank fits its memory
and the slowest rank is as fast as possible.

Identical blocks are interchangeable, so the model counts blocks per (rank,
option) instead of placing each one: the blocks of rank ``p`` are the next
``sum_o n[p, o]`` blocks, which keeps every stage contiguous by construction.

Reads like an OR-Tools sample: data, variables, constraints, objective,
solve, extract.

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

from dataclasses import dataclass

from ortools.sat.python import cp_model

from ..errors import InfeasiblePlan

__all__ = ["StageProblem", "StageSolution", "solve_stage_problem", "memory_allows"]


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
    """Minimise the slowest rank's time subject to every rank's memory.

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
