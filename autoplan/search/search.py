"""``autoplan.plan``: the fastest layout that fits, found in seconds.

Method
------
1. **Devices.** A layout runs on the first ``n`` devices of a pool
   (:mod:`autoplan.search.fleet`): every device of the cluster in cluster order, whole
   nodes first, and on clusters of several device types the devices of each proper
   subset of the types, so leaving a slow group idle is one of the priced options.
   ``use_all_devices=True`` keeps every device.
2. **Degrees.** ``tp`` divides the devices of a node and the model's heads (tensor
   parallelism stays inside a node); ``cp`` wherever the sequence splits into the ``2 cp``
   load-balanced chunks the runtime uses, any degree, its ``tp x cp`` group inside one
   NVLink domain or over whole nodes; ``pp`` at most the number of blocks; ``dp`` at most
   the global batch, whose sequences split over the replicas in proportion to their
   speed (without pipelining, one replica may end on a shorter micro-batch); then
   micro-batch sizes, schedules, sequence and expert parallelism.  "Inside a node" means
   inside one NVLink domain with no group straddling two
   (:meth:`Pool.domain <autoplan.search.fleet.Pool.domain>`): on GB200 NVL72 racks groups
   of 12, 24, 36 or 72 GPUs, and of 16, 32 or 64 on racks of which 64 GPUs are used; an
   expert-parallel group (``ep x tp`` consecutive devices) fits one domain or spans whole
   nodes.  Ranks are laid out ``tp`` innermost and ``pp`` outermost over the devices, so
   pipelines cut between nodes, groups and sites before data parallelism does.
3. **Best bound first.** Every combination has a lower bound of the step time of each of
   its layouts, whatever the ZeRO stage, recompute or block split
   (:mod:`autoplan.search.bounds`); combinations are visited in order of their bound
   (coarse for the devices and degrees, then per micro-batch, then per schedule), and the
   search stops where the bound reaches the best plan found.  So no layout it skips is
   faster than the one it returns (with ``top_k``, than the k-th).
4. **Memory ladder.** For each ZeRO stage whose bound is below the best plan and whose
   least-memory option can fit, recompute climbs none, selective, full until a layout
   fits (recompute only adds time); every ZeRO stage is priced, since sharding can be
   faster (a sharded optimizer step, sharded gradient accumulation).
5. **Per-stage problem (CP-SAT).** For every fitting candidate whose refinement bound
   (:func:`~autoplan.search.refine.refine_bound`) is below the best plan, OR-Tools CP-SAT
   chooses how many blocks each pipeline rank holds and which recompute option each uses
   (:mod:`autoplan.search.stage_solver`).
6. **One engine.** Every candidate is priced by the cost model
   (:class:`autoplan.cost.CostEngine`), so the search and :func:`autoplan.estimate`
   never disagree.

The objective is the step time, or with ``price_per_gpu_hour`` the price of a sample
(the devices used, for the step's time, over the global batch).  The same inputs give a
byte-identical plan: iteration orders are fixed, ties break on a stable key, and CP-SAT
runs single-threaded with a fixed seed and a deterministic time budget.  The search's
budget is counted in steps, not seconds (``work_limit``, default :data:`WORK_LIMIT`):
should it bind, the best plan so far is returned, the same on a busy machine as on an
idle one.  A wall-clock cap (``time_limit_s``) is there only when asked for; a plan it
cuts short depends on the machine's load.  ``plan.search_stats.limit`` says which limit
bound, if any.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import heapq
import math
import numbers
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from ..cost import CostEngine, CostOptions
from ..errors import ConfigError, InfeasiblePlan, StrategyError
from ..graph import LayerKind, ModelGraph
from ..hardware.cluster import as_cluster
from ..plan import ModelFingerprint, Plan, expert_counts
from ..strategy import Precision, Recompute, Schedule, schedule_problem
from .bounds import Bounds
from .builder import _Builder, _Candidate, _Combo, micro_batch_counts
from .fleet import Pool, idle_text, pools
from .refine import refine, refine_bound

__all__ = ["plan", "search", "SearchResult", "SearchSpace", "SearchLimit", "WORK_LIMIT"]

#: The search's default budget, in steps: an entry of its queue expanded (the bounds of a
#: combination's children), a layout priced, or a candidate refined with CP-SAT.  Steps,
#: not seconds, so that the same inputs give the same plan however loaded the machine is.
#: The largest search benchmarked takes about 104,000 steps (DeepSeek-V3 on 1,024 H100s,
#: ``benchmarks/search_speed.py``; a 1T-parameter GPT on 3,072 A100s 65,000, GPT-3 175B on
#: 122 A100 nodes 27,000): the limit leaves it five times that, and stops a search of a far
#: larger space after a few minutes of CPU (2,500-3,500 steps a CPU second on those
#: searches) with its best plan so far.
WORK_LIMIT = 500_000


class SearchLimit(enum.Enum):
    """Which budget stopped a search before its bounds did (``SearchResult.limit``)."""

    WORK = "work"        # ``work_limit`` steps (deterministic)
    TIME = "time"        # ``time_limit_s`` of wall clock (asked for; depends on the load)


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose from (defaults: everything the cost model prices, all of
    which :func:`autoplan.parallelize` runs).

    ``context_parallel`` degrees (None: every degree that leaves each rank at least
    ``min_context_tokens`` of a sequence) are tried wherever the sequence splits into
    ``2 cp`` chunks (the load-balanced split the runtime uses); whether they pay is the
    cost model's call (memory of long sequences against the key/value all-gather).  ``even_batches`` keeps every replica's batch equal (no speed-proportional
    split, no shorter micro-batch).  ``expert_parallel`` degrees are tried for models with
    expert banks, where they divide ``dp x cp`` and every layer's experts and their groups
    (``ep x tp`` consecutive devices) fit one NVLink domain or span whole nodes; for those
    models the search also leaves out sequence parallelism and selective recompute, which
    the runtime does not run on MoE blocks.  ``refine``: at most this many candidates are
    refined with CP-SAT (None: every one whose bound is below the best plan)."""

    schedules: tuple[Schedule, ...] = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED,
                                       Schedule.ZERO_BUBBLE, Schedule.GPIPE)
    virtual_stages: tuple[int, ...] = (2, 4)
    micro_batches: tuple[int, ...] | None = None   # None: every divisor of the replica batch
    max_micro_batch: int = 64
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    sequence_parallel: tuple[bool, ...] = (True, False)
    context_parallel: tuple[int, ...] | None = None   # None: every degree the sequence allows
    min_context_tokens: int = 256  # (context_parallel=None) tokens of a sequence per cp rank
    refine: int | None = None      # candidates refined with CP-SAT (None: as the bound says)
    tensor_parallel: tuple[int, ...] | None = None    # None: every degree that fits a node
    expert_parallel: tuple[int, ...] | None = None    # None: every degree dividing the experts
    pipeline_parallel: tuple[int, int] | None = None  # (min, max) pp; None: any
    even_batches: bool = False     # True: every replica gets the same batch (no speed split)


