"""``autoplan.plan``: the fastest layout that fits, found in seconds.

Method
------
1. **Degrees.** Enumerate ``tp`` (dividing the devices of a node and the
   model's heads: tensor parallelism stays inside a node), ``cp`` (wherever the
   sequence splits into the ``2 cp`` load-balanced chunks the runtime uses, with
   ``tp x cp`` inside a node; whether it pays is the cost model's call), ``pp`` (dividing what is left, at most the number of
   blocks) and ``dp`` (the rest, dividing the global batch, or split unevenly
   over replicas of different speeds), micro-batch sizes and schedules.
   "Inside a node" means inside one NVLink domain with no group straddling two:
   a ``tp x cp`` group may have any size that divides every node's device count
   (:func:`_domain_size`), so on GB200 NVL72 racks (one 72-GPU domain each)
   groups of 12, 24, 36 or 72 GPUs, and of 16, 32 or 64 on racks of which 64
   GPUs are used; an expert-parallel group (``ep x tp`` consecutive devices)
   either fits one domain so, spans whole nodes, or sits like every other
   group of its pipeline rank (:func:`_groups_placed`).
   Ranks are laid out with ``tp`` innermost and ``pp`` outermost over the
   cluster's device order (node by node, group by group, site by site), so
   pipelines cut between nodes, groups and sites before data parallelism does.
2. **Memory ladder with pruning.** For each combination the two cheapest
   options (no recompute, ZeRO-0/1) are priced first; their time is a lower
   bound for every other option of that combination (recompute and sharding
   only add work), so a combination slower than the best plan so far is
   dropped at once (dominated).  Otherwise the ladder climbs: selective
   recompute and ZeRO-2, then ZeRO-3 and full recompute, stopping at the first
   rung where something fits.
3. **Per-stage problem (CP-SAT).** For the best candidates, OR-Tools CP-SAT
   chooses how many blocks each pipeline rank holds and which recompute option
   each of them uses, under each rank's memory (ranks of different device
   types, or holding different numbers of micro-batches in flight, get
   different shares), starting from the even split as a hint
   (:mod:`autoplan.search.stage_solver`).
4. **One engine.** Every candidate is priced by the cost model
   (:class:`autoplan.cost.CostEngine`), so the search and
   :func:`autoplan.estimate` never disagree.

The same inputs give a byte-identical plan: iteration orders are fixed, ties
break on a stable key, and CP-SAT runs single-threaded with a fixed seed and
a deterministic time budget.  ``time_limit_s`` bounds the wall time of the
enumeration; should it bind, the best plan so far is returned.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from ..cost import CostEngine, CostOptions, Layout, Segment, in_flight, pipeline_time
from ..errors import ConfigError, InfeasiblePlan, StrategyError
from ..graph import LayerKind, ModelGraph
from ..hardware.cluster import as_cluster
from ..plan import (MESH_DIMS, ClusterSummary, LayerPlacement, MeshPlan, Plan, StagePlan,
                    ModelFingerprint, chunk_bounds, even_block_counts, expert_counts)
from ..strategy import Precision, Recompute, Schedule, schedule_problem
from .stage_solver import StageProblem, solve_stage_problem

__all__ = ["plan", "search", "SearchResult", "SearchSpace"]

_MiB = float(2**20)


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose from (defaults: everything the cost model prices, all of
    which :func:`autoplan.parallelize` runs).

    ``context_parallel`` degrees are tried wherever the sequence splits into ``2 cp``
    chunks (the load-balanced split the runtime uses); whether they pay is the cost
    model's call (memory of long sequences against the key/value all-gather).
    ``even_batches`` keeps every replica's batch equal (no speed-proportional split).
    ``expert_parallel`` degrees are tried for models with expert banks, where they divide
    ``dp x cp`` and every layer's experts and their groups (``ep x tp`` consecutive devices)
    sit alike: inside one NVLink domain each, over whole nodes, or one per pipeline rank
    (:func:`_groups_placed`); for those models the search also leaves out
    sequence parallelism and selective recompute, which the runtime does not run on MoE
    blocks."""

    schedules: tuple[Schedule, ...] = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED,
                                       Schedule.ZERO_BUBBLE, Schedule.GPIPE)
    virtual_stages: tuple[int, ...] = (2, 4)
    micro_batches: tuple[int, ...] | None = None   # None: every divisor of the replica batch
    max_micro_batch: int = 64
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    sequence_parallel: tuple[bool, ...] = (True, False)
    context_parallel: tuple[int, ...] = (1, 2, 4)
    refine: int = 8                # candidates refined with CP-SAT
    tensor_parallel: tuple[int, ...] | None = None    # None: every degree that fits a node
    expert_parallel: tuple[int, ...] | None = None    # None: every degree dividing the experts
    pipeline_parallel: tuple[int, int] | None = None  # (min, max) pp; None: any
    even_batches: bool = False     # True: every replica gets the same batch (no speed split)


@dataclass(frozen=True)
class _Combo:
    """Degrees and options shared by a rung of the memory ladder."""

    tp: int
    cp: int
    pp: int
    dp: int
    micro_batch: int
    schedule: Schedule
    v: int
    sp: bool
    ep: int = 1

    def key(self) -> tuple:
        return (self.tp, self.cp, self.pp, self.dp, self.micro_batch, self.schedule.value,
                self.v, self.sp, self.ep)


