"""FP8 training: which linears, how each library's recipe is priced, the search, the import.

The multi-rank parity of emulated FP8 runs is in tests/test_fp8_parity.py; the ledger's FP8
layouts (what a step moves and computes against the estimate) in tests/test_ledger.py.
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys

import pytest

import runtime_cases as rc
from autoplan import Strategy
from autoplan.cost import CostOptions
from autoplan.cost import fp8 as cfp8
from autoplan.cost.engine import CostEngine
from autoplan.errors import ConfigError
from autoplan.graph import LayerKind
from autoplan.hardware import load_cluster
from autoplan.precision import fp8_all_gather, fp8_converts, fp8_linears, fp8_problem


@functools.lru_cache(maxsize=None)
def _graph(name: str):
    from autoplan import trace

    if name != "gpt":
        pytest.importorskip("transformers")
    return trace(rc.MODELS[name](0), seq_len=rc.SEQ)


@functools.lru_cache(maxsize=None)
def _h100(n: int = 2):
    return load_cluster("h100-sxm5-80gb", nodes=1, devices_per_node=n)


# ---------------------------------------------------------------------- which linears
def test_the_blocks_column_and_row_linears_run_in_fp8():
    """torchao (the runtime): the blocks' column and row linears whose features are
    multiples of 16; the head, the embeddings, a router and expert banks stay bf16;
    Transformer Engine also converts the experts."""
    gpt = _graph("gpt")
    assert fp8_linears(gpt.layers[1]) == ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    assert fp8_linears(gpt.layers[0]) == () and fp8_linears(gpt.layers[-1]) == ()
    mixtral = _graph("mixtral")
    block = next(l for l in mixtral.layers if l.kind is LayerKind.BLOCK)
    assert fp8_linears(block) == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                  "self_attn.o_proj")
    assert set(fp8_linears(block, "transformer-engine")) == {
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    # alignment: both features multiples of 16
    assert fp8_converts("row", 4096, 4096) and not fp8_converts("row", 4104, 4096)
    assert not fp8_converts("column", 4096, 8)
    for role in ("vocab_head", "vocab_embedding", "router", "replicated"):
        assert not fp8_converts(role, 4096, 4096)


def test_recipes_and_libraries():
    """Each library runs its own scalings; the others are refused with what to use."""
    assert fp8_problem("bf16", "torchao") is None
    assert fp8_problem("fp8", "torchao") is None and fp8_problem("fp8-rowwise", "torchao") is None
    assert "megatron-core" in fp8_problem("fp8-blockwise", "torchao")
    assert fp8_problem("fp8-blockwise", "transformer-engine") is None
    assert "torchao" in fp8_problem("fp8-rowwise", "transformer-engine")
    assert fp8_all_gather("fp8", 3, 2) and not fp8_all_gather("fp8", 3, 1)
    assert not fp8_all_gather("fp8-rowwise", 3, 2) and not fp8_all_gather("fp8", 2, 2)
    with pytest.raises(ConfigError, match="fp8_library must be one of"):
        CostOptions(fp8_library="te")
    assert CostOptions().fp8_library == "torchao"
    assert CostOptions(stack="megatron-core").fp8_library == "transformer-engine"
    with pytest.raises(ConfigError, match="torchao does not run"):
        CostEngine(_graph("gpt"), _h100()).estimate(
            Strategy(dp=2, global_batch=8, precision="fp8-blockwise"))


# ---------------------------------------------------------------------- pricing
def test_cast_bytes_of_one_linear_by_hand():
    """A column linear k=4096 -> n=14336 over m=8192 tokens on one rank (module docstring)."""
    m, k, n = 8192, 4096, 14336
    lin = cfp8.Fp8Linear("fc1", "column", k, n)
    fwd, bwd = cfp8.cast_bytes(lin, "torchao", "tensor", tokens=m, tp=1)
    assert fwd == 33 * (m * k + k * n)
    assert bwd == 33 * (k * n + 2 * m * n + m * k) + 2 * (k * n + m * n + m * k)
    fwd_r, bwd_r = cfp8.cast_bytes(lin, "torchao", "row", tokens=m, tp=1)
    assert fwd_r == fwd and bwd_r == bwd + 4 * (m * k + k * n)
    # under torchao's float8 TP styles (tp=2) the input and the gradient are cast once
    fwd2, bwd2 = cfp8.cast_bytes(lin, "torchao", "tensor", tokens=m, tp=2)
    assert fwd2 == 33 * (m * k + k * n / 2)
    assert bwd2 == 33 * (k * n / 2 + m * n / 2) + 2 * (k * n / 2 + m * n / 2 + m * k)
    te_fwd, te_bwd = cfp8.cast_bytes(lin, "transformer-engine", "tensor", tokens=m, tp=1)
    # Transformer Engine: the input and the output gradient each micro-batch; the weight
    # once a step (its cache), 6 B a weight
    assert (te_fwd, te_bwd) == (6 * m * k, 6 * m * n)
    assert cfp8.cast_bytes(lin, "transformer-engine", "block", tokens=m, tp=1)[1] == 4.0625 * m * n
    assert cfp8.te_weight_cast_bytes(lin, "tensor", tp=1) == 6 * k * n
    assert cfp8.te_weight_cast_bytes(lin, "tensor", tp=2) == 6 * k * n / 2
    bank = cfp8.Fp8Linear("experts.up", "column", k, n, num_experts=8)
    assert cfp8.te_weight_cast_bytes(bank, "tensor", tp=1, ep=4) == 6 * k * n * 2
    assert (fwd + bwd) / (te_fwd + te_bwd) > 5


@pytest.mark.parametrize("ep,tp", [(1, 1), (4, 1), (2, 2)])
def test_transformer_engine_quantizes_every_routed_row_of_an_expert_bank(monkeypatch, ep, tp):
    """An expert bank's casts under Transformer Engine: every token-to-expert assignment's
    row (tokens x top-k), by its input features forward and its output features backward,
    at any expert parallelism (a rank's experts take its ep group's tokens) and 1/tp of
    them where Megatron-Core splits the tokens over tp."""
    g = _graph("mixtral")
    block = next(l for l in g.layers if l.kind is LayerKind.BLOCK)
    cluster = _h100(8)
    b, routed = 2, 2 * rc.SEQ * rc.MOE_TOP_K / tp
    dense_tokens = b * rc.SEQ

    def times(per):
        monkeypatch.setitem(cfp8.TE_CAST_BYTES, "tensor", per)
        eng = CostEngine(g, cluster, options=CostOptions(stack="megatron-core"))
        t = eng.template_time(block.template, b, tp, 1, eng.cluster.device_types[0], "fp8",
                              sp=tp > 1, ep=ep)
        return t, eng.cluster.device_types[0].memory_bw_bytes_per_s

    (on, bw), (off, _) = times(6.0), times(0.0)
    fwd = bwd = 0.0
    for lin in block.tp.linears:
        if fp8_converts(lin.role, lin.in_features, lin.out_features, lin.num_experts,
                        "transformer-engine"):
            k, n = cfp8.Fp8Linear(lin.name, lin.role.value, lin.in_features,
                                  lin.out_features).local(tp)
            rows = routed if lin.num_experts > 1 else dense_tokens
            fwd, bwd = fwd + 6 * rows * k, bwd + 6 * rows * n
    assert on.forward_s - off.forward_s == pytest.approx(fwd / bw, rel=1e-9)
    assert on.backward_s - off.backward_s == pytest.approx(bwd / bw, rel=1e-9)


def test_transformer_engine_casts_weights_once_a_step():
    """Megatron-Core's TE weight cache: more micro-batches add no weight casts, unless ZeRO-3
    gathers the weights again for each (then one cast per micro-batch)."""
    from autoplan import trace
    from autoplan.models import GPT, GPTConfig
    import torch

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=1024, hidden=2048, heads=16, layers=2))
    g = trace(model, seq_len=1024)
    h100 = load_cluster("h100-sxm5-80gb")
    te = CostEngine(g, h100, options=CostOptions(stack="megatron-core"))
    device = h100.device_types[0]
    block = next(l for l in g.layers if l.kind is LayerKind.BLOCK)
    weights = sum(cfp8.te_weight_cast_bytes(lin, "tensor", tp=1) for lin in
                  cfp8.fp8_linears_of(block.tp.linears, "transformer-engine").values())
    blocks = sum(1 for l in g.layers if l.kind is LayerKind.BLOCK)
    one_cast = blocks * weights / device.memory_bw_bytes_per_s

    def optimizer_s(**kw):
        est = te.estimate(Strategy(dp=8, micro_batch=1, precision="fp8", **kw))
        return est.breakdown["optimizer_s"]

    def bf16_optimizer_s(**kw):
        return te.estimate(Strategy(dp=8, micro_batch=1, **kw)).breakdown["optimizer_s"]

    for zero in (0, 1):
        cast = [optimizer_s(global_batch=8 * mb, zero=zero)
                - bf16_optimizer_s(global_batch=8 * mb, zero=zero) for mb in (1, 4)]
        assert cast[0] == pytest.approx(one_cast, rel=1e-9)
        assert cast[1] == pytest.approx(one_cast, rel=1e-9)
    cast3 = optimizer_s(global_batch=32, zero=3) - bf16_optimizer_s(global_batch=32, zero=3)
    assert cast3 == pytest.approx(4 * one_cast, rel=1e-9)


def test_torchao_and_transformer_engine_price_apart():
    """The same FP8 layout: Transformer Engine's fused casts make it faster than bf16 on an
    H100 for GEMMs this wide; torchao's eager casts cost more than they save there."""
    from autoplan import trace
    from autoplan.models import GPT, GPTConfig
    import torch

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=1024, hidden=2048, heads=16, layers=2))
    g = trace(model, seq_len=1024)
    s = functools.partial(Strategy, dp=8, micro_batch=8, global_batch=64)
    h100 = load_cluster("h100-sxm5-80gb")
    te = CostEngine(g, h100, options=CostOptions(stack="megatron-core"))
    ao = CostEngine(g, h100)
    assert te.estimate(s(precision="fp8")).step_time_s < te.estimate(s()).step_time_s
    assert ao.estimate(s(precision="fp8")).step_time_s > te.estimate(s(precision="fp8")).step_time_s
    # the difference is all in the casts: without them FP8's forward is the faster
    device = h100.device_types[0]
    t16 = ao.template_time("blocks.0", 8, 1, 1, device, "bf16")
    t8 = ao.template_time("blocks.0", 8, 1, 1, device, "fp8")
    block = next(l for l in g.layers if l.kind is LayerKind.BLOCK)
    cast = sum(cfp8.cast_bytes(lin, "torchao", "tensor", tokens=8 * 1024, tp=1)[0]
               for lin in cfp8.fp8_linears_of(block.tp.linears, "torchao").values())
    assert t8.forward_s > t16.forward_s > t8.forward_s - cast / device.memory_bw_bytes_per_s