@dataclass
class SearchResult:
    """The ranked plans of one search and what it cost to find them.

    ``evaluated``: layouts priced; ``pruned``: combinations (or ZeRO stages of them) whose
    bound, or whose least-memory option, ruled them out without pricing; ``refined``:
    candidates given to CP-SAT; ``steps``: the work counted against ``work_limit``
    (:data:`WORK_LIMIT`); ``limit``: the budget that stopped the search before its
    bounds did (None: none did, the plan is the best the search space holds)."""

    plans: list[Plan]
    evaluated: int
    pruned: int
    refined: int
    seconds: float
    limit: SearchLimit | None = None
    steps: int = 0
    #: With a tolerance: every distinct plan within it of the best, best first (what
    #: :func:`autoplan.replan` chooses among); else empty.
    alternatives: list = field(default_factory=list)

    @property
    def best(self) -> Plan:
        return self.plans[0]

    @property
    def time_limit_hit(self) -> bool:
        """Whether the wall-clock cap (``time_limit_s``) stopped the search."""
        return self.limit is SearchLimit.TIME

    @property
    def work_limit_hit(self) -> bool:
        """Whether the work budget (``work_limit``) stopped the search."""
        return self.limit is SearchLimit.WORK

    def __repr__(self) -> str:
        return (f"<SearchResult {len(self.plans)} plans, {self.evaluated} evaluated, "
                f"{self.pruned} pruned, {self.refined} refined, {self.steps} steps, "
                f"{self.seconds:.1f} s"
                + (f", {self.limit.value} limit hit>" if self.limit is not None else ">"))


