"""Software-stack presets of :class:`~autoplan.cost.CostOptions`."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from autoplan.cost import STACKS, CostOptions
from autoplan.errors import ConfigError


def test_the_default_is_what_autoplan_runs():
    assert CostOptions() == CostOptions(stack="autoplan") == CostOptions.preset("autoplan")
    o = CostOptions()
    assert (o.overlap_grad_reduce, o.overlap_param_gather, o.tp_comm_overlap,
            o.pp_comm_overlap, o.fused_attention) == (True, True, False, False, False)


@pytest.mark.parametrize("name,expect", [
    ("megatron-2021", dict(overlap_grad_reduce=False, tp_comm_overlap=False,
                           pp_comm_overlap=False, fused_attention=False)),
    ("megatron-core", dict(overlap_grad_reduce=True, overlap_param_gather=True,
                           tp_comm_overlap=True, pp_comm_overlap=True, fused_attention=True)),
    ("deepspeed-zero3", dict(overlap_param_gather=True, zero3_gather_unit="module",
                             zero3_regather_for_recompute=True, tp_comm_overlap=False)),
    ("fsdp", dict(overlap_param_gather=True, overlap_grad_reduce=True, tp_comm_overlap=False,
                  zero3_gather_unit="layer", zero3_regather_for_recompute=False)),
])
def test_each_preset_sets_what_its_stack_does(name, expect):
    o = CostOptions.preset(name)
    assert o.stack == name
    assert {k: getattr(o, k) for k in expect} == expect


def test_every_preset_sets_every_implementation_field():
    for stack in STACKS.values():
        o = CostOptions(stack=stack.name)
        assert all(getattr(o, f.name) is not None for f in fields(o)), stack.name


def test_overrides_win_and_survive_replace():
    o = CostOptions(stack="megatron-core", tp_comm_overlap=False)
    assert o.tp_comm_overlap is False and o.fused_attention is True
    o2 = replace(o, memory_fraction=0.9)
    assert o2.tp_comm_overlap is False and o2.memory_fraction == 0.9


def test_options_round_trip_through_json():
    o = CostOptions.preset("deepspeed-zero3", memory_fraction=0.8)
    assert CostOptions.from_json(o.to_json()) == o


def test_an_unknown_stack_names_the_closest():
    with pytest.raises(ConfigError, match="did you mean megatron-core, megatron-2021"):
        CostOptions(stack="megatron")
    with pytest.raises(ConfigError, match="known: autoplan, megatron-2021"):
        CostOptions(stack="xyz")


def test_an_unknown_attention_kernel_is_refused():
    with pytest.raises(ConfigError, match="attention_kernel must be one of cudnn, flash-attention-2"):
        CostOptions(stack="fsdp", attention_kernel="flash3")


@pytest.mark.parametrize("profile,speed", [("h100-sxm5-80gb", 1 / 1.75),
                                           ("b200-sxm-180gb", 1 / 1.75),
                                           ("a100-sxm4-80gb", 1.0)])
def test_flash_attention_2_runs_the_attention_core_slower_on_hopper_and_blackwell(profile, speed):
    """The attention core of a fused-attention model (SDPA in the captured graph) under the
    cuDNN kernels of Megatron-Core and under FlashAttention-2: the same FLOPs at
    ``FLASH_ATTENTION_2_SPEED`` of the rate (FlashAttention-3's paper: 1.5-2.0x faster
    than FlashAttention-2 on H100); the rest of the layer is unchanged."""
    from autoplan import trace
    from autoplan.cost import engine_for
    from autoplan.hardware import load_cluster
    from autoplan.models import GPT, GPTConfig

    graph = trace(GPT(GPTConfig(vocab_size=256, seq_len=512, hidden=256, heads=4, layers=2)),
                  seq_len=512)
    cluster = load_cluster(profile)
    block = graph.layers[1].template
    times = {}
    for kernel in ("cudnn", "flash-attention-2"):
        engine = engine_for(graph, cluster, options=CostOptions(stack="fsdp",
                                                                attention_kernel=kernel))
        times[kernel] = engine.template_time(block, 4, 1, 1, engine.device_of((0,)), "bf16")
    cudnn, fa2 = times["cudnn"], times["flash-attention-2"]
    assert cudnn.core_forward_s > 0
    assert fa2.core_forward_s == pytest.approx(cudnn.core_forward_s / speed, rel=1e-9)
    # only the attention core's matmuls change, in the forward and the backward alike
    extra = fa2.core_forward_s - cudnn.core_forward_s
    assert fa2.forward_s - cudnn.forward_s == pytest.approx(extra, rel=1e-9, abs=1e-15)
    assert fa2.weight_grad_s == cudnn.weight_grad_s
    assert fa2.backward_s >= cudnn.backward_s + 2 * extra * (1 - 1e-9)


def test_each_stack_names_its_attention_kernel():
    assert CostOptions.preset("megatron-core").attention_kernel == "cudnn"
    assert CostOptions.preset("fsdp").attention_kernel == "flash-attention-2"