def test_ledger_lists_the_fp8_gemms_gathers_and_scales():
    """The estimate's ledger of FP8 layouts by hand: the converted linears' FLOPs in fp8,
    ZeRO-3 gathering them at one byte a parameter with one scale all-reduce a step (4 bytes
    a weight), and torchao's amax all-reduces under TP + SP (tests/test_ledger.py checks
    these against real steps)."""
    g = _graph("llama")
    engine = CostEngine(g, _h100())
    b, tokens = 1, rc.SEQ
    converted = sum(math.prod((lin.in_features, lin.out_features))
                    for l in g.layers for lin in l.tp.linears if lin.name in fp8_linears(l))
    dp = engine.ledger(Strategy(dp=2, global_batch=8, precision="fp8")).of_device(0)
    flops = dp.flops_by_dtype()
    micro_batches = 4
    assert flops["fp8"] == pytest.approx(micro_batches * 6 * b * tokens * converted)
    assert set(flops) == {"fp8", "bf16"}
    z3 = engine.ledger(Strategy(dp=2, zero=3, global_batch=8, precision="fp8")).of_device(0)
    totals = z3.totals()
    gathered = {k: v for k, v in totals.items() if k[0] == "all_gather"}
    blocks = [l for l in g.layers if l.kind is LayerKind.BLOCK]
    fp8_params = sum(lin.in_features * lin.out_features for l in blocks
                     for lin in l.tp.linears if lin.name in fp8_linears(l))
    other = sum(l.param_count for l in blocks) - fp8_params
    # every block gathered forward and backward per micro-batch (uint8: mixed dtypes)
    assert gathered["all_gather", "dp", "uint8"][0] == pytest.approx(
        micro_batches * 2 * (fp8_params + 2 * other))
    n_linears = sum(len(fp8_linears(l)) for l in blocks)
    assert totals["all_reduce", "dp", "fp32"] == (4 * n_linears, 1)
    rowwise = engine.ledger(Strategy(dp=2, zero=3, global_batch=8, precision="fp8-rowwise"))
    assert not any(k[2] in ("uint8", "fp8") for k in rowwise.of_device(0).totals())
    sp = engine.ledger(Strategy(tp=2, sequence_parallel=True, global_batch=8,
                                precision="fp8")).of_device(0).totals()
    # per block and micro-batch: 7 linears x 3 casts of split tensors, 2 regions entered
    # in FP8 and 2 row linears' output gradients under SP (module docstring of cost/fp8)
    assert sp["all_reduce", "tp", "float64"][1] == 8 * len(blocks) * (21 + 2 + 2)
    assert ("all_gather", "tp", "fp8") in sp


