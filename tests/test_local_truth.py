"""``benchmarks/local_truth.py --confirm`` without real runs: which layouts it takes from the
search, how it labels and ranks them, the rank correlation and the CSV (a few seconds; the
real runs take minutes and are not part of the suite)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import local_truth as lt  # noqa: E402

from autoplan import load_cluster, trace  # noqa: E402


@pytest.fixture(scope="module")
def profile4(a100_x4) -> Path:
    """The shipped A100 node profile with 4 devices (the enumeration needs some 4-device
    cluster, not this machine's)."""
    return a100_x4("a100-x4-local-truth")


@pytest.fixture(scope="module")
def gpt_rows(profile4: Path):
    model = lt._confirm_model("gpt")
    graph = trace(model, seq_len=lt.CONFIG.seq_len)
    rows = lt.confirm_layouts(graph, load_cluster(str(profile4)))
    lt.check_runnable(model, graph, rows)
    return graph, rows


def test_the_pick_and_its_neighbourhood(gpt_rows):
    graph, rows = gpt_rows
    planned = [r for r in rows if r["plan"] is not None]
    picked = planned[0]
    assert picked["source"] == "search" and picked["search_rank"] == 1
    # ranks 1..n over the priced layouts, labels unique
    assert sorted(r["predicted_rank"] for r in planned) == list(range(1, len(planned) + 1))
    assert len({r["label"] for r in planned}) == len(planned)
    key = lt._layout_key(picked["plan"])
    searched = [r for r in rows if r["source"] == "search"]
    # the best of every degree combination the search ranked, and the sample, are there
    keys = {lt._layout_key(r["plan"]) for r in searched}
    ranked = [picked["plan"], *picked["plan"].runners_up]
    assert keys == {lt._layout_key(p) for p in ranked}
    at_pick = sum(lt._layout_key(p) == key for p in ranked)
    sampled = min(lt.CONFIRM_SAMPLE, len(ranked) - at_pick - (len(keys) - 1))
    assert len(searched) == at_pick + len(keys) - 1 + sampled
    # the ZeRO stages and recompute modes above the search's first rung, at the pick
    ladder = [r for r in rows if r["source"] == "ladder"]
    blocks = {b.name for b in graph.blocks}
    block = next(i for i, lp in enumerate(picked["plan"].layers) if lp.name in blocks)
    options = {(r["plan"].layers[block].zero, r["plan"].layers[block].recompute.value)
               for r in ladder}
    assert {(z, rc) for z in range(4) for rc in ("none", "selective", "full")} \
        - {(0, "none"), (1, "none")} <= options
    assert all(lt._layout_key(r["plan"]) == key for r in ladder)
    # everything the search ranks, the runtime runs (on this world size)
    assert not [r for r in rows if r["status"]]


def test_the_selection_is_reproducible(gpt_rows, profile4: Path):
    graph, rows = gpt_rows
    again = lt.confirm_layouts(graph, load_cluster(str(profile4)))
    assert [r["label"] for r in again] == [r["label"] for r in rows]


def test_spearman_exact():
    assert lt.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert lt.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert lt._ranks([3.0, 1.0, 3.0]) == [2.5, 1.0, 2.5]
    # rho = 1 - 6 sum d^2 / (n (n^2 - 1)) without ties: d = (0, 1, -1, 0) -> 1 - 12/60
    assert lt.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_no_run_prints_and_writes_csv(profile4: Path, tmp_path: Path, capsys):
    out = tmp_path / "rows.csv"
    assert lt.main(["--confirm", "--no-run", "--models", "gpt", "--profile", str(profile4),
                    "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "picked: dp" in text and "real runs skipped" in text
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and set(rows[0]) == set(lt.CSV_FIELDS)
    assert rows[0]["model"] == "gpt" and rows[0]["search_rank"] == "1"
    assert not list(tmp_path.glob("*.tmp"))


def test_keep_profile_keeps_what_the_pass_measured(profile4: Path, tmp_path: Path,
                                                   monkeypatch, capsys):
    """A pass that profiles the machine itself keeps that profile where ``--keep-profile``
    says (here the profiling is stood in for by a copy of a shipped profile); the flag
    without a pass that profiles, beside --profile or into a missing directory is a usage
    error (before any profiling)."""
    import shutil

    measured: list[Path] = []

    def profile_machine_4(out: Path) -> Path:
        shutil.copyfile(profile4, out)
        measured.append(out)
        return out

    monkeypatch.setattr(lt, "profile_machine_4", profile_machine_4)
    kept = tmp_path / "kept.yaml"
    assert lt.main(["--confirm", "--no-run", "--models", "gpt", "--keep-profile",
                    str(kept)]) == 0
    assert len(measured) == 1 and kept.read_bytes() == profile4.read_bytes()
    assert f"kept the profile: {kept}" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.tmp"))
    for argv, says in ((["--keep-profile", str(tmp_path / "other.yaml")], "goes with"),
                       (["--confirm", "--profile", str(profile4), "--keep-profile",
                         str(tmp_path / "other.yaml")], "measures none"),
                       (["--plain", "--keep-profile", str(tmp_path / "no" / "p.yaml")],
                        "no directory")):
        with pytest.raises(SystemExit) as exc:
            lt.main(argv)
        assert exc.value.code == 2 and says in capsys.readouterr().err, argv
    assert not measured[1:]   # none of them profiled anything


def test_live_bytes_counts_storages_at_their_current_size():
    """FSDP2 frees a layer's unsharded parameters by resizing their storages to 0 and
    gathers them again by resizing back, with no operator dispatched: the count follows
    the size (first-sight sizes counted every gathered layer until the step ended)."""
    import torch
    gathered = torch.empty(1000)                  # 4000 bytes, alive at entry
    resharded = torch.empty(250)
    resharded.untyped_storage().resize_(0)        # at entry as FSDP2 leaves it: 0 bytes
    with lt.LiveBytes() as live:
        entry = live.current
        gathered.untyped_storage().resize_(0)     # resharded after its forward
        grad = torch.ones(500)                    # 2000 bytes, an operator's output
        assert live.current == entry - 4000 + 2000
        resharded.untyped_storage().resize_(1000)  # gathered for its forward
        assert live.current == entry - 2000 + 1000
    assert live.peak == entry
    del grad


def test_plain_no_run_prices_the_single_process_step(profile4: Path, capsys):
    assert lt.main(["--plain", "--no-run", "--models", "gpt", "--profile", str(profile4)]) == 0
    lines = [l.split() for l in capsys.readouterr().out.splitlines() if l.startswith("gpt ")]
    assert [int(l[1]) for l in lines] == list(lt.PLAIN_BATCHES)
    two, four = (float(l[2]) for l in lines)
    assert two < four < 2 * two     # twice the tokens, the per-operator overhead once
    for l in lines:                 # forward, backward and optimizer add up to the step
        phases = [float(l[5 + 3 * i]) for i in range(len(lt.PLAIN_PHASES))]
        assert all(p > 0 for p in phases)
        # each of the four printed to 0.1 ms (4 decimals of a second): the sum of three
        # rounded phases is within three half-units of the rounded step
        assert sum(phases) == pytest.approx(float(l[2]), abs=2e-4)


def test_plain_measures_every_process_and_reports_a_failing_one():
    times = lt.measure_plain("gpt", 1, 2)
    assert len(times) == 2
    for t in times:
        assert set(t) == {"step", *lt.PLAIN_PHASES} and 0 < t["step"] < 60
        assert all(t[p] > 0 for p in lt.PLAIN_PHASES)
        # the medians of the phases add up to about the median step
        assert sum(t[p] for p in lt.PLAIN_PHASES) == pytest.approx(t["step"], rel=0.25)
    with pytest.raises(SystemExit, match="failed: ValueError: unknown model"):
        lt.measure_plain("nope", 1, 1)


def test_pick_against_pairs_the_pick_with_each_faster_layout_side_by_side():
    """Each round runs (pick, contender) in adjacent launches, the pick first in even rounds
    and second in odd ones; a pair's figure is the median of the pick's fastest step over the
    contender's; a failed launch drops that round's pair only."""
    steps = {0: 1.00, 1: 0.95, 2: 1.10}   # pick 0; contender 1 faster, 2 slower this pass
    orders = []

    def measure(order):
        orders.append(list(order))
        k = len(orders) - 1
        slow = 1.0 + 0.1 * k     # the machine drifts between rounds, alike for a pair
        return ["failed: timed out" if (k, i) == (2, 2) else [steps[i] * slow, steps[i] * slow * 1.3]
                for i in order]

    got = lt.pick_against(measure, 0, [1, 2], 3)
    assert orders == [[0, 1, 0, 2], [1, 0, 2, 0], [0, 1, 0, 2]]
    assert got[1] == pytest.approx(1.00 / 0.95)
    assert got[2] == pytest.approx(1.00 / 1.10)     # rounds 0 and 1 only
    assert lt.pick_against(measure, 0, [], 3) == {}


def test_the_verdict_uses_the_side_by_side_ratio(capsys):
    rows = [{"source": "search", "search_rank": 1, "label": "pick", "predicted_s": 1.0,
             "measured_s": 1.06, "error": -0.06},
            {"source": "search", "search_rank": 2, "label": "other", "predicted_s": 1.1,
             "measured_s": 1.00, "error": 0.1, "paired_ratio": 1.02}]
    lt._print_confirm(rows, True)
    out = capsys.readouterr().out
    assert "ratio 1.060" in out and "median ratio 1.020" in out
    assert "side by side: ratio 1.020 (against other) (target <= 1.05): ok" in out
    rows[1]["paired_ratio"] = 0.98
    lt._print_confirm(rows, True)
    assert "side by side: ratio 1.000 (target <= 1.05): ok" in capsys.readouterr().out
    del rows[1]["paired_ratio"]
    lt._print_confirm(rows, True)
    assert "ratio 1.060 (target <= 1.05): missed" in capsys.readouterr().out


def test_the_machine_speed_line(capsys):
    """The probe's speeds: their median and range and their rank correlation with the
    error, in the verdict; no line without probes."""
    rows = [{"source": "search", "search_rank": 1, "label": f"l{i}", "predicted_s": 1.0,
             "measured_s": 1.0 / (1 + e), "error": e, "machine_speed": s}
            for i, (e, s) in enumerate([(-0.2, 0.8), (-0.1, 0.9), (0.0, 1.0), (0.05, 1.1)])]
    line = lt.speed_summary(rows)
    assert "4 layouts: median 0.95, 0.80-1.10; Spearman with the error +1.00" in line
    # scaled: (1 + e) / speed - 1 = 0, 0, 0, -0.045
    assert "to the profile's speed: 4 of 4 within 15%, median error +0.0%" in line
    lt._print_confirm(rows, True)
    out = capsys.readouterr().out
    assert line in out
    assert "median -5.0%; 3 of 4 within 15% (target: every one)" in out
    assert lt.speed_summary([dict(r, machine_speed=None) for r in rows]) is None


def test_a_layouts_step_is_its_fastest_launch_with_that_launchs_speed(profile4: Path,
                                                                      tmp_path: Path,
                                                                      monkeypatch, capsys):
    """The run path without real runs: each launch of a layout returns its steps and the
    probe, and the row keeps the fastest step of all, the machine's speed at that launch and
    every launch's fastest step (``launch_steps_s``)."""
    reference = load_cluster(str(profile4)).profile_of(0).device.matmul_time_s(
        2 * lt.PROBE_N**3, "fp32")
    launch = {"n": 0}
    # launch k of the rounds: layout i's steps scaled by (1.2, 1.0, 1.1)[k], probe (k + 1)
    factors = (1.2, 1.0, 1.1)

    def fake_measure_many(name, graph, jobs, probes=None):
        k = launch["n"]
        launch["n"] += 1
        out = {}
        for i, _ in jobs:
            base = 0.1 * (1 + i)
            out[i] = [base * factors[k % 3] * f for f in (1.05, 1.0, 1.02)]
            if probes is not None:
                probes[i] = reference * (k + 1)
        return out

    monkeypatch.setattr(lt, "measure_many", fake_measure_many)
    monkeypatch.setattr(lt, "_pair_the_pick", lambda *a: None)
    csv_path = tmp_path / "rows.csv"
    assert lt.confirm_main(profile4, ["gpt"], run=True, run_all=False, csv_path=csv_path) == 0
    with open(csv_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["measured_s"]]
    assert rows and launch["n"] == lt.CONFIRM_ROUNDS
    for r in rows:
        steps = [float(t) for t in r["launch_steps_s"].split(";")]
        assert len(steps) == lt.CONFIRM_ROUNDS
        assert float(r["measured_s"]) == pytest.approx(min(steps), abs=1e-4)
        # the fastest launch is the second (factor 1.0), whose probe read 2x the reference
        assert steps.index(min(steps)) == 1
        assert float(r["machine_speed"]) == pytest.approx(0.5)
    assert "one layout's launches" in capsys.readouterr().out


def test_the_launch_spread_line():
    rows = [{"launch_steps_s": "0.200;0.220;0.210"}, {"launch_steps_s": "0.100;0.130"},
            {"launch_steps_s": "0.300"}, {"launch_steps_s": None}]
    line = lt.launch_summary(rows)
    # spreads +10% and +30%: median +20%, one beyond the 15% target; single launches skipped
    assert "2 layouts" in line and "median +20.0%" in line and "largest +30.0%" in line
    assert "1 spread more than 15%" in line
    assert lt.launch_summary([{"launch_steps_s": "0.2"}]) is None


def test_the_speed_probe_is_the_profiles_matmul_timing(monkeypatch):
    """The probe times the profile's cold fp32 matmul of PROBE_N through the profiler's own
    free-running timer (PROBE_WINDOWS windows), the ranks' figure agreed by an all-reduce."""
    import torch

    from autoplan.profiling import timing
    seen = {}

    def free_running(fn, sync, target_s, agreed_mean, barrier, windows=1):
        fn()
        seen.update(target_s=target_s, windows=windows, mean=agreed_mean(0.5),
                    shape=tuple(fn.sets[0][0].shape), dtype=fn.sets[0][0].dtype)
        return 0.25

    class FakeDist:
        @staticmethod
        def all_reduce(t):
            t *= 4          # four ranks with the same figure

        @staticmethod
        def get_world_size():
            return 4

        @staticmethod
        def barrier():
            pass

    monkeypatch.setattr(timing, "free_running", free_running)
    assert lt._speed_probe(torch, FakeDist) == 0.25
    assert seen == {"target_s": lt.PROBE_WINDOWS * timing.MIN_FREE_WINDOW_S,
                    "windows": lt.PROBE_WINDOWS, "mean": 0.5,
                    "shape": (lt.PROBE_N, lt.PROBE_N), "dtype": torch.float32}


def test_a_failed_layout_reports_the_cause_first():
    """A pipeline stage wraps its forward's error ("[Stage 0] failed to run forward"): the
    report a failed layout gets leads with the cause, which the parent keeps when it cuts
    each rank's report short."""
    try:
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as cause:
            raise RuntimeError("[Stage 0] failed to run forward") from cause
    except RuntimeError as exc:
        text = lt._error_chain(exc)
    assert text == ("RuntimeError: Connection closed by peer <- "
                    "RuntimeError: [Stage 0] failed to run forward")


def _stored_pass(path: Path, rows: list[tuple], picked: str | None = None) -> Path:
    """A confirm pass's CSV as ``--csv`` writes it, with ``(model, label, measured_s)``;
    the row labelled ``picked`` has search rank 1 (the pass's pick)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=lt.CSV_FIELDS)
        w.writeheader()
        for model, label, measured in rows:
            w.writerow({"model": model, "label": label, "measured_s": measured,
                        "search_rank": 1 if label == picked else ""})
    return path


def test_reprice_prices_the_ladder_at_the_passs_own_pick(gpt_rows, profile4: Path,
                                                         tmp_path: Path):
    """A pass's ZeRO and recompute options (its ladder) were run at its own pick: priced
    again by code whose search picks another layout, they are still priced, at the pass's
    pick (not dropped as layouts the search no longer ranks)."""
    from autoplan.strategy import Recompute
    graph, rows = gpt_rows
    pick = rows[0]["plan"]
    other = next(r["plan"] for r in rows
                 if r["source"] == "search" and lt._layout_key(r["plan"]) != lt._layout_key(pick))
    ladder = lt._with_options(other, 3, Recompute.FULL).label()
    assert ladder not in {r["label"] for r in rows}
    stored = _stored_pass(tmp_path / "pass.csv", [("gpt", other.label(), 0.2),
                                                 ("gpt", ladder, 0.3)], picked=other.label())
    (res,) = lt.reprice([(stored, profile4)], ["gpt"], graphs={"gpt": graph})
    assert all(r["error"] is not None for r in res["rows"])
    labels = {r["label"] for r in lt.confirm_layouts(graph, load_cluster(str(profile4)),
                                                     ladder_at=other.label())}
    assert ladder in labels


def test_reprice_prices_a_stored_pass_with_its_profile(gpt_rows, profile4: Path,
                                                       tmp_path: Path, capsys):
    """``--reprice CSV PROFILE``: each measured layout priced again on the pass's profile,
    its error against the stored measurement; misses listed; over several passes, the
    layouts whose error averages beyond SYSTEMATIC; a layout the search no longer ranks
    is counted apart, and a row the pass could not run is skipped."""
    graph, rows = gpt_rows
    a, b, c = rows[0], rows[1], rows[2]
    stored = _stored_pass(tmp_path / "pass.csv", [
        ("gpt", a["label"], a["predicted_s"] / 1.2),      # priced 20% slow
        ("gpt", b["label"], b["predicted_s"]),            # exact
        ("gpt", c["label"], c["predicted_s"] / 0.95),     # 5% fast
        ("gpt", "dp9 tp1 pp1 mb1x1", 0.5),                # not a layout it ranks
        ("gpt", "dp1 tp4 pp1 mb8x1", ""),                 # failed in that pass
    ])
    (res,) = lt.reprice([(stored, profile4)], ["gpt"], graphs={"gpt": graph})
    errors = {r["label"]: r["error"] for r in res["rows"]}
    assert errors[a["label"]] == pytest.approx(0.2)
    assert errors[b["label"]] == pytest.approx(0.0, abs=1e-12)
    assert errors[c["label"]] == pytest.approx(-0.05)
    assert errors["dp9 tp1 pp1 mb1x1"] is None and len(errors) == 4

    assert lt.main(["--reprice", str(stored), str(profile4),
                    "--reprice", str(stored), str(profile4), "--models", "gpt"]) == 0
    out = capsys.readouterr().out
    assert out.count("2 of 3 within 15% priced with this code (gpt 2/3 median +0.0%); "
                     "1 no longer ranked by the search") == 2
    assert out.count(f"miss: gpt {a['label']} +20.0%") == 2
    assert "layouts measured in two or more whose error averages beyond 10%: 1" in out
    assert f"gpt {a['label']}: mean +20.0% over 2 (+20.0% to +20.0%)" in out
    assert "repeatability" not in out                     # two passes: no ceiling

    # from three passes, each priced by the others' measurements too: the same pass
    # three times measured the same, and the unranked layout counts there
    assert lt.main(["--models", "gpt"] + ["--reprice", str(stored), str(profile4)] * 3) == 0
    out = capsys.readouterr().out
    assert "the machine's own repeatability" in out
    assert out.count(f"{stored}: 4 of 4 within 15% (4 at the pass's speed); this code 2 of "
                     "3") == 3


def test_reprice_says_what_is_wrong_with_its_input(profile4: Path, tmp_path: Path, capsys):
    """No traceback for a missing file, a CSV that is not a pass's, files given the wrong
    way round or a bad measurement; --reprice beside a pass that runs is a usage error."""
    good = _stored_pass(tmp_path / "pass.csv", [("gpt", "dp4 tp1 pp1 mb2x1", 0.15)])

    def error(*argv: str) -> str:
        assert lt.main(["--reprice", *argv]) == 2
        return capsys.readouterr().err

    assert "cannot read it" in error(str(tmp_path / "missing.csv"), str(profile4))
    assert "no such profile file" in error(str(good), str(tmp_path / "missing.yaml"))
    not_a_pass = tmp_path / "other.csv"
    not_a_pass.write_text("layout,step\ndp4,0.15\n")
    assert "not a confirm pass's CSV (no column label, measured_s, model)" in error(
        str(not_a_pass), str(profile4))
    assert "expected a mapping (a profile)" in error(str(good), str(good))
    bad = _stored_pass(tmp_path / "bad.csv", [("gpt", "dp4 tp1 pp1 mb2x1", "fast")])
    assert "measured_s 'fast' is not a number" in error(str(bad), str(profile4))
    odd = _stored_pass(tmp_path / "odd.csv", [("bert", "dp4 tp1 pp1 mb2x1", 0.1)])
    assert "model 'bert'" in error(str(odd), str(profile4))
    with pytest.raises(SystemExit):
        lt.main(["--reprice", str(good), str(profile4), "--confirm"])
    assert "not with --confirm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lt.main(["--host-split"])
    assert "--host-split goes with --reprice" in capsys.readouterr().err


def test_the_stored_passes_still_load_and_price(gpt_rows):
    """``benchmarks/confirm_passes``: every kept pass's profile still loads (older ones
    lack later fields) and its measured layouts are priced by the current code (no figure
    asserted: that is what the passes judge, not what a test fixes)."""
    import math
    passes = sorted(p for p in (REPO / "benchmarks" / "confirm_passes").iterdir() if p.is_dir())
    assert len(passes) >= 6
    results = lt.reprice([(p / "rows.csv", p / "profile.yaml") for p in passes],
                         list(lt.CONFIRM_MODELS), graphs={"gpt": gpt_rows[0]})
    for p, res in zip(passes, results):
        priced = [r for r in res["rows"] if r["error"] is not None]
        assert {r["model"] for r in priced} == set(lt.CONFIRM_MODELS), p.name
        assert len(priced) >= 0.9 * len(res["rows"]) and all(math.isfinite(r["error"])
                                                             for r in priced), p.name


def test_repeatability_prices_each_layout_by_the_other_passes():
    """The machine's own ceiling: each layout priced by the geometric mean of what it
    measured in the other passes (at least two), times the pass's median ratio to those
    figures; a layout that measured 40% apart in one pass misses there, and a pass that
    ran uniformly 20% slower misses nothing at its own speed, and without it whatever
    the others measured 20% faster."""
    steady = {("gpt", f"layout {i}"): 0.1 * (i + 1) for i in range(5)}
    slow = {k: 1.2 * v for k, v in steady.items()}
    odd = {**steady, ("gpt", "layout 0"): 0.14}
    once = {("llama", "only here"): 1.0}
    got = lt.repeatability([steady, slow, {**odd, **once}, steady])
    assert [len(c["keys"]) for c in got] == [5, 5, 5, 5]   # "only here": no other pass
    assert got[1]["scale"] == pytest.approx(1.2)             # the others: 1 x steady
    assert got[2]["scale"] == pytest.approx(1.2 ** (-1 / 3))  # the others: 1.2^(1/3) x
    # "odd" priced at 0.1 against its 0.14; elsewhere its 0.14 moves layout 0 by 12%
    assert [c["within_scaled"] for c in got] == [5, 5, 4, 5]
    # without the pass's speed: "slow" priced 1/1.2 of what it measured, 16.7% off, but
    # its layout 0 at 1.4^(1/3) x 0.1 within 7%; "steady" priced layout 0 at
    # (1.2 x 1.4)^(1/3) x 0.1, 18.9% off
    assert [c["within"] for c in got] == [4, 1, 4, 4]
    # from the two others, (1.2 x 1.4)^(1/2) / 1.2^(1/2) x 0.1 = 0.118: 18% off
    assert lt.repeatability([steady, slow, odd])[0]["within_scaled"] == 4
    assert lt.repeatability([steady, once]) == [
        {"keys": [], "scale": None, "within": 0, "within_scaled": 0}] * 2


def test_reprice_rederives_a_profiles_layer_scales_from_its_reference_timing(profile4: Path):
    """A stored pass's layer scales are its reference blocks timed whole over their price
    with the code of its day; re-priced, they are re-derived with this code's price from
    the timing the profile's source states (what a profile measured now would hold), and
    re-deriving them again changes nothing.  A profile without them is used as it is."""
    from autoplan import load_cluster
    from autoplan.profiling.reference import REFERENCE_SHAPE, reference_engine
    path = [p for p in sorted((REPO / "benchmarks" / "confirm_passes").glob("*/profile.yaml"))
            if lt._SMALL_TIMING.search(" ".join(p.read_text().split())) is None][-1]
    cluster, scales = lt._rescaled(load_cluster(str(path)))
    (f0, b0), (f1, b1), host = scales
    assert host is None     # no timing at a micro-batch of one: one scale for both
    overhead = load_cluster(str(path)).profile_of(0).device.op_overhead
    assert (f0, b0) == (overhead.layer_forward_scale, overhead.layer_backward_scale)
    timing = lt._REFERENCE_TIMING.search(" ".join(overhead.source.split()))
    device = cluster.profile_of(0).device
    priced_fwd, priced_bwd = reference_engine(device).model_compute_s(REFERENCE_SHAPE[0])
    assert f1 * priced_fwd == pytest.approx(float(timing.group(1)) / 1e3, rel=1e-9)
    assert b1 * priced_bwd == pytest.approx(float(timing.group(2)) / 1e3, rel=1e-9)
    assert (device.op_overhead.layer_forward_scale,
            device.op_overhead.layer_backward_scale) == (f1, b1)
    _, again = lt._rescaled(cluster)
    assert again[1] == pytest.approx((f1, b1), rel=1e-12)
    # a source that states the micro-batch of one too: host scales, re-derived alike
    split = lt._rescaled(load_cluster(str(path)))[0]
    source = (overhead.source + "; and on 1 x 128 tokens timed whole "
              f"({float(timing.group(1)) * 0.31:.2f} ms forward, "
              f"{float(timing.group(2)) * 0.29:.2f} ms backward)")
    import dataclasses

    from autoplan.hardware import NodeGroup, compose_cluster
    profile = split.profile_of(0)
    stated = compose_cluster([NodeGroup(dataclasses.replace(profile, device=dataclasses.replace(
        profile.device, op_overhead=dataclasses.replace(profile.device.op_overhead,
                                                        source=source))), 1)])
    # as a profile measured now would: the split stated, not applied
    assert lt._rescaled(stated)[1][1:] == ((f1, b1), None)
    rescaled, (_, (f2, b2), host) = lt._rescaled(stated, host_split=True)
    assert host is not None and host[0] > 0 and host[1] > 0 and (f2, b2) != (f1, b1)
    assert rescaled.profile_of(0).device.op_overhead.host_forward_scale == host[0]
    assert lt._rescaled(rescaled, host_split=True)[1][2] == pytest.approx(host, rel=1e-12)
    assert lt._rescaled(rescaled)[0].profile_of(0).device.op_overhead.host_forward_scale is None
    # the second shape is read from the source: the same timings at 1 x 32 split apart
    from autoplan.profiling.reference import reference_scales
    at_32 = compose_cluster([NodeGroup(dataclasses.replace(profile, device=dataclasses.replace(
        profile.device, op_overhead=dataclasses.replace(
            profile.device.op_overhead, source=source.replace("1 x 128", "1 x 32")))), 1)])
    host_32 = lt._rescaled(at_32, host_split=True)[1][2]
    assert host_32 != pytest.approx(host, rel=1e-3)
    assert host_32 == pytest.approx(reference_scales(
        profile.device, (float(timing.group(1)) / 1e3, float(timing.group(2)) / 1e3,
                         round(float(timing.group(1)) * 0.31, 2) / 1e3,
                         round(float(timing.group(2)) * 0.29, 2) / 1e3),
        small_shape=(1, 32))[3], rel=1e-12)
    plain = load_cluster(str(profile4))      # a GPU profile: no layer scales
    assert lt._rescaled(plain) == (plain, None)
