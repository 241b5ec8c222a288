"""Re-planning when devices come and go, warm-started from the previous plan.

A job that loses (or gains) devices keeps much of what made its plan good: the
tensor-parallel degree that suits the model and the node, a pipeline depth in
the same range, the schedule and micro-batch size.  :func:`replan` searches
that neighbourhood first (a few hundred layouts), then the whole space with the
neighbourhood's best step time as the pruning bound, so most degree
combinations are dropped after one evaluation: the warm start makes the full
search cheap without letting the neighbourhood limit the answer (losing one
node of 128 can make the old degrees a poor fit: 1016 GPUs are 8 x 127).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError, InfeasiblePlan
from ..graph import ModelGraph
from ..plan import Plan
from ..plan_facts import PLAN_FACTS
from ..strategy import Schedule
from .search import SearchSpace, _attach, search

__all__ = ["replan", "plan_diff"]


def _neighbourhood(plan: Plan, space: SearchSpace) -> SearchSpace:
    tp = max(s.tp for s in plan.stages)
    mb = plan.micro_batch
    schedules = tuple(s for s in dict.fromkeys((plan.schedule, Schedule.ONE_F_ONE_B))
                      if s in space.schedules) or space.schedules
    return replace(
        space,
        schedules=schedules,
        virtual_stages=(plan.virtual_stages,) if plan.schedule is Schedule.INTERLEAVED else (2,),
        micro_batches=tuple(sorted({max(1, mb // 2), mb, mb * 2})),
        tensor_parallel=tuple(t for t in sorted({max(1, tp // 2), tp, tp * 2})
                              if space.tensor_parallel is None or t in space.tensor_parallel)
        or space.tensor_parallel,
        pipeline_parallel=(max(1, plan.pp // 2), plan.pp * 2) if space.pipeline_parallel is None
        else space.pipeline_parallel,
        refine=2)


def replan(plan: Plan, new_cluster, *, graph: ModelGraph | None = None,
           memory_fraction: float | None = None, time_limit_s: float = 30.0,
           top_k: int = 1, space: SearchSpace | None = None) -> Plan:
    """A new plan for ``new_cluster`` after devices were lost or added.

    Parameters
    ----------
    plan : Plan
        The plan the job ran with (from :func:`autoplan.plan`, which keeps the
        model graph on it; a plan loaded from JSON needs ``graph=``).
    new_cluster : Cluster
        The devices that are there now; the new plan uses exactly these.
    graph : ModelGraph, optional
        The model, when ``plan`` does not carry it.
    memory_fraction : float, optional
        Default: the fraction the previous plan was made with.
    space : SearchSpace, optional
        What the new plan may use (default: everything).  The warm start searches
        the previous plan's neighbourhood within it.

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
    >>> new.num_devices
    8
    """
    graph = graph if graph is not None else plan.graph
    if graph is None:
        raise ConfigError("replan needs the model graph: this plan was loaded from JSON, so pass "
                          "graph=autoplan.trace(model, seq_len=...)")
    plan.check_model(graph)     # PlanMismatchError, saying what differs, for another model
    if memory_fraction is None:
        memory_fraction = plan.estimate.memory_fraction if plan.estimate is not None else 0.9
    space = space or SearchSpace()
    common = dict(global_batch=plan.global_batch, memory_fraction=memory_fraction,
                  time_limit_s=time_limit_s, top_k=top_k, precision=plan.precision)
    try:
        warm = search(graph, new_cluster, space=_neighbourhood(plan, space), **common)
    except (InfeasiblePlan, ConfigError):
        warm = None
    bound = warm.best.estimate.step_time_s if warm is not None else float("inf")
    try:
        full = search(graph, new_cluster, space=space, bound_s=bound * (1 + 1e-9), **common)
    except InfeasiblePlan:
        if warm is None:
            raise
        full = None
    if full is None or not full.plans:
        result = warm
    elif warm is None:
        result = full
    else:   # merge: the full search's plans are at least as good as the bound
        seen, plans = set(), []
        for p in sorted(full.plans + warm.plans,
                        key=lambda p: (p.estimate.step_time_s, p.to_json())):
            if p.describe() not in seen:
                seen.add(p.describe())
                plans.append(p)
        result = replace(full, plans=plans[:top_k], evaluated=full.evaluated + warm.evaluated,
                         seconds=full.seconds + warm.seconds)
    assert result is not None
    return replace(_attach(result, graph), warm_start=warm is not None)


def plan_diff(old: Plan, new: Plan) -> str:
    """What changed between two plans, one line per difference (empty when equal).

    Degrees, micro-batching, schedule, options, stage boundaries and the
    predicted step time.
    """
    lines = []
    for fact in PLAN_FACTS:
        a, b = fact.text(old), fact.text(new)
        if a != b:
            lines.append(f"{fact.field}: {a} -> {b}")
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
