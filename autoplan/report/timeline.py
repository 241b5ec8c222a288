"""The pipeline schedule of a plan as a timeline: which rank runs what, and when.

The cost model prices a schedule with a closed formula
(:func:`autoplan.cost.pipeline_time`); this module lays the same schedule out
operation by operation, so that it can be drawn
(:func:`autoplan.report.plot_schedule`) and checked against the formula.

Operations
----------
Each pipeline rank runs, per micro-batch and per virtual stage (chunk) it
holds, a forward ``F`` and a backward ``B``; zero-bubble schedules split the
backward into the input gradient ``B`` and the weight gradient ``W``, which has
no successor and fills bubbles (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", Sec. 2).  ``F(mb, k)`` waits for ``F(mb, k-1)``; ``B(mb, k)``
waits for ``B(mb, k+1)`` (the last stage's for its own ``F``); ``W(mb, k)``
for ``B(mb, k)``.  Durations come from the Estimate's per-rank times: a rank
with ``v`` chunks spends ``forward_s / v`` on each chunk's forward.

Orders
------
* **GPipe** (Huang et al. 2019): all forwards, then all backwards.
* **1F1B** (PipeDream-Flush; Narayanan et al. 2021, Sec. 2.2.1): rank ``p``
  runs ``pp - p - 1`` warm-up forwards, then alternates one forward and one
  backward, then drains.
* **Interleaved 1F1B** (Narayanan et al. 2021, Sec. 2.2.2), in Megatron-LM's
  order: ``(pp - p - 1) * 2 + (v - 1) * pp`` warm-up chunk forwards, forward
  ``k`` on chunk ``(k // pp) % v`` of micro-batch ``(k // (pp v)) pp + k % pp``,
  backwards on the chunks in reverse; needs ``m`` divisible by ``pp``.
* **Zero bubble** (and interleaved with ``m`` not divisible by ``pp``): a
  greedy list schedule.  Whenever a rank is free it starts the ready operation
  that can start earliest, preferring ``B`` to ``F`` to ``W``; a rank starts a
  new micro-batch only while it holds fewer than
  :func:`autoplan.cost.in_flight` micro-batches, the number the memory model
  assumes.

With equal ranks the first three reproduce the cost model's formula exactly:
``(m + pp - 1) t`` for GPipe and 1F1B, ``m t + (pp - 1) t / v`` interleaved.

Examples
--------
>>> tl = simulate_schedule(Schedule.ONE_F_ONE_B, forward_s=[1.0, 1.0], backward_s=[2.0, 2.0], m=4)
>>> tl.pipeline_s          # (m + pp - 1) * (F + B)
15.0
>>> [(b.kind.value, b.micro_batch) for b in tl.of_rank(1)][:4]
[('forward', 0), ('backward', 0), ('forward', 1), ('backward', 1)]
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence

from ..cost import in_flight
from ..errors import AutoplanError, ConfigError
from ..strategy import Schedule

__all__ = ["BlockKind", "Block", "Timeline", "simulate_schedule", "schedule_timeline",
           "critical_micro_batches"]


class BlockKind(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"        # the whole backward, or its input gradient under zero bubble
    WEIGHT = "weight"            # weight gradient, deferred (zero bubble only)
    GRAD_SYNC = "grad_sync"      # data-parallel gradient reduction left exposed after the last backward
    OPTIMIZER = "optimizer"


#: Kinds that occur once per micro-batch and chunk.
PER_MICRO_BATCH: tuple[BlockKind, ...] = (BlockKind.FORWARD, BlockKind.BACKWARD, BlockKind.WEIGHT)


@dataclass(frozen=True)
class Block:
    """One operation on one pipeline rank.

    ``stage`` is the virtual stage (``-1`` for per-step blocks), ``micro_batch``
    ``-1`` for per-step blocks; ``comm_s`` is the part of ``duration_s`` spent
    in exposed communication (drawn at the block's end).
    """

    rank: int
    kind: BlockKind
    micro_batch: int
    stage: int
    start_s: float
    duration_s: float
    comm_s: float = 0.0

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class Timeline:
    """A laid-out schedule: every block, and when the pipeline and the step end.

    ``pipeline_s`` is the end of the last forward/backward/weight block;
    ``end_s`` of the last block of all (gradient sync and optimizer included);
    ``predicted_step_s`` the Estimate's step time when built from one.
    """

    schedule: Schedule
    pp: int
    virtual_stages: int
    micro_batches: int
    blocks: tuple[Block, ...]
    pipeline_s: float
    end_s: float
    predicted_step_s: float | None = None

    def of_rank(self, rank: int) -> tuple[Block, ...]:
        """The blocks of pipeline rank ``rank`` in start order."""
        return tuple(sorted((b for b in self.blocks if b.rank == rank),
                            key=lambda b: (b.start_s, b.end_s)))

    def busy_s(self, rank: int) -> float:
        return sum(b.duration_s for b in self.blocks if b.rank == rank)

    def bubble_s(self, rank: int) -> float:
        """Idle time of ``rank`` before the end of the pipeline."""
        work = sum(b.duration_s for b in self.blocks
                   if b.rank == rank and b.kind in PER_MICRO_BATCH)
        return self.pipeline_s - work


# ------------------------------------------------------------------ orders
_Op = tuple[BlockKind, int, int]          # (kind, micro-batch, chunk)


def _order_gpipe(m: int, v: int) -> list[_Op]:
    fwd = [(BlockKind.FORWARD, i, c) for c in range(v) for i in range(m)]
    bwd = [(BlockKind.BACKWARD, i, c) for c in reversed(range(v)) for i in range(m)]
    return fwd + bwd


def _order_1f1b(p: int, pp: int, m: int) -> list[_Op]:
    warmup = min(pp - p - 1, m)
    ops: list[_Op] = [(BlockKind.FORWARD, i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [(BlockKind.FORWARD, warmup + i, 0), (BlockKind.BACKWARD, i, 0)]
    ops += [(BlockKind.BACKWARD, i, 0) for i in range(m - warmup, m)]
    return ops


def _order_interleaved(p: int, pp: int, m: int, v: int) -> list[_Op]:
    """Megatron-LM's interleaved order (``forward_backward_pipelining_with_interleaving``)."""
    total = m * v

    def mb(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    def fwd(k: int) -> _Op:
        return (BlockKind.FORWARD, mb(k), (k // pp) % v)

    def bwd(k: int) -> _Op:
        return (BlockKind.BACKWARD, mb(k), v - 1 - (k // pp) % v)

    warmup = min((pp - p - 1) * 2 + (v - 1) * pp, total)
    ops = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [fwd(warmup + i), bwd(i)]
    ops += [bwd(i) for i in range(total - warmup, total)]
    return ops


def _orders_zbv(pp: int, m: int, rank_stages: Sequence[Sequence[int]]) -> list[list[_Op]] | None:
    """torch's own ZBV zero-bubble order (``ScheduleZBVZeroBubble``, what the runtime runs),
    per rank; None when torch cannot lay it out (then the greedy list schedule stands in)."""
    try:
        from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType
        sched = object.__new__(ScheduleZBVZeroBubble)
        sched.pp_group_size, sched.n_local_stages, sched.num_stages = pp, 2, 2 * pp
        sched._n_microbatches = sched.n_microbatches = m
        kinds = {_ComputationType.FORWARD: BlockKind.FORWARD,
                 _ComputationType.BACKWARD_INPUT: BlockKind.BACKWARD,
                 _ComputationType.BACKWARD_WEIGHT: BlockKind.WEIGHT}
        orders = []
        for p in range(pp):
            ops = [a for a in sched._calculate_single_rank_operations(p) if a is not None]
            orders.append([(kinds[a.computation_type], a.microbatch_index,
                            list(rank_stages[p]).index(a.stage_index)) for a in ops])
    except Exception:   # a torch without this private layout: fall back to the greedy one
        return None
    if any(sorted(o) != sorted((k, i, c) for k in kinds.values() for i in range(m) for c in (0, 1))
           for o in orders):
        return None
    return orders


# ------------------------------------------------------------------ simulation
class _Pipeline:
    """Durations and dependencies of the operations of one schedule."""

    def __init__(self, stage_ranks: Sequence[int], forward_s: Sequence[float],
                 backward_s: Sequence[float], m: int, split_weight: bool, weight_fraction: float,
                 comm_fraction: float) -> None:
        self.stage_ranks = list(stage_ranks)
        self.k = len(self.stage_ranks)
        self.pp = len(forward_s)
        self.m = m
        self.split = split_weight
        # chunks of each rank, in stage order
        self.rank_stages: list[list[int]] = [[] for _ in range(self.pp)]
        for k, r in enumerate(self.stage_ranks):
            self.rank_stages[r].append(k)
        v = [len(s) for s in self.rank_stages]
        self.fwd = [forward_s[r] / v[r] for r in self.stage_ranks]
        bwd = [backward_s[r] / v[r] for r in self.stage_ranks]
        self.wgt = [b * weight_fraction if split_weight else 0.0 for b in bwd]
        self.bwd = [b - w for b, w in zip(bwd, self.wgt)]
        self.comm_fraction = comm_fraction
        self.finish: dict[tuple[BlockKind, int, int], float] = {}

    def stage_of(self, rank: int, chunk: int) -> int:
        return self.rank_stages[rank][chunk]

    def deps(self, kind: BlockKind, mb: int, k: int) -> tuple[tuple[BlockKind, int, int], ...]:
        if kind is BlockKind.FORWARD:
            return ((kind, mb, k - 1),) if k > 0 else ()
        if kind is BlockKind.BACKWARD:
            return ((kind, mb, k + 1),) if k < self.k - 1 else ((BlockKind.FORWARD, mb, k),)
        return ((BlockKind.BACKWARD, mb, k),)

    def duration(self, kind: BlockKind, k: int) -> float:
        return {BlockKind.FORWARD: self.fwd, BlockKind.BACKWARD: self.bwd,
                BlockKind.WEIGHT: self.wgt}[kind][k]

    def block(self, rank: int, kind: BlockKind, mb: int, k: int, start: float) -> Block:
        d = self.duration(kind, k)
        comm = d * self.comm_fraction if kind is not BlockKind.WEIGHT else 0.0
        self.finish[(kind, mb, k)] = start + d
        return Block(rank, kind, mb, k, start, d, comm)


def _run_orders(pipe: _Pipeline, orders: list[list[_Op]]) -> list[Block]:
    """Execute fixed per-rank orders; each operation starts when its rank is free and its input is ready."""
    free = [0.0] * pipe.pp
    pos = [0] * pipe.pp
    blocks: list[Block] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for p in range(pipe.pp):
            while pos[p] < len(orders[p]):
                kind, mb, chunk = orders[p][pos[p]]
                k = pipe.stage_of(p, chunk)
                deps = pipe.deps(kind, mb, k)
                if any(d not in pipe.finish for d in deps):
                    break
                start = max([free[p]] + [pipe.finish[d] for d in deps])
                b = pipe.block(p, kind, mb, k, start)
                blocks.append(b)
                free[p] = b.end_s
                pos[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise AutoplanError("the schedule's operation order deadlocks; this is a bug in "
                                "autoplan.report.timeline")
    return blocks


def _run_greedy(pipe: _Pipeline, limits: Sequence[int]) -> list[Block]:
    """Greedy list scheduling (see the module docstring): earliest start, then B > F > W."""
    kinds = (BlockKind.FORWARD, BlockKind.BACKWARD) + ((BlockKind.WEIGHT,) if pipe.split else ())
    prio = {BlockKind.BACKWARD: 0, BlockKind.FORWARD: 1, BlockKind.WEIGHT: 2}
    # per (kind, stage): the next micro-batch (each stage runs its micro-batches in order)
    nxt = {(kind, k): 0 for kind in kinds for k in range(pipe.k)}
    free = [0.0] * pipe.pp
    started = [0] * pipe.pp    # micro-batches a rank has started (first chunk's forward)
    done = [0] * pipe.pp       # ... and finished (first chunk's backward)
    blocks: list[Block] = []
    total = len(kinds) * pipe.k * pipe.m
    while len(blocks) < total:
        best = None
        for p in range(pipe.pp):
            first = pipe.rank_stages[p][0]
            for k in pipe.rank_stages[p]:
                for kind in kinds:
                    mb = nxt[(kind, k)]
                    if mb >= pipe.m:
                        continue
                    if kind is BlockKind.FORWARD and k == first and \
                            started[p] - done[p] >= limits[p]:
                        continue
                    deps = pipe.deps(kind, mb, k)
                    if any(d not in pipe.finish for d in deps):
                        continue
                    start = max([free[p]] + [pipe.finish[d] for d in deps])
                    order = -k if kind is BlockKind.BACKWARD else k
                    key = (start, prio[kind], mb, order, p)
                    if best is None or key < best[0]:
                        best = (key, p, kind, mb, k)
        if best is None:
            raise AutoplanError("the greedy schedule has no ready operation; this is a bug in "
                                "autoplan.report.timeline")
        (start, *_), p, kind, mb, k = best
        b = pipe.block(p, kind, mb, k, start)
        blocks.append(b)
        free[p] = b.end_s
        nxt[(kind, k)] += 1
        if k == pipe.rank_stages[p][0]:
            if kind is BlockKind.FORWARD:
                started[p] += 1
            elif kind is BlockKind.BACKWARD:
                done[p] += 1
    return blocks


def simulate_schedule(schedule: Schedule | str, forward_s: Sequence[float],
                      backward_s: Sequence[float], m: int, *, virtual_stages: int = 1,
                      stage_ranks: Sequence[int] | None = None, comm_fraction: float = 0.0,
                      weight_fraction: float = 0.5,
                      tail_s: Sequence[Sequence[tuple[BlockKind, float]]] | None = None) -> Timeline:
    """Lay out ``m`` micro-batches through ranks with the given per-micro-batch times.

    Parameters
    ----------
    schedule : Schedule or str
    forward_s, backward_s : sequence of float
        Per pipeline rank: seconds of one micro-batch's forward (backward) over all
        the rank's chunks (:attr:`autoplan.cost.StageEstimate.forward_s`).
    m : int
        Micro-batches per step.
    virtual_stages : int
        Chunks per rank (interleaved, zero bubble).
    stage_ranks : sequence of int, optional
        The rank of each virtual stage in execution order (default: stage ``k``
        on rank ``k % pp``, :class:`autoplan.Plan`'s convention).
    comm_fraction : float
        Share of each forward/backward block that is exposed communication.
    weight_fraction : float
        Zero bubble: the share of a backward that is the weight gradient ``W``
        (0.5 when matmuls dominate: the input and weight gradients are one
        matmul of the forward's size each).
    tail_s : per rank, a sequence of ``(kind, seconds)``, optional
        Per-step blocks run after the rank's last micro-batch block.

    Returns
    -------
    Timeline
    """
    schedule = Schedule(schedule)
    pp = len(forward_s)
    if pp < 1 or len(backward_s) != pp:
        raise ConfigError(f"forward_s and backward_s need one entry per pipeline rank, got "
                          f"{len(forward_s)} and {len(backward_s)}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ConfigError(f"m (micro-batches per step) must be a positive integer, got {m!r}")
    v = virtual_stages if schedule in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE) else 1
    if schedule is Schedule.ZERO_BUBBLE and pp > 1:
        v = 2
    if pp == 1:
        v = 1 if stage_ranks is None else len(stage_ranks)
    if stage_ranks is None:
        stage_ranks = [k % pp for k in range(pp * v)]
    if sorted(set(stage_ranks)) != list(range(pp)):
        raise ConfigError(f"stage_ranks {list(stage_ranks)} must name every rank 0..{pp - 1}")
    if not 0.0 <= comm_fraction <= 1.0:
        raise ConfigError(f"comm_fraction must be within [0, 1], got {comm_fraction}")
    split = schedule is Schedule.ZERO_BUBBLE and pp > 1
    pipe = _Pipeline(stage_ranks, forward_s, backward_s, m, split, weight_fraction, comm_fraction)
    chunks = [len(s) for s in pipe.rank_stages]
    if pp == 1 or schedule is Schedule.GPIPE:
        blocks = _run_orders(pipe, [_order_gpipe(m, c) if schedule is Schedule.GPIPE
                                    else [op for i in range(m) for op in
                                          [(BlockKind.FORWARD, i, c_) for c_ in range(c)]
                                          + [(BlockKind.BACKWARD, i, c_) for c_ in reversed(range(c))]]
                                    for c in chunks])
    elif schedule is Schedule.ONE_F_ONE_B and all(c == 1 for c in chunks):
        blocks = _run_orders(pipe, [_order_1f1b(p, pp, m) for p in range(pp)])
    elif schedule is Schedule.INTERLEAVED and m % pp == 0 and len(set(chunks)) == 1 \
            and list(stage_ranks) == [k % pp for k in range(len(stage_ranks))]:
        blocks = _run_orders(pipe, [_order_interleaved(p, pp, m, chunks[0]) for p in range(pp)])
    elif schedule is Schedule.ZERO_BUBBLE and chunks == [2] * pp and list(stage_ranks) == \
            list(range(pp)) + list(reversed(range(pp))) and \
            (zbv := _orders_zbv(pp, m, pipe.rank_stages)) is not None:
        blocks = _run_orders(pipe, zbv)
    else:
        limits = [max(1, math.ceil(in_flight(schedule, p, pp, m, chunks[p]) - 1e-9))
                  for p in range(pp)]
        blocks = _run_greedy(pipe, limits)
    pipeline_end = max(b.end_s for b in blocks)
    if tail_s is not None:
        if len(tail_s) != pp:
            raise ConfigError(f"tail_s needs one entry per rank ({pp}), got {len(tail_s)}")
        for p in range(pp):
            t = max(b.end_s for b in blocks if b.rank == p)
            for kind, d in tail_s[p]:
                if d > 0:
                    blocks.append(Block(p, BlockKind(kind), -1, -1, t, d,
                                        d if kind is BlockKind.GRAD_SYNC else 0.0))
                    t += d
    blocks.sort(key=lambda b: (b.rank, b.start_s, b.kind.value, b.micro_batch, b.stage))
    return Timeline(schedule, pp, max(chunks), m, tuple(blocks), pipeline_end,
                    max(b.end_s for b in blocks))


# ------------------------------------------------------------------ from a plan
def critical_micro_batches(plan, estimate) -> int:
    """Micro-batches of the replica whose times the Estimate's stages describe.

    Replicas of different speeds run different numbers of micro-batches; the
    Estimate reports the slowest one's ranks.  Among the replicas' counts, the
    one whose pipeline time matches ``bubble + m * (slowest rank's F + B)`` is it.
    """
    from ..cost import pipeline_time
    counts = sorted({b // plan.micro_batch for b in plan.replica_batch})
    if len(counts) == 1:
        return counts[0]
    times = [s.forward_s + s.backward_s for s in estimate.stages]
    bubble = estimate.breakdown.get("bubble_s", 0.0)

    def gap(m: int) -> float:
        t = pipeline_time(plan.schedule, times, m, virtual_stages=plan.virtual_stages)
        return abs(t - (bubble + m * max(times)))

    return min(counts, key=lambda m: (gap(m), -m))


def schedule_timeline(plan, estimate=None) -> Timeline:
    """The timeline of ``plan``'s schedule with its Estimate's per-rank times.

    Each rank's forward and backward per micro-batch are
    :attr:`StageEstimate.forward_s` and ``backward_s`` (exposed communication
    included); the communication share of each block is the critical rank's
    (the Estimate splits compute from communication for that rank only).
    After its last backward a rank reduces gradients
    (``dp_comm_exposed_s``) and steps the optimizer
    (``busy_s - m (forward_s + backward_s)``).

    Raises
    ------
    ConfigError
        When the plan has no estimate and none is given.
    """
    est = estimate if estimate is not None else plan.estimate
    if est is None:
        raise ConfigError("the plan has no estimate: pass estimate=autoplan.estimate_plan(graph, "
                          "cluster, plan) or use a plan from autoplan.plan()")
    if len(est.stages) != plan.pp:
        raise ConfigError(f"the estimate has {len(est.stages)} pipeline ranks but the plan has "
                          f"pp={plan.pp}; was it made for another plan?")
    m = critical_micro_batches(plan, est)
    fwd = [s.forward_s for s in est.stages]
    bwd = [s.backward_s for s in est.stages]
    crit = max(f + b for f, b in zip(fwd, bwd))
    compute = (est.breakdown.get("compute_s", 0.0) + est.breakdown.get("recompute_s", 0.0)) / m
    comm_fraction = min(1.0, max(0.0, 1.0 - compute / crit)) if crit > 0 else 0.0
    tails = [((BlockKind.GRAD_SYNC, s.dp_comm_exposed_s),
              (BlockKind.OPTIMIZER, max(0.0, s.busy_s - m * (s.forward_s + s.backward_s))))
             for s in est.stages]
    # zero bubble: the critical rank's weight-gradient share, as the Estimate priced it
    slow = max(est.stages, key=lambda s: s.forward_s + s.backward_s)
    weight_fraction = (min(1.0, slow.weight_grad_s / slow.backward_s)
                       if slow.backward_s > 0 and slow.weight_grad_s > 0 else 0.5)
    tl = simulate_schedule(plan.schedule, fwd, bwd, m, virtual_stages=plan.virtual_stages,
                           stage_ranks=[st.rank for st in plan.stages], comm_fraction=comm_fraction,
                           weight_fraction=weight_fraction, tail_s=tails)
    return Timeline(tl.schedule, tl.pp, tl.virtual_stages, tl.micro_batches, tl.blocks,
                    tl.pipeline_s, tl.end_s, est.step_time_s)
