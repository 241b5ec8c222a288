"""The best-bound-first walk of one search (:class:`_Search`): the queue of device
subsets, degrees, micro-batches, schedules and ZeRO stages, each with its lower bound, the
memory ladder that prices what the bounds leave, refinement and the bookkeeping of
idle devices.  :func:`autoplan.search.search` sets it up and reads its result; the module
docstring of :mod:`autoplan.search.search` describes the method."""

from __future__ import annotations

import heapq
import math
import time
from typing import Any, Iterable

from ..cost import CostEngine
from ..errors import StrategyError
from ..graph import LayerKind, ModelGraph
from ..plan import expert_counts
from ..strategy import Recompute, Schedule, schedule_problem
from .bounds import Bounds
from .builder import _Builder, _Candidate, _Combo, micro_batch_counts
from .fleet import Pool, idle_text
from .refine import refine, refine_bound
from .space import (WORK_LIMIT, SearchLimit, SearchSpace, _blocks_tp_limit, _divisors,
                    _ladder, _micro_batches, _placed, _schedules)

__all__: list[str] = []

#: Relative margin by which a layout held to the best plan (:meth:`_Search.cutoff`) must be
#: slower to be left out: one as fast ties with it, and ties break on the plan.
_TIE = 1e-9


# ------------------------------------------------------------------ the search
class _Search:
    """State of one best-bound-first search (see the module docstring)."""

    #: Prune by the bounds of the same options at more replicas (:meth:`_dominated`).
    use_dominance = True
    #: Tests: compute the bound of what :meth:`_dominated` prunes, and check it does.
    check_dominance = False
    #: Tests: refine every candidate whose refinement bound is taken (one device type),
    #: and check no refinement that fits is faster than the bound.
    check_refine_bounds = False

    def __init__(self, graph: ModelGraph, cluster, engine: CostEngine, builder: _Builder,
                 space: SearchSpace, global_batch: int, use_all: bool,
                 prices: list[float] | None, bound_s: float, tolerance: float, top_k: int,
                 t0: float, time_limit_s: float | None,
                 work_limit: int | None = WORK_LIMIT, band: Any = None) -> None:
        self.graph, self.cluster, self.engine, self.builder = graph, cluster, engine, builder
        self.space, self.batch, self.use_all = space, global_batch, use_all
        self.pools = builder.pools
        self.bounds = Bounds(engine, builder.precision, space.recompute, builder.pools, cluster)
        self.blocks = sum(1 for l in graph.layers if l.kind is LayerKind.BLOCK)
        self.experts = expert_counts(graph)
        self.bound_s, self.tolerance, self.top_k = bound_s, tolerance, top_k
        # band(tp, cp, dp): whether a layout of those degrees may be wanted within the
        # tolerance though slower than the best (None: every one); see :meth:`cutoff`
        self._band = band if tolerance > 0 and top_k == 1 else None
        self._in_band: dict[tuple, bool] = {}
        self._threshold = self._held = bound_s
        self.t0, self.time_limit_s, self.work_limit = t0, time_limit_s, work_limit
        self.limit: SearchLimit | None = None
        self.steps = 0                         # the work counted against work_limit
        # objective weight per (pool, devices): 1 (time), or the price of a sample per second
        self._cum = None if prices is None else [
            [0.0] + list(_cumulative(prices[d] / 3600 / global_batch for d in p.devices))
            for p in self.pools]
        # devices a prefix of another pool has: counted with the first pool only
        first = self.pools[0].devices
        self._shared_prefix = [0] + [_common_prefix(first, p.devices) for p in self.pools[1:]]
        self.heap: list[tuple] = []
        self._seq = 0
        self.ranked: list[_Candidate] = []
        self._objectives: list[float] = []     # fitting objectives, best first (top_k)
        self.lowest: list[_Candidate] = []
        self.seeds: list[tuple] = []           # (bound, key, layout to refine, zero bound)
        self.least_memory: _Candidate | None = None
        self.evaluated = self.pruned = self.refined = 0
        self.unsplit: set[int] = set()
        self.all_best: _Candidate | None = None
        self.all_floor = math.inf              # bound of the unpriced layouts of all devices
        self._sigma: dict[tuple, list[float]] = {}
        self._zero_lb: dict[int, float] = {}   # id(candidate) -> its ZeRO stage's bound
        self._estimates: dict[int, Any] = {}   # id(candidate) -> its Estimate
        # bounds of the same options at more replicas (:meth:`_dominated`)
        self._dominance = self.use_dominance and prices is None and engine.homogeneous
        self._chains: dict[tuple, list[tuple[int, int, tuple, float, float]]] = {}
        attention = engine.summary.kv_bytes_per_token is not None
        self.tpcp = self._degrees(attention)

    # -------------------------------------------------------------- thresholds
    def weight(self, pool: int, n: int) -> float:
        return 1.0 if self._cum is None else self._cum[pool][n]

    def threshold(self) -> float:
        """Objectives at or above this cannot enter the result."""
        return self._threshold

    def _thresholds(self) -> None:
        """:meth:`threshold`, and what :meth:`cutoff` holds layouts outside the band to,
        for the objectives recorded so far."""
        t = self.bound_s
        if len(self._objectives) >= self.top_k:
            t = min(t, self._objectives[self.top_k - 1] * (1 + self.tolerance))
        self._threshold = t
        self._held = min(t, self._objectives[0] * (1 + _TIE)) \
            if self._band is not None and self._objectives else t

    def cutoff(self, pool: int, tp: int, cp: int, pp: int, dp: int) -> float:
        """:meth:`threshold` for the layouts of these degrees: those the tolerance's band
        cannot want (``band`` False; a replan's layouts that keep none of the old plan's
        shards, which reshard as much as the fastest) enter the result only by being
        faster than the best so far, so they are held to it (ties kept: ``_TIE``).  Not
        the layouts of every device: the plan's idle reason quotes their bound, which
        stays what the search proves today.  With ``top_k=1`` only."""
        if self._band is None or (pool == 0 and tp * cp * pp * dp == self.cluster.num_devices):
            return self._threshold
        key = (tp, cp, dp)
        wanted = self._in_band.get(key)
        if wanted is None:
            wanted = self._in_band[key] = bool(self._band(tp, cp, dp))
        return self._threshold if wanted else self._held

    def cutoff_of(self, c: _Combo) -> float:
        return self.cutoff(c.pool, c.tp, c.cp, c.pp, c.dp)

    def _record(self, cand: _Candidate) -> None:
        self.ranked.append(cand)
        if cand.combo.n == self.cluster.num_devices and cand.combo.pool == 0 and \
                (self.all_best is None or cand < self.all_best):
            self.all_best = cand
        if len(self._objectives) < self.top_k or cand.objective < self._objectives[-1]:
            # one entry per distinct layout: the same combination's rungs count once
            self._objectives.append(cand.objective)
            self._objectives.sort()
            del self._objectives[self.top_k:]
            self._thresholds()

    @property
    def limit_hit(self) -> bool:
        return self.limit is not None

    def _step(self) -> bool:
        """Take a step of work if the budgets allow it; True when they do not (the search
        stops, its best plan so far the result).  The work limit binds alike on every
        machine; the wall clock is read only where a cap was asked for."""
        if self.limit is None:
            if self.work_limit is not None and self.steps >= self.work_limit:
                self.limit = SearchLimit.WORK
            elif self.time_limit_s is not None and \
                    time.perf_counter() - self.t0 > self.time_limit_s:
                self.limit = SearchLimit.TIME
        if self.limit is not None:
            return True
        self.steps += 1
        return False

    def _push(self, lb: float, item: tuple) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (lb, self._seq, item))

    def _floor(self, c_n: int, pool: int, lb_time: float) -> None:
        """Note the bound of a layout of every device that is not priced."""
        if c_n == self.cluster.num_devices and pool == 0:
            self.all_floor = min(self.all_floor, lb_time)

    # -------------------------------------------------------------- degrees
    def _degrees(self, attention: bool) -> list[tuple[int, int]]:
        space, graph = self.space, self.graph
        tp_limit = _blocks_tp_limit(graph)
        # a group of tp inside one node: any degree up to the largest node's devices (the
        # first devices of a node count too; each prefix checks its own domain)
        largest = max(len(n.local_ranks) for n in self.cluster.nodes)
        if self.use_all:
            largest = self.pools[0].domain(self.pools[0].size)
        tps = [tp for tp in _divisors(tp_limit) if tp <= largest and (
            (space.tensor_parallel is None or tp in space.tensor_parallel))]
        seq = graph.seq_len or 0
        top = self.cluster.num_devices
        if not self.blocks:
            attention = False       # context parallelism splits the blocks' attention
        if space.context_parallel is None:
            cps = [1] + ([cp for cp in range(2, top + 1) if seq % (2 * cp) == 0
                          and seq // cp >= space.min_context_tokens]
                         if attention and seq else [])
        else:
            cps = sorted(cp for cp in set(space.context_parallel)
                         if cp == 1 or (attention and seq and seq % (2 * cp) == 0))
        return [(tp, cp) for cp in cps for tp in tps if tp * cp <= top]

    def _eps(self, pool: Pool, n: int, tp: int, cp: int, dp: int) -> list[int]:
        """Expert parallel degrees: dividing ``dp x cp`` and every layer's experts, their
        ``ep x tp`` groups placed alike."""
        if not self.experts:
            return [1]
        space = self.space
        eps = [ep for ep in _divisors(dp * cp)
               if all(e % ep == 0 for e in self.experts)
               and (space.expert_parallel is None or ep in space.expert_parallel)
               and (ep == 1 or _placed(pool, n, ep * tp))]
        return eps or [1]

    def _sps(self, tp: int) -> list[bool]:
        sps = [sp for sp in self.space.sequence_parallel if (sp and tp > 1) or not sp]
        return [True, False] if tp > 1 and True in sps and False in sps else sps

    # -------------------------------------------------------------- level 1: devices
    def _sigma_of(self, pi: int, tp: int, cp: int) -> list[tuple[float, float]]:
        """``sigma[k]``: the least time per sequence, ``S(mb) / mb``, of any micro-batch
        ``mb <= k`` (and sequence or expert parallel option) on any device type of pool
        ``pi`` (a lower bound of a whole model's step work per sequence), and the least of
        one block's."""
        key = (pi, tp, cp)
        hit = self._sigma.get(key)
        if hit is not None:
            return hit
        pool, g = self.pools[pi], tp * cp
        top = self.space.max_micro_batch if self.space.micro_batches is None \
            else max(self.space.micro_batches)
        allowed = range(1, top + 1) if self.space.micro_batches is None \
            else sorted(set(self.space.micro_batches))
        eps = [1]
        if self.experts:
            eps = [ep for ep in _divisors(math.gcd(*self.experts))
                   if self.space.expert_parallel is None or ep in self.space.expert_parallel]
        reps = []
        seen_types = set()
        for i, d in enumerate(pool.devices):
            name = self.cluster.device_type_of(d).name
            if name not in seen_types:
                seen_types.add(name)
                reps.append(i)
        per_mb = [math.inf] * (top + 1)
        per_block = [math.inf] * (top + 1)
        blocks = self.bounds.block_templates
        for start in reps:
            for ep in eps:
                if start + g * ep > pool.size:
                    continue
                rank = self.bounds.rank(pi, start, g * ep)
                for mb in allowed:
                    for sp in self._sps(tp):
                        s = self.bounds.time_per_micro_batch((rank,), tp, cp, ep, sp, 1, mb)
                        per_mb[mb] = min(per_mb[mb], s / mb)
                        x = self.bounds.sums(rank, tp, cp, ep, sp, 1, Recompute.NONE, mb)
                        per_block[mb] = min(per_block[mb],
                                            min((x.time_s[t] for t in blocks), default=0.0) / mb)
        sigma = [(math.inf, math.inf)] * (top + 1)
        low = low_block = math.inf
        for k in range(1, top + 1):
            low, low_block = min(low, per_mb[k]), min(low_block, per_block[k])
            sigma[k] = (low, low_block)
        self._sigma[key] = sigma
        return sigma

    def push_devices(self) -> None:
        """Every (pool, devices, tp, cp, pp, dp) with its coarse bound."""
        space, B = self.space, self.batch
        max_pp = max(self.blocks, 1)
        if space.pipeline_parallel is not None:
            lo_pp, hi_pp = space.pipeline_parallel
        else:
            lo_pp, hi_pp = 1, max_pp
        for pi, pool in enumerate(self.pools):
            N = pool.size
            skip_upto = self._shared_prefix[pi]
            one_type = len({self.cluster.device_type_of(d).name for d in pool.devices}) == 1
            for tp, cp in self.tpcp:
                g = tp * cp
                if g > N:
                    continue
                sigma = None
                for pp in range(max(1, lo_pp), min(hi_pp, max_pp, N // g) + 1):
                    dps = [N // (g * pp)] if self.use_all and N % (g * pp) == 0 else \
                        ([] if self.use_all else range(1, min(B, N // (g * pp)) + 1))
                    for dp in dps:
                        n = g * pp * dp
                        if dp > B or n <= skip_upto or pool.domain(n) % tp \
                                or not _placed(pool, n, g) or not pool.whole_nodes_first(n):
                            continue
                        if sigma is None:
                            sigma = self._sigma_of(pi, tp, cp)
                        per_seq, per_block = sigma[min(B // dp, len(sigma) - 1)]
                        if not math.isfinite(per_seq):
                            continue
                        # the ranks share the work, and one holds ceil(blocks / pp) blocks;
                        # a replica runs at least ceil(B / dp) sequences where all run at
                        # one speed (on mixed pools, replicas' batches follow their speeds:
                        # the mean, B / dp)
                        share = -(-B // dp) if one_type else B / dp
                        lb = 0.0 if self.bounds.shared_cores(n) else \
                            share * max(per_seq / pp, -(-self.blocks // pp) * per_block)
                        self._push(lb * self.weight(pi, n), ("d", pi, tp, cp, pp, dp, lb))

    # -------------------------------------------------------------- level 2: micro-batches
    def expand_devices(self, pi: int, tp: int, cp: int, pp: int, dp: int, lb: float) -> None:
        pool, B = self.pools[pi], self.batch
        n = tp * cp * pp * dp
        w = self.weight(pi, n)
        # (expert parallelism: each degree's ranks, the least bound counts)
        eps = self._eps(pool, n, tp, cp, dp)
        for mb in _micro_batches(self.space, B // dp):
            base = _Combo(tp, cp, pp, dp, mb, Schedule.ONE_F_ONE_B, 1, False, 1, pi)
            splits = self.builder.replica_splits(base, B, even=self.space.even_batches)
            if not splits:
                self.unsplit.add(dp)
                continue
            for split in splits:
                counts = micro_batch_counts(split, mb)
                for sp in self._sps(tp):
                    # every schedule takes at least m times the busiest rank's micro-batch,
                    # and at least the least bound of the schedules it can run
                    lb_m = self._micro_bound(pi, n, tp, cp, pp, eps, sp, mb, counts)
                    limit = self.cutoff(pi, tp, cp, pp, dp)
                    if lb_m * w < limit:
                        lb_m = max(lb_m, self._schedules_bound(pi, tp, cp, pp, dp, mb, sp,
                                                               counts, eps))
                    if lb_m * w >= limit:
                        self.pruned += 1
                        self._floor(n, pi, lb_m)
                        continue
                    self._push(lb_m * w, ("m", pi, tp, cp, pp, dp, mb, sp, split, counts, lb_m))

    def _micro_bound(self, pi: int, n: int, tp: int, cp: int, pp: int, eps: list[int],
                     sp: bool, mb: int, counts: tuple[int, ...]) -> float:
        """Every schedule takes at least ``m`` times its busiest rank's micro-batch: the
        least over the expert parallel degrees of the largest over the replica classes."""
        if self.bounds.shared_cores(n):
            return 0.0
        shapes = (False, True) if pp > 1 and Schedule.ZERO_BUBBLE in self.space.schedules \
            else (False,)
        out = math.inf
        for ep in eps:
            worst = 0.0
            for kinds, m, _ in self.bounds.classes(pi, n, pp, tp, cp, ep, 1, counts):
                if pp == 1:
                    t = self.bounds.time_per_micro_batch(kinds, tp, cp, ep, sp, 1, mb)
                else:
                    t = min(self.bounds.busiest(kinds, tp, cp, ep, sp, 1, mb, pp, 1, v_shape)
                            for v_shape in shapes)
                worst = max(worst, m * t)
            out = min(out, worst)
        return out

    def _schedules_bound(self, pi: int, tp: int, cp: int, pp: int, dp: int, mb: int,
                         sp: bool, counts: tuple[int, ...], eps: list[int]) -> float:
        """The least over the schedules :meth:`expand_micro` prices (and expert parallel
        degrees) of their bound without memory (:meth:`Bounds.cheap_bound`, no ZeRO
        stages): what the bound of each of its combinations is at least (inf: none)."""
        n = tp * cp * pp * dp
        if self.bounds.shared_cores(n):
            return 0.0
        out = math.inf
        for sched, v in _schedules(self.space, pp, max(1, self.batch // (dp * mb)),
                                   self.blocks):
            if any(schedule_problem(sched, pp, v, m) for m in set(counts)) or \
                    not _ladder(self.space, sched)[0]:
                continue
            for ep in eps:
                c = _Combo(tp, cp, pp, dp, mb, sched, v, sp, ep, pi)
                worst = 0.0
                for kinds, m, caps in self._classes(c, 1, counts):
                    worst = max(worst, self.bounds.cheap_bound(pi, n, kinds, pp, v, tp, cp,
                                                               ep, sp, [], mb, sched, m, caps))
                out = min(out, worst)
        return out

    def _classes(self, c: _Combo, zero: int, counts: tuple[int, ...]) -> list:
        return self.bounds.classes(c.pool, c.n, c.pp, c.tp, c.cp, c.ep, zero, counts)

    # -------------------------------------------------------------- level 3: schedules
    def expand_micro(self, pi: int, tp: int, cp: int, pp: int, dp: int, mb: int, sp: bool,
                     split: tuple[int, ...], counts: tuple[int, ...]) -> None:
        pool = self.pools[pi]
        n = tp * cp * pp * dp
        w = self.weight(pi, n)
        # the schedules of the even split's micro-batches (torch's limits checked per
        # replica below)
        for sched, v in _schedules(self.space, pp, max(1, self.batch // (dp * mb)),
                                   self.blocks):
            if any(schedule_problem(sched, pp, v, m) for m in set(counts)):
                continue
            zeros, _ = _ladder(self.space, sched)
            for ep in self._eps(pool, n, tp, cp, dp):
                c = _Combo(tp, cp, pp, dp, mb, sched, v, sp, ep, pi)
                live = [z for z in zeros if not self._dominated(c, counts, z)]
                self.pruned += len(zeros) - len(live)
                if not live:
                    continue
                # (a ZeRO stage fits wherever a lower one does: the stages left keep
                # the bounds they have among all of them)
                bounds = self.cheap_bounds(c, counts, live)
                for z, lb in bounds.items():
                    if lb * w >= self.cutoff_of(c):
                        self.pruned += 1
                        self._floor(n, pi, lb)
                        continue
                    self._push(lb * w, ("s", c, split, counts, z))
                if not bounds:
                    self.pruned += 1

    def cheap_bounds(self, c: _Combo, counts: tuple[int, ...],
                     zeros: list[int]) -> dict[int, float]:
        """:meth:`Bounds.cheap_bound` of each ZeRO stage some layout of ``c`` can fit at,
        plus the optimizer's step (:meth:`Bounds.tail`), the largest over the replica
        classes."""
        out: dict[int, float] = {z: 0.0 for z in zeros}
        bounds = self.bounds
        for kinds, m, caps in self._classes(c, 1, counts):
            # a higher ZeRO stage holds no more: once one fits its least-memory option,
            # every higher one does
            fits_from = None
            for z in sorted(out):
                least = bounds.least_memory(z, c.schedule)
                if least is not None and bounds.fits(c.pool, c.n, kinds[0], c.pp, c.v, c.tp,
                                                     c.cp, c.ep, c.sp, z, least,
                                                     c.micro_batch, c.schedule, m, caps):
                    fits_from = z
                    break
            if fits_from is None:
                return {}
            base = bounds.cheap_bound(c.pool, c.n, kinds, c.pp, c.v, c.tp, c.cp, c.ep, c.sp,
                                      [], c.micro_batch, c.schedule, m, caps)
            for z in list(out):
                if z < fits_from:
                    del out[z]
                    continue
                out[z] = max(out[z], base + bounds.tail(kinds, c.tp, c.cp, c.ep, z,
                                                        c.n // c.pp // c.tp, c.pp, m))
        return out

    def cheap_bound(self, c: _Combo, counts: tuple[int, ...], zero: int) -> float | None:
        """:meth:`cheap_bounds` of one ZeRO stage (None: no layout of ``c`` at it fits)."""
        return self.cheap_bounds(c, counts, [zero]).get(zero)

    def expand_combo(self, c: _Combo, split: tuple[int, ...], counts: tuple[int, ...],
                     zero: int, exact: bool = False, lb_before: float = 0.0) -> None:
        """The bound of ZeRO stage ``zero`` of ``c``; the combination again, at it.

        At ZeRO-2/3 the bound without the data-parallel collectives first
        (:meth:`Bounds.zero_bound`'s ``exact=False``: no terms of the data-parallel
        group to price), the exact one once that is the least bound left."""
        exact = exact or zero < 2
        if self._dominated(c, counts, zero):
            self.pruned += 1
            return
        if not exact or zero < 2:
            lb = self._noted_bound(c, counts, zero)
        else:
            lb = self.zero_bound(c, counts, zero, exact)
        if lb is None:
            self.pruned += 1
            return
        lb = max(lb, lb_before)
        w = self.weight(c.pool, c.n)
        if lb * w >= self.cutoff_of(c):
            self.pruned += 1
            self._floor(c.n, c.pool, lb)
            return
        if not exact:
            if self.heap and lb * w > self.heap[0][0]:
                self._push(lb * w, ("z", c, split, counts, zero, True, lb))
                return
            self.expand_combo(c, split, counts, zero, True, lb)
        elif self.heap and lb * w > self.heap[0][0]:
            self._push(lb * w, ("c", c, split, counts, ((lb, zero),)))
        else:
            self.climb(c, split, counts, ((lb, zero),))

    def zero_bound(self, c: _Combo, counts: tuple[int, ...], zero: int,
                   exact: bool = True, slope: bool = False) -> Any:
        """:meth:`Bounds.zero_bound`, the largest over the replica classes (None: no layout
        of ``c`` at ``zero`` fits); ``slope=True``: with its growth per micro-batch."""
        if self.bounds.least_memory(zero, c.schedule) is None:
            return None
        threshold = self.cutoff_of(c) / self.weight(c.pool, c.n)
        lb, grows = 0.0, 0.0
        for kinds, m, caps in self._classes(c, zero, counts):
            x = self.bounds.zero_bound(c.pool, c.n, kinds, c.pp, c.v, c.tp, c.cp, c.ep, c.sp,
                                       zero, c.micro_batch, c.schedule, m, threshold, caps=caps,
                                       exact=exact, slope=True)
            if x is None:
                return None
            if x[0] > lb:
                lb, grows = x
        return (lb, grows) if slope else lb

    # -------------------------------------------------------------- dominance
    def _chain(self, c: _Combo, zero: int) -> tuple:
        """The options of ``c`` but its data-parallel degree."""
        return (c.pool, c.tp, c.cp, c.pp, c.micro_batch, c.schedule, c.v, c.sp, c.ep, zero)

    def _terms(self, c: _Combo, zero: int) -> tuple:
        """What the layers' terms of ``c``'s ranks depend on at ZeRO-0/1 (the signatures of
        its kinds of rank)."""
        kinds = self.bounds.rank_kinds(c.pool, c.n, c.pp, c.tp, c.cp, c.ep, zero)
        return self.bounds._kinds_key(kinds, c.tp, c.cp, c.ep, 1)

    def _noted_bound(self, c: _Combo, counts: tuple[int, ...], zero: int) -> float | None:
        """:meth:`zero_bound` without the data-parallel collectives (``exact=False``),
        kept for :meth:`_dominated` with how it grows with micro-batches."""
        if not self._dominance:
            return self.zero_bound(c, counts, zero, False)
        lb, slope = self.zero_bound(c, counts, zero, False, slope=True) or (None, 0.0)
        self._chains.setdefault(self._chain(c, zero), []).append(
            (c.dp, max(counts), self._terms(c, zero), math.inf if lb is None else lb, slope))
        return lb

    def _dominated(self, c: _Combo, counts: tuple[int, ...], zero: int) -> bool:
        """Whether the bound of the same options at more replicas proves that no layout of
        ``c`` at ``zero`` enters the result.

        That bound (:meth:`Bounds.zero_bound` with ``exact=False``: the layers' terms of
        ZeRO-0/1, the recompute memory forces, the optimizer's step) falls as replicas are
        added, on a cluster of one device type where the ranks' terms are alike (the same
        signatures) and a replica runs no more micro-batches: the layers' terms are the
        same; each rank holds no more (the optimizer states and gradients sharded over
        more ranks, no more micro-batches in flight or pipeline buffers), so the recompute
        memory forces is no more; the optimizer's step updates no more states; and the
        schedule's time grows with the micro-batches.  None (nothing fits) carries over
        alike.  So a bound at least the threshold with more replicas bounds ``c`` out
        too, without being computed.  Not with prices (more devices cost more a second)."""
        if not self._dominance:
            return False
        entries = self._chains.get(self._chain(c, zero))
        if not entries:
            return False
        threshold, m, terms = self.cutoff_of(c), max(counts), None
        for dp, m_more, terms_more, lb, slope in entries:
            if dp > c.dp and m_more <= m and lb + (m - m_more) * slope >= threshold:
                if terms is None:
                    terms = self._terms(c, zero)
                if terms_more == terms:
                    if self.check_dominance:
                        own = self.zero_bound(c, counts, zero, False)
                        assert own is None or own >= threshold, (c, zero, own, threshold, lb)
                    return True
        return False

    def zero_bounds(self, c: _Combo, counts: tuple[int, ...]) -> list[tuple[float, int]]:
        """``(bound, zero)`` of every ZeRO stage some layout of ``c`` can fit at, least
        bound first (:meth:`zero_bound`)."""
        zeros, _ = _ladder(self.space, c.schedule)
        out = [(lb, z) for z in zeros if (lb := self.zero_bound(c, counts, z)) is not None]
        return sorted(out)

    # -------------------------------------------------------------- level 4: the ladder
    def climb(self, c: _Combo, split: tuple[int, ...], counts: tuple[int, ...],
              zero_bounds: tuple[tuple[float, int], ...]) -> None:
        """Price ``c`` at each ZeRO stage whose bound is below the threshold, recompute
        climbing until a layout fits (more recompute only adds time).  A stage whose
        uniform options are all bounded out, or none of which fits, still leaves its
        least-memory layout as a seed for refinement (mixed recompute may fit and win)."""
        builder, engine, bounds = self.builder, self.engine, self.bounds
        w = self.weight(c.pool, c.n)
        _, rcs = _ladder(self.space, c.schedule)
        for lb, z in zero_bounds:
            if lb * w >= self.cutoff_of(c):
                self.pruned += 1
                self._floor(c.n, c.pool, lb)
                continue
            classes = self._classes(c, z, counts)
            seed: Recompute | None = None
            for rc in rcs:
                if not all(bounds.fits(c.pool, c.n, kinds[0], c.pp, c.v, c.tp, c.cp, c.ep,
                                       c.sp, z, rc, c.micro_batch, c.schedule, m, caps)
                           for kinds, m, caps in classes):
                    continue
                seed = rc
                uniform = max(bounds.step_bound(c.schedule, c.pp, c.v, m, sum(
                    count * min(bounds.sums(k, c.tp, c.cp, c.ep, c.sp, z, rc,
                                            c.micro_batch).time_s[t] for k in kinds)
                    for t, count in bounds.layers), c.n) for kinds, m, _ in classes)
                if max(lb, uniform) * w >= self.cutoff_of(c):
                    self.pruned += 1
                    break                # this and more recompute: bounded out
                if self._step():
                    return               # the budget is spent: the search stops
                try:
                    lay = builder.layout(c, z, rc, counts, self.batch)
                    q = engine.estimate(lay, ledger=False)   # (its records: refinement's bound reads them)
                except StrategyError:
                    seed = None
                    break
                self.evaluated += 1
                cand = _Candidate(q.step_time_s * w, q.step_time_s, q.peak_memory_bytes,
                                  c.key() + (z, rc.value, split), c, z, rc, lay, split, q.fits)
                if self.least_memory is None or q.peak_memory_bytes < self.least_memory.peak_bytes:
                    self.least_memory = cand
                if q.fits:
                    self._zero_lb[id(cand)] = lb
                    self._estimates[id(cand)] = q
                    self._record(cand)
                    seed = None
                    break
                if c.v == 1:
                    self.lowest.append(cand)
                    if len(self.lowest) > 64:
                        self.lowest.sort(key=lambda x: (x.peak_bytes, x.key))
                        del self.lowest[32:]
                if cand.objective >= self.cutoff_of(c):
                    break
            else:
                # every uniform option priced and none fits: the last (least memory) seeds
                pass
            if seed is not None and c.v == 1 and self.builder.blocks:
                for later in rcs[rcs.index(seed) + 1:]:
                    if all(bounds.fits(c.pool, c.n, kinds[0], c.pp, c.v, c.tp, c.cp, c.ep,
                                       c.sp, z, later, c.micro_batch, c.schedule, m, caps)
                           for kinds, m, caps in classes):
                        seed = later
                lay = builder.layout(c, z, seed, counts, self.batch)
                self.seeds.append((lb * w, c.key() + (z, seed.value, split, "seed"),
                                   _Candidate(math.inf, math.inf, math.inf,
                                              c.key() + (z, seed.value, split), c, z, seed,
                                              lay, split, False), lb))

    # -------------------------------------------------------------- the loop
    def run(self) -> None:
        self.push_devices()
        while self.heap:
            lb, _, item = self.heap[0]
            if lb >= self.threshold():
                break
            if self._band is not None and lb >= (self.cutoff(*item[1:6]) if item[0] in "dm"
                                                 else self.cutoff_of(item[1])):
                heapq.heappop(self.heap)       # held to the best, and not faster
                self.pruned += 1
                continue
            if self._step():
                break
            heapq.heappop(self.heap)
            kind = item[0]
            if kind == "d":
                self.expand_devices(*item[1:6], item[6])
            elif kind == "m":
                self.expand_micro(*item[1:10])
            elif kind in "sz":
                self.expand_combo(*item[1:])
            else:
                self.climb(*item[1:])
        for lb, _, item in self.heap:          # what was never reached
            if item[0] in "csz":
                self._floor(item[1].n, item[1].pool, lb / self.weight(item[1].pool, item[1].n))
            else:
                pi, tp, cp, pp, dp = item[1:6]
                self._floor(tp * cp * pp * dp, pi, item[-1])

    def refine_all(self) -> None:
        """Refine every candidate, and every seed (a least-memory layout of a ZeRO
        stage none of whose uniform options fit or is bounded in), whose refinement bound
        is below the threshold, least bound first."""
        space, engine, bounds = self.space, self.engine, self.bounds
        queue, seen = [], set()
        for cand in sorted(self.ranked):
            c = cand.combo
            if c.v != 1 or not self.builder.blocks or (c.key(), cand.zero) in seen:
                continue
            if c.pp == 1 and cand.recompute is Recompute.NONE:
                continue        # one stage, nothing recomputed: nothing to refine
            seen.add((c.key(), cand.zero))
            queue.append((self._zero_lb.get(id(cand), 0.0) * self.weight(c.pool, c.n),
                          cand.key, cand))
        for coarse, key, cand, _ in self.seeds:
            if (cand.combo.key(), cand.zero) not in seen:
                seen.add((cand.combo.key(), cand.zero))
                queue.append((coarse, key, cand))
        queue.sort(key=lambda x: (x[0], x[1]))
        homogeneous = engine.homogeneous
        for coarse, _, cand in queue:
            if coarse >= self.threshold():
                break
            if space.refine is not None and self.refined >= space.refine:
                break
            c = cand.combo
            if coarse >= self.cutoff_of(c):
                continue
            w = self.weight(c.pool, c.n)
            est = self._estimates.get(id(cand))
            if homogeneous:
                kinds = bounds.rank_kinds(c.pool, c.n, c.pp, c.tp, c.cp, c.ep, cand.zero)
                tight = refine_bound(cand, engine, bounds, kinds, True, estimate=est)
                if self.check_refine_bounds:
                    found = refine(cand, self.builder, self.batch, w)
                    assert found is None or not found.fits \
                        or found.step_time_s >= tight * (1 - 1e-9), \
                        (c.key(), cand.zero, tight, found.step_time_s)
            else:
                tight = max(refine_bound(cand, engine, bounds, kinds, False, m, caps,
                                         estimate=est)
                            for kinds, m, caps in self._classes(
                                c, cand.zero, cand.layout.replica_micro_batches))
            if tight * w >= self.cutoff_of(c):
                continue
            if self._step():
                break
            better = refine(cand, self.builder, self.batch, w)
            self.refined += 1
            if better is not None and better.step_time_s < cand.step_time_s * (1 - 1e-9):
                self._record(better)

    def rescue(self) -> None:
        """Nothing fits evenly: let CP-SAT rebalance the least-memory candidates (e.g. fewer
        layers on the stage of smaller GPUs), and price the combinations the memory bound
        ruled out, for the message."""
        for cand in sorted(self.lowest, key=lambda x: (x.peak_bytes, x.key))[:16]:
            better = refine(cand, self.builder, self.batch, self.weight(cand.combo.pool,
                                                                          cand.combo.n))
            self.refined += 1
            if better is not None:
                self._record(better)
        if self.ranked:
            return
        # for the message: the least memory of any layout of every device (each degree
        # combination at its least-memory option, one-sequence micro-batches)
        for c in self._least_memory_combos():
            zeros, rcs = _ladder(self.space, c.schedule)
            if not zeros or not rcs:
                continue
            split = self.builder.replica_batches(c, self.batch, self.space.even_batches)
            if split is None:
                continue
            counts = micro_batch_counts(split, c.micro_batch)
            if any(schedule_problem(c.schedule, c.pp, c.v, m) for m in set(counts)):
                continue
            try:
                lay = self.builder.layout(c, zeros[-1], rcs[-1], counts, self.batch)
                q = self.engine.quick(lay)
            except StrategyError:
                continue
            self.evaluated += 1
            cand = _Candidate(q.step_time_s, q.step_time_s, q.peak_memory_bytes,
                              c.key() + (zeros[-1], rcs[-1].value, split), c, zeros[-1],
                              rcs[-1], lay, split, q.fits)
            if self.least_memory is None or q.peak_memory_bytes < self.least_memory.peak_bytes:
                self.least_memory = cand

    def _least_memory_combos(self) -> Iterable[_Combo]:
        """Every degree combination of all of the first pool's devices with one-sequence
        micro-batches, sequence parallelism where tp > 1, 1F1B (GPipe where 1F1B cannot
        run) and each expert parallel degree."""
        pool = self.pools[0]
        N = pool.size
        lo_pp, hi_pp = self.space.pipeline_parallel or (1, max(self.blocks, 1))
        for tp, cp in self.tpcp:
            g = tp * cp
            for pp in range(max(lo_pp, 1), min(hi_pp, max(self.blocks, 1)) + 1):
                if N % (g * pp) or pool.domain(N) % tp or not _placed(pool, N, g):
                    continue
                dp = N // (g * pp)
                if dp > self.batch:
                    continue
                m = self.batch // dp
                sched = Schedule.ONE_F_ONE_B if pp == 1 or m >= pp else Schedule.GPIPE
                for ep in self._eps(pool, N, tp, cp, dp):
                    yield _Combo(tp, cp, pp, dp, 1, sched, 1, self._sps(tp)[0], ep, 0)

    def idle_reason(self, cand: _Candidate, label: str) -> str:
        """Why ``cand`` leaves devices idle (empty when it uses them all)."""
        n = self.cluster.num_devices
        if cand.combo.n == n and cand.combo.pool == 0:
            return ""
        all_best = None
        if self.all_best is not None and self.all_best.step_time_s <= self.all_floor:
            best = self.builder.plan(self.all_best.layout, self.batch, self.all_best.replica_batch)
            all_best = (self.all_best.step_time_s, best.label(compact=True))
        floor = self.all_floor
        if self.all_best is not None:
            floor = min(floor, self.all_best.step_time_s)
        return idle_text(self.cluster, self.builder.devices(cand.combo), cand.step_time_s,
                         label, all_best, floor, "time" if self._cum is None else "price")


def _cumulative(values: Iterable[float]) -> Iterable[float]:
    total = 0.0
    for v in values:
        total += v
        yield total


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k
