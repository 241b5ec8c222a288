"""Schedules laid out operation by operation, the figures, and the HTML report."""

from __future__ import annotations

import base64
import re

import pytest

import autoplan
from autoplan import Plan, Strategy
from autoplan.cost import BREAKDOWN_KEYS, pipeline_time
from autoplan.errors import ConfigError
from autoplan.models import GPT, GPTConfig
from autoplan.report import (BlockKind, plan_report_html, plan_stage_table, plot_memory,
                             plot_scaling, plot_schedule, plot_top_k, save_figure,
                             schedule_timeline, simulate_schedule, whatif, write_plan_report)
from autoplan.report.plots import MEMORY_KINDS, figure_png
from autoplan.strategy import Schedule

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ schedules (exact)
def _check_valid(tl):
    """Every (micro-batch, stage) runs F and B once; dependencies and ranks never overlap."""
    ops = {(b.kind, b.micro_batch, b.stage): b for b in tl.blocks if b.micro_batch >= 0}
    stages = {b.stage for b in tl.blocks if b.stage >= 0}
    for mb in range(tl.micro_batches):
        for k in stages:
            f, bw = ops[(BlockKind.FORWARD, mb, k)], ops[(BlockKind.BACKWARD, mb, k)]
            if k > 0:
                assert f.start_s >= ops[(BlockKind.FORWARD, mb, k - 1)].end_s - 1e-12
            if k < max(stages):
                assert bw.start_s >= ops[(BlockKind.BACKWARD, mb, k + 1)].end_s - 1e-12
            assert bw.start_s >= f.end_s - 1e-12
            w = ops.get((BlockKind.WEIGHT, mb, k))
            if w is not None:
                assert w.start_s >= bw.end_s - 1e-12
    for p in range(tl.pp):
        blocks = tl.of_rank(p)
        for a, b in zip(blocks, blocks[1:]):
            assert b.start_s >= a.end_s - 1e-12, (p, a, b)


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
@pytest.mark.parametrize("pp, m", [(1, 3), (2, 4), (4, 8), (4, 5), (8, 16)])
def test_gpipe_and_1f1b_match_the_cost_formula(schedule, pp, m):
    # equal ranks, F = 1, B = 2: (m + pp - 1) * 3
    tl = simulate_schedule(schedule, [1.0] * pp, [2.0] * pp, m)
    assert tl.pipeline_s == pytest.approx(pipeline_time(schedule, [3.0] * pp, m), rel=1e-12)
    assert tl.pipeline_s == pytest.approx((m + pp - 1) * 3.0, rel=1e-12)
    _check_valid(tl)
    assert len(tl.blocks) == 2 * pp * m


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 12, 3), (8, 16, 2)])
def test_interleaved_matches_the_cost_formula(pp, m, v):
    # m t + (pp - 1) t / v  (Narayanan et al. 2021, Sec. 2.2.2)
    tl = simulate_schedule(Schedule.INTERLEAVED, [1.0] * pp, [2.0] * pp, m, virtual_stages=v)
    expected = pipeline_time(Schedule.INTERLEAVED, [3.0] * pp, m, virtual_stages=v)
    assert tl.pipeline_s == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(m * 3.0 + (pp - 1) * 3.0 / v)
    _check_valid(tl)
    assert len(tl.blocks) == 2 * pp * m * v


def test_1f1b_order_and_activations_in_flight():
    pp, m = 4, 8
    tl = simulate_schedule(Schedule.ONE_F_ONE_B, [1.0] * pp, [2.0] * pp, m)
    # the last rank alternates from the start; rank p runs pp - p - 1 warm-up forwards
    last = [(b.kind.value[0], b.micro_batch) for b in tl.of_rank(pp - 1)]
    assert last[:4] == [("f", 0), ("b", 0), ("f", 1), ("b", 1)]
    for p in range(pp):
        kinds = [b.kind for b in tl.of_rank(p)]
        assert kinds[:pp - p] == [BlockKind.FORWARD] * (pp - p)
        held = peak = 0
        for k in kinds:
            held += 1 if k is BlockKind.FORWARD else -1
            peak = max(peak, held)
        assert peak == pp - p          # autoplan.cost.in_flight for 1F1B


