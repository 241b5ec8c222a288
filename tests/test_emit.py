"""``autoplan emit``: the written script runs under torchrun and computes what one process does."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.errors import ConfigError
from autoplan.elastic import batch_for_step
from autoplan.emit import RESTART_ENV, emit_script, launch_commands
from autoplan.runtime.loss import token_cross_entropy
from autoplan.zoo import build_model

ARGS = dict(vocab_size=128, seq_len=32, hidden=32, heads=4, layers=4)


@functools.lru_cache(maxsize=None)
def _graph():
    model, _ = build_model("gpt", ARGS)
    return autoplan.trace(model, seq_len=32)


@functools.lru_cache(maxsize=None)
def _plan(devices: int, global_batch: int = 8, nodes: int = 1, precision: str = "bf16"):
    """The plan of the test GPT on ``devices`` A100s (made once per arguments: plans are
    immutable)."""
    graph = _graph()
    cluster = autoplan.load_cluster("a100-sxm4-80gb", nodes=nodes)
    if devices < cluster.num_devices:
        cluster = cluster.subset(range(devices))
    return autoplan.plan(graph, cluster, global_batch=global_batch, precision=precision)


def test_launch_commands_one_line_for_every_node():
    plan = _plan(16, global_batch=32, nodes=2)
    cmds = launch_commands(plan)
    assert len(cmds) == 1
    assert all("--nnodes=2" in c and "--nproc-per-node=8" in c and "--rdzv-backend=c10d" in c
               for c in cmds)
    assert "--node-rank=$NODE_RANK" in cmds[0]
    assert not any(RESTART_ENV in c for c in cmds)
    # elastic: one line for every node, node ranks from the rendezvous, fresh stores per attempt
    elastic = launch_commands(plan, min_nodes=1, max_restarts=2)
    assert len(elastic) == 1
    assert elastic[0].startswith(f"{RESTART_ENV} torchrun --nnodes=1:2 --nproc-per-node=8 "
                                 "--max-restarts=2 --rdzv-backend=c10d")
    assert "--node-rank" not in elastic[0]
    with pytest.raises(ConfigError, match="min_nodes"):
        launch_commands(plan, min_nodes=3)


@pytest.mark.distributed
def test_emitted_script_matches_a_single_process(tmp_path: Path):
    plan = _plan(2, precision="fp32")       # parity at 1e-5 is an fp32 statement
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    script = tmp_path / "train.py"
    cli = [sys.executable, "-m", "autoplan.cli", "emit", str(plan_file), "--model", "gpt",
           "--out", str(script), "--json"] + [x for k, v in ARGS.items() for x in ("--model-arg", f"{k}={v}")]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout)["commands"] == launch_commands(plan, "train.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", str(script), "--steps", "2"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 2
    # every step logs what it measured next to what the plan predicted
    rates = re.findall(r"([0-9.e-]+) s/step, ([0-9,]+) tokens/s \(predicted ([0-9.e-]+) s: "
                       r"measured ([0-9.]+)x\)", run.stdout)
    assert len(rates) == 2, run.stdout
    seconds, tokens, predicted, ratio = rates[-1]
    assert float(seconds) > 0 and float(predicted) == float(f"{plan.estimate.step_time_s:.4g}")
    assert int(tokens.replace(",", "")) == pytest.approx(8 * 32 / float(seconds), rel=0.01)
    # the single-process reference: same seed, same first batch, same weights
    torch.manual_seed(0)
    model, _ = build_model("gpt", ARGS, dtype=torch.float32, device="cpu")
    batch = batch_for_step(0, 1, global_batch=8, seq_len=32, vocab_size=128)
    with torch.no_grad():
        ref = token_cross_entropy(model(batch), batch, shift=True).item()
    torch.testing.assert_close(losses[0], ref, atol=1e-5, rtol=0)   # printed with 6 decimals


def test_emit_rejects_bad_input(tmp_path: Path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"model": "x"}')
    out = subprocess.run([sys.executable, "-m", "autoplan.cli", "emit", str(bad), "--model", "gpt"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "missing key" in out.stderr
    plan = _plan(2)
    text = emit_script(plan, "gpt", ARGS)
    compile(text, "train.py", "exec")


def test_emit_embeds_the_cluster_it_can_replan_for():
    plan = _plan(16, global_batch=32, nodes=2)
    text = emit_script(plan, "gpt", ARGS, min_nodes=1, max_restarts=3)
    assert "CLUSTER_JSON = r\"\"\"" in text and "--nnodes=1:2" in text
    # a plan on part of a node: its cluster is not a shipped profile at a node count
    part = _plan(2)
    assert "CLUSTER_JSON = None" in emit_script(part, "gpt", ARGS)
    with pytest.raises(ConfigError, match="pass the cluster"):
        emit_script(part, "gpt", ARGS, min_nodes=1)
    cluster = autoplan.load_cluster("a100-sxm4-80gb").subset(range(2))
    assert "CLUSTER_JSON = r" in emit_script(part, "gpt", ARGS, cluster=cluster, min_nodes=1)
    with pytest.raises(ConfigError, match="not for the cluster given"):
        emit_script(part, "gpt", ARGS, cluster=autoplan.load_cluster("a100-sxm4-80gb"))


def test_cli_emits_an_elastic_launch(tmp_path: Path):
    plan = _plan(16, global_batch=32, nodes=2)
    (tmp_path / "plan.json").write_text(plan.to_json())
    cli = [sys.executable, "-m", "autoplan.cli", "emit", str(tmp_path / "plan.json"), "--model",
           "gpt", "--out", str(tmp_path / "train.py"), "--min-nodes", "1", "--max-restarts", "2",
           "--cluster", "a100-sxm4-80gb", "--json"]
    cli += [x for k, v in ARGS.items() for x in ("--model-arg", f"{k}={v}")]
    out = subprocess.run(cli + ["--nodes", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cmds = json.loads(out.stdout)["commands"]
    assert cmds == launch_commands(plan, "train.py", min_nodes=1, max_restarts=2)
    assert "CLUSTER_JSON = r" in (tmp_path / "train.py").read_text()
    bad = subprocess.run(cli + ["--nodes", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not for the cluster given" in bad.stderr, bad.stderr


def test_recipes_the_runtime_cannot_run_are_named():
    """fp16 (no loss scaling) is priced but not run; FP8 runs with torchao where the device
    has FP8 matmuls, or emulated when asked, and Transformer Engine's blockwise recipe is
    refused with what to use instead; each refusal is one line."""
    import torch

    from autoplan.errors import ConfigError
    from autoplan.runtime.parallelize import check_runnable_precision

    for ok in ("bf16", "fp32", "fp8", "fp8-rowwise"):
        check_runnable_precision(ok)           # emit's check: no device yet
    with pytest.raises(ConfigError, match="loss scaling.*'bf16' or 'fp32'"):
        check_runnable_precision("fp16")
    with pytest.raises(ConfigError, match="fp8-blockwise.*torchao does not run.*megatron-core"):
        check_runnable_precision("fp8-blockwise")
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError) as info:
        check_runnable_precision("fp8", cpu)
    assert "needs FP8 matmuls" in str(info.value) and "fp8_emulate=True" in str(info.value)
    assert "\n" not in str(info.value)
    try:
        import torchao  # noqa: F401
    except ImportError:   # without the fp8 extra: one line that says how to install it
        from autoplan.errors import MissingDependencyError
        with pytest.raises(MissingDependencyError, match=r"autoplan\[fp8\]"):
            check_runnable_precision("fp8-rowwise", cpu, fp8_emulate=True)
    else:
        check_runnable_precision("fp8-rowwise", cpu, fp8_emulate=True)

@pytest.mark.slow   # two torchrun launches of 2 ranks: about a minute
@pytest.mark.distributed
def test_emitted_fp8_script_refuses_cpu_in_one_line_and_runs_emulated(tmp_path: Path):
    """``plan --precision fp8`` then ``emit``: on CPU ranks the script stops in one line
    that names ``--fp8-emulate`` (exit code :data:`autoplan.elastic.EXIT_CANNOT_RUN`, no
    worker traceback), and with ``--fp8-emulate`` it trains; its first loss is the
    single-process emulated FP8 loss within 3x that loss's distance from fp32 (the FP8
    parity tests' tolerance, tests/fp8_cases.py)."""
    pytest.importorskip("torchao")
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from autoplan.elastic import EXIT_CANNOT_RUN
    from autoplan.graph import LayerKind
    from autoplan.precision import fp8_linears

    graph = _graph()
    cluster = autoplan.load_cluster("h100-sxm5-80gb").subset(range(2))
    plan = autoplan.plan(graph, cluster, global_batch=8, precision="fp8")
    assert plan.precision.value == "fp8"
    plan_file, script = tmp_path / "plan.json", tmp_path / "train.py"
    plan_file.write_text(plan.to_json())
    subprocess.run([sys.executable, "-m", "autoplan.cli", "emit", str(plan_file), "--model", "gpt",
                    "--out", str(script)] + [x for k, v in ARGS.items()
                                             for x in ("--model-arg", f"{k}={v}")],
                   capture_output=True, text=True, timeout=120, check=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
              str(script), "--steps", "2"]
    refused = subprocess.run(launch, capture_output=True, text=True, timeout=300, env=env,
                             cwd=tmp_path)
    assert refused.returncode != 0
    said = [l for l in refused.stderr.splitlines() if l.startswith("autoplan: ")]
    assert len(said) == 1, refused.stderr[-3000:]
    assert "needs FP8 matmuls" in said[0] and "--fp8-emulate" in said[0]
    assert f"exitcode  : {EXIT_CANNOT_RUN}" in refused.stderr
    assert 'train.py", line' not in refused.stderr      # no traceback from the workers
    run = subprocess.run(launch + ["--fp8-emulate"], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 2 and all(l == l for l in losses)
    # the single-process reference: the same first batch and weights, the same linears in
    # emulated FP8 (tensorwise) over bf16 compute weights, and in fp32
    torch.manual_seed(0)
    model, _ = build_model("gpt", ARGS, dtype=torch.float32, device="cpu")
    batch = batch_for_step(0, 1, global_batch=8, seq_len=32, vocab_size=128)
    paths = {(l.name + "." if l.kind is LayerKind.BLOCK else "") + name
             for l in graph.layers for name in fp8_linears(l)}
    assert paths
    compute = copy.deepcopy(model).to(torch.bfloat16)
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    config = Float8LinearConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                                   "emulate": True})
    convert_to_float8_training(compute, config=config, module_filter_fn=lambda _, fqn: fqn in paths)
    with torch.no_grad():
        fp32 = token_cross_entropy(model(batch), batch, shift=True).item()
        ref = token_cross_entropy(compute(batch), batch, shift=True).item()
    tolerance = 3 * abs(ref - fp32)
    assert tolerance > 1e-4      # FP8 moves the loss: the comparison can fail
    assert abs(losses[0] - ref) <= tolerance, (losses[0], ref, fp32)
