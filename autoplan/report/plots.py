"""Figures of plans, estimates and what-if tables (matplotlib, Agg backend).

Every function returns a :class:`matplotlib.figure.Figure` drawn on its own
Agg canvas, without pyplot's global state (nothing leaks between calls, no
display is needed, the process-wide backend is left alone) and, given
``path``, also writes it atomically; the format follows the file name
(``.png``, ``.svg``, ``.pdf``).

* :func:`plot_schedule` -- the pipeline schedule as a timeline per rank
  (:func:`autoplan.report.schedule_timeline`).
* :func:`plot_memory` -- peak memory per pipeline rank by kind, with each
  device's capacity and the usable share.
* :func:`plot_scaling` -- throughput against GPU count from a
  :func:`autoplan.report.whatif` table, with ideal linear scaling.
* :func:`plot_top_k` -- ranked plans side by side, step time split by kind.
"""

from __future__ import annotations

import io
import os
from typing import Any, Sequence

from .._optional import require

matplotlib = require("matplotlib", "figures")       # one line with the pip install, not a traceback
import matplotlib.ticker  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ..cost.result import BREAKDOWN_KEYS, Estimate
from ..errors import ConfigError
from ..records import atomic_write_bytes
from ._text import model_name, plan_label
from .timeline import BlockKind, Timeline, schedule_timeline

__all__ = ["plot_schedule", "plot_memory", "plot_scaling", "plot_top_k", "save_figure",
           "figure_png", "MEMORY_KINDS", "SCHEDULE_COLORS", "BREAKDOWN_COLORS"]

_GiB = float(2**30)

#: Memory kinds of :class:`~autoplan.cost.MemoryBreakdown`, bottom to top, and their labels.
MEMORY_KINDS: tuple[tuple[str, str], ...] = (
    ("params_bytes", "parameters"), ("grads_bytes", "gradients"),
    ("optimizer_bytes", "optimizer states"), ("activations_bytes", "activations"),
    ("buffers_bytes", "buffers"), ("reserve_bytes", "runtime reserve"))

_MEMORY_COLORS = ("#4c72b0", "#55a868", "#8172b2", "#dd8452", "#937860", "#bbbbbb")

SCHEDULE_COLORS: dict[BlockKind, str] = {
    BlockKind.FORWARD: "#4c72b0", BlockKind.BACKWARD: "#55a868", BlockKind.WEIGHT: "#b5d9a8",
    BlockKind.GRAD_SYNC: "#c44e52", BlockKind.OPTIMIZER: "#8172b2"}
_COMM_COLOR = "#7f7f7f"

BREAKDOWN_COLORS: dict[str, str] = {
    "compute_s": "#4c72b0", "recompute_s": "#64b5cd", "tp_comm_s": "#dd8452",
    "cp_comm_s": "#da8bc3", "ep_comm_s": "#8c8c00", "dp_comm_s": "#c44e52", "pp_comm_s": "#937860",
    "bubble_s": "#cccccc", "optimizer_s": "#8172b2"}