def _check_limits(time_limit_s: Any, work_limit: Any) -> None:
    """``time_limit_s``: None or positive seconds; ``work_limit``: None or a positive
    number of steps (ConfigError, one line, otherwise)."""
    if time_limit_s is not None and (isinstance(time_limit_s, bool)
                                     or not isinstance(time_limit_s, numbers.Real)
                                     or not time_limit_s > 0):
        raise ConfigError(f"time_limit_s must be positive seconds or None (no wall-clock "
                          f"cap, the default), got {time_limit_s!r}")
    if work_limit is not None and (isinstance(work_limit, bool)
                                   or not isinstance(work_limit, numbers.Integral)
                                   or work_limit < 1):
        raise ConfigError(f"work_limit must be a positive whole number of search steps or "
                          f"None (no limit), got {work_limit!r} (default {WORK_LIMIT})")


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


def _placed(pool: Pool, n: int, span: int) -> bool:
    """Whether groups of ``span`` consecutive devices of the first ``n`` of ``pool`` sit
    alike: each inside one NVLink domain, or each over whole nodes of one size.

    >>> from autoplan.hardware import load_cluster
    >>> from autoplan.search.fleet import pools
    >>> racks = pools(load_cluster("gb200-nvl72", nodes=2))[0]
    >>> [_placed(racks, 144, g) for g in (8, 16, 72, 144)]
    [True, False, True, True]
    """
    if pool.domain(n) % span == 0:
        return True
    whole = pool.whole_node(n)
    return whole is not None and span % whole == 0 and n % span == 0


def _micro_batches(space: SearchSpace, per_replica: int) -> list[int]:
    """Micro-batch sizes tried for replicas of about ``per_replica`` sequences: every
    divisor (what an expert would try), and powers of two for batches that split
    unevenly."""
    if space.micro_batches is not None:
        return sorted({mb for mb in space.micro_batches if 1 <= mb <= per_replica})
    top = min(per_replica, space.max_micro_batch)
    return sorted({d for d in _divisors(per_replica) if d <= space.max_micro_batch}
                  | {2 ** i for i in range(7) if 2 ** i <= top})


def _schedules(space: SearchSpace, pp: int, m: int, blocks: int) -> list[tuple[Schedule, int]]:
    """Pipeline schedules and chunks per rank worth pricing with ``m`` micro-batches.

    GPipe only where 1F1B cannot run (fewer micro-batches than stages): the cost model
    times them alike ((m - 1) x the slowest rank + every rank once) and GPipe holds every
    micro-batch in flight where 1F1B holds at most pp, so GPipe is never the faster
    layout that fits."""
    if pp == 1:
        return [(Schedule.ONE_F_ONE_B, 1)]
    one_f_one_b = Schedule.ONE_F_ONE_B in space.schedules and m >= pp
    out: list[tuple[Schedule, int]] = []
    for s in space.schedules:
        if s is Schedule.GPIPE and one_f_one_b:
            continue
        if s is Schedule.INTERLEAVED:
            out += [(s, v) for v in space.virtual_stages
                    if blocks >= pp * v and m >= pp and m % pp == 0]
        elif s is Schedule.ZERO_BUBBLE:
            if blocks >= 2 * pp and m >= 2 * pp:
                out.append((s, 2))
        elif s is Schedule.ONE_F_ONE_B:
            if m >= pp:
                out.append((s, 1))
        else:
            out.append((s, 1))
    return out