def test_gpipe_holds_every_micro_batch():
    tl = simulate_schedule(Schedule.GPIPE, [1.0] * 3, [2.0] * 3, 5)
    first = [b.kind for b in tl.of_rank(0)]
    assert first == [BlockKind.FORWARD] * 5 + [BlockKind.BACKWARD] * 5


def test_zero_bubble_is_between_the_ideal_and_1f1b():
    pp, m = 4, 8
    zb = simulate_schedule(Schedule.ZERO_BUBBLE, [1.0] * pp, [2.0] * pp, m, virtual_stages=2)
    one = simulate_schedule(Schedule.ONE_F_ONE_B, [1.0] * pp, [2.0] * pp, m)
    _check_valid(zb)
    assert m * 3.0 <= zb.pipeline_s < one.pipeline_s
    assert sum(b.kind is BlockKind.WEIGHT for b in zb.blocks) == pp * m * 2
    # W is half of each chunk's backward (weight_fraction 0.5): 0.5 s of a 1 s chunk backward
    w = next(b for b in zb.blocks if b.kind is BlockKind.WEIGHT)
    assert w.duration_s == pytest.approx(0.5)


def test_uneven_ranks_and_tails():
    tl = simulate_schedule(Schedule.ONE_F_ONE_B, [1.0, 1.5, 1.0], [2.0, 3.0, 2.0], 6,
                           tail_s=[[(BlockKind.GRAD_SYNC, 0.5), (BlockKind.OPTIMIZER, 0.25)]] * 3)
    _check_valid(tl)
    # below: the slow rank's work, after rank 0's first forward and before its last
    # backward; above: the closed formula (m - 1) max t + sum t
    assert 6 * 4.5 + 1.0 + 2.0 <= tl.pipeline_s <= pipeline_time(Schedule.ONE_F_ONE_B,
                                                                  [3.0, 4.5, 3.0], 6)
    for p in range(3):
        tail = tl.of_rank(p)[-2:]
        assert [b.kind for b in tail] == [BlockKind.GRAD_SYNC, BlockKind.OPTIMIZER]
        assert tail[1].end_s == pytest.approx(tail[0].start_s + 0.75)
    assert tl.end_s == pytest.approx(max(b.end_s for b in tl.blocks))


def test_comm_fraction_marks_the_end_of_each_block():
    tl = simulate_schedule(Schedule.ONE_F_ONE_B, [1.0, 1.0], [2.0, 2.0], 2, comm_fraction=0.25)
    for b in tl.blocks:
        assert b.comm_s == pytest.approx(0.25 * b.duration_s)


@pytest.mark.parametrize("kwargs, match", [
    (dict(forward_s=[1.0], backward_s=[1.0, 2.0], m=2), "one entry per pipeline rank"),
    (dict(forward_s=[1.0], backward_s=[1.0], m=0), "positive integer"),
    (dict(forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], m=2, stage_ranks=[0, 0]), "every rank"),
    (dict(forward_s=[1.0], backward_s=[1.0], m=2, comm_fraction=2.0), "comm_fraction"),
])
def test_simulate_rejects_bad_input(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        simulate_schedule(Schedule.ONE_F_ONE_B, **kwargs)


# ------------------------------------------------------------------ real plans
@pytest.fixture(scope="module")
def graph():
    return autoplan.trace(GPT(GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=8)),
                          seq_len=64)


@pytest.fixture(scope="module")
def cluster():
    return autoplan.load_cluster("a100-sxm4-80gb")


def _plan(graph, cluster, **kw):
    strategy = Strategy(**{"dp": 2, "pp": 4, "micro_batch": 1, "global_batch": 16, **kw})
    p = Plan.from_strategy(graph, cluster, strategy)
    return p.with_estimate(autoplan.estimate_plan(graph, cluster, p))


