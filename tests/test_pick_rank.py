"""``benchmarks/pick_rank.py`` without real runs: which layouts it takes from the search, how
it ranks them, the pick's rank, ratio and Spearman, and how runs are folded into rows (the
real runs take minutes and are not part of the suite)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import pick_rank as pr  # noqa: E402

from autoplan import load_cluster, trace  # noqa: E402


@pytest.fixture(scope="module")
def profile4(a100_x4) -> Path:
    """The shipped A100 node profile with 4 devices (the selection needs some 4-device
    cluster, not this machine's)."""
    return a100_x4("a100-x4-pick-rank")


@pytest.fixture(scope="module")
def gpt(profile4: Path):
    model = pr.build_model("gpt")
    graph = trace(model, seq_len=pr.CONFIG.seq_len)
    return model, graph, pr.select_layouts(graph, load_cluster(str(profile4)))


def test_the_pick_its_runners_up_the_other_degrees_and_the_ladder(gpt, profile4: Path):
    model, graph, rows = gpt
    pick = rows[0]
    assert pick["source"] == "pick" and pick["search_rank"] == 1
    ranked = [pick["plan"], *pick["plan"].runners_up]
    runners = [r for r in rows if r["source"] == "runner-up"]
    assert [r["search_rank"] for r in runners] == list(range(2, 2 + pr.RUNNERS_UP))
    # every degree combination the search ranked is there, each other one by its best
    keys = {pr.layout_key(p) for p in ranked}
    assert {pr.layout_key(r["plan"]) for r in rows} == keys
    for r in rows:
        if r["source"] == "degrees":
            assert r["search_rank"] == 1 + min(i for i, p in enumerate(ranked)
                                               if pr.layout_key(p) == pr.layout_key(r["plan"]))
    # ZeRO-3 and full recompute at the pick's degrees, priced
    ladder = [r for r in rows if r["source"] == "ladder"]
    blocks = {b.name for b in graph.blocks}
    got = {(lp.zero, lp.recompute.value) for r in ladder for lp in r["plan"].layers
           if lp.name in blocks}
    block_zero = next(lp.zero for lp in pick["plan"].layers if lp.name in blocks)
    assert got == {(3, "none"), (block_zero, "full")}
    assert all(pr.layout_key(r["plan"]) == pr.layout_key(pick["plan"]) for r in ladder)
    # predicted ranks 1..n in the order of the prices, labels unique
    assert len({r["label"] for r in rows}) == len(rows)
    by_price = sorted(rows, key=lambda r: r["predicted_s"])
    assert [r["predicted_rank"] for r in by_price] == list(range(1, len(rows) + 1))
    # the runtime runs every selected layout on 4 ranks (as parallelize checks before running)
    import importlib
    rt = importlib.import_module("autoplan.runtime.parallelize")
    for r in rows:
        plan = rt.resolve_plan(model, r["plan"], graph, world_size=pr.WORLD, global_batch=pr.BATCH)
        rt._check_program(model, graph, plan, graph.seq_len, True, None,
                          device=next(model.parameters()).device)


def test_spearman_exact():
    assert pr.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert pr.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert pr.ranks([3.0, 1.0, 3.0]) == [2.5, 1.0, 2.5]
    # rho = 1 - 6 sum d^2 / (n (n^2 - 1)) without ties: d = (0, 1, -1, 0) -> 1 - 12/60
    assert pr.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert pr.spearman([1, 1, 1], [1, 2, 3]) != pr.spearman([1, 1, 1], [1, 2, 3])  # NaN


def _row(label, source, predicted_s, measured_s=None, status=""):
    return {"label": label, "source": source, "predicted_s": predicted_s,
            "measured_s": measured_s, "status": status}


def test_the_picks_rank_ratio_and_spearman():
    rows = [_row("pick", "pick", 1.0, 0.210), _row("a", "runner-up", 1.1, 0.200),
            _row("b", "degrees", 1.2, 0.300), _row("c", "ladder", 1.5, 0.400),
            _row("d", "degrees", 1.3, None, "failed: boom")]
    v = pr.verdict(rows)
    assert v["pick_rank"] == 2 and v["measured"] == 4 and v["fastest"] == "a"
    assert v["ratio"] == pytest.approx(0.210 / 0.200) and v["ok"] is True   # 1.05 exactly
    assert v["rho"] == pytest.approx(0.8)
    assert [r.get("measured_rank") for r in rows] == [2, 1, 3, 4, None]
    rows[0]["measured_s"] = 0.2101
    assert pr.verdict(rows)["ok"] is False
    rows[0]["measured_s"] = 0.1
    v = pr.verdict(rows)
    assert (v["pick_rank"], v["ratio"], v["fastest"]) == (1, 1.0, "pick")
    rows[0]["measured_s"] = None   # the pick failed: no verdict
    assert pr.verdict(rows) is None


def test_runs_keep_each_layouts_fastest_step_and_say_why_one_did_not_run(monkeypatch, capsys):
    """``measure`` with the launches stood in for: the order alternates by round, a layout's
    step is its fastest over every launch, a rejected or failed layout keeps its reason and
    is not launched again."""
    plans = {}

    class FakePlan:
        def __init__(self, label):
            self.label = label
            plans[label] = self

        def to_json(self):
            return self.label

    steps = {"pick": [[0.30, 0.25], [0.22, 0.40]], "a": [[0.20], [0.21]],
             "bad": ["not runnable: StrategyError: no"], "dead": [RuntimeError("rank 2 died")]}
    launched = []

    def run_ranks(worker, world, args, timeout_s, read, *, ctx=None):
        assert world == pr.WORLD and args[0] == "gpt" and timeout_s == pr.LAYOUT_TIMEOUT_S
        launched.append(args[2])
        got = steps[args[2]].pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(pr, "_run_ranks", run_ranks)
    rows = [{"label": x, "plan": FakePlan(x)} for x in ("pick", "a", "bad", "dead")]

    class Graph:   # what measure replaces fx_graph on
        pass
    monkeypatch.setattr(pr, "replace", lambda g, **kw: g)
    pr.measure("gpt", Graph(), rows, rounds=2)
    assert launched == ["pick", "a", "bad", "dead", "a", "pick"]
    assert rows[0]["measured_s"] == 0.22 and rows[1]["measured_s"] == 0.20
    assert rows[2]["status"].startswith("not runnable: StrategyError")
    assert rows[3]["status"] == "failed: rank 2 died" and "measured_s" not in rows[3]
    assert "round 2: pick: 0.220 s" in capsys.readouterr().out


def test_no_run_profiles_this_machine_and_prints_the_selection(profile4: Path, monkeypatch,
                                                                 capsys):
    made = []

    def profile_machine(out: Path) -> Path:   # stands in for autoplan profile
        shutil.copyfile(profile4, out)
        made.append(out)
        return out

    monkeypatch.setattr(pr, "profile_machine", profile_machine)
    assert pr.main(["--no-run", "--models", "gpt", "--layouts", "2"]) == 0
    assert len(made) == 1 and not made[0].exists()   # in a temporary directory, gone
    out = capsys.readouterr().out
    assert "=== gpt" in out and "running the first 2" in out and "runner-up" in out
    assert "picked: dp" in out and "real runs skipped" in out


@pytest.mark.parametrize("argv, says", [
    (["--profile", "no-such-profile.yaml"], "no-such-profile.yaml"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--models", "bert"], "invalid choice"),
])
def test_bad_input_is_a_usage_error(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        pr.main(["--no-run", *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_profile_of_another_world_size_is_a_usage_error(a100_x4, capsys):
    import yaml
    path = a100_x4("a100-x2-pick-rank")
    data = yaml.safe_load(path.read_text())
    data["node"]["devices_per_node"] = 2
    data["network"]["nics_per_node"] = 2
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exc:
        pr.main(["--no-run", "--profile", str(path)])
    assert exc.value.code == 2 and "the profile has 2 devices" in capsys.readouterr().err


def test_the_table_shows_each_layouts_measured_rank_and_the_verdict(capsys):
    rows = [_row("pick", "pick", 1.0, 0.30), _row("a", "runner-up", 1.1, 0.20),
            _row("b", "ladder", 1.2, None, "failed: rank 1 died")]
    for i, r in enumerate(rows):
        r.update(search_rank=i + 1 if r["source"] != "ladder" else None, predicted_rank=i + 1)
    pr._print(rows, run=True)
    lines = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line.split() for line in lines[2:5]}
    assert table["a"][-1] == "1" and table["pick"][-1] == "2"   # fastest first, m.rank last
    assert table["b"][2:4] == ["-", "1.200"] and "failed: rank 1 died" in lines[4]
    assert lines[5] == ("picked: pick, measured rank 2 of 2; fastest measured a; picked/fastest "
                        "1.500 (target <= 1.05): missed")