def _ladder(space: SearchSpace, schedule: Schedule) -> tuple[list[int], list[Recompute]]:
    """ZeRO stages and recompute options (least time first) a schedule may use: torch
    runs neither ZeRO-3 nor selective recompute under zero-bubble schedules
    (strategy.ZBV_ZERO3, ZBV_SELECTIVE)."""
    zbv = schedule is Schedule.ZERO_BUBBLE
    rcs = [r for r in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
           if r in space.recompute and not (zbv and r is Recompute.SELECTIVE)]
    return [z for z in sorted(set(space.zero)) if not (zbv and z == 3)], rcs


def _prices(cluster, price_per_gpu_hour: Any) -> list[float] | None:
    """Price per hour of each device (None: no price, the objective is the step time)."""
    if price_per_gpu_hour is None:
        return None
    from ..report.whatif import _prices as per_device
    prices = per_device(cluster, price_per_gpu_hour)
    if any(p < 0 or not math.isfinite(p) for p in prices):
        raise ConfigError("price_per_gpu_hour must be finite and >= 0")
    return prices


# ------------------------------------------------------------------ the search
class _Search:
    """State of one best-bound-first search (see the module docstring)."""

    def __init__(self, graph: ModelGraph, cluster, engine: CostEngine, builder: _Builder,
                 space: SearchSpace, global_batch: int, use_all: bool,
                 prices: list[float] | None, bound_s: float, tolerance: float, top_k: int,
                 t0: float, time_limit_s: float | None,
                 work_limit: int | None = WORK_LIMIT) -> None:
        self.graph, self.cluster, self.engine, self.builder = graph, cluster, engine, builder
        self.space, self.batch, self.use_all = space, global_batch, use_all
        self.pools = builder.pools
        self.bounds = Bounds(engine, builder.precision, space.recompute, builder.pools)
        self.blocks = sum(1 for l in graph.layers if l.kind is LayerKind.BLOCK)
        self.experts = expert_counts(graph)
        self.bound_s, self.tolerance, self.top_k = bound_s, tolerance, top_k
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
        attention = engine.summary.kv_bytes_per_token is not None
        self.tpcp = self._degrees(attention)

    # -------------------------------------------------------------- thresholds
    def weight(self, pool: int, n: int) -> float:
        return 1.0 if self._cum is None else self._cum[pool][n]

    def threshold(self) -> float:
        """Objectives at or above this cannot enter the result."""
        t = self.bound_s
        if len(self._objectives) >= self.top_k:
            t = min(t, self._objectives[self.top_k - 1] * (1 + self.tolerance))
        return t

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
                        # the ranks share the work, and one holds ceil(blocks / pp) blocks
                        lb = 0.0 if self.bounds.shared_cores(n) else \
                            B / dp * max(per_seq / pp, -(-self.blocks // pp) * per_block)
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
                    # every schedule takes at least m times the busiest rank's micro-batch
                    lb_m = self._micro_bound(pi, n, tp, cp, pp, eps, sp, mb, counts)
                    if lb_m * w >= self.threshold():
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
                bounds = self.cheap_bounds(c, counts, zeros)
                for z, lb in bounds.items():
                    if lb * w >= self.threshold():
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
        lb = self.zero_bound(c, counts, zero, exact)
        if lb is None:
            self.pruned += 1
            return
        lb = max(lb, lb_before)
        w = self.weight(c.pool, c.n)
        if lb * w >= self.threshold():
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
                   exact: bool = True) -> float | None:
        """:meth:`Bounds.zero_bound`, the largest over the replica classes (None: no layout
        of ``c`` at ``zero`` fits)."""
        if self.bounds.least_memory(zero, c.schedule) is None:
            return None
        threshold = self.threshold() / self.weight(c.pool, c.n)
        lb = 0.0
        for kinds, m, caps in self._classes(c, zero, counts):
            x = self.bounds.zero_bound(c.pool, c.n, kinds, c.pp, c.v, c.tp, c.cp, c.ep, c.sp,
                                       zero, c.micro_batch, c.schedule, m, threshold, caps=caps,
                                       exact=exact)
            if x is None:
                return None
            lb = max(lb, x)
        return lb

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
            if lb * w >= self.threshold():
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
                if max(lb, uniform) * w >= self.threshold():
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
                if cand.objective >= self.threshold():
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
        """CP-SAT on every candidate, and every seed (a least-memory layout of a ZeRO
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
            w = self.weight(c.pool, c.n)
            est = self._estimates.get(id(cand))
            if homogeneous:
                kinds = bounds.rank_kinds(c.pool, c.n, c.pp, c.tp, c.cp, c.ep, cand.zero)
                tight = refine_bound(cand, engine, bounds, kinds, True, estimate=est)
            else:
                tight = max(refine_bound(cand, engine, bounds, kinds, False, m, caps,
                                         estimate=est)
                            for kinds, m, caps in self._classes(
                                c, cand.zero, cand.layout.replica_micro_batches))
            if tight * w >= self.threshold():
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


# ------------------------------------------------------------------ search
@contextlib.contextmanager
def _cyclic_gc_paused():
    """Python's cyclic garbage collector paused for a search (resumed as it was after).

    A search fills its caches and heap with hundreds of thousands of small containers and
    frees few of them; each of the collector's full passes walks them all, and finds
    next to nothing: a DeepSeek-V3 search on 1,024 H100s spent a quarter of its CPU time
    there and left 5,500 objects in cycles (0.8 GB peak either way).  Reference counting
    frees everything else as before; the plans are the same."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_cyclic_gc_paused()
def search(graph: ModelGraph, cluster, *, global_batch: int, memory_fraction: float = 0.9,
           time_limit_s: float | None = None, top_k: int = 1, precision: Precision | str = Precision.BF16,
           options: CostOptions | None = None, space: SearchSpace | None = None,
           bound_s: float = math.inf, use_all_devices: bool = False,
           price_per_gpu_hour: float | Mapping[str, float] | None = None,
           tolerance: float = 0.0, work_limit: int | None = WORK_LIMIT) -> SearchResult:
    """Search the layouts of ``graph`` on ``cluster``; see :func:`plan`.

    ``bound_s``: the step time of a plan already known to fit (a warm start); layouts
    whose bound is at least this are not priced.  ``tolerance``: also price every layout
    within this fraction of the best and keep the distinct plans among them
    (``SearchResult.alternatives``; what :func:`autoplan.replan` chooses among).
    """
    t0 = time.perf_counter()
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be a positive integer (sequences per step), "
                          f"got {global_batch!r}")
    if cluster.num_devices < 1:
        raise ConfigError("the cluster has no devices")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {top_k!r}")
    if not 0 <= tolerance < 1:
        raise ConfigError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}")
    _check_limits(time_limit_s, work_limit)
    precision = Precision(precision)
    space = space or SearchSpace()
    if expert_counts(graph):
        # what autoplan.parallelize runs on MoE blocks: no sequence parallelism (their
        # experts stay whole on every tp rank), no selective recompute (a Hugging Face MoE
        # block's operators differ from the captured ones); see docs/limitations.md
        space = replace(space, sequence_parallel=(False,),
                        recompute=tuple(r for r in space.recompute if r is not Recompute.SELECTIVE))
    options = replace(options or CostOptions(), memory_fraction=memory_fraction)
    engine = CostEngine(graph, cluster, options=options)
    prices = _prices(cluster, price_per_gpu_hour)
    builder = _Builder(graph, engine, cluster, precision,
                       pools(cluster, use_all_devices=use_all_devices))
    builder.recompute = tuple(space.recompute)
    s = _Search(graph, cluster, engine, builder, space, global_batch, use_all_devices, prices,
                bound_s, tolerance, top_k, t0, time_limit_s, work_limit)
    if not s.tpcp:
        raise _no_layout(graph, cluster, global_batch, space)
    s.run()
    s.refine_all()
    if not s.ranked:
        s.rescue()
    if not s.ranked:
        if s.least_memory is not None and not s.least_memory.fits:
            raise _infeasible(engine, s.least_memory, graph, cluster)
        if s.limit is SearchLimit.TIME:
            raise InfeasiblePlan(f"the search's time limit ({time_limit_s:g} s) ran out before "
                                 "it priced a layout that fits: give it more time "
                                 "(time_limit_s, or --time-limit)")
        if s.limit is SearchLimit.WORK:
            raise InfeasiblePlan(f"the search's work limit ({work_limit} steps) ran out before "
                                 "it priced a layout that fits: give it more steps "
                                 "(work_limit, or --work-limit)")
        if bound_s < math.inf:
            raise InfeasiblePlan(f"no layout is faster than the bound given ({bound_s:.4g} s)")
        if s.unsplit:
            raise _unsplit(cluster, global_batch, s.unsplit)
        raise _no_layout(graph, cluster, global_batch, space)

    s.ranked.sort()
    plans: list[Plan] = []
    descriptions: set[str] = set()
    for cand in s.ranked:
        if len(plans) >= top_k:
            break
        p = builder.plan(cand.layout, global_batch, cand.replica_batch)
        desc = p.describe()
        if desc in descriptions:
            continue
        descriptions.add(desc)
        p = replace(p, idle_reason=s.idle_reason(cand, p.label(compact=True)))
        plans.append(p.with_estimate(engine.estimate(p)))
    alternatives: list[Plan] = []
    if tolerance > 0:
        seen: set[str] = set()
        for cand in s.ranked:
            if cand.objective > s.ranked[0].objective * (1 + tolerance) or \
                    len(alternatives) >= MAX_ALTERNATIVES:
                break
            p = builder.plan(cand.layout, global_batch, cand.replica_batch)
            if p.describe() in seen:
                continue
            seen.add(p.describe())
            p = replace(p, idle_reason=s.idle_reason(cand, p.label(compact=True)))
            alternatives.append(p.with_estimate(engine.estimate(p)))
    return SearchResult(plans, s.evaluated, s.pruned, s.refined, time.perf_counter() - t0,
                        s.limit, s.steps, alternatives)


