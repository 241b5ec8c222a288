"""The command line: exit codes, --json output, errors for bad input.

Most calls run ``autoplan.cli.main`` in this process (:func:`run`): starting
``python -m autoplan.cli`` costs seconds of imports per call. What only a real process
shows runs in one (:func:`run_subprocess`): ``autoplan demo`` offline, ``autoplan profile``
(it spawns ranks), the ``--debug`` traceback, and one bad argument end to end (import-time
noise on stderr, the exit code of ``python -m autoplan.cli``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from autoplan import cli
from autoplan.plan import Plan

GPT = ["gpt", "--model-arg", "vocab_size=256", "--model-arg", "seq_len=64", "--model-arg", "hidden=64",
       "--model-arg", "heads=4", "--model-arg", "layers=4", "--seq-len", "64"]


def _check(proc: subprocess.CompletedProcess, check_rc: int | None) -> subprocess.CompletedProcess:
    if check_rc is not None:
        assert proc.returncode == check_rc, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


def run_subprocess(*args: str, check_rc: int | None = 0, env: dict[str, str] | None = None,
                   cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m autoplan.cli ARGS`` in a new process, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "autoplan.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})
    return _check(proc, check_rc)


# python's warning filters when started without -W or PYTHONWARNINGS (not pytest's)
# (``python -m autoplan.cli`` runs the CLI as __main__)
_DEFAULT_WARNING_FILTERS = [("default", DeprecationWarning, r"__main__$|autoplan\.cli$"),
                            ("ignore", DeprecationWarning, ""),
                            ("ignore", PendingDeprecationWarning, ""),
                            ("ignore", ImportWarning, ""), ("ignore", ResourceWarning, "")]


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return [h for lg in loggers for h in getattr(lg, "handlers", ())
            if isinstance(h, logging.StreamHandler)]


@contextlib.contextmanager
def _fd_captured(fd: int):
    """Whatever is written to file descriptor ``fd`` (by C code, say), as a list of one string."""
    out: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(fd)
        os.dup2(tmp.fileno(), fd)
        try:
            yield out
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode("utf-8", "replace"))


def run(*args: str, check_rc: int | None = 0, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``autoplan ARGS`` in this process: ``cli.main(ARGS)`` with its stdout and stderr
    captured, ``env`` added to ``os.environ`` and ``cwd`` made current for the call, all
    restored after. Everything a new process would print reaches the captured streams:
    warnings (under python's default filters, not pytest's), and logging handlers bound to
    the old stderr (torch binds its handlers at import). An exception other than
    ``SystemExit`` is not caught: the test fails with its traceback, as a user would see it."""
    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in env or {}}
    saved_cwd = os.getcwd()
    old_err = sys.stderr
    moved = [h for h in _stream_handlers() if h.stream in (old_err, sys.__stderr__)]
    handlers_before = set(map(id, _stream_handlers()))
    try:
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        for h in moved:
            h.setStream(err)
        with warnings.catch_warnings(record=True) as caught, _fd_captured(1) as fd_out, \
                _fd_captured(2) as fd_err:
            warnings.resetwarnings()
            for action, category, module in reversed(_DEFAULT_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = cli.main(list(args))
                except SystemExit as exc:   # argparse: usage errors, --help
                    code = exc.code
                    if code is not None and not isinstance(code, int):
                        err.write(f"{code}\n")
                        code = 1
                    code = code or 0
                except Exception as exc:    # a traceback a user would see: the test fails on it
                    exc.add_note(f"raised by: autoplan {' '.join(args)}\ncaptured stderr:\n"
                                 f"{err.getvalue()[-2000:]}")
                    raise
    finally:
        for h in moved:
            h.setStream(old_err)
        for h in _stream_handlers():   # one made during the call: the stderr it would have had
            if id(h) not in handlers_before and h.stream is err:
                h.setStream(old_err)
        os.chdir(saved_cwd)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    stderr = err.getvalue() + fd_err[0] + "".join(
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught)
    proc = subprocess.CompletedProcess(["autoplan", *args], code, out.getvalue() + fd_out[0],
                                       stderr)
    return _check(proc, check_rc)


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


def test_estimate_takes_a_stack():
    base = ["estimate", *GPT, "--cluster", "a100-sxm4-80gb", "--dp", "4", "--tp", "2",
            "--global-batch", "8", "--json"]
    times = {stack: json.loads(run(*base, "--stack", stack).stdout)["estimate"]["step_time_s"]
             for stack in ("autoplan", "megatron-2021", "megatron-core")}
    # tensor-parallel overlap and overlapped gradient reduction only take time away; the
    # autoplan stack alone ends its step with a loss all-reduce over the 8 GPUs
    from autoplan.hardware import load_cluster
    loss = load_cluster("a100-sxm4-80gb").collective_time("all_reduce", tuple(range(8)), 16)
    assert 0 < loss < 1e-4
    assert times["megatron-core"] < times["autoplan"]
    assert times["autoplan"] - loss <= times["megatron-2021"] * (1 + 1e-12)


def test_estimate_takes_measured_kernels():
    """``--kernels torch-eager`` prices an H100 with torch's measured kernels (faster than the
    published-run fit: 0.76 of the 16-bit peak against 0.57 for a large matmul); an A100,
    which no table measures, the same, with a one-line note saying so."""
    def step(cluster, *extra):
        out = run("estimate", *GPT, "--cluster", cluster, "--dp", "8", "--global-batch", "64",
                  "--json", *extra)
        return json.loads(out.stdout)["estimate"]["step_time_s"], out.stderr
    assert step("h100-sxm5-80gb", "--kernels", "torch-eager")[0] < step("h100-sxm5-80gb")[0]
    a100, note = step("a100-sxm4-80gb", "--kernels", "torch-eager")
    assert a100 == step("a100-sxm4-80gb")[0]
    assert "measures hopper GPUs; a100-sxm4-80gb has none" in note     # not silently


def test_fp8_is_a_precision_of_estimate_and_plan(tmp_path: Path):
    """``--precision fp8`` prices FP8 GEMMs on a device with an FP8 peak (faster than bf16
    there with Transformer Engine's fused casts, slower with torchao's eager ones), is refused with the device's dtypes where it has none (an A100); a plan made for
    it is emitted as an FP8 program (torchao), one for Transformer Engine's blockwise recipe
    is refused, without a traceback."""
    wide = ["gpt", "--model-arg", "vocab_size=256", "--model-arg", "seq_len=1024",
            "--model-arg", "hidden=2048", "--model-arg", "heads=16", "--model-arg", "layers=2",
            "--seq-len", "1024"]      # GEMMs large enough that FP8 pays for its casts
    base = ["estimate", *wide, "--cluster", "h100-sxm5-80gb", "--dp", "8",
            "--global-batch", "64", "--micro-batch", "8", "--json"]
    te = ["--stack", "megatron-core"]
    bf16 = json.loads(run(*base, *te).stdout)["estimate"]["step_time_s"]
    fp8 = json.loads(run(*base, *te, "--precision", "fp8").stdout)["estimate"]["step_time_s"]
    assert 0 < fp8 < bf16
    # torchao's eager casts (the autoplan stack) move ~5x the bytes of Transformer Engine's
    torchao = json.loads(run(*base, "--precision", "fp8").stdout)["estimate"]["step_time_s"]
    assert torchao > fp8
    out = run("estimate", *GPT, "--cluster", "a100-sxm4-80gb", "--dp", "8", "--global-batch",
              "16", "--precision", "fp8", check_rc=2)
    assert "no 'fp8' peak" in out.stderr and "Traceback" not in out.stderr
    dest = tmp_path / "plan.json"
    run("plan", *GPT, "--cluster", "h100-sxm5-80gb", "--global-batch", "16", "--top-k", "1",
        "--precision", "fp8", "--out", str(dest))
    assert Plan.from_json(dest.read_text()).precision.value == "fp8"
    script = tmp_path / "train.py"
    run("emit", str(dest), "--model", "gpt", *GPT[1:-2], "--out", str(script))
    assert "--fp8-emulate" in script.read_text()       # torchao's FP8, emulated off GPUs
    # Transformer Engine's recipe is priced with its stack, and not emitted
    blockwise = tmp_path / "blockwise.json"
    out = run("plan", *GPT, "--cluster", "h100-sxm5-80gb", "--global-batch", "16", "--top-k",
              "1", "--precision", "fp8-blockwise", check_rc=2)
    assert "torchao does not run" in out.stderr and "Traceback" not in out.stderr
    run("plan", *GPT, "--cluster", "h100-sxm5-80gb", "--global-batch", "16", "--top-k", "1",
        "--precision", "fp8-blockwise", "--stack", "megatron-core", "--out", str(blockwise))
    out = run("emit", str(blockwise), "--model", "gpt", *GPT[1:-2], "--out",
              str(tmp_path / "te.py"), check_rc=2)
    assert "torchao does not run" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "te.py").exists()


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