# ------------------------------------------------------------------ output
def figure_png(fig: Figure, *, dpi: int = 100) -> bytes:
    """The figure as PNG bytes, byte-identical for identical figures (no timestamps)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def save_figure(fig: Figure, path: str | os.PathLike[str], *, dpi: int = 100) -> None:
    """Write ``fig`` to ``path`` atomically (temporary file, then rename); format from the suffix."""
    path = os.fspath(path)
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    buf = io.BytesIO()
    metadata: dict[str, Any] = {"png": {"Software": None}, "svg": {"Date": None},
                                "pdf": {"CreationDate": None, "ModDate": None}}.get(fmt, {})
    fig.savefig(buf, format=fmt, dpi=dpi, metadata=metadata)
    atomic_write_bytes(path, buf.getvalue())


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _finish(fig: Figure, path: str | os.PathLike[str] | None) -> Figure:
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


# ------------------------------------------------------------------ helpers
def _estimate_of(obj: Any) -> Estimate:
    if isinstance(obj, Estimate):
        return obj
    est = getattr(obj, "estimate", None)
    if est is None:
        raise ConfigError(f"{type(obj).__name__} has no estimate: pass a Plan from autoplan.plan(), "
                          "plan.with_estimate(autoplan.estimate_plan(graph, cluster, plan)), or an "
                          "Estimate")
    return est


# ------------------------------------------------------------------ schedule
def plot_schedule(plan: Any, *, estimate: Estimate | None = None, path: str | None = None,
                  width: float = 12.0, label_micro_batches: bool | None = None) -> Figure:
    """The pipeline schedule of ``plan``: one row per pipeline rank, time to the right.

    Forward blocks (blue, darker for later chunks), backward (green), deferred
    weight gradients under zero bubble (light green), the exposed
    communication at the end of each block (grey hatch), then each rank's
    exposed gradient reduction (red) and optimizer step (purple).  The dashed
    line is the Estimate's predicted step time.

    Parameters
    ----------
    plan : Plan
        With an estimate (from :func:`autoplan.plan`), or pass ``estimate``.
    label_micro_batches : bool, optional
        Write the micro-batch number in each block (default: when there are at
        most 32 blocks per rank).

    Returns
    -------
    Figure
        Its axes holds one ``broken_barh`` collection per (kind, rank, chunk), with
        gid ``"kind/rank/chunk"`` (``"comm/rank/0"`` for the communication hatch).
    """
    tl = schedule_timeline(plan, estimate)
    return _draw_timeline(tl, title=f"{model_name(plan)}: {plan_label(plan)}", path=path,
                          width=width, label_micro_batches=label_micro_batches)


def _shade(color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Darker for later chunks, so the interleaved chunks can be told apart."""
    from matplotlib.colors import to_rgb
    r, g, b = to_rgb(color)
    f = 1.0 - 0.45 * (chunk / max(1, chunks - 1)) if chunks > 1 else 1.0
    return (r * f, g * f, b * f)