@pytest.fixture(scope="module")
def plans(graph, cluster):
    return {
        "1f1b": _plan(graph, cluster, schedule="1f1b"),
        "gpipe": _plan(graph, cluster, schedule="gpipe"),
        "interleaved": _plan(graph, cluster, schedule="interleaved", virtual_stages=2),
        "zero_bubble": _plan(graph, cluster, schedule="zero_bubble", virtual_stages=2),
    }


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "interleaved", "zero_bubble"])
def test_timeline_of_a_plan(plans, name):
    p = plans[name]
    tl = schedule_timeline(p)
    est = p.estimate
    assert tl.pp == p.pp == 4 and tl.micro_batches == p.num_micro_batches == 8
    assert tl.predicted_step_s == est.step_time_s
    _check_valid(tl)
    per_mb = [b for b in tl.blocks if b.micro_batch >= 0]
    kinds = 3 if name == "zero_bubble" else 2
    assert len(per_mb) == kinds * len(p.stages) * p.num_micro_batches
    # blocks of stage k run on the plan's rank of stage k
    assert all(b.rank == p.stages[b.stage].rank for b in per_mb)
    # each rank's micro-batch work equals the Estimate's forward + backward per micro-batch
    for s in est.stages:
        work = sum(b.duration_s for b in per_mb if b.rank == s.rank)
        assert work == pytest.approx(p.num_micro_batches * (s.forward_s + s.backward_s), rel=1e-9)
    if name != "zero_bubble":     # the closed formula bounds the exact layout from above
        assert tl.pipeline_s <= est.step_time_s * (1 + 1e-9)


def test_timeline_needs_an_estimate(graph, cluster):
    p = Plan.from_strategy(graph, cluster, Strategy(dp=8, global_batch=8))
    with pytest.raises(ConfigError, match="no estimate"):
        schedule_timeline(p)


def _collections(fig):
    ax = fig.axes[0]
    return [c for c in ax.collections if c.get_gid()]


def test_plot_schedule_draws_every_block(plans):
    p = plans["interleaved"]
    tl = schedule_timeline(p)
    fig = plot_schedule(p)
    ax = fig.axes[0]
    assert len(ax.get_yticks()) == p.pp
    drawn = {}
    for c in _collections(fig):
        kind, rank, chunk = c.get_gid().split("/")
        drawn[(kind, int(rank), int(chunk))] = len(c.get_paths())
    # one rectangle per block: forward and backward of each chunk of each rank
    for rank in range(p.pp):
        for chunk in range(p.virtual_stages):
            assert drawn[("forward", rank, chunk)] == p.num_micro_batches
            assert drawn[("backward", rank, chunk)] == p.num_micro_batches
    total = sum(n for (kind, _, _), n in drawn.items() if kind != "comm")
    assert total == len(tl.blocks)
    assert any(line.get_xdata()[0] == pytest.approx(p.estimate.step_time_s) for line in ax.lines)


def test_plot_memory_stacks_every_kind_per_rank(plans):
    p = plans["1f1b"]
    fig = plot_memory(p)
    ax = fig.axes[0]
    assert len(ax.containers) == len(MEMORY_KINDS)
    assert all(len(c) == p.pp for c in ax.containers)
    tops = [sum(c[i].get_height() for c in ax.containers) for i in range(p.pp)]
    for top, s in zip(tops, p.estimate.stages):
        assert top == pytest.approx(s.peak_memory_bytes / 2**30, rel=1e-9)
    # the capacity and the usable share over each bar
    assert len(ax.collections) == 2 * p.pp
    assert plot_memory(p.estimate).axes[0].containers[0].patches[0].get_height() == \
        ax.containers[0].patches[0].get_height()


def test_plot_top_k_bars_sum_to_step_time(plans):
    ps = [plans["1f1b"], plans["interleaved"], plans["gpipe"]]
    fig = plot_top_k(ps)
    ax = fig.axes[0]
    assert len(ax.containers) == len(BREAKDOWN_KEYS)
    assert all(len(c) == 3 for c in ax.containers)
    for i, p in enumerate(ps):
        assert sum(c[i].get_height() for c in ax.containers) == \
            pytest.approx(p.estimate.step_time_s, rel=1e-9)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0].startswith("#1\n") and "1f1b" in labels[0]
    with pytest.raises(ConfigError, match="labels"):
        plot_top_k(ps, labels=["a"])