def test_demo_runs_offline_on_a_plain_install():
    # as after `pip install autoplan` with no extras: neither transformers nor matplotlib
    # (.ci/wheel checks a real plain install)
    blocked = ("import runpy, sys; sys.modules.update(transformers=None, matplotlib=None); "
               "runpy.run_module('autoplan.cli', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", blocked, "demo", "--json"], capture_output=True,
                          text=True, timeout=300)
    data = json.loads(_check(proc, 0).stdout)
    plan = Plan.from_dict(data["plan"])
    assert plan.num_devices == 1024 and plan.estimate.fits and plan.title == "GPT-3 175B"
    from autoplan.cost.result import Estimate
    published = Estimate.from_dict(data["published"]["estimate"])
    assert published.step_time_s >= plan.estimate.step_time_s
    # Megatron-LM ran it on 80 GB A100s: it fits the card (test_newcomer.py: the message
    # of a layout over the planning limit but not over the card)
    assert published.peak_memory_bytes <= 80 * 2**30


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


def test_profile_has_a_quick_mode():
    # (the quick profile itself, run as a user runs it, is test_profiler's
    # test_quick_cpu_profile_loads_and_is_plausible: about a minute)
    assert "--quick" in run("profile", "--help").stdout


# this one runs in a real process: a bad argument is one line and code 2 end to end
BAD_IN_A_SUBPROCESS = ("trace", "zoo:llama9", "--seq-len", "8")