@dataclass(order=True)
class _Candidate:
    step_time_s: float
    peak_bytes: float
    key: tuple
    combo: _Combo = field(compare=False)
    zero: int = field(compare=False)
    recompute: Recompute = field(compare=False)
    layout: Layout = field(compare=False)
    fits: bool = field(compare=False, default=True)


@dataclass
class SearchResult:
    """The ranked plans of one search and what it cost to find them."""

    plans: list[Plan]
    evaluated: int
    pruned: int
    refined: int
    seconds: float
    time_limit_hit: bool

    @property
    def best(self) -> Plan:
        return self.plans[0]

    def __repr__(self) -> str:
        return (f"<SearchResult {len(self.plans)} plans, {self.evaluated} evaluated, "
                f"{self.pruned} pruned, {self.refined} refined, {self.seconds:.1f} s"
                + (", time limit hit>" if self.time_limit_hit else ">"))


# ------------------------------------------------------------------ helpers
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _blocks_tp_limit(graph: ModelGraph) -> int:
    g = 0
    for l in graph.layers:
        if l.kind is LayerKind.BLOCK:
            g = math.gcd(g, l.tp.max_degree())
    return g or 1


def _domain_size(cluster) -> int:
    """The size of the device groups that tile every node's devices (its NVLink domain):
    the greatest common divisor of the nodes' device counts.

    Ranks are laid out over the cluster's device order, so groups of ``g`` consecutive
    devices start at multiples of ``g``; none straddles two nodes exactly when ``g``
    divides every node's device count, i.e. this number.  On clusters of whole 8-GPU
    nodes it is 8; on GB200 NVL72 racks 72 (whole racks), 64 (64 GPUs of each rack in
    use) or 8 (the first 128 GPUs of two racks: 72 + 56).

    >>> from autoplan.hardware import load_cluster
    >>> racks = load_cluster("gb200-nvl72", nodes=2)
    >>> _domain_size(racks), _domain_size(racks.subset(range(128)))
    (72, 8)
    """
    return math.gcd(*(len(n.local_ranks) for n in cluster.nodes))


def _whole_nodes(cluster) -> int | None:
    """The device count of every node when the nodes are alike in it, else None."""
    sizes = {len(n.local_ranks) for n in cluster.nodes}
    return sizes.pop() if len(sizes) == 1 else None


def _groups_placed(cluster, span: int, per_rank: int, domain: int, whole: int | None) -> bool:
    """Whether the groups of ``span`` consecutive devices (aligned at multiples of ``span``)
    inside every pipeline rank of ``per_rank`` devices are placed alike: each inside one
    NVLink domain (``span`` divides ``domain``, :func:`_domain_size`), each over whole nodes
    of ``whole`` devices, one group per rank, or otherwise all with the same
    :meth:`Cluster.placement <autoplan.hardware.Cluster.placement>` (their collectives
    priced over the links they span).  Otherwise some groups would straddle two domains
    while others do not: :meth:`CostEngine._evaluate` prices each, but the search does
    not place such layouts (on two 72-GPU racks, groups of 16 would put devices 64-79,
    eight on each rack, in one group).

    >>> from autoplan.hardware import load_cluster
    >>> racks = load_cluster("gb200-nvl72", nodes=2)
    >>> [_groups_placed(racks, g, 144, 72, 72) for g in (8, 16, 72, 144)]
    [True, False, True, True]
    """
    if domain % span == 0 or span == per_rank or (whole is not None and span % whole == 0):
        return True
    place = cluster.placement
    for rank in range(0, cluster.num_devices, per_rank):
        first = place(range(rank, rank + span))
        if any(place(range(g, g + span)) != first
               for g in range(rank + span, rank + per_rank, span)):
            return False
    return True


def _split_batch(global_batch: int, weights: Sequence[float], micro_batch: int) -> tuple[int, ...] | None:
    """Sequences per replica in proportion to ``weights`` (speeds), in multiples of
    ``micro_batch``, minimising the busiest replica's time ``max_r b_r / w_r``.

    Every replica gets one micro-batch, then each further one goes to the replica that
    would finish it first (greedy list scheduling of identical jobs on machines of
    different speeds, optimal for the makespan); replicas of equal speed end within
    one micro-batch of each other.  None when there are fewer micro-batches than replicas.

    >>> _split_batch(24, [1.0, 1.0, 2.0], 2)
    (6, 6, 12)
    >>> _split_batch(8, [2.0, 1.0], 1)     # (6, 2) finishes as early; the more even wins
    (5, 3)
    """
    units = global_batch // micro_batch
    if units * micro_batch != global_batch or units < len(weights):
        return None
    base = [1] * len(weights)
    # (finish time with one more, micro-batches now, replica): on a tie the replica with
    # fewer takes it, so the split stays as even as the speeds allow
    heap = [(2 / w, 1, j) for j, w in enumerate(weights)]
    heapq.heapify(heap)
    for _ in range(units - len(weights)):
        _, _, j = heapq.heappop(heap)
        base[j] += 1
        heapq.heappush(heap, ((base[j] + 1) / weights[j], base[j], j))
    return tuple(b * micro_batch for b in base)


