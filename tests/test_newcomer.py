"""What a newcomer meets first ends in one clear line: their own code failing, a package
the plain install lacks, a plan for another model, Ctrl-C, a layout over the planning limit,
one name for a model in every report, several clusters in one what-if table."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import autoplan
from autoplan.errors import MissingDependencyError, PlanMismatchError, UserCodeError
from autoplan.models import GPT, GPTConfig
from autoplan.plan import ModelFingerprint, Plan
from test_cli import GPT as GPT_ARGS
from test_cli import run

SMALL = dict(vocab_size=256, seq_len=64, heads=4, layers=4)


def _graph(**over):
    cfg = {**SMALL, "hidden": 64, **over}
    return autoplan.trace(GPT(GPTConfig(**cfg)), seq_len=64)


@pytest.fixture(scope="module")
def small_plan():
    return autoplan.plan(_graph(), autoplan.load_cluster("a100-sxm4-80gb"), global_batch=16)


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


# ------------------------------------------------------------------ the user's own code
def test_a_model_file_with_a_syntax_error_is_the_users_error(tmp_path: Path):
    (tmp_path / "bad.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(4, 4\n")
    out = run("plan", "bad.py:make", "--seq-len", "16", "--cluster", "a100-sxm4-80gb",
              "--global-batch", "8", cwd=tmp_path, check_rc=1)
    line = _one_line(out.stderr)
    assert line.startswith("autoplan plan: error: your model code failed (importing the file): "
                           "bad.py, line 4: SyntaxError: "), line


def test_a_factory_that_raises_names_its_file_and_line(tmp_path: Path):
    (tmp_path / "m.py").write_text(textwrap.dedent("""\
        import torch

        def helper(width):
            if width < 8:
                raise ValueError(f"width {width} is too small")
            return torch.nn.Linear(width, width)

        def make(width=4):
            return helper(width)
        """))
    out = run("plan", "m.py:make", "--seq-len", "16", "--cluster", "a100-sxm4-80gb",
              "--global-batch", "8", cwd=tmp_path, check_rc=1)
    assert _one_line(out.stderr) == ("autoplan plan: error: your model code failed (calling make()): "
                                     "m.py, line 5, in helper: ValueError: width 4 is too small")
    # the API raises the same error, the user's exception kept as its cause
    with pytest.raises(UserCodeError, match="m.py, line 5") as info:
        autoplan.trace(str(tmp_path / "m.py") + ":make", seq_len=16)
    assert info.value.line == 5 and isinstance(info.value.__cause__, ValueError)


# ------------------------------------------------------------------ optional packages
def test_report_figures_without_matplotlib_is_one_line_with_the_install(small_plan_file, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # as in a plain install
    monkeypatch.delitem(sys.modules, "autoplan.report.plots", raising=False)
    import autoplan.report
    monkeypatch.delitem(vars(autoplan.report), "plot_memory", raising=False)   # a lazy name kept
    html = tmp_path / "r.html"
    out = run("report", "--plan", str(small_plan_file), "--cluster", "a100-sxm4-80gb",
              "--out", str(html), check_rc=1)
    assert _one_line(out.stderr) == (
        "autoplan report: error: the HTML report's figures need matplotlib, which is not "
        "installed: pip install 'autoplan[plots]' (or: pip install matplotlib); or pass "
        "--no-figures")
    assert not html.exists()
    run("report", "--plan", str(small_plan_file), "--cluster", "a100-sxm4-80gb", "--out", str(html),
        "--no-figures")
    assert html.read_text().startswith("<!DOCTYPE html>")
    with pytest.raises(MissingDependencyError, match=r"^figures need matplotlib, .* pip install "
                                                     r"'autoplan\[plots\]'"):
        from autoplan.report import plot_memory  # noqa: F401 - the API: the same error


def test_zoo_models_without_transformers_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    out = run("trace", "zoo:llama3-8b", check_rc=1)
    assert _one_line(out.stderr) == (
        "autoplan trace: error: zoo: and hf: models need transformers, which is not installed: "
        "pip install 'autoplan[hf]' (or: pip install transformers)")


# ------------------------------------------------------------------ a plan for another model
def test_the_fingerprint_round_trips_and_old_plans_still_load(small_plan):
    assert small_plan.fingerprint == ModelFingerprint.of(_graph())
    assert Plan.from_json(small_plan.to_json()) == small_plan
    old = json.loads(small_plan.to_json())
    del old["fingerprint"]                 # a plan written before fingerprints were recorded
    loaded = Plan.from_dict(old)
    assert loaded.fingerprint is None
    loaded.check_model(_graph())           # checked by class and layer names: the same model
    with pytest.raises(PlanMismatchError, match=r"6 layers \(this model: 8\)"):
        loaded.check_model(_graph(layers=6))


def test_emit_parallelize_and_replan_refuse_another_models_plan(small_plan, tmp_path):
    wider = _graph(hidden=128)         # the same layer names, another width
    expect = r"^the plan was made for another model: hidden_size 64 \(this model: 128\); "
    from autoplan.emit import emit_script
    with pytest.raises(PlanMismatchError, match=expect):
        emit_script(small_plan, "gpt", {**SMALL, "hidden": 128})
    from autoplan.runtime.parallelize import resolve_plan
    with pytest.raises(PlanMismatchError, match=expect):
        resolve_plan(GPT(GPTConfig(**SMALL, hidden=128)), small_plan, wider, world_size=8)
    with pytest.raises(PlanMismatchError, match=expect):
        autoplan.replan(small_plan, autoplan.load_cluster("a100-sxm4-80gb").subset(range(4)),
                        graph=wider)
    # the command line: one line, nothing written
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(small_plan.to_json())
    script = tmp_path / "train.py"
    out = run("emit", str(plan_file), "--model", "gpt", *[a for k, v in SMALL.items()
                                                          for a in ("--model-arg", f"{k}={v}")],
              "--model-arg", "hidden=128", "--out", str(script), "--json", check_rc=2)
    line = _one_line(out.stderr)
    assert line.startswith("autoplan emit: error: the plan was made for another model: "
                           "hidden_size 64 (this model: 128);"), line
    assert not script.exists()


def test_what_differs_is_said_most_telling_first():
    base = ModelFingerprint.of(_graph())
    deeper = ModelFingerprint.of(_graph(layers=6))
    assert base.differences(deeper)[0] == ("6 layers (this model: 8), layer 5 post "
                                           "(this model: blocks.4)")
    renamed = dataclasses.replace(base, model="Other")
    assert base.differences(renamed) == ["a GPT (this model: a Other)"]
    reshaped = dataclasses.replace(base, linears_sha256="0" * 64)
    assert base.differences(reshaped) == ["linear layers of other shapes (the same parameter counts)"]


# ------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_during_a_plan_says_interrupted(tmp_path: Path):
    big = ["gpt", "--model-arg", "vocab_size=51200", "--model-arg", "seq_len=2048", "--model-arg",
           "hidden=12288", "--model-arg", "heads=96", "--model-arg", "layers=96"]
    proc = subprocess.Popen([sys.executable, "-m", "autoplan.cli", "plan", *big, "--cluster",
                             "a100-sxm4-80gb", "--nodes", "128", "--global-batch", "1536"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    err = bytearray()
    searching = threading.Event()

    def read() -> None:
        while chunk := proc.stderr.read1(256):     # type: ignore[union-attr]
            err.extend(chunk)
            if b"searching layouts" in err:
                searching.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert searching.wait(timeout=240), err.decode()
    time.sleep(0.5)                                 # inside the search
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, err.decode()
    reader.join(timeout=10)
    text = err.decode()
    assert text.rstrip().endswith("searching layouts for 1024 devices of a100-sxm4-80gb ... "
                                  "interrupted\nautoplan plan: interrupted"), text
    assert "failed" not in text and "Traceback" not in text


# ------------------------------------------------------------------ memory limits
def test_a_layout_over_the_planning_limit_says_so_not_that_the_card_is_too_small():
    graph = _graph()
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    layout = autoplan.Strategy(dp=8, global_batch=16)
    est = autoplan.estimate(graph, cluster, layout)
    assert est.summary().endswith("(fits)")
    cap = est.stages[0].memory_capacity_bytes / 2**30
    fraction = 0.5 * est.peak_memory_bytes / 2**30 / cap       # under the card, over the limit
    tight = autoplan.estimate(graph, cluster, layout, memory_fraction=fraction)
    assert not tight.fits and f"{cap:.3g}" == "80"
    assert tight.summary().endswith(f"(over the planning limit, {fraction:.0%} of 80 GiB = "
                                    f"{cap * fraction:.1f} GiB; the 80 GiB device holds it)")
    small = dataclasses.replace(est, fits=False, stages=tuple(
        dataclasses.replace(s, memory_capacity_bytes=s.peak_memory_bytes / 2) for s in est.stages))
    assert "(DOES NOT FIT the " in small.summary() and "GiB device)" in small.summary()


# ------------------------------------------------------------------ one name, true titles
def test_one_name_for_a_model_in_every_report(tmp_path: Path):
    pytest.importorskip("matplotlib")
    from autoplan.report import plan_report_html, plot_schedule, whatif
    graph = autoplan.trace(GPT(GPTConfig(**SMALL, hidden=64)), seq_len=64, title="Tiny GPT")
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    searched = autoplan.plan(graph, cluster, global_batch=16)
    assert searched.summary().startswith("Tiny GPT ")
    # a plan without pipelining (whatever the search prefers for this model)
    from autoplan.search import SearchSpace
    plan = autoplan.plan(graph, cluster, global_batch=16,
                         space=SearchSpace(pipeline_parallel=(1, 1)))
    assert plan.pp == 1 and plan.summary().startswith("Tiny GPT ")
    page = plan_report_html(plan)
    # the search may leave devices idle: the title names the ones the plan uses
    assert f"<title>autoplan: Tiny GPT on {plan.num_devices} devices" in page and ">GPT<" not in page
    assert "<h2>Step timeline</h2>" in page and "Pipeline schedule" not in page
    title = plot_schedule(plan).axes[0].get_title()
    assert title.startswith("Tiny GPT: ")
    # no pipeline: no schedule name, no "1 ranks"
    assert title.endswith("no pipeline: 1 micro-batch per step, each forward then backward"), title
    df = whatif(graph, "a100-sxm4-80gb", global_batch=16)
    assert df["model"].tolist() == ["Tiny GPT"]
    out = run("trace", "zoo:llama3-8b", "--seq-len", "128") if _has("transformers") else None
    if out is not None:
        assert out.stdout.startswith("Llama 3 8B: ")


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


# ------------------------------------------------------------------ what-if across clusters
def test_whatif_compares_gpu_types_in_one_table_with_a_price_each():
    out = run("whatif", *GPT_ARGS, "--cluster", "a100-sxm4-80gb", "h100-sxm5-80gb", "--nodes", "1",
              "2", "--global-batch", "16", "--price", "a100-sxm4-80gb=1.8", "H100-SXM5-80GB=3.0",
              "--json")
    rows = json.loads(out.stdout)
    assert [(r["cluster"], r["gpus"]) for r in rows] == [
        ("a100-sxm4-80gb", 8), ("a100-sxm4-80gb", 16), ("h100-sxm5-80gb", 8), ("h100-sxm5-80gb", 16)]
    for r in rows:
        price = 1.8 if r["cluster"].startswith("a100") else 3.0
        assert r["cost_per_hour"] == pytest.approx(price * r["gpus"])
    text = run("whatif", *GPT_ARGS, "--cluster", "a100-sxm4-80gb,h100-sxm5-80gb",
               "--global-batch", "16", "--price", "2").stdout
    header = next(line for line in text.splitlines() if "$/h" in line)
    assert header.split()[:2] == ["cluster", "device_types"]
    assert sum("A100-SXM4-80GB" in line or "H100-SXM5-80GB" in line
               for line in text.splitlines()) == 2
    # a GPU type without its price: one line before any capture
    bad = run("whatif", *GPT_ARGS, "--cluster", "a100-sxm4-80gb", "h100-sxm5-80gb",
              "--global-batch", "16", "--price", "a100-sxm4-80gb=1.8", check_rc=2)
    assert _one_line(bad.stderr).startswith("autoplan whatif: error: --price has no price for "
                                            "['H100-SXM5-80GB']")
    whole = run("whatif", *GPT_ARGS, "--cluster", "mixed-a100-v100", "--nodes", "2",
                "--global-batch", "16", check_rc=2)
    assert "mixed-a100-v100 is a whole cluster" in _one_line(whole.stderr)
