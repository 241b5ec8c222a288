"""The cost model: step time and memory of a parallel layout.

* :func:`estimate` prices a uniform :class:`~autoplan.strategy.Strategy`,
  :func:`estimate_plan` a per-layer :class:`~autoplan.plan.Plan`; both run one
  :class:`CostEngine` (see :mod:`autoplan.cost.engine` for the formulas).
* A search holds an engine (:func:`engine_for`) and calls
  :meth:`CostEngine.quick` for step time, peak memory and fit without records;
  to price single layers it uses the engine's public building blocks
  (:meth:`CostEngine.template_time`, :meth:`CostEngine.collective_time`,
  :meth:`CostEngine.activation_bytes`, :meth:`CostEngine.precision_costs`, ...).
* :class:`CostOptions` says how the training runs (fused attention, overlaps);
  :class:`CostConstants` holds the constants of ``profiles/cost/cost-model.yaml``.
"""

from .constants import STACKS, CostConstants, CostOptions, load_constants
from .engine import CostEngine, Layout, QuickEstimate, Segment, layout_from_plan
from .api import clear_engines, engine_for, estimate, estimate_plan
from .result import BREAKDOWN_KEYS, Estimate, MemoryBreakdown, StageEstimate
from .schedules import bubble_fraction, in_flight, pipeline_time
from .summary import GraphSummary, summarize

__all__ = [
    "estimate",
    "estimate_plan",
    "engine_for",
    "clear_engines",
    "CostEngine",
    "QuickEstimate",
    "CostOptions",
    "STACKS",
    "CostConstants",
    "load_constants",
    "Estimate",
    "StageEstimate",
    "MemoryBreakdown",
    "BREAKDOWN_KEYS",
    "GraphSummary",
    "summarize",
    "Layout",
    "Segment",
    "layout_from_plan",
    "pipeline_time",
    "bubble_fraction",
    "in_flight",
]
