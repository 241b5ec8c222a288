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
5. **Per-stage problem.** For every fitting candidate whose refinement bound
   (:func:`~autoplan.search.refine.refine_bound`) is below the best plan, an exact solver
   chooses how many blocks each pipeline rank holds and which recompute option each uses
   (:mod:`autoplan.search.stage_solver`: by counting for the three recompute options,
   OR-Tools CP-SAT beyond).
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

The walk itself (the queue, its bounds and the ladder) is :mod:`autoplan.search.frontier`;
the search space, its budget and the enumeration rules are :mod:`autoplan.search.space`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..cost import CostEngine, CostOptions
from ..errors import ConfigError, InfeasiblePlan
from ..graph import ModelGraph
from ..hardware.cluster import as_cluster
from ..plan import ModelFingerprint, Plan, expert_counts
from ..strategy import Precision, Recompute
from .builder import _Builder, _Candidate, _Combo
from .fleet import pools
from .frontier import _Search
from .space import (WORK_LIMIT, SearchLimit, SearchSpace, _blocks_tp_limit, _check_limits,
                    _divisors, _domain_size, _micro_batches, _placed, _schedules)

__all__ = ["plan", "search", "SearchResult", "SearchSpace", "SearchLimit", "WORK_LIMIT"]


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



def _prices(cluster, price_per_gpu_hour: Any) -> list[float] | None:
    """Price per hour of each device (None: no price, the objective is the step time)."""
    if price_per_gpu_hour is None:
        return None
    from ..report.whatif import _prices as per_device
    prices = per_device(cluster, price_per_gpu_hour)
    if any(p < 0 or not math.isfinite(p) for p in prices):
        raise ConfigError("price_per_gpu_hour must be finite and >= 0")
    return prices


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
           tolerance: float = 0.0, work_limit: int | None = WORK_LIMIT,
           band: Callable[[int, int, int], bool] | None = None) -> SearchResult:
    """Search the layouts of ``graph`` on ``cluster``; see :func:`plan`.

    ``bound_s``: the step time of a plan already known to fit (a warm start); layouts
    whose bound is at least this are not priced.  ``tolerance``: also price every layout
    within this fraction of the best and keep the distinct plans among them
    (``SearchResult.alternatives``; what :func:`autoplan.replan` chooses among).
    ``band(tp, cp, dp)``: whether a layout of those degrees may be wanted from that band
    though slower than the best; those it is False for (and that leave devices idle) are
    priced only where they can be faster than the best (what :func:`autoplan.replan`
    passes when no layout keeps a shard of the old plan: the fastest is then chosen).
    With ``top_k=1`` and no ``space.refine`` cap only; the best plan is the same.
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
    asked = space                              # (what fastest_key digests)
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
                bound_s, tolerance, top_k, t0, time_limit_s, work_limit,
                band if space.refine is None else None)
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
    # what replan prices the plan's again with, and weighs them by
    recorded = options.recorded()
    weighed = {} if prices is None else _weighed(cluster, prices)
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
        p = replace(p, idle_reason=s.idle_reason(cand, p.label(compact=True)),
                    cost_options=recorded, price_per_gpu_hour=weighed,
                    search_space=asked.recorded())
        plans.append(p.with_estimate(engine.estimate(p)))
    if s.limit is None and prices is None and not use_all_devices and space.refine is None:
        # nothing stopped the search: its best is the fastest of every subset of devices
        plans[0] = replace(plans[0], fastest_for=fastest_key(engine, asked, precision))
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
            p = replace(p, idle_reason=s.idle_reason(cand, p.label(compact=True)),
                        cost_options=recorded, price_per_gpu_hour=weighed,
                        search_space=asked.recorded())
            alternatives.append(p.with_estimate(engine.estimate(p)))
    return SearchResult(plans, s.evaluated, s.pruned, s.refined, time.perf_counter() - t0,
                        s.limit, s.steps, alternatives)


def _weighed(cluster, prices: list[float]) -> dict[str, float]:
    """The price per GPU-hour of each device type (each node profile where one type has
    several), as a plan records the prices its search weighed."""
    by_type: dict[str, set[float]] = {}
    for d in range(cluster.num_devices):
        by_type.setdefault(cluster.device_type_of(d).name, set()).add(prices[d])
    if all(len(v) == 1 for v in by_type.values()):
        return {name: next(iter(v)) for name, v in sorted(by_type.items())}
    return dict(sorted({cluster.node_of(d).profile: prices[d]
                        for d in range(cluster.num_devices)}.items()))


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
    merged = _merged(results, top_k)
    if share > 1:           # (what replan searches again)
        searched = tuple(p.value for p in precisions)
        merged = replace(merged, plans=[replace(p, searched_precisions=searched)
                                        for p in merged.plans])
    return _attach(merged, graph)


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


def fastest_key(engine: CostEngine, space: SearchSpace, precision: Precision) -> str:
    """What a complete search on ``engine``'s cluster proves its best plan fastest for
    (:attr:`Plan.fastest_for <autoplan.Plan.fastest_for>`): a digest of the cost model's
    options and constants, the calibrated node profile, the search space and the
    precision; empty where the cluster is not one node profile on one site with every node
    whole (subsets of other clusters are not alike by whole nodes)."""
    cluster = engine.cluster
    whole = all(n.local_ranks == tuple(range(cluster.profiles[n.profile].node.devices_per_node))
                for n in cluster.nodes)
    if len(cluster.profiles) != 1 or len(cluster.sites) != 1 or cluster.servers or not whole:
        return ""
    inputs = repr((engine.options, engine.constants, tuple(cluster.profiles.values()), space,
                   precision))
    return "sha256:" + hashlib.sha256(inputs.encode()).hexdigest()[:32]


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