class _Builder:
    """Builds layouts and plans for one model on one cluster."""

    def __init__(self, graph: ModelGraph, engine: CostEngine, cluster, precision: Precision) -> None:
        self.graph = graph
        self.engine = engine
        self.summary = engine.summary
        self.cluster = cluster
        self.precision = precision
        self.n = cluster.num_devices
        self.blocks = list(self.summary.block_indices)
        self.devices = tuple(range(self.n))
        self._speed: dict[tuple[int, ...], float] = {}
        self.recompute: tuple[Recompute, ...] = tuple(Recompute)   # what refinement may use
        self._bounds: dict[tuple, float] = {}
        self._replica_speeds: dict[tuple, tuple[float, ...]] = {}
        self._is_block = [l.is_block for l in self.summary.layers]
        self._even: dict[int, list[tuple[int, int]]] = {}
        self._chunks: dict[tuple, tuple[tuple[Segment, ...], ...]] = {}
        self._rank_devices: dict[int, tuple[tuple[int, ...], ...]] = {}

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
        per_rank = c.dp * c.cp * c.tp
        speeds = [self.replica_speed(self.devices[p * per_rank:p * per_rank + c.cp * c.tp])
                  for p in range(c.pp)]
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

    def replica_splits(self, c: _Combo, global_batch: int,
                       even: bool = False) -> list[tuple[int, ...]]:
        """The replica splits worth pricing: :meth:`replica_batches`, and the even split
        too when that one is uneven (speed is the devices' peak; the cost model, which
        also sees memory-bound work and communication, decides which is faster)."""
        split = self.replica_batches(c, global_batch, even)
        if split is None:
            return []
        out = [split]
        if len(set(split)) > 1:
            equal = self.replica_batches(c, global_batch, even=True)
            if equal is not None:
                out.append(equal)
        return out

    def replica_speeds(self, c: _Combo) -> tuple[float, ...]:
        """Each replica's speed: the lowest peak of its devices over all pipeline ranks."""
        key = (c.tp, c.cp, c.pp, c.dp)
        speeds = self._replica_speeds.get(key)
        if speeds is None:
            per_rank = c.dp * c.cp * c.tp
            out = []
            for r in range(c.dp):
                t = math.inf
                for p in range(c.pp):
                    devs = self.devices[p * per_rank:(p + 1) * per_rank]
                    rep = devs[r * c.cp * c.tp:(r + 1) * c.cp * c.tp]
                    t = min(t, self.replica_speed(rep))
                out.append(t)
            speeds = self._replica_speeds[key] = tuple(out)
        return speeds

    def replica_batches(self, c: _Combo, global_batch: int,
                        even: bool = False) -> tuple[int, ...] | None:
        """Micro-batches per replica: equal on identical replicas, in proportion to speed
        otherwise (``even``: always equal, None when the batch does not divide)."""
        if even:
            if global_batch % (c.dp * c.micro_batch):
                return None
            return (global_batch // (c.dp * c.micro_batch),) * c.dp
        speeds = self.replica_speeds(c)
        if len(set(speeds)) == 1 and global_batch % (c.dp * c.micro_batch) == 0:
            return (global_batch // (c.dp * c.micro_batch),) * c.dp
        # replicas of different speeds, or a batch that does not divide: split in proportion
        # to speed, in whole micro-batches (the step waits for the busiest replica)
        split = _split_batch(global_batch, speeds, c.micro_batch)
        return None if split is None else tuple(b // c.micro_batch for b in split)

    def layout(self, c: _Combo, zero: int, rc: Recompute, replica_mbs: tuple[int, ...],
               global_batch: int, bounds: Sequence[tuple[int, int]] | None = None,
               options: Sequence[Sequence[tuple[int, Recompute]]] | None = None) -> Layout:
        """A layout; ``options[k]`` optionally gives ``(blocks, recompute)`` runs per chunk."""
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
        per_rank = c.dp * c.cp * c.tp
        rank_devices = self._rank_devices.get(c.pp)
        if rank_devices is None:   # one map per pp (the engine caches by its identity)
            rank_devices = self._rank_devices[c.pp] = tuple(
                self.devices[p * per_rank:(p + 1) * per_rank] for p in range(c.pp))
        return Layout(c.pp, c.v, c.dp, c.cp, c.micro_batch, global_batch, replica_mbs,
                      c.schedule, self.precision, chunks, rank_devices, (c.tp,) * c.pp,
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

    def busy_bound(self, c: _Combo, m: int) -> float:
        """A lower bound of the step time of every layout of ``c`` with ``m`` micro-batches
        per replica: the schedule's time (:func:`autoplan.cost.pipeline_time`, which grows
        with every rank's time) when the pipeline ranks share the least time each layer
        takes on any of them (:meth:`CostEngine.layer_time_bound`: compute and exposed
        tensor-, context- and expert-parallel collectives) evenly: with ``pp`` ranks'
        times adding up to ``S`` the busiest takes at least ``S / pp``, and every schedule
        is fastest for equal ranks.  Recompute, sharding, pipeline sends, the
        data-parallel step and the optimizer only add to it."""
        key = (c.tp, c.cp, c.pp, c.dp, c.micro_batch, c.sp, c.ep)
        per_mb = self._bounds.get(key)
        if per_mb is None:
            engine = self.engine
            per_rank = c.dp * c.cp * c.tp
            ranks = [self.devices[p * per_rank:(p + 1) * per_rank] for p in range(c.pp)]
            node = _whole_nodes(self.cluster)
            if engine.homogeneous and node is not None \
                    and (per_rank % node == 0 or node % per_rank == 0):
                ranks = ranks[:1]   # every rank's groups are alike: translated by whole nodes
            total = 0.0
            for template, count in engine.layer_counts(0, self.summary.num_layers):
                ep = c.ep if engine.template(template).expert_params else 1
                total += count * min(engine.layer_time_bound(template, devs, c.tp, c.cp, ep, c.sp,
                                                             c.micro_batch, self.precision)
                                     for devs in ranks)
            per_mb = self._bounds[key] = total / c.pp
        return pipeline_time(c.schedule, [per_mb] * c.pp, m, virtual_stages=c.v)

    def plan(self, lay: Layout, global_batch: int) -> Plan:
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
        replica_batch = tuple(m * lay.micro_batch for m in lay.replica_micro_batches)
        return Plan(model=self.graph.model, title=self.graph.title, cluster=ClusterSummary.from_cluster(self.cluster),
                    global_batch=global_batch, seq_len=self.graph.seq_len,
                    precision=lay.precision, mesh=mesh, stages=tuple(stages),
                    layers=tuple(placements), micro_batch=lay.micro_batch,
                    num_micro_batches=max(lay.replica_micro_batches),
                    replica_batch=replica_batch, schedule=lay.schedule, virtual_stages=v)


# ------------------------------------------------------------------ enumeration
def _combos(graph: ModelGraph, cluster, global_batch: int, space: SearchSpace,
            attention: bool = True) -> Iterable[_Combo]:
    """Degree combinations, context-parallel degree outermost with cp = 1 first (its plans
    bound the step time that prunes the others).  ``attention``: the model's key/value
    size is known, so context parallelism can be priced.  Expert parallel degrees (models
    with expert banks only) divide ``dp x cp`` and every layer's experts, ep = 1 first."""
    n = cluster.num_devices
    experts = expert_counts(graph)
    domain = _domain_size(cluster)      # tp x cp groups tile it (inside one NVLink domain)
    whole = _whole_nodes(cluster)
    placed_cache: dict[tuple[int, int], bool] = {}

    def placed(span: int, per_rank: int) -> bool:
        hit = placed_cache.get((span, per_rank))
        if hit is None:
            hit = placed_cache[(span, per_rank)] = _groups_placed(cluster, span, per_rank,
                                                                  domain, whole)
        return hit
    tp_limit = _blocks_tp_limit(graph)
    blocks = sum(1 for l in graph.layers if l.kind is LayerKind.BLOCK)
    seq = graph.seq_len or 0
    # the runtime splits each sequence into 2 cp load-balanced chunks
    cps = sorted(cp for cp in set(space.context_parallel)
                 if cp == 1 or (attention and seq and seq % (2 * cp) == 0))
    for cp, tp in ((cp, tp) for cp in cps for tp in _divisors(domain)):
        if tp_limit % tp or (space.tensor_parallel is not None and tp not in space.tensor_parallel):
            continue
        if (n // tp) % cp or domain % (tp * cp):
            continue   # the key/value all-gather stays inside a domain, as tp's collectives do
        rest = n // (tp * cp)
        for pp in _divisors(rest):
            if pp > max(blocks, 1):     # a model without repeated blocks runs as one stage
                continue
            if space.pipeline_parallel is not None and \
                    not space.pipeline_parallel[0] <= pp <= space.pipeline_parallel[1]:
                continue
            dp = rest // pp
            if dp > global_batch:
                continue
            per_replica = global_batch // dp
            if space.micro_batches is not None:
                mbs = [mb for mb in space.micro_batches if mb <= per_replica]
            else:   # every divisor (what an expert would try), plus powers of two for
                # batches that split unevenly over the replicas
                mbs = sorted({d for d in _divisors(per_replica) if d <= space.max_micro_batch}
                             | {2 ** i for i in range(7) if 2 ** i <= min(per_replica,
                                                                         space.max_micro_batch)})
            for mb in mbs:
                if dp * mb > global_batch:
                    continue
                m = global_batch // (dp * mb)
                scheds: list[tuple[Schedule, int]] = []
                if pp == 1:
                    scheds = [(Schedule.ONE_F_ONE_B, 1)]
                else:
                    for s in space.schedules:
                        if s is Schedule.INTERLEAVED:
                            scheds += [(s, v) for v in space.virtual_stages
                                       if blocks >= pp * v and m >= pp and m % pp == 0]
                        elif s is Schedule.ZERO_BUBBLE:
                            if blocks >= 2 * pp and m >= 2 * pp:
                                scheds.append((s, 2))
                        elif s is Schedule.ONE_F_ONE_B:
                            if m >= pp:
                                scheds.append((s, 1))
                        else:
                            scheds.append((s, 1))
                sps = [sp for sp in space.sequence_parallel if (sp and tp > 1) or not sp]
                if tp > 1 and True in sps and False in sps:
                    sps = [True, False]
                # an ep group spans ep x tp consecutive devices (same tp index): inside one
                # NVLink domain or over whole nodes, never straddling a domain's edge
                eps = [ep for ep in _divisors(dp * cp)
                       if experts and all(e % ep == 0 for e in experts)
                       and (space.expert_parallel is None or ep in space.expert_parallel)
                       and (ep == 1 or placed(ep * tp, dp * cp * tp))] or [1]
                for sched, v in scheds:
                    for sp in sps:
                        for ep in eps:
                            yield _Combo(tp, cp, pp, dp, mb, sched, v, sp, ep)


def _ladder(space: SearchSpace, schedule: Schedule) -> list[list[tuple[int, Recompute]]]:
    """Rungs of (ZeRO stage, recompute), cheapest first; a rung is tried only when the
    rungs below hold nothing that fits."""
    zbv = schedule is Schedule.ZERO_BUBBLE
    # what torch cannot run under zero-bubble schedules (strategy.ZBV_ZERO3, ZBV_SELECTIVE)
    rc = [r for r in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
          if r in space.recompute and not (zbv and r is Recompute.SELECTIVE)]
    zs = [z for z in space.zero if not (zbv and z == 3)]
    rungs = [
        [(z, Recompute.NONE) for z in zs if z in (0, 1)],
        [(z, r) for z in zs for r in rc if (z, r) in ((0, Recompute.SELECTIVE),
                                                      (1, Recompute.SELECTIVE),
                                                      (2, Recompute.NONE),
                                                      (2, Recompute.SELECTIVE))],
        [(z, r) for z in zs for r in rc if (z == 3 and r is not Recompute.FULL)
         or (r is Recompute.FULL)],
    ]
    return [r for r in rungs if r]


# ------------------------------------------------------------------ refinement
def _refine(cand: _Candidate, builder: _Builder, global_batch: int) -> _Candidate | None:
    """CP-SAT over blocks per rank and recompute per block, from the candidate's layout."""
    c, engine, s = cand.combo, builder.engine, builder.summary
    if c.v != 1 or not builder.blocks:
        return None
    lay = cand.layout
    full = engine.estimate(lay)
    recipe = engine.precision_costs(lay.precision)
    act_scale = recipe.activation_scale
    m = max(lay.replica_micro_batches)
    opts = [r for r in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
            if r in builder.recompute
            and not (r is Recompute.SELECTIVE and engine.options.fused_attention)]
    mid = s.layers[builder.blocks[len(builder.blocks) // 2]]
    zero_deg = c.dp * c.cp

    def state_bytes_over(shards: int) -> float:
        """Weight, gradient and optimizer bytes per parameter under the candidate's ZeRO
        stage over ``shards`` ranks."""
        weights, grads, optimizer = recipe.param_bytes, recipe.grad_bytes, recipe.optimizer_bytes
        return {0: weights + grads + optimizer, 1: weights + grads + optimizer / shards,
                2: weights + (grads + optimizer) / shards,
                3: (weights + grads + optimizer) / shards}[cand.zero]

    state_bytes = state_bytes_over(zero_deg)
    # expert banks: 1/ep of them per device, their states sharded over dp x cp / ep
    ep = c.ep if mid.expert_params else 1
    x = mid.expert_params if ep > 1 else 0
    local_params = mid.sharded_params / c.tp + (mid.params - mid.sharded_params - x)
    local_x, state_x = x / ep, state_bytes_over(zero_deg // c.ep)
    time_us, mem_mib, fixed_t, fixed_m, cap = [], [], [], [], []
    counts_now = []
    for p in range(c.pp):
        chunk = lay.chunks[p]
        nblocks = sum(seg.hi - seg.lo for seg in chunk if s.layers[seg.lo].is_block)
        counts_now.append(nblocks)
        device = engine.device_of(lay.rank_devices[p][:c.cp * c.tp])
        layer_time = engine.template_time(mid.template, c.micro_batch, c.tp, c.cp, device,
                                          recipe.dtype, False, ep)
        forward, backward = layer_time.forward_s, layer_time.backward_s
        # the token all-to-alls: dispatch and combine, forward and backward
        ep_group = lay.rank_devices[p][0::c.tp][:ep]
        a2a = engine.collective_time("all_to_all", ep_group,
                                     engine.dispatch_bytes(mid, c.micro_batch, c.cp, act_scale,
                                                           c.tp, ep_group)) \
            if ep > 1 else 0.0
        flight = in_flight(c.schedule, p, c.pp, m, 1)
        t_row, m_row = [], []
        for rc in opts:
            extra = forward if rc is Recompute.FULL else \
                (layer_time.core_forward_s if rc is Recompute.SELECTIVE else 0.0)
            comm = a2a * (6 if rc is Recompute.FULL else 4)
            t_row.append(max(1, round((forward + backward + extra + comm) * 1e6)))
            act = engine.activation_bytes(mid, c.tp, c.sp, rc, c.cp) * c.micro_batch * act_scale \
                * flight
            m_row.append(max(1, math.ceil((act + local_params * state_bytes
                                           + local_x * state_x) / _MiB)))
        time_us.append(tuple(t_row))
        mem_mib.append(tuple(m_row))
        st = full.stages[p]
        per_mb = st.forward_s + st.backward_s
        base_rc = opts.index(cand.recompute) if cand.recompute in opts else 0
        fixed_t.append(max(0, round(per_mb * 1e6) - nblocks * t_row[base_rc]))
        fixed_m.append(max(0, math.ceil(st.memory.total_bytes / _MiB) - nblocks * m_row[base_rc]))
        cap.append(int(st.memory_capacity_bytes * engine.options.memory_fraction / _MiB))
    base = opts.index(cand.recompute) if cand.recompute in opts else 0
    hint = tuple(tuple(counts_now[p] if o == base else 0 for o in range(len(opts)))
                 for p in range(c.pp))
    problem = StageProblem(num_blocks=len(builder.blocks), options=tuple(o.value for o in opts),
                           time_us=tuple(time_us), memory_mib=tuple(mem_mib),
                           fixed_time_us=tuple(fixed_t), fixed_memory_mib=tuple(fixed_m),
                           capacity_mib=tuple(cap), hint=hint)
    best: _Candidate | None = None
    for _ in range(3):   # tighten the budget if the engine disagrees on memory
        try:
            sol = solve_stage_problem(problem)
        except InfeasiblePlan:
            return best
        counts = [sum(row) for row in sol.counts]
        # within a rank: the most memory-saving options first (earliest layers live longest)
        runs = [[(row[o], opts[o]) for o in reversed(range(len(opts))) if row[o]] for row in sol.counts]
        bounds = builder.bounds_from_counts(counts)
        new = builder.layout(c, cand.zero, cand.recompute, lay.replica_micro_batches, global_batch,
                             bounds=bounds, options=runs)
        q = engine.quick(new)
        if q.fits:
            rcs = {r for run in runs for _, r in run}
            best = _Candidate(q.step_time_s, q.peak_memory_bytes, cand.key + ("refined",), c, cand.zero,
                              cand.recompute if len(rcs) != 1 else next(iter(rcs)), new)
            break
        over = math.ceil((q.peak_memory_bytes - min(cap) * _MiB) / _MiB) + 1
        problem = replace(problem, capacity_mib=tuple(max(1, x - max(over, 1)) for x in problem.capacity_mib))
    return best


#: A refined layout takes at least this fraction of its candidate's step time: refinement
#: removes at most the recompute, and full recompute re-runs a forward, which is at most a
#: third of forward plus backward (the backward runs two matmuls per forward matmul,
#: Narayanan et al. 2021, Sec. 3.5), so at most a quarter of the step.
REFINE_FLOOR = 3 / 4


def _refine_order(ranked: list[_Candidate], engine: CostEngine, budget: int) -> list[_Candidate]:
    """The candidates worth refining, best first: those whose step time could drop below
    the best candidate's (``REFINE_FLOOR``), ordered by what refinement could reach at
    best, the step time without the candidate's recompute (CP-SAT chooses recompute per
    block and blocks per stage), one per degree combination."""
    if not ranked:
        return []
    limit = ranked[0].step_time_s / REFINE_FLOOR
    pool, seen = [], set()
    for cand in ranked:
        if cand.step_time_s > limit:
            break
        if cand.combo.v != 1 or cand.combo.key() in seen:
            continue   # only single-chunk pipelines are refined (see _refine)
        seen.add(cand.combo.key())
        pool.append(cand)
    bound = {id(c): c.step_time_s - engine.estimate(c.layout).breakdown["recompute_s"]
             for c in pool}
    return sorted(pool, key=lambda c: (bound[id(c)], c.step_time_s, c.key))


# ------------------------------------------------------------------ search
def search(graph: ModelGraph, cluster, *, global_batch: int, memory_fraction: float = 0.9,
           time_limit_s: float = 60.0, top_k: int = 1, precision: Precision | str = Precision.BF16,
           options: CostOptions | None = None, space: SearchSpace | None = None,
           bound_s: float = math.inf) -> SearchResult:
    """Search the layouts of ``graph`` on ``cluster``; see :func:`plan`.

    ``bound_s``: the step time of a plan already known to fit (a warm start); degree
    combinations whose cheapest layout is slower are pruned without climbing the ladder.
    """
    t0 = time.perf_counter()
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be a positive integer (sequences per step), "
                          f"got {global_batch!r}")
    if cluster.num_devices < 1:
        raise ConfigError("the cluster has no devices")
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {top_k!r}")
    precision = Precision(precision)
    space = space or SearchSpace()
    moe = bool(expert_counts(graph))
    if moe:
        # what autoplan.parallelize runs on MoE blocks: no sequence parallelism (their
        # experts stay whole on every tp rank), no selective recompute (a Hugging Face MoE
        # block's operators differ from the captured ones); see docs/limitations.md
        space = replace(space, sequence_parallel=(False,),
                        recompute=tuple(r for r in space.recompute if r is not Recompute.SELECTIVE))
    options = replace(options or CostOptions(), memory_fraction=memory_fraction)
    engine = CostEngine(graph, cluster, options=options)
    builder = _Builder(graph, engine, cluster, precision)
    builder.recompute = tuple(space.recompute)

    combos = list(_combos(graph, cluster, global_batch, space,
                          attention=engine.summary.kv_bytes_per_token is not None))
    if not combos:
        # the data-parallel degrees this model and cluster allow: n / (tp x pp), tp inside a
        # node and within the blocks' limit (heads, features), pp at most one block per stage
        n, blocks = cluster.num_devices, len(graph.blocks)
        tps = [tp for tp in _divisors(_domain_size(cluster)) if _blocks_tp_limit(graph) % tp == 0]
        dps = sorted({n // (tp * pp) for tp in tps for pp in _divisors(n // tp) if pp <= max(blocks, 1)})
        limits = (f"{n} devices / (tp x pp), with tp in {tps} (inside a node's NVLink domain, "
                  f"tiling every node's {sorted({len(x.local_ranks) for x in cluster.nodes})} "
                  "devices, dividing the "
                  f"blocks' heads and features) and pp at most the model's {blocks} blocks")
        if not any(global_batch % dp == 0 and dp <= global_batch for dp in dps):
            raise ConfigError(
                f"global_batch={global_batch} cannot be split over any data-parallel degree this "
                f"model and cluster allow ({dps[:12]}: {limits}); choose a global batch that is a "
                "multiple of one of them, or fewer devices")
        raise ConfigError(f"no layout of {graph.model} fits the search space on {n} devices: the "
                          f"data-parallel degrees are {dps[:12]} ({limits}), and the search "
                          "space's micro-batch, pipeline or context-parallel limits leave none")

    best_time = bound_s
    ranked: list[_Candidate] = []
    least_memory: _Candidate | None = None
    lowest: list[_Candidate] = []
    evaluated = pruned = 0
    limit_hit = False
    unsplit: set[int] = set()      # dp degrees whose replicas cannot get equal batches

    def _climb(c: _Combo, mbs: tuple[int, ...]) -> None:
        """Climb the memory ladder of one combination and replica split."""
        nonlocal best_time, least_memory, evaluated, pruned
        if any(schedule_problem(c.schedule, c.pp, c.v, m) for m in set(mbs)):
            return   # a replica's micro-batches do not fit the schedule (uneven splits)
        for rung_i, rung in enumerate(_ladder(space, c.schedule)):
            rung_cands = []
            for zero, rc in rung:
                try:
                    lay = builder.layout(c, zero, rc, mbs, global_batch)
                    q = engine.quick(lay)
                except StrategyError:
                    continue
                evaluated += 1
                cand = _Candidate(q.step_time_s, q.peak_memory_bytes,
                                  c.key() + (zero, rc.value, mbs), c, zero, rc, lay, q.fits)
                if least_memory is None or q.peak_memory_bytes < least_memory.peak_bytes:
                    least_memory = cand
                if not q.fits and c.v == 1:
                    lowest.append(cand)
                    if len(lowest) > 64:
                        lowest.sort(key=lambda x: (x.peak_bytes, x.key))
                        del lowest[32:]
                rung_cands.append(cand)
            if not rung_cands:
                break
            fitting = [x for x in rung_cands if x.fits]
            if fitting:
                ranked.extend(fitting)
                best_time = min(best_time, min(x.step_time_s for x in fitting))
                break
            # the lowest rung's time bounds every higher rung: prune dominated combos
            if rung_i == 0 and min(x.step_time_s for x in rung_cands) > best_time:
                pruned += 1
                break

    for c in combos:
        if time.perf_counter() - t0 > time_limit_s:
            limit_hit = True
            break
        splits = builder.replica_splits(c, global_batch, even=space.even_batches)
        if not splits:
            unsplit.add(c.dp)
            continue
        for mbs in splits:
            # MoE models (several times the combinations, one per ep degree): skip those
            # slower than the best plan whatever the memory ladder does.  Dense models
            # climb as they always have (their fitting but slower candidates stay ranked).
            if moe and builder.busy_bound(c, max(mbs)) > best_time:
                pruned += 1
                continue
            _climb(c, mbs)

    if not ranked:
        # nothing fits evenly: let CP-SAT rebalance the least-memory candidates (e.g. fewer
        # layers on the stage of smaller GPUs) before giving up
        for cand in sorted(lowest, key=lambda x: (x.peak_bytes, x.key))[:space.refine * 2]:
            better = _refine(cand, builder, global_batch)
            if better is not None:
                ranked.append(better)
        if not ranked:
            if least_memory is None and unsplit:
                raise ConfigError(
                    f"global_batch={global_batch} does not split into equal replica batches for "
                    f"any data-parallel degree the {cluster.num_devices} devices allow "
                    f"({sorted(unsplit)[:12]}): choose a global batch that is a multiple of one "
                    "of them")
            raise _infeasible(engine, least_memory, graph, cluster)

    ranked.sort()
    refined = 0
    seen_keys = set()
    for cand in _refine_order(ranked, engine, space.refine):
        if refined >= space.refine:
            break
        if cand.combo.key() in seen_keys:
            continue
        seen_keys.add(cand.combo.key())
        better = _refine(cand, builder, global_batch)
        refined += 1
        if better is not None and better.step_time_s < cand.step_time_s * (1 - 1e-9):
            ranked.append(better)
    ranked.sort()

    plans: list[Plan] = []
    descriptions: set[str] = set()
    for cand in ranked:
        if len(plans) >= max(top_k, 1):
            break
        p = builder.plan(cand.layout, global_batch)
        desc = p.describe()
        if desc in descriptions:
            continue
        descriptions.add(desc)
        plans.append(p.with_estimate(engine.estimate(p)))
    return SearchResult(plans, evaluated, pruned, refined, time.perf_counter() - t0, limit_hit)


def _infeasible(engine: CostEngine, least: _Candidate | None, graph: ModelGraph, cluster) -> InfeasiblePlan:
    cap = min(t.memory_bytes for t in cluster.device_types) * engine.options.memory_fraction
    if least is None:
        return InfeasiblePlan("no layout could be built for this model and cluster")
    est = engine.estimate(least.layout)
    worst = max(est.stages, key=lambda st: st.memory.total_bytes)
    mem = worst.memory
    states = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes
    binding = "model states (parameters, gradients, optimizer)" if states >= mem.activations_bytes \
        else "activations"
    need = worst.memory.total_bytes
    helps = []
    if states >= mem.activations_bytes:
        helps += ["more devices (more pipeline/tensor parallelism or ZeRO-3 sharding)",
                  "a GPU with more memory"]
    else:
        helps += ["a smaller micro-batch or global batch", "shorter sequences",
                  "full recompute", "more devices"]
    return InfeasiblePlan(
        f"no layout of {graph.model} ({graph.num_params / 1e9:.2f}B parameters) fits on "
        f"{cluster.num_devices} devices of {cluster.name}: the least memory any layout needs is "
        f"{need / 2**30:.1f} GiB per device ({least.combo.key()[:4]} tp/cp/pp/dp, ZeRO-{least.zero}, "
        f"recompute {least.recompute.value}), but each device allows "
        f"{cap / 2**30:.1f} GiB; the binding constraint is {binding}. "
        f"What would help: {', '.join(helps)}.",
        required_bytes=need, available_bytes=cap, binding=binding)


def plan(model_or_graph: Any, cluster, *, global_batch: int, seq_len: int | None = None,
         example_inputs: Any = None, memory_fraction: float = 0.9, time_limit_s: float = 60.0,
         top_k: int = 1, precision: Precision | str | Sequence[Precision | str] = Precision.BF16,
         options: CostOptions | None = None, space: SearchSpace | None = None) -> Plan:
    """The fastest layout of a model on a cluster that fits every device's memory.

    Parameters
    ----------
    model_or_graph : nn.Module or ModelGraph
        A model (captured with :func:`autoplan.trace`) or its graph.
    cluster : Cluster or str
        From :func:`autoplan.load_cluster` / :func:`autoplan.compose_cluster`, or a
        profile's name or path (one node of it).
    global_batch : int
        Sequences (samples) per optimizer step.
    memory_fraction : float
        Plans use at most this fraction of each device's memory.
    time_limit_s : float
        Wall-time bound of the search; the best plan so far is returned when it binds.
    top_k : int
        How many plans to rank; the runners-up are ``plan.runners_up``.
    precision : Precision, str or list of them
        The mixed-precision recipe (default bf16), or several to search, each with its
        share of ``time_limit_s``, the fastest plan of any winning.  FP8 recipes are
        searched only when given here.

    Returns
    -------
    Plan
        With its :class:`~autoplan.cost.Estimate`; ``plan.runners_up`` holds the next
        ``top_k - 1`` plans and ``plan.search_stats`` what the search did.

    Raises
    ------
    InfeasiblePlan
        When nothing fits: says the least memory a layout needs, what binds and what would help.
    ConfigError
        For arguments that cannot work (e.g. a global batch no data-parallel degree divides).
    """
    from ..capture import trace
    from ..graph import ModelGraph as _MG
    graph = model_or_graph if isinstance(model_or_graph, _MG) else \
        trace(model_or_graph, seq_len=seq_len, example_inputs=example_inputs)
    cluster = as_cluster(cluster)
    precisions = _precisions(precision)
    results, infeasible = [], None
    for p in precisions:
        # each recipe its share of the time limit
        try:
            results.append(search(graph, cluster, global_batch=global_batch,
                                  memory_fraction=memory_fraction,
                                  time_limit_s=time_limit_s / len(precisions), top_k=top_k,
                                  precision=p, options=options, space=space))
        except InfeasiblePlan as exc:
            infeasible = infeasible or exc
    if not results:
        assert infeasible is not None
        raise infeasible
    return _attach(_merged(results, top_k), graph)


def _precisions(precision) -> tuple[Precision, ...]:
    """One recipe, or several to search (a list or tuple), each once, in the order given."""
    many = isinstance(precision, (list, tuple))
    if many and not precision:
        raise ConfigError("precision: give a recipe or a non-empty list of them")
    out = []
    for p in (precision if many else (precision,)):
        try:
            out.append(Precision(p))
        except ValueError:
            raise ConfigError(f"precision={p!r} is not one of "
                              f"{[m.value for m in Precision]}") from None
    return tuple(dict.fromkeys(out))


def _merged(results: list[SearchResult], top_k: int) -> SearchResult:
    """The searches of several recipes as one: their plans ranked together (fitting plans
    first, then by step time; a tie keeps the recipe given first), the statistics summed."""
    if len(results) == 1:
        return results[0]
    order = {id(p): (i, j) for i, r in enumerate(results) for j, p in enumerate(r.plans)}
    plans = sorted((p for r in results for p in r.plans),
                   key=lambda p: (not p.estimate.fits, p.estimate.step_time_s, order[id(p)]))
    return SearchResult(plans[:top_k], sum(r.evaluated for r in results),
                        sum(r.pruned for r in results), sum(r.refined for r in results),
                        sum(r.seconds for r in results),
                        any(r.time_limit_hit for r in results))


def _attach(result: SearchResult, graph: ModelGraph) -> Plan:
    """The best plan, carrying its runners-up, the search statistics and the graph
    (not serialized: ``replan`` uses the graph to search again)."""
    fingerprint = ModelFingerprint.of(graph)      # emit, parallelize, replan refuse another model
    plans = [replace(p, graph=graph, fingerprint=fingerprint) for p in result.plans]
    return replace(plans[0], runners_up=tuple(plans[1:]), search_stats=result)
