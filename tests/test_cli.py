"""The command line, run as a subprocess: exit codes, --json output, errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.plan import Plan

GPT = ["gpt", "--model-arg", "vocab_size=256", "--model-arg", "seq_len=64", "--model-arg", "hidden=64",
       "--model-arg", "heads=4", "--model-arg", "layers=4", "--seq-len", "64"]


def run(*args: str, check_rc: int | None = 0, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "autoplan.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})
    if check_rc is not None:
        assert proc.returncode == check_rc, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


def test_trace_json():
    out = run("trace", *GPT, "--json")
    data = json.loads(out.stdout)
    assert [l["kind"] for l in data["layers"]] == ["pre", "block", "block", "block", "block", "post"]
    text = run("trace", *GPT).stdout
    assert "blocks.3" in text and "forward" in text


def test_estimate_json():
    out = run("estimate", *GPT, "--cluster", "a100-sxm4-80gb", "--dp", "4", "--tp", "2",
              "--global-batch", "8", "--json")
    data = json.loads(out.stdout)
    assert data["strategy"]["dp"] == 4 and data["estimate"]["step_time_s"] > 0


def test_plan_writes_a_plan_that_round_trips(tmp_path: Path):
    dest = tmp_path / "plan.json"
    out = run("plan", *GPT, "--cluster", "a100-sxm4-80gb", "--global-batch", "16", "--top-k", "2",
              "--out", str(dest), "--json")
    data = json.loads(out.stdout)
    plan = Plan.from_dict(data["plan"])
    assert Plan.from_json(dest.read_text()) == plan
    assert len(data["runners_up"]) == 1
    text = run("plan", *GPT, "--cluster", "a100-sxm4-80gb", "--global-batch", "16").stdout
    assert "why it won" in text


def test_demo_runs_offline():
    out = run("demo", "--json")
    data = json.loads(out.stdout)
    plan = Plan.from_dict(data["plan"])
    assert plan.num_devices == 1024 and plan.estimate.fits
    assert data["published"]["estimate"]["step_time_s"] >= plan.estimate.step_time_s


def test_whatif_json_and_csv(tmp_path: Path):
    csv = tmp_path / "w.csv"
    out = run("whatif", *GPT[:-2], "--seq-len", "64", "--cluster", "a100-sxm4-80gb", "--nodes", "1",
              "2", "--global-batch", "16", "--price", "2.5", "--csv", str(csv), "--json")
    rows = json.loads(out.stdout)
    assert [r["gpus"] for r in rows] == [8, 16]
    for r in rows:
        assert r["cost_per_hour"] == pytest.approx(2.5 * r["gpus"])
    assert csv.read_text().splitlines()[0].startswith("model,")


def test_report_html(tmp_path: Path):
    html = tmp_path / "plan.html"
    out = run("report", *GPT, "--cluster", "a100-sxm4-80gb", "--global-batch", "16", "--out",
              str(html), "--json")
    assert Plan.from_dict(json.loads(out.stdout)["plan"]).estimate.fits
    text = html.read_text()
    assert text.startswith("<!DOCTYPE html>") and "data:image/png;base64," in text


def test_profile_quick_writes_a_loadable_profile_to_the_user_folder(tmp_path: Path, monkeypatch):
    # without --out the profile goes to $AUTOPLAN_HOME/profiles (not the checkout), by name
    home = tmp_path / "home"
    out = run("profile", "--quick", "--nproc", "2", "--device", "cpu", "--name", "local-cli", "--json",
              env={"AUTOPLAN_HOME": str(home)}, cwd=tmp_path)
    report = json.loads(out.stdout)
    dest = home / "profiles" / "local-cli.yaml"
    assert report["path"] == str(dest) and dest.is_file()
    assert [p.name for p in dest.parent.iterdir()] == ["local-cli.yaml"]  # no temp file left
    monkeypatch.setenv("AUTOPLAN_HOME", str(home))
    import autoplan
    cluster = autoplan.load_cluster("local-cli")
    assert cluster.num_devices >= 1 and cluster.device_types[0].memory_bytes > 0
    assert "--quick" in run("profile", "--help").stdout


@pytest.mark.parametrize("args,expect", [
    (("trce",), "did you mean: trace"),
    (("trace", "zoo:llama9", "--seq-len", "8"), "did you mean llama3-8b"),
    (("trace", "gpt", "--sq-len", "8"), "did you mean: --seq-len"),
    (("plan", *GPT, "--cluster", "a100-sxm4-8gb", "--global-batch", "8"), "a100-sxm4-80gb"),
    (("trace", "hf:lama", "--seq-len", "8"), "did you mean"),
    (("estimate", *GPT, "--cluster", "a100-sxm4-80gb", "--dp", "3", "--global-batch", "8"),
     "dp=3"),
])
def test_bad_input_gets_a_clear_message_and_code_2(args, expect):
    out = run(*args, check_rc=2)
    assert expect in out.stderr
    assert "Traceback" not in out.stderr


def test_debug_shows_the_traceback():
    out = run("--debug", "trace", "zoo:llama9", "--seq-len", "8", check_rc=None)
    assert out.returncode != 0 and "Traceback" in out.stderr
