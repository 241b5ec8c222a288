"""A self-contained HTML report of a plan: one file, no external resources.

:func:`plan_report_html` returns the page; :func:`write_plan_report` writes it
atomically.  Sections: the summary, the layout (one row per virtual stage),
the step-time breakdown, communication, memory per pipeline rank, the
runners-up when the plan has them, and the figures of
:mod:`autoplan.report.plots` embedded as base64 PNG.  The same plan gives the
same bytes (no timestamps; PNGs without metadata).
"""

from __future__ import annotations

import base64
import html
import os
from typing import Any

import numpy as np

from .. import __version__
from ..cost.result import BREAKDOWN_KEYS
from ..errors import ConfigError
from ..records import atomic_write_text
from ._text import model_name, plan_label
from .tables import plan_stage_table

__all__ = ["plan_report_html", "write_plan_report"]

_GiB = float(2**30)

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1200px; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
.summary { background: #f7f7f7; padding: 0.7em 1em; border-left: 4px solid #4c72b0; }
.bad { color: #c44e52; font-weight: bold; } img { max-width: 100%; }
""".strip()


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0.0:
            return "0"
        return f"{value:.4g}" if abs(value) < 1e3 else f"{value:,.0f}"
    return str(value)


def _table(columns: list[str], rows: list[list[Any]], *, table_id: str,
           text_columns: tuple[int, ...] = (0,)) -> str:
    head = "".join(f'<th class="text">{_esc(c)}</th>' if i in text_columns else f"<th>{_esc(c)}</th>"
                   for i, c in enumerate(columns))
    body = []
    for row in rows:
        cells = "".join(f'<td class="text">{_esc(_fmt(v))}</td>' if i in text_columns
                        else f"<td>{_esc(_fmt(v))}</td>" for i, v in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    return (f'<table id="{table_id}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def _image(fig, alt: str, img_id: str) -> str:
    from .plots import figure_png
    data = base64.b64encode(figure_png(fig)).decode("ascii")
    return f'<img id="{img_id}" alt="{_esc(alt)}" src="data:image/png;base64,{data}">'


def _layout_table(plan, cluster, graph) -> str:
    df = plan_stage_table(plan, cluster, graph)
    text = {"device_type", "first", "last", "devices", "zero", "recompute", "sites"}
    cols = list(df.columns)
    return _table([c.replace("_", " ") for c in cols], df.values.tolist(), table_id="stages",
                  text_columns=tuple(i for i, c in enumerate(cols) if c in text))


def _breakdown_table(est) -> str:
    rows = []
    for k in BREAKDOWN_KEYS:
        v = est.breakdown.get(k, 0.0)
        share = v / est.step_time_s if est.step_time_s else 0.0
        rows.append([k[:-2].replace("_", " "), v, f"{share:.1%}"])
    rows.append(["step", est.step_time_s, "100.0%"])
    return _table(["kind", "exposed time (s)", "share"], rows, table_id="breakdown")


def _comm_table(est) -> str:
    rows = [[k[:-2].replace("_", " "), est.comm_total.get(k, 0.0), est.breakdown.get(k, 0.0)]
            for k in est.comm_total]
    return _table(["communication", "total (s)", "exposed (s)"], rows, table_id="communication")


def _memory_table(est) -> str:
    rows = []
    for s in est.stages:
        m = s.memory
        rows.append([s.rank, s.device_type, s.layers, s.micro_batches_in_flight,
                     s.forward_s * 1e3, s.backward_s * 1e3,
                     m.params_bytes / _GiB, m.grads_bytes / _GiB, m.optimizer_bytes / _GiB,
                     m.activations_bytes / _GiB, m.buffers_bytes / _GiB, m.reserve_bytes / _GiB,
                     m.total_bytes / _GiB, s.memory_capacity_bytes / _GiB, s.fits])
    cols = ["rank", "device type", "layers", "in flight", "fwd (ms)", "bwd (ms)", "params (GiB)",
            "grads (GiB)", "optimizer (GiB)", "activations (GiB)", "buffers (GiB)",
            "reserve (GiB)", "peak (GiB)", "capacity (GiB)", "fits"]
    return _table(cols, rows, table_id="memory", text_columns=(1,))


def _runners_up_table(plans) -> str:
    rows = []
    for i, p in enumerate(plans):
        e = p.estimate
        rows.append([f"#{i + 1}", plan_label(p), e.step_time_s if e else "-",
                     e.tokens_per_s if e else "-", f"{e.mfu:.1%}" if e else "-",
                     e.peak_memory_bytes / _GiB if e else "-"])
    return _table(["rank", "layout", "step (s)", "tokens/s", "MFU", "peak (GiB)"], rows,
                  table_id="top-k", text_columns=(0, 1))


def plan_report_html(plan, *, cluster: Any = None, graph: Any = None, title: str | None = None,
                     figures: bool = True) -> str:
    """A self-contained HTML page describing ``plan`` and its estimate.

    Parameters
    ----------
    plan : Plan
        With an estimate (as :func:`autoplan.plan` returns it); its
        ``runners_up``, when present, get a table and a figure.
    cluster : Cluster, optional
        Adds the nodes and sites of each stage (:func:`plan_stage_table`).
    graph : ModelGraph, optional
        Adds the number of blocks per stage.
    title : str, optional
    figures : bool
        Embed the schedule, memory and top-k figures (base64 PNG).

    Returns
    -------
    str
        The page; tables have ids ``stages``, ``breakdown``, ``communication``,
        ``memory`` (and ``top-k``), images ``schedule``, ``memory-plot`` (and
        ``top-k-plot``).

    Raises
    ------
    ConfigError
        When the plan has no estimate.
    """
    est = plan.estimate
    if est is None:
        raise ConfigError("plan_report_html() needs a plan with an estimate: use "
                          "plan.with_estimate(autoplan.estimate_plan(graph, cluster, plan))")
    title = title or (f"autoplan: {model_name(plan)} on {plan.num_devices} devices of "
                      f"{plan.cluster.name}")
    c = plan.cluster
    runners = list(getattr(plan, "runners_up", ()) or ())
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_esc(title)}</title>", f"<style>{_CSS}</style></head><body>",
        f"<h1>{_esc(title)}</h1>",
        f'<p class="summary" id="summary">{_esc(plan.summary())}</p>',
        "<h2>Inputs</h2>",
        _table(["what", "value"], [
            ["model", model_name(plan)], ["sequence length", plan.seq_len or "-"],
            ["global batch (sequences)", plan.global_batch],
            ["tokens per step", est.tokens_per_step], ["precision", plan.precision.value],
            ["cluster", c.name], ["devices", c.num_devices], ["nodes", c.num_nodes],
            ["device types", ", ".join(c.device_types)], ["sites", ", ".join(c.sites)],
            ["memory fraction", est.memory_fraction]],
            table_id="inputs", text_columns=(0, 1)),
        "<h2>Prediction</h2>",
        _table(["step (s)", "tokens/s", "TFLOP/s per GPU", "MFU", "HFU", "peak memory (GiB)",
                "fits"],
               [[est.step_time_s, est.tokens_per_s, est.model_tflops_per_gpu, f"{est.mfu:.1%}",
                 f"{est.hfu:.1%}", est.peak_memory_bytes / _GiB, est.fits]],
               table_id="prediction", text_columns=()),
    ]
    if not est.fits:
        parts.append('<p class="bad">This plan does not fit in memory.</p>')
    replicas = (", ".join(map(str, plan.replica_batch)) if len(set(plan.replica_batch)) > 1
                else str(plan.replica_batch[0]))
    parts += [
        "<h2>Layout</h2>",
        f"<p>{_esc(plan_label(plan))}; micro-batch {plan.micro_batch} x "
        f"{plan.num_micro_batches} per replica; replica batches "
        f"{_esc(replicas)}.</p>",
        _layout_table(plan, cluster, graph),
        "<h2>Step time breakdown</h2>", _breakdown_table(est), _comm_table(est),
    ]
    if figures:
        from .plots import plot_schedule
        parts += ["<h2>Pipeline schedule</h2>" if plan.pp > 1 else "<h2>Step timeline</h2>",
                  _image(plot_schedule(plan), "pipeline schedule", "schedule")]
    parts += ["<h2>Memory per pipeline rank</h2>", _memory_table(est)]
    if figures:
        from .plots import plot_memory
        parts.append(_image(plot_memory(plan), "memory per pipeline rank", "memory-plot"))
    if runners:
        from ._text import plan_differences
        parts += ["<h2>Ranked plans</h2>", _runners_up_table([plan, *runners]),
                  "<h3>Why it won: what each runner-up changes</h3>",
                  '<ul id="why-it-won">' + "".join(
                      f"<li>#{i} {_esc(plan_label(p))}: "
                      f"{_esc('; '.join(plan_differences(plan, p)) or 'the same layout')}</li>"
                      for i, p in enumerate(runners, start=2)) + "</ul>"]
        if figures and all(p.estimate is not None for p in runners):
            from .plots import plot_top_k
            parts.append(_image(plot_top_k([plan, *runners]), "ranked plans", "top-k-plot"))
    if est.notes:
        parts += ["<h2>Notes</h2>", "<ul>" + "".join(f"<li>{_esc(n)}</li>" for n in est.notes)
                  + "</ul>"]
    from ._text import LEGEND
    parts += ["<h2>Legend</h2>",
              _table(["term", "meaning"], [list(row) for row in LEGEND], table_id="legend",
                     text_columns=(0, 1)),
              f"<p><small>autoplan {_esc(__version__)}</small></p>", "</body></html>", ""]
    return "\n".join(parts)


def write_plan_report(plan, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """Write :func:`plan_report_html` to ``path`` atomically."""
    atomic_write_text(path, plan_report_html(plan, **kwargs))
