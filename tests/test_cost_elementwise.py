"""Memory-bound operators of a kind at their own measured speed (``DeviceType.elementwise_rates``).

On a CPU, GELU, SiLU, softmax, layer norm and masked_fill are arithmetic per byte rather
than a copy: ``autoplan profile`` times each
(:func:`autoplan.profiling.elementwise.measure_elementwise`) and the cost model prices the
bytes the capture counts for each kind at that speed, in place of the copy bandwidth
(forward) and twice the bytes at it (backward).  Other operators' backward moves what
their derivative does (:func:`autoplan.cost.summary.backward_traffic`).
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from autoplan import trace
from autoplan.cost import CostOptions, estimate
from autoplan.cost.engine import ELEMENTWISE_BACKWARD_FACTOR
from autoplan.cost.summary import rate_kind, summarize
from autoplan.errors import AutoplanError
from autoplan.hardware import ElementwiseRates, NodeGroup, compose_cluster
from autoplan.hardware.profile_records import (ELEMENTWISE_KINDS, LAYOUT_KINDS, RATE_KINDS,
                                               elementwise_kind)
from autoplan.hardware.profiles import parse_profile, profile_to_yaml
from autoplan.models import GPT, GPTConfig
from autoplan.strategy import Strategy
from runtime_cases import cpu_cluster

CONFIG = GPTConfig(vocab_size=128, seq_len=16, hidden=32, heads=4, layers=2)
OPTS = CostOptions(overlap_grad_reduce=False, overlap_param_gather=False,
                   tp_comm_overlap=False, pp_comm_overlap=False, autocast=False,
                   step_loss_all_reduce=False)


@pytest.fixture(scope="module")
def graph():
    return trace(GPT(CONFIG), seq_len=CONFIG.seq_len)


def _cluster(rates: ElementwiseRates | None, world: int = 2):
    p = next(iter(cpu_cluster(world).profiles.values()))
    p = dataclasses.replace(p, device=dataclasses.replace(p.device, elementwise_rates=rates))
    return compose_cluster([NodeGroup(p, 1)], name=f"ew-{id(rates)}")


def _rates(forward: dict[str, float], backward: dict[str, float]) -> ElementwiseRates:
    return ElementwiseRates(forward_bytes_per_s=forward, backward_bytes_per_s=backward,
                            source="a test's figures")


def test_kinds_are_matched_by_operator_not_by_prefix():
    assert elementwise_kind("aten.gelu.default") == "gelu"
    assert elementwise_kind("aten._softmax.default") == "softmax"
    assert elementwise_kind("aten.native_layer_norm.default") == "layer_norm"
    assert elementwise_kind("aten.gelu_backward.default") is None
    assert elementwise_kind("aten.add.Tensor") is None


def test_the_kinds_are_part_of_the_elementwise_bytes(graph):
    """The GPT block's GELU (tensor-parallel sharded: the MLP's inner width), its two layer
    norms (replicated), its softmax and causal mask (the attention's s x s scores) and the
    copy of its heads' transposed output into the projection's layout (sharded) are each a
    part of the block's memory-bound bytes; the GPT has no SiLU and no broadcast."""
    s = summarize(graph)
    block = next(t for t in s.elementwise if t.startswith("blocks"))
    kinds = s.elementwise_kinds[block]
    assert set(kinds) == {"gelu", "layer_norm", "softmax", "masked_fill", "layout_copy"}
    assert kinds["layout_copy"][0] == kinds["layout_copy"][2] == 0
    assert kinds["layout_copy"][1] > 0
    assert kinds["gelu"][0] == kinds["gelu"][2] == 0 and kinds["gelu"][1] > 0
    assert kinds["layer_norm"][1:] == (0, 0) and kinds["layer_norm"][0] > 0
    assert kinds["softmax"][:2] == (0, 0) and kinds["masked_fill"][:2] == (0, 0)
    for part in range(3):
        assert sum(v[part] for v in kinds.values()) <= s.elementwise[block][part]


def test_rates_at_the_copy_speed_change_nothing(graph):
    """A kind measured exactly as the copy bandwidth prices it (the forward's bytes at the
    bandwidth, the backward's at half of it) costs what it cost without figures."""
    bw = next(iter(cpu_cluster(2).profiles.values())).device.memory_bw_bytes_per_s
    kinds = list(RATE_KINDS)
    same = _rates({k: bw for k in kinds}, {k: bw / ELEMENTWISE_BACKWARD_FACTOR for k in kinds})
    for s in (Strategy(dp=2, micro_batch=2, global_batch=8, precision="fp32"),
              Strategy(tp=2, micro_batch=2, global_batch=8, precision="fp32",
                       sequence_parallel=True)):
        base = estimate(graph, _cluster(None), s, calibration=None, options=OPTS)
        timed = estimate(graph, _cluster(same), s, calibration=None, options=OPTS)
        assert timed.step_time_s == pytest.approx(base.step_time_s, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_slower_kind_costs_its_bytes_at_its_own_speed(graph, tp):
    """GELU at a quarter of the copy bandwidth forward and a tenth backward: each micro-batch
    of each block pays the GELU's counted bytes (its share on this tensor-parallel rank) at
    those speeds instead of the copy's; nothing else moves."""
    bw = next(iter(cpu_cluster(2).profiles.values())).device.memory_bw_bytes_per_s
    s = Strategy(dp=2 // tp, tp=tp, micro_batch=2, global_batch=8, precision="fp32")
    base = estimate(graph, _cluster(None), s, calibration=None, options=OPTS)
    slow = estimate(graph, _cluster(_rates({"gelu": bw / 4}, {"gelu": bw / 10})), s,
                    calibration=None, options=OPTS)
    summary = summarize(graph)
    scale = 4 / summary.activation_bytes          # fp32 bytes per counted unit
    gelu = sum(summary.elementwise_kinds[l.template]["gelu"][1]
               for l in summary.layers if "gelu" in summary.elementwise_kinds[l.template])
    moved = gelu / tp * 2 * scale                 # per micro-batch of 2 sequences
    micro_batches = 8 // (2 // tp) // 2
    per_micro_batch = (moved * (4 / bw - 1 / bw)
                       + moved * (10 / bw - ELEMENTWISE_BACKWARD_FACTOR / bw))
    added = slow.breakdown["compute_s"] - base.breakdown["compute_s"]
    assert gelu > 0 and added == pytest.approx(micro_batches * per_micro_batch, rel=1e-9)
    others = {k: v for k, v in slow.breakdown.items() if k != "compute_s"}
    assert others == pytest.approx({k: v for k, v in base.breakdown.items() if k != "compute_s"})


def test_rates_round_trip_and_bad_ones_are_named():
    p = next(iter(_cluster(_rates({"gelu": 2e9, "softmax": 3e9, "broadcast": 5e9},
                                  {"gelu": 1e9, "softmax": 4e9, "broadcast": 2e9})
                           ).profiles.values()))
    text = profile_to_yaml(p)
    back = parse_profile(yaml.safe_load(text)).device.elementwise_rates
    assert back == p.device.elementwise_rates
    assert back.seconds("gelu", 4e9) == (2.0, 4.0) and back.seconds("silu", 1.0) is None
    # profiles without the section (GPUs, older CPU profiles) read None
    plain = profile_to_yaml(next(iter(cpu_cluster(2).profiles.values())))
    assert "elementwise_rates" not in plain
    assert parse_profile(yaml.safe_load(plain)).device.elementwise_rates is None
    for edit, match in ((lambda r: r["forward"].update(swish=1e9), "swish"),
                        (lambda r: r["backward"].update(gelu=0), "gelu"),
                        (lambda r: r["backward"].pop("softmax"), "backward"),
                        (lambda r: r.pop("source"), "source")):
        bad = yaml.safe_load(text)
        edit(bad["device"]["elementwise_rates"])
        with pytest.raises(AutoplanError, match=match):
            parse_profile(bad)


def test_llama_blocks_broadcasts_and_layout_copies_are_their_own_kinds():
    """A Hugging Face Llama block: RMSNorm's row scale and weight and the rotary
    embeddings' products with cos and sin are broadcasts, the attention output made
    contiguous is a layout copy; the residual additions, the rotation's concatenation,
    the SiLU (its own kind) and the gate's product (same shapes) are not broadcasts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=16)
    torch.manual_seed(0)
    g = trace(LlamaForCausalLM(cfg), seq_len=16)
    block = next(t for t in g.templates if "layers" in t)
    nodes = {n.name: n for n in g.templates[block]}
    kinds: dict[str, list[str]] = {}
    for n in nodes.values():
        if not (n.fwd_flops or n.bwd_flops):
            kinds.setdefault(str(rate_kind(n, nodes)), []).append(n.target.split(".")[1])
    # RMSNorm twice (x * rsqrt(mean), weight * x), rotary: q and k times cos and sin
    assert sorted(kinds["broadcast"]) == ["mul"] * 8
    # contiguous() then a reshape, or a reshape that copies (by transformers' version)
    assert len(kinds["layout_copy"]) == 1 and kinds["layout_copy"][0] in ("contiguous",
                                                                          "reshape")
    assert kinds["silu"] == ["silu"]
    assert "cat" in kinds["None"] and kinds["None"].count("add") >= 2
    summary = summarize(g)
    assert set(LAYOUT_KINDS) <= set(summary.elementwise_kinds[block])


def test_a_slower_broadcast_costs_its_bytes_at_its_own_speed(graph):
    """A layout kind is priced like an operator kind: the GPT's layout copy at a quarter of
    the copy bandwidth both ways adds its counted bytes at that speed, nothing else."""
    bw = next(iter(cpu_cluster(2).profiles.values())).device.memory_bw_bytes_per_s
    s = Strategy(dp=2, micro_batch=2, global_batch=8, precision="fp32")
    base = estimate(graph, _cluster(None), s, calibration=None, options=OPTS)
    slow = estimate(graph, _cluster(_rates({"layout_copy": bw / 4}, {"layout_copy": bw / 4})),
                    s, calibration=None, options=OPTS)
    summary = summarize(graph)
    moved = sum(sum(summary.elementwise_kinds[l.template].get("layout_copy", (0, 0, 0)))
                for l in summary.layers) * 2 * 4 / summary.activation_bytes
    added = slow.breakdown["compute_s"] - base.breakdown["compute_s"]
    per_micro_batch = moved * (4 / bw - 1 / bw) + moved * (4 / bw - ELEMENTWISE_BACKWARD_FACTOR / bw)
    assert moved > 0 and added == pytest.approx(2 * per_micro_batch, rel=1e-9)


def test_the_profiler_turns_the_slowest_ranks_timings_into_rates():
    """What each rank measured (forward seconds, backward seconds, counted bytes per call)
    becomes bytes per second, the slowest rank's per figure."""
    from autoplan.profiling.build import build_profile
    from runtime_cases import synthetic_measurements

    raw = synthetic_measurements(2)
    raw["ranks"][0]["elementwise"] = {"gelu": [1e-3, 4e-3, 2e6], "silu": [1e-3, 1e-3, 2e6]}
    raw["ranks"][1]["elementwise"] = {"gelu": [2e-3, 2e-3, 2e6], "silu": [1e-3, 1e-3, 2e6]}
    profile, _ = build_profile("ew", raw, cuda=False, nproc=2, threads=1, devices_per_node=2,
                               quick=True, copy_bytes=2**20)
    rates = profile.device.elementwise_rates
    assert rates.forward_bytes_per_s == {"gelu": 1e9, "silu": 2e9}
    assert rates.backward_bytes_per_s == {"gelu": 0.5e9, "silu": 2e9}
    del raw["ranks"][0]["elementwise"]    # a rank (an older profiler) without them: none
    profile, _ = build_profile("ew", raw, cuda=False, nproc=2, threads=1, devices_per_node=2,
                               quick=True, copy_bytes=2**20)
    assert profile.device.elementwise_rates is None


def test_the_profiler_times_each_kind_forward_and_backward():
    """The calls run the operators (a timer that runs each call twice and reads 1 ms a
    forward, 3 ms forward + backward): 2 ms backward, on 2 MiB in and 2 MiB out."""
    import torch

    from autoplan.profiling.elementwise import measure_elementwise

    calls = []

    def timed(fn):
        fn()
        fn()
        calls.append(fn)
        return 1e-3 if len(calls) % 2 else 3e-3

    out = measure_elementwise(torch, timed, torch.device("cpu"), 16 * 2**20)
    assert set(out) == set(ELEMENTWISE_KINDS)
    for fwd, bwd, nbytes in out.values():
        assert (fwd, bwd, nbytes) == pytest.approx((1e-3, 2e-3, 2 * 2 * 2**20))


def test_the_profiler_times_the_layout_kinds_as_a_gpu_would():
    """The layout kinds' calls run (on the CPU here, as on a GPU): the broadcast is three
    products (a row's scale, a weight, rotary cos of a transposed view), each counted at
    its output and input, the row scale and cos tables too; the layout copy at its
    output and input.  Their gradients flow (the timer runs forward + backward)."""
    import torch

    from autoplan.profiling.elementwise import _elementwise_calls, measure_elementwise

    out = measure_elementwise(torch, lambda fn: (fn(), fn(), 1e-3)[-1], torch.device("cpu"),
                              2**20, LAYOUT_KINDS, (256, 128))
    tensor = 256 * 128 * 4
    assert out["layout_copy"][2] == 2 * tensor
    assert out["broadcast"][2] == 3 * 2 * tensor + 256 * 4 + 256 * 64 * 4
    forward, both, _ = _elementwise_calls(torch, "layout_copy", torch.device("cpu"), 2**20,
                                          (256, 128))
    forward()
    both()


# ------------------------------------------------------------ the backward's bytes


def _node(name: str, target: str, inputs=(), dtype="float32", out_bytes=1024,
          saved_bytes=0, shape=(2, 8, 16)):
    from autoplan.graph import NodeRecord
    return NodeRecord(name=name, target=target, module="", inputs=tuple(inputs), shape=shape,
                      dtype=dtype, out_bytes=out_bytes, fwd_flops=0, bwd_flops=0,
                      param_bytes=0, saved_bytes=saved_bytes, saved_tp_sharded_bytes=0,
                      saved_quadratic_bytes=0, tp_region=False)


@pytest.mark.parametrize("target, inputs, dtype, expected", [
    ("aten.add.Tensor", ("a", "b"), "float32", 0.0),       # the gradient passes through
    ("aten.cat.default", ("a", "b"), "float32", 0.0),      # its slices are views
    ("aten.mul.Tensor", ("a", "b"), "float32", 2.0),       # each operand: grad x the other
    ("aten.mul.Tensor", ("a",), "float32", 1.0),           # times a number
    ("aten.neg.default", ("a",), "float32", 1.5),
    ("aten.mean.dim", ("a",), "float32", 1.0),
    ("aten.bitwise_not.default", ("a",), "bool", 0.0),     # no gradient
    ("aten.some_new_op.default", ("a",), "float32", 2.0),  # unknown: the default
])
def test_each_operators_backward_moves_what_its_derivative_does(target, inputs, dtype,
                                                                expected):
    from autoplan.cost.summary import BACKWARD_TRAFFIC_DEFAULT, backward_traffic
    assert BACKWARD_TRAFFIC_DEFAULT == ELEMENTWISE_BACKWARD_FACTOR == 2.0
    assert backward_traffic(_node("n", target, inputs, dtype)) == expected


def test_the_summary_counts_the_backward_per_operator():
    """An add's backward moves nothing, a product of two tensors twice its forward; a
    dropout that saved no mask (probability 0) moves nothing either way; an unbind is free
    forward and stacks its pieces' gradients backward; a kind a profile times (GELU) is
    counted at the default, which its measured backward replaces."""
    from autoplan.cost.summary import _elementwise
    x = _node("x", "aten.linear.default")
    x = dataclasses.replace(x, fwd_flops=1, bwd_flops=2)
    nodes = (x,
             _node("add", "aten.add.Tensor", ("x", "x")),
             _node("mul", "aten.mul.Tensor", ("x", "add")),
             _node("drop", "aten.dropout.default", ("mul",)),
             _node("masked", "aten.dropout.default", ("mul",), saved_bytes=128),
             _node("gelu", "aten.gelu.default", ("mul",)),
             _node("parts", "aten.unbind.int", ("x",), out_bytes=1024))
    fwd, kinds, bwd, returned = _elementwise(nodes, seq_len=None, mb=1)
    each = 3 * 1024                     # output + two inputs
    unary = 2 * 1024                    # output + one input
    assert fwd == (each + each + unary + unary + unary, 0.0, 0.0)
    assert returned == (unary, 0.0, 0.0)            # the dropout that saved no mask
    assert kinds == {"gelu": (unary, 0.0, 0.0)}
    assert bwd == (0 + 2 * each + 2 * unary + 2 * unary + 2 * 1024, 0.0, 0.0)


def test_a_dropout_of_probability_zero_costs_nothing(graph):
    """The package GPT's dropouts (probability 0 by default) return their input: on a CPU
    the same model with dropout 0.1 pays for them in both directions."""
    on = trace(GPT(dataclasses.replace(CONFIG, dropout=0.1)), seq_len=CONFIG.seq_len)
    s_off, s_on = summarize(graph), summarize(on)
    block = next(l.template for l in s_off.layers if l.is_block)
    assert sum(s_on.elementwise[block]) == sum(s_off.elementwise[block])
    assert sum(s_off.elementwise_returned[block]) > 0 == sum(s_on.elementwise_returned[block])
    assert sum(s_on.elementwise_backward[block]) > sum(s_off.elementwise_backward[block])
    s = Strategy(micro_batch=2, global_batch=2, precision="fp32")
    cluster = _cluster(None, world=1)
    assert (estimate(on, cluster, s, calibration=None, options=OPTS).step_time_s
            > estimate(graph, cluster, s, calibration=None, options=OPTS).step_time_s)


def test_a_gpu_prices_the_backward_at_twice_the_forward(graph):
    """Only where the host is the device (CPUs) does the backward move its derivative's
    bytes: a GPU's stays at ELEMENTWISE_BACKWARD_FACTOR times the forward's (the
    session-38 H100/H200 step times priced 7-15% fast with the derivative's), so zeroing
    the summary's backward bytes moves the CPU's estimate and leaves the GPU's alone."""
    import copy

    from autoplan import load_cluster
    s = Strategy(micro_batch=2, global_batch=2, precision="fp32")
    gpu = load_cluster("h100-sxm5-80gb", devices_per_node=1)
    cpu = _cluster(None, world=1)
    real = summarize(graph)
    none = copy.copy(real)
    none.elementwise_backward = {t: (0.0, 0.0, 0.0) for t in real.elementwise_backward}
    assert any(sum(v) for v in real.elementwise_backward.values())

    def step(summary, cluster):
        return estimate(summary, cluster, s, calibration=None, options=OPTS).step_time_s
    assert step(none, gpu) == step(real, gpu)
    assert step(none, cpu) < step(real, cpu)