def test_search_considers_fp8_only_when_asked():
    """The default search stays bf16 on an FP8 GPU; a list of recipes is searched together
    and the fastest plan of any wins."""
    from autoplan import plan, trace
    from autoplan.models import GPT, GPTConfig
    import torch

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=1024, hidden=2048, heads=16, layers=2))
    g = trace(model, seq_len=1024)
    h100 = load_cluster("h100-sxm5-80gb")
    te = CostOptions(stack="megatron-core")
    default = plan(g, h100, global_batch=64, top_k=3, options=te)
    assert {p.precision.value for p in (default, *default.runners_up)} == {"bf16"}
    both = plan(g, h100, global_batch=64, top_k=3, options=te,
                precision=["bf16", "fp8"])
    assert both.precision.value == "fp8"
    assert both.estimate.step_time_s < default.estimate.step_time_s
    with pytest.raises(ConfigError, match="is not one of"):
        plan(g, h100, global_batch=64, time_limit_s=1, precision=["bf16", "fp9"])


# ---------------------------------------------------------------------- the import
def test_torchao_import_noise_stays_off_the_console():
    """With torchao installed, building a Hugging Face model imports it (transformers
    does); its kernel-loading messages and torch's pytree deprecations are not printed."""
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    code = ("import autoplan\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,"
            " num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))\n"
            "from autoplan.runtime.fp8 import import_torchao\nimport_torchao()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Failed to load" not in out.stderr and "Enum subclass" not in out.stderr, out.stderr


# ---------------------------------------------------------------------- the profiler
def test_fp8_gemm_timing_rehearsed_on_cpu():
    """``autoplan profile --device cuda`` times tensorwise and rowwise ``torch._scaled_mm``
    (autoplan.profiling.fp8); torch's CPU kernels run the same calls, here with a
    stand-in timer, so what the GPU would run is checked without one."""
    import torch

    from autoplan.profiling.fp8 import cold_scaled_mm, fp8_capable, measure_fp8_gemms

    cpu = torch.device("cpu")
    assert not fp8_capable(torch, cpu)
    calls = []

    def timer(call):            # runs the call, reports an H100-like rate
        call()
        calls.append(call)
        return 1e-3
    said = []
    out = measure_fp8_gemms(torch, cpu, (32, 64), 2**16, timer, said.append)
    assert set(out) == {"fp8", "fp8_rowwise"}
    assert [n for n, _ in out["fp8"]] == [32, 64] and len(calls) == 4
    assert any("fp8_rowwise 64^3" in m for m in said)
    # a rotation of operand sets, each an FP8 GEMM into bf16 as torchao calls it
    call = cold_scaled_mm(torch, 32, cpu, 2**16, rowwise=True)
    call()

    class NoRowwise:            # a torch whose _scaled_mm lacks the rowwise kernel
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def _scaled_mm(*args, use_fast_accum=False, **kw):
            if kw["scale_a"].dim():
                raise RuntimeError("Only tensorwise scaling is supported on this device\nmore")
            return torch._scaled_mm(*args, use_fast_accum=use_fast_accum, **kw)
    out = measure_fp8_gemms(NoRowwise(), cpu, (32,), 2**16, timer, said.append)
    assert set(out) == {"fp8"} and "matmul fp8_rowwise: not measured" in said[-1]

    class Hopper:
        class cuda:
            @staticmethod
            def get_device_capability(device):
                return (9, 0)
    assert fp8_capable(Hopper, torch.device("cuda", 0))


def test_measured_fp8_rates_become_the_profile_tables():
    """The profile keeps the best tensorwise FP8 GEMM as its ``fp8`` peak with its table, and
    the rowwise GEMMs as ``fp8_rowwise`` against that peak; the YAML round-trips, and the cost
    model prices torchao's rowwise forward GEMM from that table."""
    import yaml

    from autoplan.hardware.profile_yaml import parse_profile, profile_to_yaml
    from autoplan.profiling.build import build_profile

    matmul = {d: [[1024, 2 * 1024**3 / 5e14], [4096, 2 * 4096**3 / 7e14]]
              for d in ("fp32", "bf16")}
    fp8 = {"fp8": [[1024, 2 * 1024**3 / 8e14], [4096, 2 * 4096**3 / 1.4e15]],
           "fp8_rowwise": [[1024, 2 * 1024**3 / 6e14], [4096, 2 * 4096**3 / 1.2e15]]}
    rank = {"rank": 0, "matmul": matmul, "copy_s": 2 * 2**30 / 3e12,
            "info": {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30,
                     "capability": [9, 0]}, "overhead": None, "attention": [],
            "fp8_matmul": fp8}
    profile, measured = build_profile("gpu", {"ranks": [rank], "comm": {}, "world": 1},
                                      cuda=True, nproc=1, threads=1, devices_per_node=1,
                                      quick=False, copy_bytes=2**30)
    d = profile.device
    assert d.peak_flops_per_s["fp8"] == pytest.approx(1.4e15)
    assert [e for _, e in d.matmul_efficiency["fp8"].points] == pytest.approx([8 / 14, 1.0])
    assert [e for _, e in d.matmul_efficiency["fp8_rowwise"].points] == pytest.approx(
        [6 / 14, 12 / 14])
    assert "rowwise" in d.matmul_efficiency["fp8_rowwise"].source
    assert set(measured["matmul_flops_per_s"]) == {"fp32", "bf16", "fp8", "fp8_rowwise"}
    assert parse_profile(yaml.safe_load(profile_to_yaml(profile))) == profile
    assert cfp8.fp8_gemm_rate(d, 2 * 4096**3, rowwise=True) == pytest.approx(1.2e15)
    assert cfp8.fp8_gemm_rate(d, 2 * 4096**3) == pytest.approx(1.4e15)
    # a profile without FP8 GEMMs timed (a CPU's, an A100's) has no fp8 peak
    del rank["fp8_matmul"]
    plain, _ = build_profile("gpu", {"ranks": [rank], "comm": {}, "world": 1}, cuda=True,
                             nproc=1, threads=1, devices_per_node=1, quick=False,
                             copy_bytes=2**30)
    assert "fp8" not in plain.device.peak_flops_per_s


@pytest.mark.slow
def test_gpu_truth_runs_and_prices_fp8_steps(tmp_path):
    """benchmarks/gpu_truth.py --precision fp8: the step of an FP8 program (emulated on this
    CPU: the code path a GPU runs for real) is measured beside bf16's, and the report prices
    it as FP8 on the GPU's shipped profile."""
    import json
    import os

    pytest.importorskip("torchao")
    bench = str(rc.__file__).rsplit("/tests/", 1)[0] + "/benchmarks"
    sys.path.insert(0, bench)
    import gpu_truth

    rows = tmp_path / "cases.jsonl"
    env = {**os.environ, "AUTOPLAN_GPU_TRUTH_PRECISION": "bf16,fp8",
           "AUTOPLAN_GPU_TRUTH_RECOMPUTE": "none", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, f"{bench}/gpu_truth.py", "--worker", "gpt-tiny",
                          "--device", "cpu", "--rows", str(rows)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    cases = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [c["precision"] for c in cases] == ["bf16", "fp8"]
    assert all(c.get("step_s", 0) > 0 for c in cases), cases
    h100 = gpu_truth._device_cluster("h100-sxm5-80gb")
    report = gpu_truth.report_rows({"cases": cases, "precision_program": "fsdp2"},
                                   {"shipped": h100}, gpu_truth.TINY)
    assert [r["model"] for r in report] == ["gpt-tiny", "gpt-tiny fp8"]
    assert all(r["pred_shipped_s"] > 0 for r in report)
