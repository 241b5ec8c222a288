"""Degree combinations, and the layouts and plans the search builds from them.

A :class:`_Combo` fixes the degrees, micro-batch, schedule and the devices (the first
``tp x cp x pp x dp`` of a :class:`~autoplan.search.fleet.Pool`); :class:`_Builder`
turns it, a ZeRO stage and recompute options into the engine's
:class:`~autoplan.cost.Layout` and the user's :class:`~autoplan.plan.Plan`, which price
the same.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from ..cost import CostEngine, Layout, Segment
from ..errors import StrategyError
from ..graph import ModelGraph
from ..plan import (MESH_DIMS, ClusterSummary, LayerPlacement, MeshPlan, Plan, StagePlan,
                    chunk_bounds, even_block_counts)
from ..strategy import Precision, Recompute, Schedule
from .fleet import Pool

__all__ = ["_Combo", "_Candidate", "_Builder", "_split_batch", "micro_batch_counts"]


@dataclass(frozen=True)
class _Combo:
    """Degrees and options shared by a rung of the memory ladder, and the devices: the
    first ``tp x cp x pp x dp`` of pool ``pool``."""

    tp: int
    cp: int
    pp: int
    dp: int
    micro_batch: int
    schedule: Schedule
    v: int
    sp: bool
    ep: int = 1
    pool: int = 0

    @property
    def n(self) -> int:
        """Devices used."""
        return self.tp * self.cp * self.pp * self.dp

    def key(self) -> tuple:
        return (self.tp, self.cp, self.pp, self.dp, self.micro_batch, self.schedule.value,
                self.v, self.sp, self.ep, self.pool)


@dataclass(order=True)
class _Candidate:
    """A priced layout: ordered by the search's objective (step time, or cost per sample
    with prices), then step time, peak memory and a stable key."""

    objective: float
    step_time_s: float
    peak_bytes: float
    key: tuple
    combo: _Combo = field(compare=False)
    zero: int = field(compare=False)
    recompute: Recompute = field(compare=False)
    layout: Layout = field(compare=False)
    replica_batch: tuple[int, ...] = field(compare=False)
    fits: bool = field(compare=False, default=True)


def _split_batch(global_batch: int, weights: Sequence[float], micro_batch: int,
                 partial: bool = False) -> tuple[int, ...] | None:
    """Sequences per replica in proportion to ``weights`` (speeds), in micro-batches of
    ``micro_batch``, minimising the busiest replica's time ``max_r m_r / w_r`` in
    micro-batches ``m_r``.

    Every replica gets one micro-batch, then each further one goes to the replica that
    would finish it first (greedy list scheduling of identical jobs on machines of
    different speeds, optimal for the makespan); replicas of equal speed end within
    one micro-batch of each other.  With ``partial``, a global batch that is not a
    multiple of ``micro_batch`` leaves one micro-batch short, on a replica with the
    fewest micro-batches (the busiest replicas run full ones only); otherwise such a
    batch gives None, as do fewer micro-batches than replicas.

    >>> _split_batch(24, [1.0, 1.0, 2.0], 2)
    (6, 6, 12)
    >>> _split_batch(8, [2.0, 1.0], 1)     # (6, 2) finishes as early; the more even wins
    (5, 3)
    >>> _split_batch(511, [1.0] * 8, 2, partial=True)
    (64, 64, 64, 64, 64, 64, 64, 63)
    """
    units, rem = divmod(global_batch, micro_batch)
    if rem and not partial:
        return None
    units += 1 if rem else 0
    if units < len(weights):
        return None
    if len(set(weights)) == 1:
        # equal speeds: what the greedy below gives, at once (the first replicas take
        # the one more, the last with the fewest the shorter micro-batch)
        each, extra = divmod(units, len(weights))
        out = [(each + (j < extra)) * micro_batch for j in range(len(weights))]
        if rem:
            out[-1 if extra == 0 else len(weights) - 1] -= micro_batch - rem
        return tuple(out)
    base = [1] * len(weights)
    # (finish time with one more, micro-batches now, replica): on a tie the replica with
    # fewer takes it, so the split stays as even as the speeds allow
    heap = [(2 / w, 1, j) for j, w in enumerate(weights)]
    heapq.heapify(heap)
    for _ in range(units - len(weights)):
        _, _, j = heapq.heappop(heap)
        base[j] += 1
        heapq.heappush(heap, ((base[j] + 1) / weights[j], base[j], j))
    out = [b * micro_batch for b in base]
    if rem:
        short = min(range(len(base)), key=lambda j: (base[j], -j))
        out[short] -= micro_batch - rem
    return tuple(out)


class _Builder:
    """Builds layouts and plans for one model on one cluster."""

    def __init__(self, graph: ModelGraph, engine: CostEngine, cluster, precision: Precision,
                 pools: Sequence[Pool]) -> None:
        self.graph = graph
        self.engine = engine
        self.summary = engine.summary
        self.cluster = cluster
        self.precision = precision
        self.pools = list(pools)
        self.blocks = list(self.summary.block_indices)
        self._speed: dict[tuple[int, ...], float] = {}
        self.recompute: tuple[Recompute, ...] = tuple(Recompute)   # what refinement may use
        self._replica_speeds: dict[tuple, tuple[float, ...]] = {}
        self._is_block = [l.is_block for l in self.summary.layers]
        self._even: dict[int, list[tuple[int, int]]] = {}
        self._chunks: dict[tuple, tuple[tuple[Segment, ...], ...]] = {}
        self._rank_devices: dict[tuple, tuple[tuple[int, ...], ...]] = {}
        self._devices: dict[tuple[int, int], tuple[int, ...]] = {}
        self._splits: dict[tuple, tuple[int, ...] | None] = {}

    def devices(self, c: _Combo) -> tuple[int, ...]:
        """The devices ``c`` runs on, in rank order (one tuple per pool and count)."""
        key = (c.pool, c.n)
        hit = self._devices.get(key)
        if hit is None:
            hit = self._devices[key] = self.pools[c.pool].devices[:c.n]
        return hit

    def rank_devices(self, c: _Combo) -> tuple[tuple[int, ...], ...]:
        """Each pipeline rank's devices (one map per pool, count and pp: the engine
        caches by its identity)."""
        key = (c.pool, c.n, c.pp)
        hit = self._rank_devices.get(key)
        if hit is None:
            devs, per_rank = self.devices(c), c.n // c.pp
            hit = self._rank_devices[key] = tuple(devs[p * per_rank:(p + 1) * per_rank]
                                                  for p in range(c.pp))
        return hit

    def even_bounds(self, k: int) -> list[tuple[int, int]]:
        hit = self._even.get(k)
        if hit is None:
            hit = self._even[k] = self.bounds_from_counts(even_block_counts(len(self.blocks), k))
        return list(hit)

    def bounds_from_counts(self, counts: Sequence[int]) -> list[tuple[int, int]]:
        """Chunk bounds when chunk ``c`` holds ``counts[c]`` blocks (:func:`chunk_bounds`)."""
        return chunk_bounds(self._is_block, counts)

    def proportional_bounds(self, c: _Combo) -> list[tuple[int, int]]:
        """Blocks per rank in proportion to the rank's speed (even on identical ranks)."""
        speeds = [self.replica_speed(devs[:c.cp * c.tp]) for devs in self.rank_devices(c)]
        if len(set(speeds)) == 1:
            return self.even_bounds(c.pp)
        n = len(self.blocks)
        if n < c.pp:
            raise StrategyError(f"the model has {n} blocks, fewer than pp={c.pp}")
        total = sum(speeds)
        counts = [max(1, round(n * sp / total)) for sp in speeds]
        while sum(counts) > n:
            i = max((j for j in range(c.pp) if counts[j] > 1),
                    key=lambda j: (counts[j] - n * speeds[j] / total, j))
            counts[i] -= 1
        while sum(counts) < n:
            i = max(range(c.pp), key=lambda j: (n * speeds[j] / total - counts[j], -j))
            counts[i] += 1
        return self.bounds_from_counts(counts)

    def replica_speed(self, devices: tuple[int, ...]) -> float:
        hit = self._speed.get(devices)
        if hit is None:
            dtype = self.engine.precision_costs(self.precision).peak_dtype
            hit = min(self.cluster.device_type_of(d).peak(dtype) for d in devices)
            self._speed[devices] = hit
        return hit

    def replica_speeds(self, c: _Combo) -> tuple[float, ...]:
        """Each replica's speed: the lowest peak of its devices over all pipeline ranks."""
        key = (c.tp, c.cp, c.pp, c.dp, c.pool)
        speeds = self._replica_speeds.get(key)
        if speeds is None and self.engine.homogeneous:
            speeds = self._replica_speeds[key] = (1.0,) * c.dp
        if speeds is None:
            g = c.cp * c.tp
            speeds = self._replica_speeds[key] = tuple(
                min(self.replica_speed(devs[r * g:(r + 1) * g]) for devs in self.rank_devices(c))
                for r in range(c.dp))
        return speeds

    def replica_splits(self, c: _Combo, global_batch: int,
                       even: bool = False) -> list[tuple[int, ...]]:
        """The replica batches (sequences) worth pricing: :meth:`replica_batches`, and the
        even split too when that one is uneven (speed is the devices' peak; the cost
        model, which also sees memory-bound work and communication, decides which is
        faster)."""
        split = self.replica_batches(c, global_batch, even)
        if split is None:
            return []
        out = [split]
        if len(set(split)) > 1 and len(set(self.replica_speeds(c))) > 1:
            equal = self.replica_batches(c, global_batch, even=True)
            if equal is not None:
                out.append(equal)
        return out

    def replica_batches(self, c: _Combo, global_batch: int,
                        even: bool = False) -> tuple[int, ...] | None:
        """Sequences per replica: equal on identical replicas where the batch divides, in
        proportion to speed otherwise, in micro-batches (``even``: always equal, None
        when the batch does not divide).  Without pipelining one replica may end on a
        shorter micro-batch (the runtime weights each micro-batch by its sequences)."""
        if even:
            if global_batch % (c.dp * c.micro_batch):
                return None
            return (global_batch // c.dp,) * c.dp
        speeds = self.replica_speeds(c)
        key = (c.dp, c.micro_batch, c.pp == 1, speeds if len(set(speeds)) > 1 else None)
        hit = self._splits.get(key, False)
        if hit is False:
            if len(set(speeds)) == 1 and global_batch % (c.dp * c.micro_batch) == 0:
                hit = (global_batch // c.dp,) * c.dp
            else:
                # replicas of different speeds, or a batch that does not divide: split in
                # proportion to speed (the step waits for the busiest replica)
                hit = _split_batch(global_batch, speeds, c.micro_batch, partial=c.pp == 1)
            if len(self._splits) > 8192:
                self._splits.clear()
            self._splits[key] = hit
        return hit

    def layout(self, c: _Combo, zero: int, rc: Recompute, replica_mbs: tuple[int, ...],
               global_batch: int, bounds: Sequence[tuple[int, int]] | None = None,
               options: Sequence[Sequence[tuple[int, Recompute]]] | None = None) -> Layout:
        """A layout; ``options[k]`` optionally gives ``(blocks, recompute)`` runs per chunk;
        ``replica_mbs`` the micro-batches each replica runs."""
        k = c.pp * c.v
        if bounds is None:
            bounds = self.proportional_bounds(c) if c.v == 1 else self.even_bounds(k)
        bounds = list(bounds)
        key = (tuple(bounds), c.tp, c.sp, zero, rc) if options is None else None
        chunks = self._chunks.get(key) if key is not None else None
        if chunks is None:
            chunks = self._segments(c, zero, rc, bounds, options)
            if key is not None:
                if len(self._chunks) > 4096:
                    self._chunks.clear()
                self._chunks[key] = chunks
        return Layout(c.pp, c.v, c.dp, c.cp, c.micro_batch, global_batch, replica_mbs,
                      c.schedule, self.precision, chunks, self.rank_devices(c), (c.tp,) * c.pp,
                      padded=len(set(replica_mbs)) > 1 and (zero >= 2 or c.ep > 1), ep=c.ep)

    def _segments(self, c: _Combo, zero: int, rc: Recompute, bounds: list[tuple[int, int]],
                  options: Sequence[Sequence[tuple[int, Recompute]]] | None
                  ) -> tuple[tuple[Segment, ...], ...]:
        """Each chunk's segments (runs of layers with the same options)."""
        is_block = self._is_block
        chunks = []
        for ci, (lo, hi) in enumerate(bounds):
            runs = list(options[ci]) if options is not None else None
            segs: list[Segment] = []
            start = lo
            for i in range(lo, hi + 1):
                edge = i == hi or (i > start and is_block[i] != is_block[start])
                if not edge:
                    continue
                if not is_block[start]:
                    segs.append(Segment(start, i, c.tp, c.sp, zero, Recompute.NONE))
                elif runs is None:
                    segs.append(Segment(start, i, c.tp, c.sp, zero, rc))
                else:
                    j = start
                    while j < i and runs:
                        count, opt = runs[0]
                        take = min(count, i - j)
                        if take > 0:
                            segs.append(Segment(j, j + take, c.tp, c.sp, zero, opt))
                        j += take
                        if take == count:
                            runs.pop(0)
                        else:
                            runs[0] = (count - take, opt)
                    if j < i:
                        segs.append(Segment(j, i, c.tp, c.sp, zero, rc))
                start = i
            chunks.append(tuple(segs))
        return tuple(chunks)

    def plan(self, lay: Layout, global_batch: int, replica_batch: tuple[int, ...],
             idle_reason: str = "") -> Plan:
        """The :class:`Plan` record of a layout (the engine prices both the same)."""
        layers = self.summary.layers
        pp, v = lay.pp, lay.virtual_stages
        stages, placements = [], []
        for k, chunk in enumerate(lay.chunks):
            rank = lay.stage_ranks[k]
            devs = lay.rank_devices[rank]
            names = []
            for seg in chunk:
                for i in range(seg.lo, seg.hi):
                    names.append(layers[i].name)
                    placements.append(LayerPlacement(layers[i].name, k, seg.tp,
                                                     seg.sequence_parallel, seg.zero, seg.recompute))
            types = list(dict.fromkeys(self.cluster.device_type_of(d).name for d in devs))
            stages.append(StagePlan(k, rank, k // pp, tuple(names), tuple(devs), "+".join(types),
                                    lay.rank_tp[rank], lay.dp, lay.cp))
        mesh = MeshPlan(MESH_DIMS, (pp, lay.dp, lay.cp, lay.rank_tp[0]),
                        tuple(d for devs in lay.rank_devices for d in devs), ep=lay.ep)
        return Plan(model=self.graph.model, title=self.graph.title,
                    cluster=ClusterSummary.from_cluster(self.cluster),
                    global_batch=global_batch, seq_len=self.graph.seq_len,
                    precision=lay.precision, mesh=mesh, stages=tuple(stages),
                    layers=tuple(placements), micro_batch=lay.micro_batch,
                    num_micro_batches=max(lay.replica_micro_batches),
                    replica_batch=replica_batch, schedule=lay.schedule, virtual_stages=v,
                    idle_reason=idle_reason)


def micro_batch_counts(replica_batch: Sequence[int], micro_batch: int) -> tuple[int, ...]:
    """Micro-batches of each replica (a shorter last one counts)."""
    key = (id(replica_batch), micro_batch)
    hit = _COUNTS.get(key)
    if hit is not None and hit[0] is replica_batch:
        return hit[1]
    counts = tuple(-(-b // micro_batch) for b in replica_batch)
    if len(_COUNTS) > 4096:
        _COUNTS.clear()
    _COUNTS[key] = (replica_batch, counts)
    return counts


#: micro_batch_counts by the identity of its (cached) replica batches
_COUNTS: dict[tuple, tuple] = {}
