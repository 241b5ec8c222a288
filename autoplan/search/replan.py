"""Re-planning when devices come and go: the same search, warm-started, resharding least.

A job that loses (or gains) devices keeps much of what made its plan good: the
tensor-parallel degree that suits the model and the node, the pipeline depth, the
schedule and micro-batch size.  :func:`replan` prices that layout on the devices
there are first (as many replicas as fit), and runs :func:`autoplan.search.search` with
its step time as the bound, so the search prunes from the start; the search may leave
devices idle as :func:`autoplan.plan` does (losing one node of 128 leaves 1,016 = 8 x 127
GPUs, which force every layout of all of them into 127 replicas; 126 nodes run a
pipeline).  Among the plans within ``tolerance`` of the fastest it keeps the one that
reshards least (:func:`reshard_fraction`): a restart loads the last checkpoint into the
new layout, and a layout close to the old one moves fewer bytes.  Where no layout can keep
a shard of the old plan (its layers' states sharded over more replicas than the devices
left hold: :func:`_may_keep_shards`), every plan moves every parameter and the fastest is
chosen, so the search prices the layouts that leave devices idle only where they can be
faster than the best (those of every device still over the whole band: the idle reason
quotes their bound); the plan is the same.  A plan a complete search proved the fastest of
every subset of its cluster's nodes (:attr:`Plan.fastest_for <autoplan.Plan.fastest_for>`)
is kept without a search on a cluster of those nodes that still holds it (:func:`_kept`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import replace

from ..cost import CostOptions
from ..errors import ConfigError, InfeasiblePlan, PlanMismatchError, StrategyError
from ..graph import ModelGraph
from ..plan import Plan
from ..plan_facts import PLAN_FACTS
from ..strategy import Precision
from .fleet import kept_text
from .search import (WORK_LIMIT, SearchResult, SearchSpace, _attach, _check_limits, _merged,
                     _prices, fastest_key, search)

__all__ = ["replan", "plan_diff", "reshard_fraction"]

#: Default tolerance of :func:`replan`: plans within 1% of the fastest count as fast.
REPLAN_TOLERANCE = 0.01


def reshard_fraction(old: Plan, new: Plan, graph: ModelGraph | None = None) -> float:
    """The share of the model's parameters whose shard changes between two plans.

    A layer's shard is where its states sit: its pipeline stage (as a fraction of the
    pipeline), its tensor- and context-parallel degrees and, for ZeRO-sharded states,
    how many data-parallel ranks share them (a replicated layer is whole on every
    replica, so more or fewer replicas do not move it).  Weighted by the layer's
    parameters (``graph``; each layer counts once without it).  0 for the same layout.

    >>> from autoplan.models import GPT, GPTConfig
    >>> from autoplan import trace, Strategy
    >>> g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)), seq_len=16)
    >>> a = Plan.from_strategy(g, 8, Strategy(dp=4, pp=2, global_batch=8))
    >>> b = Plan.from_strategy(g, 4, Strategy(dp=2, pp=2, global_batch=8))
    >>> c = Plan.from_strategy(g, 8, Strategy(dp=2, tp=2, pp=2, global_batch=8))
    >>> reshard_fraction(a, b, g), reshard_fraction(a, c, g)
    (0.0, 1.0)
    """
    params = {l.name: float(l.param_count) for l in graph.layers} if graph is not None else {}

    def shard(p: Plan, name: str) -> tuple:
        lp = p.placement(name)
        st = p.stages[lp.stage]
        shards = p.dp * p.cp if lp.zero >= 1 else 1
        return (st.index / len(p.stages), lp.tp, p.cp, lp.zero >= 1, shards)

    total = moved = 0.0
    for lp in new.layers:
        w = params.get(lp.name, 1.0) or 1.0
        total += w
        try:
            same = shard(old, lp.name) == shard(new, lp.name)
        except PlanMismatchError:         # a layer the old plan does not have
            same = False
        moved += 0.0 if same else w
    return moved / total if total else 0.0


def replan(plan: Plan, new_cluster, *, graph: ModelGraph | None = None,
           memory_fraction: float | None = None, time_limit_s: float | None = None,
           top_k: int = 1, space: SearchSpace | None = None,
           tolerance: float = REPLAN_TOLERANCE, use_all_devices: bool = False,
           work_limit: int | None = WORK_LIMIT, options: CostOptions | None = None,
           price_per_gpu_hour: float | Mapping[str, float] | None = None) -> Plan:
    """A new plan for ``new_cluster`` after devices were lost or added.

    The old plan as it is where it is provably still the fastest (``plan.fastest_for``: a
    complete search's plan, on no more nodes of the same profile that still hold it; no
    search, ``search_stats.steps`` 0); else the search, warm-started from the old plan.

    Parameters
    ----------
    plan : Plan
        The plan the job ran with (from :func:`autoplan.plan`, which keeps the
        model graph on it; a plan loaded from JSON needs ``graph=``).
    new_cluster : Cluster
        The devices that are there now; the new plan may leave some of them idle
        (``use_all_devices=True``: none), as :func:`autoplan.plan` does.
    graph : ModelGraph, optional
        The model, when ``plan`` does not carry it.
    memory_fraction : float, optional
        Default: the fraction the previous plan was made with.
    options : CostOptions, optional
        The cost model's options (the software stack); default: those the previous plan
        was priced with (:meth:`Plan.cost_model_options`), so a plan made for, say,
        ``megatron-core`` is replanned for it.
    price_per_gpu_hour : float or dict, optional
        Make the new plan the cheapest per sample at these prices, as
        :func:`autoplan.plan` does; default: the prices the previous plan was made the
        cheapest at (``Plan.price_per_gpu_hour``), else the fastest.
    space : SearchSpace, optional
        What the new plan may use (default: the space the previous plan was chosen from,
        ``Plan.search_space``; everything for the default one).
    tolerance : float
        Among the plans within this fraction of the fastest (default 1%), the one
        that reshards least (:func:`reshard_fraction`; then the fastest) is returned.
    work_limit : int, optional
        The search's budget in steps, as in :func:`autoplan.plan` (the same inputs give
        the same plan on any machine).
    time_limit_s : float, optional
        A wall-clock cap (default None: none), as in :func:`autoplan.plan`.

    Raises
    ------
    InfeasiblePlan
        When no layout of the model fits the devices that remain (the message says
        the memory it would need and the devices there are).
    PlanMismatchError
        When ``graph`` is of another model than the one ``plan`` was made for.

    Examples
    --------
    >>> import autoplan
    >>> from autoplan.models import GPT, GPTConfig
    >>> g = autoplan.trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)), seq_len=16)
    >>> old = autoplan.plan(g, autoplan.load_cluster("a100-sxm4-80gb", nodes=2), global_batch=32)
    >>> new = replan(old, autoplan.load_cluster("a100-sxm4-80gb"))
    >>> new.num_devices <= 8 and new.cluster.num_devices == 8
    True
    """
    graph = graph if graph is not None else plan.graph
    if graph is None:
        raise ConfigError("replan needs the model graph: this plan was loaded from JSON, so pass "
                          "graph=autoplan.trace(model, seq_len=...)")
    plan.check_model(graph)     # PlanMismatchError, saying what differs, for another model
    if memory_fraction is None:
        memory_fraction = plan.estimate.memory_fraction if plan.estimate is not None else 0.9
    options = replace(options if options is not None else plan.cost_model_options(),
                      memory_fraction=memory_fraction)
    space = space or SearchSpace.from_recorded(plan.search_space)
    _check_limits(time_limit_s, work_limit)
    # the recipes the plan was chosen among (each its share of the budgets, as in plan())
    precisions = tuple(Precision(p) for p in plan.searched_precisions) or (plan.precision,)
    share = len(precisions)
    common = dict(global_batch=plan.global_batch, memory_fraction=memory_fraction,
                  time_limit_s=None if time_limit_s is None else time_limit_s / share,
                  top_k=top_k, use_all_devices=use_all_devices,
                  work_limit=None if work_limit is None else max(1, work_limit // share),
                  options=options)
    if price_per_gpu_hour is None and plan.price_per_gpu_hour:
        price_per_gpu_hour = plan.price_per_gpu_hour
        try:
            _prices(new_cluster, price_per_gpu_hour)
        except ConfigError as exc:
            raise ConfigError(f"the plan was made the cheapest per sample at its recorded "
                              f"prices, and the new cluster has devices it has none for: "
                              f"{exc}; pass price_per_gpu_hour= to replan with a price for "
                              "each") from None
    common["price_per_gpu_hour"] = price_per_gpu_hour
    t0 = time.perf_counter()
    if top_k == 1 and not use_all_devices and price_per_gpu_hour is None and share == 1:
        kept = _kept(plan, graph, new_cluster, options, space)
        if kept is not None:        # still the fastest, and it reshards nothing
            stats = SearchResult([kept], 1, 0, 0, time.perf_counter() - t0)
            return replace(_attach(stats, graph), warm_start=True)
    # (a step time: no bound of a price per sample)
    warm = math.inf if price_per_gpu_hour is not None else \
        _warm_bound(plan, graph, new_cluster, options, space)
    # no layout keeps a shard: every plan moves every parameter, the fastest is chosen
    band = None if _may_keep_shards(plan, new_cluster) else _keeps_none

    def searched(bound_s: float) -> tuple[list[SearchResult], InfeasiblePlan | None]:
        results, infeasible = [], None
        for p in precisions:
            try:
                results.append(search(graph, new_cluster, space=space, tolerance=tolerance,
                                      bound_s=bound_s, band=band, precision=p, **common))
            except InfeasiblePlan as exc:
                infeasible = infeasible or exc
        return results, infeasible

    results, infeasible = searched(warm * (1 + tolerance) * (1 + 1e-9))
    if not results and not math.isinf(warm) and (
            time_limit_s is None or time.perf_counter() - t0 <= time_limit_s):
        # nothing within the warm start's bound: the search again, unbounded
        results, infeasible = searched(math.inf)
    if not results:
        assert infeasible is not None
        raise infeasible
    result = _merged(results, top_k)
    best = result.plans[0]
    if len(results) == 1:
        alternatives = result.alternatives or [best]
    else:       # each recipe's, within the tolerance of the fastest of all
        alternatives = [p for r in results for p in (r.alternatives or r.plans[:1])
                        if p.estimate.step_time_s <= best.estimate.step_time_s * (1 + tolerance)]
    chosen = min(alternatives, key=lambda p: (reshard_fraction(plan, p, graph),
                                              p.estimate.step_time_s, p.to_json()))
    if chosen.describe() == best.describe():
        chosen = replace(chosen, fastest_for=best.fastest_for)     # (what the search proved)
    plans = [chosen] + [p for p in result.plans if p.describe() != chosen.describe()]
    if share > 1:           # (searched again by the next replan)
        plans = [replace(p, searched_precisions=plan.searched_precisions) for p in plans]
    return replace(_attach(replace(result, plans=plans[:top_k]), graph), warm_start=not math.isinf(warm))


def _kept(plan: Plan, graph: ModelGraph, cluster, options: CostOptions,
          space: SearchSpace) -> Plan | None:
    """``plan`` on ``cluster`` as it is, where it is provably the fastest plan there (None
    where that is not shown).

    A search that ran to the end with idle devices allowed proved its plan the fastest of
    every layout of every subset of whole nodes of its cluster
    (:attr:`Plan.fastest_for <autoplan.Plan.fastest_for>`).  A cluster of the same nodes
    with no more devices (a failed node gone, or swapped for a spare) has only such
    subsets, so where the plan's devices are still there (the first ones, as the search
    lays a plan out) and the cost model's inputs are the same (the digest, and the plan
    priced again at the same step time and memory), it is still the fastest; it also
    reshards nothing (:func:`reshard_fraction` 0)."""
    from ..cost import CostEngine
    from ..plan import ClusterSummary

    used = sorted(plan.mesh.devices)
    n = cluster.num_devices
    if (not plan.fastest_for or plan.estimate is None or used != list(range(len(used)))
            or len(used) > n or n > plan.cluster.num_devices):
        return None
    engine = CostEngine(graph, cluster, options=options)
    if fastest_key(engine, space, plan.precision) != plan.fastest_for:
        return None
    kept = replace(plan, cluster=ClusterSummary.from_cluster(cluster), idle_reason="",
                   runners_up=(), search_stats=None, graph=None, warm_start=None)
    try:
        kept.check(graph, cluster)
        est = engine.estimate(kept)
    except (StrategyError, ConfigError, PlanMismatchError):
        return None
    old = plan.estimate
    if not (est.fits and math.isclose(est.step_time_s, old.step_time_s, rel_tol=1e-9)
            and math.isclose(est.peak_memory_bytes, old.peak_memory_bytes, rel_tol=1e-9)):
        return None
    reason = kept_text(cluster, tuple(used), est.step_time_s, kept.label(compact=True),
                       plan.cluster.num_devices) if len(used) < n else ""
    return replace(kept.with_estimate(est), idle_reason=reason)


def _may_keep_shards(plan: Plan, cluster) -> bool:
    """Whether some plan on ``cluster`` may keep a layer's shard of ``plan``
    (:func:`reshard_fraction` below 1).

    A layer whose states are sharded over the data-parallel group keeps its shard only
    on the same number of shards at the same context-parallel degree, so at ``plan.dp``
    replicas, and at its tensor-parallel degree: its stage alone then takes
    ``dp x cp x tp`` devices.  Where every layer is sharded so and that is more devices
    than ``cluster`` has, no plan keeps any shard (a replicated layer may keep its)."""
    n = cluster.num_devices
    return any(lp.zero < 1 or plan.dp * plan.cp * lp.tp <= n for lp in plan.layers)


def _keeps_none(tp: int, cp: int, dp: int) -> bool:
    """``search``'s band where no layout keeps a shard: none is wanted but the fastest."""
    return False