def _draw_timeline(tl: Timeline, *, title: str, path: str | None, width: float,
                   label_micro_batches: bool | None) -> Figure:
    height = max(3.0, 1.4 + 0.45 * tl.pp)
    fig = _new_figure(width, height)
    ax = fig.add_subplot(1, 1, 1)
    v = tl.virtual_stages
    per_rank = tl.micro_batches * v * (3 if tl.schedule.value == "zero_bubble" else 2)
    if label_micro_batches is None:
        label_micro_batches = per_rank <= 32
    for p in range(tl.pp):
        blocks = tl.of_rank(p)
        y = tl.pp - 1 - p
        groups: dict[tuple[BlockKind, int], list[tuple[float, float]]] = {}
        comm: list[tuple[float, float]] = []
        for b in blocks:
            chunk = (b.stage // tl.pp) if b.stage >= 0 else 0
            groups.setdefault((b.kind, chunk), []).append((b.start_s, b.duration_s))
            if b.comm_s > 0 and b.kind is not BlockKind.GRAD_SYNC:
                comm.append((b.end_s - b.comm_s, b.comm_s))
        for (kind, chunk), spans in sorted(groups.items(), key=lambda kv: (kv[0][0].value, kv[0][1])):
            coll = ax.broken_barh(spans, (y - 0.4, 0.8),
                                  facecolors=_shade(SCHEDULE_COLORS[kind], chunk, v),
                                  edgecolor="white", linewidth=0.3)
            coll.set_gid(f"{kind.value}/{p}/{chunk}")
        if comm:
            coll = ax.broken_barh(comm, (y - 0.4, 0.8), facecolors="none", edgecolor=_COMM_COLOR,
                                  hatch="////", linewidth=0.0)
            coll.set_gid(f"comm/{p}/0")
        if label_micro_batches:
            for b in blocks:
                if b.micro_batch >= 0:
                    ax.text(b.start_s + b.duration_s / 2, y, str(b.micro_batch), ha="center",
                            va="center", fontsize=7, color="white")
    if tl.predicted_step_s is not None:
        ax.axvline(tl.predicted_step_s, color="black", linestyle="--", linewidth=1.0)
    ax.set_yticks(range(tl.pp))
    ax.set_yticklabels([f"rank {tl.pp - 1 - i}" for i in range(tl.pp)])
    ax.set_ylim(-0.6, tl.pp - 0.4)
    ax.set_xlim(0, max(tl.end_s, tl.predicted_step_s or 0.0) * 1.01)
    ax.set_xlabel("time in the step (s)")
    kinds = {b.kind for b in tl.blocks}
    handles = [Patch(facecolor=SCHEDULE_COLORS[k], label=k.value.replace("_", " "))
               for k in BlockKind if k in kinds]
    if any(b.comm_s > 0 and b.kind is not BlockKind.GRAD_SYNC for b in tl.blocks):
        handles.append(Patch(facecolor="none", edgecolor=_COMM_COLOR, hatch="////",
                             label="exposed comm"))
    if tl.predicted_step_s is not None:
        from matplotlib.lines import Line2D
        handles.append(Line2D([0], [0], color="black", linestyle="--", label="predicted step"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
              frameon=False)
    ax.set_title(f"{title}\n{_schedule_caption(tl)}", fontsize=10)
    return _finish(fig, path)


def _schedule_caption(tl: Timeline) -> str:
    """``1f1b x2, 8 micro-batches, 4 pipeline ranks``; without a pipeline, what runs instead
    (no schedule: each micro-batch's forward then its backward)."""
    mbs = f"{tl.micro_batches} micro-batch{'es' if tl.micro_batches != 1 else ''}"
    if tl.pp == 1:
        return f"no pipeline: {mbs} per step, each forward then backward"
    sched = tl.schedule.value + (f" x{tl.virtual_stages}" if tl.virtual_stages > 1 else "")
    return f"{sched}, {mbs}, {tl.pp} pipeline ranks"


# ------------------------------------------------------------------ memory
def plot_memory(plan_or_estimate: Any, *, path: str | None = None) -> Figure:
    """Peak memory per pipeline rank, stacked by kind, with each device's capacity.

    The solid marker over each bar is the device's memory; the dashed one the
    share a plan may use (``memory_fraction``).  Bars over the dashed line do not fit.

    Returns
    -------
    Figure
        One bar container per memory kind (:data:`MEMORY_KINDS`), one bar per rank.
    """
    est = _estimate_of(plan_or_estimate)
    n = len(est.stages)
    labels = [f"rank {s.rank}\n{s.device_type}\n{s.layers} layers" for s in est.stages]
    # about 0.06 in per character at 7 pt: as wide as the widest label, up to 16 in; past
    # that the labels turn upright so neighbours never overlap
    per_bar = max(0.7, 0.065 * max(len(line) for lab in labels for line in lab.split("\n")))
    width = min(16.0, 2.8 + per_bar * n)
    upright = (width - 2.8) / n < per_bar
    fig = _new_figure(max(5.0, width), 4.2 + (1.2 if upright else 0.0))
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(n))
    bottom = [0.0] * n
    for (key, label), color in zip(MEMORY_KINDS, _MEMORY_COLORS):
        vals = [getattr(s.memory, key) / _GiB for s in est.stages]
        ax.bar(xs, vals, bottom=bottom, color=color, label=label, width=0.7)
        bottom = [b + x for b, x in zip(bottom, vals)]
    caps = [s.memory_capacity_bytes / _GiB for s in est.stages]
    for x, cap in zip(xs, caps):
        ax.hlines(cap, x - 0.42, x + 0.42, colors="black", linewidth=1.5)
        ax.hlines(cap * est.memory_fraction, x - 0.42, x + 0.42, colors="black",
                  linestyles="dashed", linewidth=1.0)
    for x, s, top in zip(xs, est.stages, bottom):
        if not s.fits:
            ax.text(x, top, "over", ha="center", va="bottom", color="#c44e52", fontsize=8)
    from matplotlib.lines import Line2D
    handles, _ = ax.get_legend_handles_labels()
    handles = list(reversed(handles)) + [
        Line2D([0], [0], color="black", linewidth=1.5, label="device memory"),
        Line2D([0], [0], color="black", linestyle="dashed",
               label=f"usable ({est.memory_fraction:.0%})")]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
              frameon=False)
    ax.set_xticks(xs)
    if upright:
        ax.set_xticklabels([lab.replace("\n", " | ") for lab in labels], fontsize=7, rotation=90)
    else:
        ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("peak memory per device (GiB)")
    ax.set_ylim(0, max(max(caps), max(bottom)) * 1.1)
    title = "memory per pipeline rank"
    if hasattr(plan_or_estimate, "model") and not isinstance(plan_or_estimate, Estimate):
        title = f"{model_name(plan_or_estimate)}: {plan_label(plan_or_estimate)}"
    ax.set_title(title, fontsize=10)
    return _finish(fig, path)