#: At most this many plans within the tolerance are kept (best first).
MAX_ALTERNATIVES = 32


def _unsplit(cluster, global_batch: int, unsplit: set[int]) -> ConfigError:
    return ConfigError(
        f"global_batch={global_batch} does not split into equal replica batches for any "
        f"data-parallel degree the {cluster.num_devices} devices allow "
        f"({sorted(unsplit)[:12]}): choose a global batch that is a multiple of one of them")


def _no_layout(graph: ModelGraph, cluster, global_batch: int, space: SearchSpace) -> ConfigError:
    """The data-parallel degrees this model and cluster allow, and why none works."""
    n, blocks = cluster.num_devices, len(graph.blocks)
    tps = [tp for tp in _divisors(_domain_size(cluster)) if _blocks_tp_limit(graph) % tp == 0]
    dps = sorted({n // (tp * pp) for tp in tps for pp in _divisors(n // tp) if pp <= max(blocks, 1)})
    limits = (f"{n} devices / (tp x pp), with tp in {tps} (inside a node's NVLink domain, "
              f"tiling every node's {sorted({len(x.local_ranks) for x in cluster.nodes})} "
              "devices, dividing the "
              f"blocks' heads and features) and pp at most the model's {blocks} blocks")
    if not any(global_batch % dp == 0 and dp <= global_batch for dp in dps):
        return ConfigError(
            f"global_batch={global_batch} cannot be split over any data-parallel degree this "
            f"model and cluster allow ({dps[:12]}: {limits}); choose a global batch that is a "
            "multiple of one of them, or fewer devices")
    return ConfigError(f"no layout of {graph.model} fits the search space on {n} devices: the "
                       f"data-parallel degrees are {dps[:12]} ({limits}), and the search "
                       "space's micro-batch, pipeline or context-parallel limits leave none")


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
         example_inputs: Any = None, memory_fraction: float = 0.9,
         time_limit_s: float | None = None,
         top_k: int = 1, precision: Precision | str | Sequence[Precision | str] = Precision.BF16,
         options: CostOptions | None = None, space: SearchSpace | None = None,
         use_all_devices: bool = False,
         price_per_gpu_hour: float | Mapping[str, float] | None = None,
         work_limit: int | None = WORK_LIMIT) -> Plan:
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
    time_limit_s : float, optional
        A wall-clock cap on the search (default None: none); the best plan so far is
        returned when it binds, and that plan depends on the machine's load.
    top_k : int
        How many plans to rank; the runners-up are ``plan.runners_up``.
    precision : Precision, str or list of them
        The mixed-precision recipe (default bf16), or several to search, each with its
        share of ``work_limit`` and ``time_limit_s``, the fastest plan of any winning.
        FP8 recipes are searched only when given here.
    use_all_devices : bool
        Only layouts that use every device of the cluster.  By default the devices
        used are part of the search: a plan may leave some idle (whole nodes first,
        a slow group of a mixed cluster) when that is faster; ``plan.idle_devices``
        lists them and ``plan.idle_reason`` says why.
    price_per_gpu_hour : float or dict, optional
        With prices (one for every GPU, or by device type or node profile name) the plan
        is the cheapest per sample instead of the fastest (idle devices cost nothing).
    work_limit : int, optional
        The search's budget in steps (default :data:`WORK_LIMIT`; None: no limit): a
        combination's bounds computed, a layout priced or a candidate refined counts one.
        When it binds the best plan so far is returned, the same plan on any machine.

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
    _check_limits(time_limit_s, work_limit)
    share = len(precisions)
    results, infeasible = [], None
    for p in precisions:
        # each recipe its share of the budgets
        try:
            results.append(search(graph, cluster, global_batch=global_batch,
                                  memory_fraction=memory_fraction,
                                  time_limit_s=None if time_limit_s is None
                                  else time_limit_s / share,
                                  work_limit=None if work_limit is None
                                  else max(1, work_limit // share), top_k=top_k,
                                  precision=p, options=options, space=space,
                                  use_all_devices=use_all_devices,
                                  price_per_gpu_hour=price_per_gpu_hour))
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
                        next((r.limit for r in results if r.limit is not None), None),
                        sum(r.steps for r in results))


def _attach(result: SearchResult, graph: ModelGraph) -> Plan:
    """The best plan, carrying its runners-up, the search statistics and the graph
    (not serialized: ``replan`` uses the graph to search again)."""
    fingerprint = ModelFingerprint.of(graph)      # emit, parallelize, replan refuse another model
    plans = [replace(p, graph=graph, fingerprint=fingerprint) for p in result.plans]
    return replace(plans[0], runners_up=tuple(plans[1:]), search_stats=result)


# ------------------------------------------------------------------ enumeration (tests)
def _combos(graph: ModelGraph, cluster, global_batch: int, space: SearchSpace,
            attention: bool = True) -> Iterable[_Combo]:
    """Every degree combination of all the devices of ``cluster`` the search may price
    (before bounds): what the tests of placement rules read."""
    engine = CostEngine(graph, cluster, options=CostOptions())
    builder = _Builder(graph, engine, cluster, Precision.BF16, pools(cluster, use_all_devices=True))
    s = _Search(graph, cluster, engine, builder, space, global_batch, True, None, math.inf,
                0.0, 1, time.perf_counter(), None, None)
    if not attention:
        s.tpcp = [(tp, cp) for tp, cp in s.tpcp if cp == 1]
    N, pool = cluster.num_devices, builder.pools[0]
    for tp, cp in s.tpcp:
        g = tp * cp
        for pp in range(1, max(s.blocks, 1) + 1):
            if N % (g * pp):
                continue
            dp = N // (g * pp)
            if dp > global_batch or pool.domain(N) % tp or not _placed(pool, N, g):
                continue
            for mb in _micro_batches(space, global_batch // dp):
                for sched, v in _schedules(space, pp, max(1, global_batch // (dp * mb)), s.blocks):
                    for sp in s._sps(tp):
                        for ep in s._eps(pool, N, tp, cp, dp):
                            yield _Combo(tp, cp, pp, dp, mb, sched, v, sp, ep, 0)