def _warm_bound(plan: Plan, graph: ModelGraph, cluster, options: CostOptions,
                space: SearchSpace) -> float:
    """The step time of the old plan's degrees and options on ``cluster`` with as many
    replicas as its devices hold (inf when that layout does not fit or cannot be built).

    Fewer replicas run more micro-batches each (gradients then accumulate): where the old
    options no longer fit, full recompute, then ZeRO-3 with it, are tried at the same
    degrees where ``space`` has them (still a layout the search prices, so still a bound)."""
    from ..cost import engine_for
    from ..strategy import Recompute, Strategy

    tp, cp, pp = max(s.tp for s in plan.stages), plan.cp, plan.pp
    dp = cluster.num_devices // (tp * cp * pp)
    zero = max(lp.zero for lp in plan.layers)
    rcs = [lp.recompute for lp in plan.layers if lp.recompute is not Recompute.NONE]
    tries = [(z, rc) for z, rc in ((zero, rcs[0] if rcs else Recompute.NONE),
                                   (zero, Recompute.FULL), (3, Recompute.FULL))
             if z in space.zero and rc in space.recompute]    # (what the search may price)
    for d in range(dp, 0, -1):
        if plan.global_batch % (d * plan.micro_batch):
            continue
        built = False
        engine = None
        for z, rc in dict.fromkeys(tries):
            try:
                strategy = Strategy(dp=d, tp=tp, cp=cp, pp=pp, micro_batch=plan.micro_batch,
                                    global_batch=plan.global_batch, zero=z, recompute=rc,
                                    sequence_parallel=any(lp.sequence_parallel
                                                          for lp in plan.layers),
                                    schedule=plan.schedule, virtual_stages=plan.virtual_stages,
                                    precision=plan.precision, ep=plan.ep)
                if engine is None:
                    engine = engine_for(graph, cluster.subset(range(d * tp * cp * pp)),
                                        options=options)
                est = engine.estimate(strategy, ledger=False)
            except (StrategyError, ConfigError):
                continue
            built = True
            if est.fits:
                return est.step_time_s
        if built:
            break
    return math.inf