def test_plot_top_k_expands_runners_up(graph, cluster):
    best = autoplan.plan(graph, cluster, global_batch=16, top_k=3)
    n = 1 + len(best.runners_up)
    fig = plot_top_k(best)
    assert all(len(c) == n for c in fig.axes[0].containers)


def test_plot_scaling_lines(graph):
    df = whatif(graph, [("a100-sxm4-80gb", n) for n in (1, 2, 4)], global_batch=lambda g: 2 * g)
    fig = plot_scaling(df)
    ax = fig.axes[0]
    solid = [l for l in ax.lines if l.get_linestyle() == "-"]
    ideal = [l for l in ax.lines if l.get_linestyle() == ":"]
    assert len(solid) == 1 and len(ideal) == 1
    assert list(solid[0].get_xdata()) == [8, 16, 32]
    assert list(solid[0].get_ydata()) == df["tokens_per_s"].tolist()
    y0 = df["tokens_per_s"].iloc[0]
    assert list(ideal[0].get_ydata()) == pytest.approx([y0, 2 * y0, 4 * y0])
    # two batch series on the same GPU counts: two lines, split by batch
    df2 = whatif(graph, [("a100-sxm4-80gb", n) for n in (1, 2)], global_batch=[16, 32])
    assert len([l for l in plot_scaling(df2, ideal=False).axes[0].lines
                if l.get_linestyle() == "-"]) == 2
    with pytest.raises(ConfigError, match="whatif"):
        plot_scaling(df[["gpus"]])