@pytest.mark.parametrize("args,expect", [
    (("trce",), "did you mean: trace"),
    (BAD_IN_A_SUBPROCESS, "did you mean llama3-8b"),
    (("trace", "gpt", "--sq-len", "8"), "did you mean: --seq-len"),
    (("plan", *GPT, "--cluster", "a100-sxm4-8gb", "--global-batch", "8"), "a100-sxm4-80gb"),
    (("trace", "hf:lama", "--seq-len", "8"), "did you mean"),
    (("estimate", *GPT, "--cluster", "a100-sxm4-80gb", "--dp", "3", "--global-batch", "8"),
     "dp=3"),
    (("estimate", *GPT, "--cluster", "a100-sxm4-80gb", "--dp", "8", "--global-batch", "8",
      "--stack", "megatron"), "did you mean megatron-core, megatron-2021"),
    (("plan", *GPT, "--cluster", "a100-sxm4-80gb", "--global-batch", "8", "--stack", "fdsp"),
     "did you mean fsdp"),
    (("estimate", *GPT, "--cluster", "h100-sxm5-80gb", "--dp", "8", "--global-batch", "8",
      "--kernels", "torch-eagre"), "known: torch-eager"),
])
def test_bad_input_gets_a_clear_message_and_code_2(args, expect):
    out = (run_subprocess if args == BAD_IN_A_SUBPROCESS else run)(*args, check_rc=2)
    assert expect in out.stderr
    assert "Traceback" not in out.stderr
    if args == BAD_IN_A_SUBPROCESS:   # nothing else on stderr, imports' warnings included
        _one_line_error(out, "trace")