def plan_diff(old: Plan, new: Plan) -> str:
    """What changed between two plans, one line per difference (empty when equal).

    Degrees, micro-batching, schedule, options, stage boundaries, the devices left idle
    and the predicted step time.
    """
    lines = []
    for fact in PLAN_FACTS:
        a, b = fact.text(old), fact.text(new)
        if a != b:
            lines.append(f"{fact.field}: {a} -> {b}")
    ia, ib = _idle(old), _idle(new)
    if ia != ib:
        lines.append(f"idle: {ia} -> {ib}")
    sa = [len(s.layers) for s in old.stages]
    sb = [len(s.layers) for s in new.stages]
    if sa != sb:
        lines.append(f"layers per stage: {sa} -> {sb}")
    else:
        moved = [i for i, (x, y) in enumerate(zip(old.stages, new.stages)) if x.layers != y.layers]
        if moved:
            lines.append(f"stage boundaries moved in stages {moved}")
    if old.estimate is not None and new.estimate is not None:
        ta, tb = old.estimate.step_time_s, new.estimate.step_time_s
        if ta != tb:
            lines.append(f"predicted step time: {ta:.3f} s -> {tb:.3f} s ({(tb / ta - 1) * 100:+.1f}%)")
        ma, mb_ = old.estimate.peak_memory_bytes, new.estimate.peak_memory_bytes
        if ma != mb_:
            lines.append(f"peak memory: {ma / 2**30:.1f} GiB -> {mb_ / 2**30:.1f} GiB")
    return "\n".join(lines)


def _idle(p: Plan) -> str:
    """``none``, or how many of the cluster's devices (and whole nodes) the plan leaves
    idle: ``8 of 1016 devices (1 node)``."""
    idle = p.idle_devices
    if not idle:
        return "none"
    per_node = p.cluster.num_devices // max(1, p.cluster.num_nodes)
    text = f"{len(idle)} of {p.cluster.num_devices} devices"
    if per_node and p.cluster.num_devices % max(1, p.cluster.num_nodes) == 0:
        nodes = sorted({d // per_node for d in idle})
        whole = [j for j in nodes if all(d in idle for d in range(j * per_node, (j + 1) * per_node))]
        if whole:
            text += f" ({len(whole)} node{'s' if len(whole) > 1 else ''} whole)"
    return text