def test_figures_save_atomically_and_deterministically(plans, tmp_path):
    fig = plot_memory(plans["1f1b"])
    png = figure_png(fig)
    assert png.startswith(PNG_MAGIC) and png == figure_png(plot_memory(plans["1f1b"]))
    save_figure(fig, tmp_path / "m.png")
    save_figure(fig, tmp_path / "m.svg")
    assert (tmp_path / "m.png").read_bytes() == png
    assert (tmp_path / "m.svg").read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.png", "m.svg"]   # no temp files left
    plot_schedule(plans["gpipe"], path=tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes().startswith(PNG_MAGIC)


# ------------------------------------------------------------------ tables and HTML
def test_stage_table_marks_site_crossings(graph):
    sites = autoplan.load_cluster("two-sites")
    strategy = Strategy(dp=8, tp=4, pp=2, global_batch=16)
    df = plan_stage_table(Plan.from_strategy(graph, sites, strategy), sites, graph)
    assert df["sites"].tolist() == ["east", "west"]
    assert df["crosses_site"].tolist() == [False, True]
    assert df["blocks"].sum() == 8 and df["layers"].sum() == len(graph.layers)
    # pipelines inside each site: data parallelism crosses, the pipeline does not
    devices = tuple(d for st in range(2) for site in (0, 32)
                    for d in range(site + st * 16, site + st * 16 + 16))
    df = plan_stage_table(Plan.from_strategy(graph, sites, strategy, devices=devices), sites)
    assert df["sites"].tolist() == ["east+west"] * 2 and not df["crosses_site"].any()


def test_html_report_is_self_contained(plans, graph, cluster):
    p = plans["interleaved"]
    page = plan_report_html(p, cluster=cluster, graph=graph)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for table_id in ("inputs", "prediction", "stages", "breakdown", "communication", "memory"):
        assert f'<table id="{table_id}">' in page
    # one layout row per virtual stage, one memory row per pipeline rank
    stages = page.split('<table id="stages">')[1].split("</table>")[0]
    assert stages.count("<tr>") == 1 + len(p.stages)
    memory = page.split('<table id="memory">')[1].split("</table>")[0]
    assert memory.count("<tr>") == 1 + p.pp
    images = dict(re.findall(r'<img id="([^"]+)" alt="[^"]*" src="data:image/png;base64,([^"]+)"', page))
    assert set(images) == {"schedule", "memory-plot"}
    assert all(base64.b64decode(v).startswith(PNG_MAGIC) for v in images.values())
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert p.summary().split(":")[0] in page
    assert page == plan_report_html(p, cluster=cluster, graph=graph)     # deterministic


def test_html_report_ranks_runners_up(graph, cluster, tmp_path):
    best = autoplan.plan(graph, cluster, global_batch=16, top_k=3)
    path = tmp_path / "report.html"
    write_plan_report(best, path, figures=False)
    page = path.read_text()
    assert '<table id="top-k">' in page and "<img" not in page
    ranked = page.split('<table id="top-k">')[1].split("</table>")[0]
    assert ranked.count("<tr>") == 1 + 1 + len(best.runners_up)
    why = page.split('<ul id="why-it-won">')[1].split("</ul>")[0]
    assert why.count("<li>") == len(best.runners_up) and "=&gt; step" in why
    legend = page.split('<table id="legend">')[1].split("</table>")[0]
    assert "rc-selective" in legend and "zero_bubblexV" in legend


def test_html_escapes_and_needs_an_estimate(graph, cluster):
    p = Plan.from_strategy(graph, cluster, Strategy(dp=8, global_batch=8))
    with pytest.raises(ConfigError, match="estimate"):
        plan_report_html(p)
    est = autoplan.estimate_plan(graph, cluster, p)
    page = plan_report_html(p.with_estimate(est), title="<b>&</b>", figures=False)
    assert "<title>&lt;b&gt;&amp;&lt;/b&gt;</title>" in page


def _tick_boxes(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return [t.get_window_extent(renderer) for t in fig.axes[0].get_xticklabels() if t.get_text()]


@pytest.mark.parametrize("pp", [4, 16, 64])
def test_plot_memory_labels_never_overlap(cluster, pp):
    g = autoplan.trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=pp)),
                       seq_len=16)
    big = autoplan.load_cluster("a100-sxm4-80gb", nodes=8).subset(range(pp))
    p = _plan(g, big, dp=1, pp=pp, global_batch=pp)
    boxes = _tick_boxes(plot_memory(p))
    assert len(boxes) == pp
    for a, b in zip(boxes, boxes[1:]):
        assert a.x1 <= b.x0 + 0.5, (a, b)       # left to right, no overlap (half a pixel)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "interleaved", "zero_bubble"])
def test_schedule_bars_end_by_the_predicted_step(plans, name):
    fig = plot_schedule(plans[name])
    ax = fig.axes[0]
    line = [l.get_xdata()[0] for l in ax.lines][0]
    ends = [path.get_extents().x1 for c in _collections(fig) for path in c.get_paths()]
    assert ends and max(ends) <= line * (1 + 1e-9)


def test_zero_bubble_timeline_runs_torchs_zbv_order():
    """The zero-bubble chart lays out torch's own ScheduleZBVZeroBubble order (what the
    runtime runs), not a stand-in: each rank's F/I/W sequence is torch's."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    pp, m = 4, 8
    tl = simulate_schedule("zero_bubble", [4.0] * pp, [8.0] * pp, m, virtual_stages=2,
                           stage_ranks=list(range(pp)) + list(reversed(range(pp))),
                           weight_fraction=0.4)
    sched = object.__new__(ScheduleZBVZeroBubble)
    sched.pp_group_size, sched.n_local_stages, sched.num_stages = pp, 2, 2 * pp
    sched._n_microbatches = sched.n_microbatches = m
    letter = {"forward": "F", "backward": "I", "weight": "W"}
    for p in range(pp):
        want = [str(a) for a in sched._calculate_single_rank_operations(p) if a is not None]
        got = [f"{b.stage}{letter[b.kind.value]}{b.micro_batch}"
               for b in sorted(tl.of_rank(p), key=lambda b: b.start_s) if b.micro_batch >= 0]
        assert got == want