def test_debug_shows_the_traceback():
    out = run_subprocess("--debug", "trace", "zoo:llama9", "--seq-len", "8", check_rc=None)
    assert out.returncode != 0 and "Traceback" in out.stderr


# ------------------------------------------------------------ no traceback reaches a user
def _one_line_error(out: subprocess.CompletedProcess, command: str) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"autoplan {command}: error: "), lines
    return lines[0]


@pytest.mark.parametrize("content,expect", [
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not a plan JSON file (byte 0 is not UTF-8 text)"),
    (b'{"model": ', "not valid JSON"),
    (b"[1, 2]", "expected an object"),
])
@pytest.mark.parametrize("command", ["report", "emit", "replan"])
def test_a_corrupt_plan_file_is_one_line_naming_the_file(tmp_path, command, content, expect):
    bad = tmp_path / "plan.json"
    bad.write_bytes(content)
    args = {"report": ("report", "--plan", str(bad), "--cluster", "a100-sxm4-80gb"),
            "emit": ("emit", str(bad), "--model", "gpt", "--out", str(tmp_path / "train.py")),
            "replan": ("replan", str(bad), "--model", "gpt", "--cluster", "a100-sxm4-80gb",
                       "--out", str(tmp_path / "train.py"))}[command]
    line = _one_line_error(run(*args, check_rc=2), command)
    assert expect in line and str(bad) in line and "autoplan plan" in line  # how to get a good one
    assert not (tmp_path / "train.py").exists()