# ------------------------------------------------------------------ scaling
def _scaling_groups(df, by: Sequence[str] | None) -> list[tuple[str, Any]]:
    """Lines of a scaling plot: (label, rows) per value of ``by``.

    Default ``by``: model, cluster and sequence length, plus the global batch
    when some GPU count has several rows (several batches per GPU count).
    """
    if by is None:
        by = [k for k in ("model", "cluster", "seq_len") if k in df.columns]
        if "global_batch" in df.columns and df.duplicated(by + ["gpus"]).any():
            by.append("global_batch")
    by = list(by)
    missing = [k for k in by if k not in df.columns]
    if missing:
        raise ConfigError(f"plot_scaling(by=...) names columns {missing} the table does not have")
    if not by:
        return [("", df)]
    out = []
    for key, rows in df.groupby(by, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        out.append((", ".join(f"batch {k}" if col == "global_batch" else str(k)
                              for col, k in zip(by, key)), rows))
    return out


def plot_scaling(df, *, by: str | Sequence[str] | None = None, ideal: bool = True,
                 path: str | None = None) -> Figure:
    """Throughput (tokens/s) against GPU count from a :func:`~autoplan.report.whatif` table.

    One solid line per group (``by``; default model, cluster and sequence
    length, and the global batch when a GPU count has several) through the
    best feasible plan at each GPU count; with ``ideal``, a dotted line of
    linear scaling from the group's smallest feasible GPU count.  GPU counts
    where nothing fits are marked with a red ``x`` on the axis.

    Returns
    -------
    Figure
        Its axes holds one solid line per group with a feasible row, plus one
        dotted ideal line for each of them (with ``ideal``).
    """
    required = {"gpus", "tokens_per_s", "fits"}
    missing = required - set(df.columns)
    if missing:
        raise ConfigError(f"plot_scaling() needs a whatif() table; columns {sorted(missing)} are "
                          "missing")
    if isinstance(by, str):
        by = [by]
    if "rank" in df.columns:
        df = df[df["rank"].fillna(1) == 1]
    fig = _new_figure(7.5, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    any_failed = False
    for i, (label, rows) in enumerate(_scaling_groups(df, by)):
        color = colors[i % len(colors)]
        ok = rows[rows["fits"].astype(bool)]
        best = ok.groupby("gpus", sort=True)["tokens_per_s"].max()
        gpus = [int(g) for g in best.index]
        if gpus:
            ax.plot(gpus, best.to_list(), marker="o", color=color, label=label or None)
        if ideal and gpus:
            g0, t0 = gpus[0], float(best.iloc[0])
            gs = sorted({int(g) for g in rows["gpus"] if int(g) >= g0})
            ax.plot(gs, [t0 * g / g0 for g in gs], linestyle=":", color=color)
        failed = sorted({int(g) for g in rows["gpus"]} - set(gpus))
        if failed:
            any_failed = True
            ax.plot(failed, [0.0] * len(failed), linestyle="none", marker="x", color="#c44e52",
                    markersize=8, clip_on=False, transform=ax.get_xaxis_transform())
    from matplotlib.lines import Line2D
    handles, _ = ax.get_legend_handles_labels()
    if ideal:
        handles.append(Line2D([0], [0], color="grey", linestyle=":", label="ideal linear"))
    if any_failed:
        handles.append(Line2D([0], [0], color="#c44e52", marker="x", linestyle="none",
                              label="nothing fits"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens / s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(handles=handles, fontsize=8)
    ax.set_title("throughput of the best plan per GPU count", fontsize=10)
    return _finish(fig, path)


# ------------------------------------------------------------------ top-k
def _wrap(text: str, width: int = 22) -> str:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])


def _split_text(plan: Any) -> str:
    """Layers per pipeline rank (``\nlayers 41+41``), for plans that differ only there."""
    stages = getattr(plan, "stages", None)
    if not stages or getattr(plan, "pp", 1) == 1:
        return ""
    per_rank: dict[int, int] = {}
    for st in stages:
        per_rank[st.rank] = per_rank.get(st.rank, 0) + len(st.layers)
    counts = [per_rank[r] for r in sorted(per_rank)]
    if len(counts) > 8:
        return f"\nlayers {min(counts)}..{max(counts)}/rank"
    return "\nlayers " + "+".join(map(str, counts))


def plot_top_k(plans: Any, *, path: str | None = None, labels: Sequence[str] | None = None) -> Figure:
    """Ranked plans side by side: step time as a stack of its breakdown.

    Parameters
    ----------
    plans : Plan or sequence of Plan / Estimate
        A single plan brings its ``runners_up`` (``autoplan.plan(..., top_k=k)``).
    labels : sequence of str, optional
        One per plan (default: ``#rank`` and the layout).

    Returns
    -------
    Figure
        One bar container per breakdown key (:data:`autoplan.cost.BREAKDOWN_KEYS`),
        one bar per plan.
    """
    if hasattr(plans, "runners_up") or hasattr(plans, "stages") or isinstance(plans, Estimate):
        plans = [plans, *getattr(plans, "runners_up", ())]
    plans = list(plans)
    if not plans:
        raise ConfigError("plot_top_k() needs at least one plan")
    ests = [_estimate_of(p) for p in plans]
    if labels is None:
        labels = [f"#{i + 1}\n" + _wrap(plan_label(p)) + _split_text(p)
                  for i, p in enumerate(plans)]
    elif len(labels) != len(plans):
        raise ConfigError(f"{len(labels)} labels for {len(plans)} plans")
    n = len(plans)
    fig = _new_figure(max(5.0, 1.5 + 1.6 * n), 4.5)
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(n))
    bottom = [0.0] * n
    for key in BREAKDOWN_KEYS:
        vals = [e.breakdown.get(key, 0.0) for e in ests]
        ax.bar(xs, vals, bottom=bottom, color=BREAKDOWN_COLORS[key], label=key[:-2].replace("_", " "),
               width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, e in zip(xs, ests):
        ax.text(x, e.step_time_s, f"{e.step_time_s:.3g} s\nMFU {e.mfu:.0%}", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("step time (s)")
    ax.set_ylim(0, max(e.step_time_s for e in ests) * 1.2)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(list(reversed(handles)), list(reversed(names)), loc="center left",
              bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    model = model_name(plans[0]) if hasattr(plans[0], "model") else None
    ax.set_title(f"top {n} plans" + (f" for {model}" if model else ""), fontsize=10)
    return _finish(fig, path)
