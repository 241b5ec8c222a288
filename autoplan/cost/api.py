"""Public entry points: :func:`estimate` (a uniform Strategy) and :func:`estimate_plan`.

Both run the same :class:`~autoplan.cost.engine.CostEngine`; engines are kept
per (graph, cluster, options, constants), so repeated calls reuse every cached
compute and collective time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn

from ..errors import ConfigError
from ..graph import ModelGraph
from ..hardware.cluster import as_cluster
from ..strategy import Strategy
from .calibration import DEFAULT_CALIBRATION, Calibration, resolve_calibration
from .constants import CostConstants, CostOptions
from .engine import CostEngine
from .result import Estimate
from .summary import GraphSummary, summarize

__all__ = ["estimate", "estimate_plan", "engine_for", "clear_engines"]

_ENGINES: "OrderedDict[tuple, tuple[Any, Any, CostEngine]]" = OrderedDict()
_MAX_ENGINES = 16


def clear_engines() -> None:
    """Forget the cached engines (after changing profiles or calibrations on disk)."""
    _ENGINES.clear()


def engine_for(graph: ModelGraph | GraphSummary, cluster, *, options: CostOptions | None = None,
               constants: CostConstants | None = None,
               calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> CostEngine:
    """The (cached) engine for ``graph`` on ``cluster``; what a search should hold on to.

    ``calibration`` (default: the fit to published runs,
    ``profiles/cost/published-fit.yaml``) overlays fitted figures on the cluster's
    GPU profiles by architecture and link kind; ``None`` disables it.
    """
    summary = summarize(graph)
    cluster = as_cluster(cluster)
    cal = resolve_calibration(calibration)
    key = (id(summary), id(cluster), options, constants, id(cal))
    hit = _ENGINES.get(key)
    if hit is not None and hit[0] is summary and hit[1] is cluster:
        _ENGINES.move_to_end(key)
        return hit[2]
    engine = CostEngine(summary, cluster, options=options, constants=constants, calibration=cal)
    _ENGINES[key] = (summary, cluster, engine)
    while len(_ENGINES) > _MAX_ENGINES:
        _ENGINES.popitem(last=False)
    return engine


def _graph(model_or_graph: Any, seq_len: int | None, example_inputs: Any) -> ModelGraph | GraphSummary:
    if isinstance(model_or_graph, (ModelGraph, GraphSummary)):
        return model_or_graph
    if isinstance(model_or_graph, nn.Module):
        from ..capture import trace
        return trace(model_or_graph, seq_len=seq_len, example_inputs=example_inputs)
    raise ConfigError(f"estimate() takes an nn.Module or a ModelGraph (from autoplan.trace), "
                      f"got {type(model_or_graph).__name__}")


def _options(options: CostOptions | None, memory_fraction: float | None) -> CostOptions | None:
    if memory_fraction is None:
        return options
    from dataclasses import replace
    return replace(options or CostOptions(), memory_fraction=memory_fraction)


def estimate(model_or_graph: Any, cluster, strategy: Strategy, *, seq_len: int | None = None,
             example_inputs: Any = None, options: CostOptions | None = None,
             memory_fraction: float | None = None,
             constants: CostConstants | None = None,
             calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> Estimate:
    """Predict step time, throughput and memory of ``strategy`` for a model on ``cluster``.

    Parameters
    ----------
    model_or_graph : nn.Module or ModelGraph
        A module is captured first with :func:`autoplan.trace` (``seq_len`` or
        ``example_inputs`` as there); pass the graph to avoid capturing again.
    cluster : Cluster
        From :func:`autoplan.hardware.load_cluster`; ``strategy.world_size``
        must equal its number of devices.
    strategy : Strategy
        A uniform layout; its layers are split over the pipeline stages as
        Megatron-LM does (:meth:`autoplan.plan.Plan.from_strategy`).
    options : CostOptions, optional
        Implementation choices (fused attention, overlaps).
    memory_fraction : float, optional
        Overrides ``options.memory_fraction``: the share of each device's memory a
        plan may use to count as fitting.
    calibration : Calibration, str or None
        Fitted device figures overlaid on the profiles (default: the fit to
        published runs, ``profiles/cost/published-fit.yaml``); ``None`` for the
        profiles as they are.

    Returns
    -------
    Estimate

    Raises
    ------
    StrategyError
        When the degrees do not fit the cluster or the model.

    Examples
    --------
    >>> from autoplan import trace
    >>> from autoplan.models import GPT, GPTConfig
    >>> from autoplan.hardware import load_cluster
    >>> g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)), seq_len=16)
    >>> e = estimate(g, load_cluster("a100-sxm4-80gb"), Strategy(dp=2, tp=2, pp=2, global_batch=8))
    >>> abs(sum(e.breakdown.values()) - e.step_time_s) < 1e-12
    True
    """
    graph = _graph(model_or_graph, seq_len, example_inputs)
    return engine_for(graph, cluster, options=_options(options, memory_fraction),
                      constants=constants, calibration=calibration).estimate(strategy)


def estimate_plan(graph: ModelGraph | GraphSummary, cluster, plan, *,
                  options: CostOptions | None = None, memory_fraction: float | None = None,
                  constants: CostConstants | None = None,
                  calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> Estimate:
    """Predict step time and memory of a per-layer :class:`~autoplan.plan.Plan`.

    The same engine as :func:`estimate`:
    ``estimate(g, c, s) == estimate_plan(g, c, Plan.from_strategy(g, c, s))``.
    ``options`` default: those the plan was priced with (``Plan.cost_options``: a plan
    the search made for another software stack is priced for that stack again).
    """
    recorded = getattr(plan, "cost_options", None)
    if options is None and recorded:
        options = CostOptions.from_recorded(recorded)
    return engine_for(graph, cluster, options=_options(options, memory_fraction),
                      constants=constants, calibration=calibration).estimate(plan)