def test_replan_keeps_the_plans_stack_and_says_what_changed(tmp_path: Path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    run("plan", *GPT, "--cluster", "a100-sxm4-80gb", "--nodes", "2", "--global-batch", "32",
        "--stack", "megatron-core", "--out", str(old))
    model = ["--model", *GPT[:-2]]          # the plan records the sequence length
    out = run("replan", str(old), *model, "--cluster", "a100-sxm4-80gb", "--nodes", "1",
              "--out", str(new), "--json")
    data = json.loads(out.stdout)
    plan = Plan.from_json(new.read_text())
    assert Plan.from_dict(data["plan"]) == plan and plan.cluster.num_devices == 8
    assert plan.cost_options == {"stack": "megatron-core"}
    assert "devices: 16 -> 8" in data["changes"]
    text = run("replan", str(old), *model, "--cluster", "a100-sxm4-80gb").stdout
    assert f"what changed from {old}:" in text and plan.summary() in text
    # a script runs autoplan's own program, not the stack the plan was priced for: said
    emitted = run("emit", str(new), *model, "--out", str(tmp_path / "train.py"))
    assert "was priced for the megatron-core stack; the script runs autoplan's own program" \
        in emitted.stderr
    # another model than the plan's: one line, saying what differs, and no file
    bigger = [a.replace("layers=4", "layers=6") for a in model]
    line = _one_line_error(run("replan", str(old), *bigger, "--cluster", "a100-sxm4-80gb",
                               "--out", str(tmp_path / "x.json"), "--json", check_rc=2),
                           "replan")
    assert "made for another model" in line and not (tmp_path / "x.json").exists()


def test_report_on_another_cluster_names_the_plans(small_plan_file: Path, tmp_path: Path):
    out = run("report", "--plan", str(small_plan_file), "--cluster", "h100-sxm5-80gb", "--nodes", "2",
              check_rc=2)
    line = _one_line_error(out, "report")
    assert "made for a100-sxm4-80gb (8 devices on 1 nodes), not h100-sxm5-80gb (16 devices" in line
    assert "pass --cluster a100-sxm4-80gb --nodes 1" in line
    # the same cluster, more nodes: still another cluster; a composite profile takes no --nodes
    assert "pass --cluster a100-sxm4-80gb --nodes 1" in run(
        "report", "--plan", str(small_plan_file), "--cluster", "a100-sxm4-80gb", "--nodes", "2",
        check_rc=2).stderr
    html = tmp_path / "r.html"
    ok = run("report", "--plan", str(small_plan_file), "--cluster", "a100-sxm4-80gb", "--out", str(html))
    assert "dp" in ok.stdout and html.read_text().startswith("<!DOCTYPE html>")


LLAMA = ("trace", "hf:llama", "--seq-len", "8", "--model-arg", "hidden_size=64", "--model-arg",
         "intermediate_size=128", "--model-arg", "num_attention_heads=4", "--model-arg",
         "num_key_value_heads=4", "--model-arg", "vocab_size=128")


@pytest.mark.parametrize("arg,expect", [
    ("num_hidden_layers=abc", "--model-arg num_hidden_layers='abc': llama (LlamaConfig) expects an "
                              "integer (default num_hidden_layers=32)"),
    ("hidden_sise=4096", "llama (LlamaConfig) has no field 'hidden_sise'; did you mean hidden_size"),
    ("tie_word_embeddings=1", "expects true or false"),
])
def test_model_args_are_checked_against_the_config_class(arg, expect):
    line = _one_line_error(run(*LLAMA, "--model-arg", arg, check_rc=2), "trace")
    assert expect in line


def test_cheap_checks_run_before_the_model_is_built(tmp_path: Path):
    # the model factory leaves a mark when called: a bad cluster name or batch must be
    # refused before the model is built, let alone captured
    mark = tmp_path / "built"
    model = tmp_path / "m.py"
    model.write_text("from pathlib import Path\nfrom autoplan.models import GPT, GPTConfig\n"
                     f"def make():\n    Path({str(mark)!r}).touch()\n"
                     "    return GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=32, heads=4, layers=2))\n")
    spec = f"{model}:make"
    for args, expect in [
        (("plan", spec, "--seq-len", "8", "--cluster", "h100-sxm5-80g", "--global-batch", "8"),
         "Did you mean 'h100-sxm5-80gb'"),
        (("plan", spec, "--seq-len", "8", "--cluster", "h100-sxm5-80gb", "--global-batch", "0"),
         "--global-batch must be a positive number"),
        (("estimate", spec, "--seq-len", "8", "--cluster", "h100-sxm5-80gb", "--dp", "3",
          "--global-batch", "9"), "dp=3 x tp=1 x pp=1 x cp=1 = 3, but the world has 8 devices"),
        (("estimate", spec, "--seq-len", "8", "--cluster", "h100-sxm5-80gb", "--dp", "8",
          "--global-batch", "12"), "global_batch=12 is not divisible by dp=8"),
        (("report", spec, "--seq-len", "8", "--cluster", "nope", "--global-batch", "8"),
         "unknown profile 'nope'"),
        (("whatif", spec, "--seq-len", "8", "--cluster", "h100-sxm5-80gb", "--nodes", "1", "0",
          "--global-batch", "8"), "nodes must be an integer >= 1, got 0"),
        (("whatif", spec, "--seq-len", "8", "--cluster", "h100-sxm5-80gb", "--global-batch", "8",
          "--price", "cheap"), "--price takes a price per GPU-hour"),
    ]:
        assert expect in _one_line_error(run(*args, check_rc=2), args[0])
        assert not mark.exists(), args
    run("plan", spec, "--seq-len", "8", "--cluster", "h100-sxm5-80gb", "--global-batch", "8")
    assert mark.exists()      # the factory does leave its mark when the arguments are good


def test_trace_takes_a_zoo_name_as_whatif_does():
    import autoplan
    from autoplan.zoo import build_model
    graph = autoplan.trace("zoo:llama3-8b")
    assert graph.seq_len == 8192 and len(graph.blocks) == 32
    assert graph.num_params == sum(p.numel() for p in build_model("zoo:llama3-8b")[0].parameters())
    with pytest.raises(autoplan.AutoplanError, match="did you mean llama3-8b"):
        autoplan.trace("zoo:llama9")
