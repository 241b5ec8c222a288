"""Reporting: what-if tables, figures and self-contained HTML reports of plans.

* :func:`whatif` -- the best plan for every (model, sequence length, cluster,
  global batch) scenario as a pandas table, with cost when given a price.
* :func:`plot_schedule`, :func:`plot_memory`, :func:`plot_scaling`,
  :func:`plot_top_k` -- matplotlib figures (Agg; nothing needs a display).
* :func:`plan_report_html` / :func:`write_plan_report` -- one HTML file with
  the summary, tables and figures of a plan.
* :func:`plan_stage_table` -- one row per stage: devices, device type, nodes,
  sites, and where the pipeline crosses sites.
* :func:`schedule_timeline` -- the operation-by-operation pipeline schedule
  that :func:`plot_schedule` draws.

The figures need matplotlib (``pip install 'autoplan[plots]'``); they are
imported on first use, so :func:`whatif` and an HTML report without figures work
without it.
"""

from __future__ import annotations

from .._lazy import lazy_names as _lazy_names
from ._text import LEGEND, legend_text, plan_differences, plan_label
from .tables import device_span, plan_stage_table
from .timeline import Block, BlockKind, Timeline, schedule_timeline, simulate_schedule
from .whatif import WHATIF_COLUMNS, cluster_price_per_hour, whatif

__all__ = ["whatif", "WHATIF_COLUMNS", "cluster_price_per_hour", "plot_schedule", "plot_memory",
           "plot_scaling", "plot_top_k", "save_figure", "plan_report_html", "write_plan_report",
           "schedule_timeline", "simulate_schedule", "Timeline", "Block", "BlockKind",
           "plan_label", "plan_stage_table", "device_span", "LEGEND", "legend_text",
           "plan_differences"]

_LAZY = {"plot_schedule": ".plots", "plot_memory": ".plots", "plot_scaling": ".plots",
         "plot_top_k": ".plots", "save_figure": ".plots", "plan_report_html": ".html",
         "write_plan_report": ".html"}
__getattr__, __dir__ = _lazy_names(__name__, _LAZY, __all__)
