"""Lower bounds of the step time and memory of every layout of a degree combination.

The search visits degree combinations best bound first and stops where the bound
reaches the best plan found (:func:`autoplan.search.search`), so what it skips is
provably no faster than what it returns.  Every bound here is assembled from the cost
engine's own per-layer terms (:class:`autoplan.cost.CostEngine`), summed where the
engine sums them and with every term the engine adds on top left out (each is
non-negative), so it holds for *every* layout of the combination: any ZeRO stage the
bound is taken over, any recompute per block, any split of the blocks over the
pipeline ranks.

Time.  A pipeline rank's time per micro-batch is the sum of its layers' forward and
backward (compute and exposed tensor-, context-, expert- and ZeRO-parallel
collectives), plus pipeline sends; the schedule's time grows with every rank's time,
and is least, for ranks adding up to ``S``, when each takes ``S / pp``
(:func:`autoplan.cost.pipeline_time`).  The data-parallel step, the optimizer and the
closing loss reduction only add to it.  Recompute only adds to a layer's time (the
recomputed forward; a backward that grows hides more of the ZeRO collectives behind
it, never more than it grew).  So ``pipeline_time(schedule, [S_z / pp] * pp, m)``
with ``S_z`` the layers' time at ZeRO stage ``z`` without recompute bounds every
layout at that stage; ZeRO-0 and ZeRO-1 add no per-layer term and share ``S_1``.
On ranks of several device types each layer counts at its fastest.  Where ranks share
fewer CPU cores than there are of them (a one-node CPU cluster), the engine's schedule
speeds up over the cores the bubble leaves idle; there the bound is 0.

Memory (:mod:`.memory_bounds`).  A rank holds at least its layers' model states (per ZeRO stage:
:func:`autoplan.cost.memory.model_state_bytes`) and the activations of its micro-batches
in flight (:func:`autoplan.cost.in_flight`), plus the runtime's reserve and the
allocator's fragmentation share of it (the engine's ``MemoryBreakdown``).  A uniform
option ``(z, r)`` fits only if the ranks can hold the blocks between them: rank ``p``
at most ``floor(free_p / (states + in_flight_p x activations))`` of them, at least one
per chunk, the embeddings on the first stage's rank and the head on the last's.  Blocks
of several templates (DeepSeek-V3's dense blocks before its mixtures of experts) count
each at its own size, the smallest first: no split puts more of them on a rank.
Recompute of some blocks only saves their activations, so a combination none of whose
ranks can hold its blocks at the stage's least-memory option fits no mix either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..cost import pipeline_time
from ..cost.engine import GRAD_ACCUMULATE_READS_WRITES, Segment
from ..precision import DTYPE_BYTES
from ..strategy import Recompute, Schedule, stage_ranks
from .memory_bounds import MemoryBounds
from .recompute_lp import hull_at, lower_hull, recompute_lp

__all__ = ["Bounds", "ByRank"]


@dataclass(frozen=True)
class _Sums:
    """One micro-batch of a uniform option on one kind of rank, per layer template."""

    time_s: dict[str, float]            # forward + backward of one layer
    params: dict[str, float]            # local parameters outside expert banks
    expert_params: dict[str, float]     # local parameters in them
    saved: dict[str, float]             # activation bytes saved for the backward


class ByRank(tuple):
    """Kinds of rank one per pipeline rank, in rank order (:meth:`Bounds.classes` on
    mixed clusters), where a plain tuple of kinds lists each kind once."""


#: The tables of per-replica terms of the latest searches (:func:`_shared_tables`).
_SHARED: list[tuple[tuple, tuple, dict[str, dict]]] = []
#: How many searches' tables are kept (a plan, then its replan, of two models).
_SHARED_KEPT = 2
#: The tables shared: keyed by what the terms depend on (the ranks' signatures, the
#: options), not by devices or pools.
_SHARED_NAMES = ("_sums", "_per_mb", "_busiest", "_cheap", "_tails")


def _shared_tables(engine: Any, cluster: Any, precision: Any,
                   recompute: Sequence[Recompute]) -> dict[str, dict]:
    """The tables of :data:`_SHARED_NAMES` for a search of ``engine`` on ``cluster``,
    those of an earlier search where its terms are the same.

    A rank's terms are keyed by its signature (its device type and where its groups sit:
    :meth:`Bounds._signature`), which prices it alike on any cluster of the same node
    profiles, so a replan after its plan (``Cluster.without`` or ``load_cluster`` of
    fewer nodes) finds the terms of every rank both priced.  The same model (its
    summary), profiles, calibration and cost constants (each the same object), options,
    precision, recompute options, links between sites, and, on several sites, their
    device counts (a link's share of a group depends on them)."""
    same = (engine.summary, engine.calibration, engine.constants,
            *(p for _, p in sorted(cluster.profiles.items())))
    sites = cluster.sites
    counts = tuple(cluster._index.site_devices[s] for s in sites) if len(sites) > 1 else ()
    equal = (tuple(sorted(cluster.profiles)), sites, counts, cluster.site_links,
             cluster.servers, engine.options, precision, tuple(recompute))
    del _SHARED[:max(0, len(_SHARED) - _SHARED_KEPT)]
    for i, (objects, values, _) in enumerate(_SHARED):
        if len(objects) == len(same) and all(a is b for a, b in zip(objects, same)) \
                and values == equal:
            entry = _SHARED.pop(i)
            break
    else:
        entry = (same, equal, {name: {} for name in _SHARED_NAMES})
    _SHARED.append(entry)                           # the latest last
    del _SHARED[:max(0, len(_SHARED) - _SHARED_KEPT)]
    return entry[2]


class Bounds(MemoryBounds):
    """Bounds for one search: one engine, precision and set of recompute options (the
    memory model it shares, :class:`~autoplan.search.memory_bounds.MemoryBounds`).

    ``cluster`` (the search's, before calibration): share the tables of per-replica terms
    with earlier searches of the same terms (:func:`_shared_tables`)."""

    #: Tests: recompute every term found in a table shared with an earlier search, and
    #: check it is the same.
    check_shared = False

    def __init__(self, engine: Any, precision: Any, recompute: Sequence[Recompute],
                 pools: Sequence[Any], cluster: Any = None) -> None:
        self.engine = engine
        self.pools = list(pools)
        self._ranks: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._where: dict[int, tuple] = {}      # id(rank) -> (rank, (pool, offset, size))
        self._shapes: dict[tuple, tuple] = {}
        self.summary = engine.summary
        self.recipe = engine.precision_costs(precision)
        self.recompute = tuple(recompute)
        s = self.summary
        n = len(s.layers)
        blocks = [i for i, l in enumerate(s.layers) if l.is_block]
        self.num_blocks = len(blocks)
        self.layers = engine.layer_counts(0, n)
        self.pre = engine.layer_counts(0, blocks[0]) if blocks else self.layers
        self.post = engine.layer_counts(blocks[-1] + 1, n) if blocks else ()
        self.block_templates = tuple(dict.fromkeys(s.layers[i].template for i in blocks))
        #: How many blocks of each template (in ``block_templates`` order).
        self.block_counts = tuple(sum(1 for i in blocks if s.layers[i].template == t)
                                  for t in self.block_templates)
        # what a pipeline boundary between two blocks sends per sequence (the least)
        self.boundary_bytes = min((s.layers[i].send_bytes for i in blocks[:-1]), default=0.0)
        kmem = engine.constants.memory
        self.reserve = kmem.runtime_reserved_bytes
        self.frag = kmem.allocator_fragmentation_fraction
        self.fraction = engine.options.memory_fraction
        # the engine's data-parallel gradient buckets: the one buffer that grows with a
        # rank's parameters (up to this), left out of what refinement carries over
        self.bucket_bytes = kmem.grad_bucket_bytes * kmem.grad_buckets_in_flight
        self.per_param = (self.recipe.param_bytes, self.recipe.grad_bytes,
                          self.recipe.optimizer_bytes)
        self._sums: dict[tuple, _Sums] = {}
        self._kinds: dict[tuple, tuple[tuple[int, ...], ...]] = {}
        self._caps: dict[tuple, tuple[float, ...]] = {}
        self._ends: dict[tuple, tuple[tuple[int, ...], list[int]]] = {}
        self._per_mb: dict[tuple, float] = {}
        self._busiest: dict[tuple, float] = {}
        self._kinds_keys: dict[tuple, tuple] = {}
        self._classes: dict[tuple, list] = {}
        self._by_sig: dict[tuple, tuple[int, ...]] = {}
        self._rooms: dict[tuple, tuple] = {}
        self._flight: dict[tuple, tuple[float, ...]] = {}
        self._tails: dict[tuple, float] = {}
        self._cheap: dict[tuple, float] = {}
        self._sig: dict[tuple, tuple] = {}
        self._per_param_bytes: dict[tuple[int, int, bool], float] = {}
        self._own_sums: set[tuple] | None = None
        if cluster is not None:
            for name, table in _shared_tables(engine, cluster, precision,
                                              self.recompute).items():
                setattr(self, name, table)
            if self.check_shared:
                self._own_sums = set()
        cluster = engine.cluster
        self._shared_cores = (cluster.profile_of(0).node.shared_cores
                              if cluster.num_nodes == 1 else None)

    # ------------------------------------------------------------------ per-layer terms
    def _signature(self, rank: tuple[int, ...], tp: int, cp: int, ep: int, zero: int) -> tuple:
        """What the engine's terms of a rank depend on besides the options: its replica's
        device type and where its groups sit (the data-parallel ones under ZeRO-2/3).  On
        a cluster of one device type and nodes of one size, a rank of a pool is priced as
        any other of its size starting as far into a node (translated by whole nodes)."""
        key = (id(rank), tp, cp, ep, zero >= 2)
        seen = self._sig.get(key)
        hit = seen[1] if seen is not None and seen[0] is rank else None
        where = self._where.get(id(rank))
        if hit is None and where is not None and where[0] is rank:
            shape = (where[1], tp, cp, ep, zero >= 2)
            hit = self._shapes.get(shape)
            if hit is None:
                hit = self._shapes[shape] = self._signature_of(rank, tp, cp, ep, zero)
            self._sig[key] = (rank, hit)
        if hit is None:
            hit = self._signature_of(rank, tp, cp, ep, zero)
            if len(self._sig) > 65536:
                self._sig.clear()
            self._sig[key] = (rank, hit)     # by identity: hashing a rank costs more
        return hit

    def _signature_of(self, rank: tuple[int, ...], tp: int, cp: int, ep: int,
                      zero: int) -> tuple:
        engine = self.engine
        place = engine.cluster.placement        # (cached per group)
        g = engine._groups(rank, tp, cp, ep, 0)
        return (engine.device_of(g.replica).name, place(g.tp),
                place(g.cp) if g.cp else (), place(g.ep) if g.ep else (),
                (len(g.dp), place(g.dp), place(g.edp) if g.edp else ()) if zero >= 2 else ())

    def sums(self, rank: tuple[int, ...], tp: int, cp: int, ep: int, sp: bool, zero: int,
             rc: Recompute, b: int) -> _Sums:
        """The engine's terms of every layer template on a rank with devices ``rank``
        (replica 0): blocks with recompute ``rc``, every layer at ZeRO stage ``zero``."""
        z = max(zero, 1) if zero < 2 else zero      # ZeRO-0 and 1 add no per-layer term
        key = (self._signature(rank, tp, cp, ep, z), tp, cp, ep, sp, z, rc, b)
        hit = self._sums.get(key)
        if hit is not None and self._own_sums is not None and key not in self._own_sums:
            self._own_sums.add(key)                  # (check_shared) priced here again
            del self._sums[key]
            again = self.sums(rank, tp, cp, ep, sp, zero, rc, b)
            assert again == hit, (key, hit, again)
            return hit
        if hit is None:
            engine = self.engine
            groups = engine._groups(rank, tp, cp, ep, 0)
            device = engine.device_of(groups.replica)
            time_s, params, experts, saved = {}, {}, {}, {}
            for template, _ in self.layers:
                layer = engine.template(template)
                seg = Segment(0, 0, tp, sp, z, rc if layer.is_block else Recompute.NONE)
                # the engine's own per-layer terms (the _rank loop sums these)
                t = engine._layer_terms(layer, seg, b, cp, device, self.recipe, groups,
                                        ep if layer.expert_params else 1)
                time_s[template] = t.forward_s + t.backward_s
                params[template], experts[template] = t.local_params, t.local_expert_params
                saved[template] = t.saved_bytes
            hit = self._sums[key] = _Sums(time_s, params, experts, saved)
            if self._own_sums is not None:
                self._own_sums.add(key)
        return hit

    # ------------------------------------------------------------------ ranks
    def rank(self, pool: int, start: int, size: int) -> tuple[int, ...]:
        """Devices ``start .. start + size - 1`` of pool ``pool``, one tuple object per slice
        (caches below go by its identity)."""
        key = (pool, start, size)
        hit = self._ranks.get(key)
        if hit is None:
            hit = self._ranks[key] = self.pools[pool].devices[start:start + size]
            sizes = self.pools[pool].node_sizes
            if self.engine.homogeneous and len(set(sizes)) == 1:
                # (nodes of one size, all whole in a pool: where in a node it starts)
                self._where[id(hit)] = (hit, (pool, start % sizes[0], size))
        return hit

    def rank_kinds(self, pool: int, n: int, pp: int, tp: int, cp: int, ep: int,
                   zero: int) -> tuple[tuple[int, ...], ...]:
        """One representative rank (its devices) per kind among the ``pp`` pipeline ranks
        over the first ``n`` devices of pool ``pool``: ranks whose terms the engine prices
        alike count once.  Clusters of several device types: every replica of every rank
        counts (each put first in its rank's devices)."""
        key = (pool, n, pp, tp, cp, ep, zero >= 2)
        hit = self._kinds.get(key)
        if hit is None:
            per_rank = n // pp
            whole = self.pools[pool].whole_node(n)
            ranks = [self.rank(pool, p * per_rank, per_rank) for p in range(pp)]
            domain = self.pools[pool].domain(n)
            if self.engine.homogeneous and ((whole is not None and (per_rank % whole == 0
                                                                    or whole % per_rank == 0))
                                            or (zero < 2 and domain % (tp * cp) == 0
                                                and domain % (tp * ep) == 0)):
                # translated by whole nodes, or (no ZeRO-2/3 terms, which see the
                # data-parallel group) groups inside a node each: all alike
                hit = (ranks[0],)
            elif self.engine.homogeneous and len(set(self.pools[pool].node_sizes)) == 1:
                # nodes of one size: a rank is priced as any other starting as far into a
                # node (translated by whole nodes), unless it runs into a partly used one
                size = self.pools[pool].node_sizes[0]
                full = n - n % size
                seen_at: dict[tuple, tuple[int, ...]] = {}
                for p, r in enumerate(ranks):
                    start = p * per_rank
                    seen_at.setdefault((start % size, start + per_rank > full, start // size
                                        if start + per_rank > full else 0), r)
                hit = tuple(dict.fromkeys(self._canonical(x, tp, cp, ep, zero)
                                          for x in seen_at.values()))
            else:
                seen: dict[tuple, tuple[int, ...]] = {}
                g = tp * cp
                for r in ranks:
                    replicas = [r] if self.engine.homogeneous else \
                        [r[i:] + r[:i] for i in range(0, per_rank, g)]
                    for x in replicas:
                        seen.setdefault(self._signature(x, tp, cp, ep, zero), x)
                hit = tuple(seen.values())
            if len(self._kinds) > 4096:
                self._kinds.clear()
            self._kinds[key] = hit
        return hit

    def _canonical(self, rank: tuple[int, ...], tp: int, cp: int, ep: int,
                   zero: int) -> tuple[int, ...]:
        """One rank object per signature (what the caches of terms go by)."""
        sig = self._signature(rank, tp, cp, ep, zero)
        return self._by_sig.setdefault((sig, tp, cp, ep, zero >= 2), rank)

    def classes(self, pool: int, n: int, pp: int, tp: int, cp: int, ep: int, zero: int,
                counts: Sequence[int]) -> list[tuple[tuple[tuple[int, ...], ...], int,
                                                     tuple[float, ...] | None]]:
        """The replicas in classes the engine prices alike, each as ``(kinds, m, caps)``:
        its ranks' kinds (:meth:`rank_kinds`; on mixed clusters one per rank), the most micro-batches a replica of it runs
        (``counts[r]`` for replica ``r``) and its ranks' usable memory (None: the pool's,
        :meth:`capacities`).  One class on a cluster of one device type; on others, the
        replicas whose devices, rank by rank, are of the same types and sit alike (each
        bound holds for every class, so the search takes the largest)."""
        if self.engine.homogeneous:
            return [(self.rank_kinds(pool, n, pp, tp, cp, ep, zero), max(counts), None)]
        key = (pool, n, pp, tp, cp, ep, zero >= 2)
        hit = self._classes.get(key)
        if hit is None:
            per_rank, g = n // pp, tp * cp
            ranks = [self.rank(pool, p * per_rank, per_rank) for p in range(pp)]
            cluster = self.engine.cluster
            groups: dict[tuple, list] = {}
            for r in range(per_rank // g):
                # each rank with replica r first, as the engine prices replica r
                reps = tuple(x[r * g:] + x[:r * g] if r else x for x in ranks)
                sig = tuple(self._signature(x, tp, cp, ep, zero) for x in reps)
                entry = groups.setdefault(sig, [reps, [], None])
                entry[1].append(r)
                if entry[2] is None:
                    entry[2] = tuple(
                        (max(cluster.device_type_of(d).memory_bytes for d in x[:g])
                         * self.fraction - self.reserve) / (1 + self.frag) for x in reps)
            hit = [(ByRank(reps), tuple(rs), caps) for reps, rs, caps in groups.values()]
            if len(self._classes) > 4096:
                self._classes.clear()
            self._classes[key] = hit
        return [(kinds, max(counts[r] for r in rs), caps) for kinds, rs, caps in hit]

    # ------------------------------------------------------------------ bounds
    def shared_cores(self, n: int) -> bool:
        """Whether ``n`` ranks on this (one-node) cluster share fewer cores."""
        return self._shared_cores is not None and self._shared_cores < n

    def time_per_micro_batch(self, kinds: tuple[tuple[int, ...], ...], tp: int, cp: int,
                             ep: int, sp: bool, zero: int, b: int) -> float:
        """``S_z``: every layer's forward and backward without recompute at ZeRO stage
        ``zero``, each at the fastest kind of rank."""
        key = (self._kinds_key(kinds, tp, cp, ep, zero), sp, b)
        hit = self._per_mb.get(key)
        if hit is None:
            sums = [self.sums(k, tp, cp, ep, sp, zero, Recompute.NONE, b) for k in kinds]
            hit = sum(count * min(x.time_s[t] for x in sums) for t, count in self.layers)
            if len(self._per_mb) > 65536:
                self._per_mb.clear()
            self._per_mb[key] = hit
        return hit

    def _kinds_key(self, kinds: tuple[tuple[int, ...], ...], tp: int, cp: int, ep: int,
                   zero: int) -> tuple:
        """What the terms of ``kinds`` depend on (their signatures), for the caches."""
        z = max(zero, 1)
        memo = (id(kinds), tp, cp, ep, z)
        seen = self._kinds_keys.get(memo)
        if seen is not None and seen[0] is kinds:
            return seen[1]
        key = (tuple(self._signature(k, tp, cp, ep, z) for k in kinds), tp, cp, ep, z)
        if len(self._kinds_keys) > 65536:
            self._kinds_keys.clear()
        self._kinds_keys[memo] = (kinds, key)
        return key

    def step_bound(self, schedule: Schedule, pp: int, v: int, m: int, per_mb_s: float,
                   n_devices: int) -> float:
        """The schedule's time with ranks sharing ``per_mb_s`` evenly (module docstring)."""
        if self.shared_cores(n_devices):
            return 0.0
        return pipeline_time(schedule, [per_mb_s / pp] * pp, m, virtual_stages=v)

    def tail(self, kinds: tuple[tuple[int, ...], ...], tp: int, cp: int, ep: int, zero: int,
             shards: int, pp: int, m: int) -> float:
        """A lower bound of what the step adds after the pipeline drains: the slowest
        rank's optimizer step, at least the ranks' mean (their parameters add up to the
        model's whatever the split).  The engine's step per parameter: the optimizer's
        bytes over the memory bandwidth (the states this rank updates: all under ZeRO-0,
        else ``1 / (dp x cp)`` of them, of an expert bank's ``ep / (dp x cp)``), and where
        gradients accumulate over micro-batches (``CostOptions.grad_accumulate_add``) each
        micro-batch after the first adds them (3 passes over the gradient: whole under
        ZeRO-0/1, the shard under ZeRO-2/3).
        0 on devices whose host time the engine prices (CPU profiles)."""
        key = (self._kinds_key(kinds, tp, cp, ep, 1), zero, shards, pp, m)
        hit = self._tails.get(key)
        if hit is not None:
            return hit
        engine = self.engine
        devices = [engine.device_of(engine._groups(k, tp, cp, ep, 0).replica) for k in kinds]
        if any(d.op_overhead is not None for d in devices):
            hit = 0.0
        else:
            x = self.sums(kinds[0], tp, cp, ep, False, 1, Recompute.NONE, 1)
            # outside the expert banks, sharded over dp x cp; in them, over their ep group
            dense = sum(c * x.params[t] for t, c in self.layers)
            banks = sum(c * x.expert_params[t] for t, c in self.layers)
            sharded = dense / shards + banks / max(1, shards // ep)
            seconds = (dense + banks if zero == 0 else sharded) \
                * self.recipe.optimizer_bytes_accessed
            if getattr(engine.options, "grad_accumulate_add", False) and m > 1:
                autocast = getattr(engine.options, "autocast", False) \
                    and self.recipe.dtype != "fp32"
                grad = DTYPE_BYTES["fp32"] if autocast else self.recipe.grad_bytes
                kept = dense + banks if zero <= 1 else sharded
                seconds += (m - 1) * kept * GRAD_ACCUMULATE_READS_WRITES * grad
            hit = seconds / pp / max(d.memory_bw_bytes_per_s for d in devices)
        self._tails[key] = hit
        return hit

    def zero_bound(self, pool: int, n_devices: int, kinds: tuple[tuple[int, ...], ...],
                   pp: int, v: int, tp: int, cp: int, ep: int, sp: bool, zero: int, b: int,
                   schedule: Schedule, m: int, threshold: float = math.inf,
                   extra_bytes: Sequence[float] | None = None,
                   rest_s: float = 0.0,
                   rank_rest_s: Sequence[float] | None = None,
                   caps: Sequence[float] | None = None, tail: bool = True,
                   exact: bool = True, slope: bool = False) -> Any:
        """A lower bound of the step time of every layout at ZeRO stage ``zero`` (any
        recompute per block, any split of the blocks), or None when none fits.

        Beyond ``S_z`` shared evenly (module docstring): whole blocks and the recompute
        memory forces.  Whole blocks: the busiest rank holds at least the least time, over
        whole-block splits, of its blocks and the embeddings or head it holds (each rank
        a block per chunk at least).  Recompute: a rank holding more blocks than fit its
        memory without recompute saves the excess bytes, spread over its blocks, at the
        least seconds the options allow (the lower convex hull of what each saves per
        micro-batch in flight against what it adds); blocks go where that costs least
        (:func:`~autoplan.search.recompute_lp.recompute_lp`), so the ranks' work adds up
        to at least ``S_z`` plus that.  A bound already at ``threshold`` without recompute
        is returned as it is (the caller prunes it either way).  ``extra_bytes[p]``: more bytes rank
        ``p`` holds whatever its blocks (what refinement reads off a priced layout);
        ``rest_s``: more seconds the ranks' work adds up to per micro-batch.  Plus the
        optimizer's step (:meth:`tail`; ``tail=False``: without it).

        With ``rank_rest_s`` (each rank's seconds beyond its layers', which add up to
        ``rest_s``) the busiest rank is also bounded by the fractional min-max split:
        the least time ``T`` at which the ranks can hold every block, rank ``p`` at most
        the blocks whose time, with the recompute its memory forces on them, stays within
        ``T`` (bisection; what CP-SAT solves in whole numbers).

        ``exact=False`` at ZeRO-2/3: the layers' times of ZeRO-0/1 (no data-parallel
        group to price) and recompute at what it adds there.  Still a bound: a block's
        exposed ZeRO collectives ``e >= 0`` add ``e`` to its time, and recompute hides at
        most ``e`` of them, so every block's time at ``z`` is at least its ZeRO-0/1
        time plus, where recomputed, ZeRO-0/1's addition.  What the search takes first;
        the exact bound only for what that leaves below the best plan.

        ``slope=True``: ``(bound, seconds)``, where the bound of the same layouts with
        more micro-batches a step grows by at least ``seconds`` for each (the busiest
        rank's time per micro-batch in the schedule's time the bound is)."""
        n = self.num_blocks
        block, room_of, states = self._room(pool, n_devices, kinds[0], pp, v, tp, cp, ep, sp,
                                            zero, b, schedule, m, caps)
        if extra_bytes is not None:
            room_of = [(free - extra, flight)
                       for (free, flight), extra in zip(room_of, extra_bytes)]
        if not n:
            if room_of[0][0] < 0:
                return None
            per_mb = self.time_per_micro_batch(kinds, tp, cp, ep, sp, zero, b)
            x = self.step_bound(schedule, pp, v, m, per_mb, n_devices)
            return (x, 0.0 if self.shared_cores(n_devices) else per_mb / pp) if slope else x
        bt = self.block_templates
        least = self.least_memory(zero, schedule)
        low = self.sums(kinds[0], tp, cp, ep, sp, 1, least, b) if least is not None else None
        if low is None:
            return None
        least_saved = [low.saved[t] for t in bt]
        if extra_bytes is not None:
            # refinement's extra bytes are read against :meth:`allocated`'s model, every
            # block at the least template's size: the same model here
            states = (block,) * len(states)
            least_saved = [min(least_saved)] * len(least_saved)
        if not self._hold_blocks(room_of, self._sizes(states, least_saved), v):
            return None                         # (each chunk holds at least one block)
        shared = self.shared_cores(n_devices)
        if shared:
            return (0.0, 0.0) if slope else 0.0
        ranks = stage_ranks(schedule, pp, pp * v)
        first, last = ranks[0], ranks[-1]
        after = self.tail(kinds, tp, cp, ep, zero, n_devices // pp // tp, pp, m) if tail else 0.0
        # the cheap bound first: ZeRO-0/1's layer times (ZeRO-2/3 only add), no recompute
        cheap, cheap_busiest = self._balanced(kinds, tp, cp, ep, sp, 1, b, schedule, pp, v, m,
                                              first, last, rest_s, busiest=True)
        cheap += after
        if cheap >= threshold:
            return (cheap, cheap_busiest) if slope else cheap
        none_bytes = self.sums(kinds[0], tp, cp, ep, sp, 1, Recompute.NONE, b)
        a_none = min(none_bytes.saved[t] for t in bt)
        layers_at = zero if exact else min(zero, 1)
        # what recompute saves per block and micro-batch in flight, and at what time: the
        # lower convex hull of the options' (bytes saved, seconds added)
        points = [(0.0, 0.0)]
        for rc in self.recompute:
            if rc is Recompute.NONE or (schedule is Schedule.ZERO_BUBBLE
                                        and rc is Recompute.SELECTIVE):
                continue
            xb = self.sums(kinds[0], tp, cp, ep, sp, 1, rc, b)
            saved = max(none_bytes.saved[t] - xb.saved[t] for t in bt)
            if saved > 0:
                # the least it adds on any kind of rank: at ZeRO-2/3 a longer backward hides
                # more of the layer's exposed collectives, never more than were exposed, so
                # at least ZeRO-0/1's addition less the exposure without recompute
                extra = math.inf
                for k in kinds:
                    one_none = self.sums(k, tp, cp, ep, sp, 1, Recompute.NONE, b)
                    one_rc = self.sums(k, tp, cp, ep, sp, 1, rc, b)
                    at_none = self.sums(k, tp, cp, ep, sp, layers_at, Recompute.NONE, b)
                    for t in bt:
                        exposed = max(0.0, at_none.time_s[t] - one_none.time_s[t])
                        extra = min(extra, one_rc.time_s[t] - one_none.time_s[t] - exposed)
                points.append((saved, max(0.0, extra)))
        hull = lower_hull(points)

        def cost(free: float, flight: float, k: int) -> float:
            """Least recompute seconds for ``k`` blocks in ``free`` bytes: the bytes over
            spread evenly over them (the hull is convex), inf beyond what it saves (what
            :func:`~autoplan.search.recompute_lp.recompute_lp` allocates, at whole blocks)."""
            over = k * (block + flight * a_none) - free
            if over <= 0:
                return 0.0
            return k * hull_at(hull, over / (k * flight))

        spent = recompute_lp(room_of, block, a_none, hull, n, v)
        if spent is None:
            return None                         # the blocks do not fit, whatever recompute
        # blocks of several sizes: the blocks of at least each size alone, at that size
        # (the smaller ones dropped, free: a rank need not hold any of the larger)
        for size in sorted(set(states))[1:]:
            big = [i for i, x in enumerate(states) if x >= size]
            more = recompute_lp(room_of, size, min(none_bytes.saved[bt[i]] for i in big), hull,
                                sum(self.block_counts[i] for i in big), 0)
            if more is None:
                return None
            spent = max(spent, more)
        at_least = 0.0
        if rank_rest_s is not None and pp > 1:
            sums = [self.sums(k, tp, cp, ep, sp, layers_at, Recompute.NONE, b) for k in kinds]
            if not isinstance(kinds, ByRank):       # every rank at the fastest kind's
                sums = [_Sums({t: min(x.time_s[t] for x in sums) for t, _ in self.layers},
                              {}, {}, {})] * pp
            fixed = [0.0] * pp
            fixed[first] += sum(c * sums[first].time_s[t] for t, c in self.pre)
            fixed[last] += sum(c * sums[last].time_s[t] for t, c in self.post)
            fixed = [f + r for f, r in zip(fixed, rank_rest_s)]
            t_blocks = [min(x.time_s[t] for t in bt) for x in sums]

            def within(p: int, limit: float) -> int:
                """The most blocks rank ``p`` holds within ``limit`` seconds."""
                free, flight = room_of[p]
                lo, hi, t_block = 0, n, t_blocks[p]
                while lo < hi:
                    k = (lo + hi + 1) // 2
                    if fixed[p] + k * t_block + cost(free, flight, k) <= limit:
                        lo = k
                    else:
                        hi = k - 1
                return lo if fixed[p] + lo * t_block + cost(free, flight, lo) <= limit else -1

            def holds(limit: float) -> bool:
                total = 0
                for p in range(pp):
                    k = within(p, limit)
                    if k < v:
                        return False
                    total += k
                return total >= n

            lo = (sum(fixed) + n * min(t_blocks) + spent) / pp
            hi = max(lo, 1e-12) * 2
            for _ in range(64):
                if holds(hi):
                    break
                lo, hi = hi, hi * 2
            else:
                return None
            while hi - lo > 1e-6 * hi:
                mid = (lo + hi) / 2
                if holds(mid):
                    hi = mid
                else:
                    lo = mid
            at_least = lo
        bound, busiest = self._balanced(kinds, tp, cp, ep, sp, layers_at, b, schedule, pp, v,
                                        m, first, last, spent + rest_s, at_least, busiest=True)
        bound += after
        if not slope:
            return max(cheap, bound)
        return (cheap, cheap_busiest) if cheap > bound else (bound, busiest)

    def cheap_bound(self, pool: int, n_devices: int, kinds: tuple[tuple[int, ...], ...],
                    pp: int, v: int, tp: int, cp: int, ep: int, sp: bool, zeros: Sequence[int],
                    b: int, schedule: Schedule, m: int,
                    caps: Sequence[float] | None = None) -> float | None:
        """:meth:`zero_bound` without recompute and at ZeRO-0/1's layer times: a bound of
        every layout at any of ``zeros`` (None when none of them can fit; no ``zeros``:
        the bound alone, memory unchecked)."""
        for z in sorted(zeros, reverse=True):    # the most sharded fits first
            least = self.least_memory(z, schedule)
            if least is not None and self.fits(pool, n_devices, kinds[0], pp, v, tp, cp, ep,
                                               sp, z, least, b, schedule, m, caps):
                break
        else:
            if zeros:
                return None
        if self.shared_cores(n_devices):
            return 0.0
        key = (self._kinds_key(kinds, tp, cp, ep, 1), sp, b, schedule, pp, v, m)
        hit = self._cheap.get(key)
        if hit is None:
            ranks, _ = self._stage_ends(schedule, pp, v)
            hit = self._balanced(kinds, tp, cp, ep, sp, 1, b, schedule, pp, v, m, ranks[0],
                                 ranks[-1], 0.0)
            if len(self._cheap) > 65536:
                self._cheap.clear()
            self._cheap[key] = hit
        return hit

    def _balanced(self, kinds: tuple[tuple[int, ...], ...], tp: int, cp: int, ep: int,
                  sp: bool, zero: int, b: int, schedule: Schedule, pp: int, v: int, m: int,
                  first: int, last: int, recompute_s: float, at_least: float = 0.0,
                  busiest: bool = False) -> Any:
        """The schedule's time for ranks whose work adds up to ``S_z`` plus
        ``recompute_s``, the busiest holding at least its share and the least whole-block
        split's busiest rank (see :meth:`zero_bound`); ``busiest=True``: with that rank's
        time, by which the schedule's time grows with each micro-batch more
        (:func:`autoplan.cost.pipeline_time`: ``m`` times it plus what does not grow)."""
        total = self.time_per_micro_batch(kinds, tp, cp, ep, sp, zero, b) + recompute_s
        if pp == 1:
            return (m * total, total) if busiest else m * total
        top = max(total / pp, at_least, self.busiest(kinds, tp, cp, ep, sp, zero, b, pp, v,
                                                     first == last))
        rest = max(0.0, (total - top) / (pp - 1))
        t = pipeline_time(schedule, [top] + [min(rest, top)] * (pp - 1), m, virtual_stages=v)
        return (t, top) if busiest else t

    def busiest(self, kinds: tuple[tuple[int, ...], ...], tp: int, cp: int, ep: int,
                sp: bool, zero: int, b: int, pp: int, v: int, v_shape: bool) -> float:
        """The least time per micro-batch of the busiest of ``pp`` ranks over whole-block
        splits (at least ``v`` blocks each, no recompute), the embeddings on the first
        rank and the head on the last (``v_shape``: both on the first, as zero-bubble
        schedules place them).  ``kinds``: one per rank (ranks of several speeds: the
        slower hold fewer blocks), or one for every rank."""
        key = (self._kinds_key(kinds, tp, cp, ep, zero), isinstance(kinds, ByRank), sp, b, pp,
               v, v_shape)
        hit = self._busiest.get(key)
        if hit is not None:
            return hit
        sums = [self.sums(k, tp, cp, ep, sp, zero, Recompute.NONE, b) for k in kinds]
        if isinstance(kinds, ByRank):
            per_rank = sums
        else:                      # kinds not by rank: each layer at its fastest
            fast = {t: min(x.time_s[t] for x in sums) for t, _ in self.layers}
            per_rank = [_Sums(fast, {}, {}, {})] * pp
        fixed_t = [0.0] * pp
        fixed_t[0] += sum(c * per_rank[0].time_s[t] for t, c in self.pre)
        last = 0 if v_shape else pp - 1
        fixed_t[last] += sum(c * per_rank[last].time_s[t] for t, c in self.post)
        if isinstance(kinds, ByRank):
            t_block = [min((x.time_s[t] for t in self.block_templates), default=0.0)
                       for x in per_rank]
        else:
            t_block = [min((per_rank[0].time_s[t] for t in self.block_templates),
                           default=0.0)] * pp
        # ranks alike count once, with how many of them there are
        groups: dict[tuple[float, float], int] = {}
        for f, t in zip(fixed_t, t_block):
            groups[(f, t)] = groups.get((f, t), 0) + 1
        n = self.num_blocks
        if min(t_block) <= 0:
            busiest = max(f + v * t for f, t in groups)
        else:
            # the rank speeds' share, then whole blocks: the least T at which the ranks
            # hold every block (each at most floor((T - fixed) / block time))
            busiest = max(max(f + v * t for f, t in groups),
                          (n + sum(c * f / t for (f, t), c in groups.items()))
                          / sum(c / t for (f, t), c in groups.items()))
            for _ in range(n + pp + 1):
                fit = sum(c * max(0, math.floor((busiest - f) / t + 1e-9))
                          for (f, t), c in groups.items())
                if fit >= n:
                    break
                busiest = min(f + (math.floor((busiest - f) / t + 1e-9) + 1) * t
                              for f, t in groups)
        if len(self._busiest) > 65536:
            self._busiest.clear()
        self._busiest[key] = busiest
        return busiest
