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


def _attention_fraction(profile: str, kernel: str) -> float:
    """The fraction of peak ``kernel`` reaches on ``profile``'s GPU on a large problem
    (the calibration's attention curve at its largest size)."""
    from autoplan.cost.calibration import attention_tables, load_calibration
    from autoplan.hardware import load_cluster
    cluster = load_cluster(profile)
    table = attention_tables(cluster, load_calibration(), kernel)[
        cluster.device_type_of(0).name]
    return table.points[-1][1]


def test_hopper_attention_is_priced_from_ampere_flash_attention_2():
    """FlashAttention-2 runs the same kernel on Ampere and Hopper: the shipped fit has no
    Hopper attention figure; an H100 (and an H200, the same chip) gets Ampere's fitted
    fraction times the ratio of the kernel's published fractions on the two (Dao 2023: 335
    TFLOP/s of 989 on H100, 230 of 312 on A100), and the cuDNN kernels that over
    FLASH_ATTENTION_2_SPEED (Shah et al. 2024).  Blackwell: its own fitted fraction, and
    FlashAttention-2 that times FLASH_ATTENTION_2_SPEED; Ampere: one kernel."""
    from autoplan.cost.calibration import (FLASH_ATTENTION_2_HOPPER_VS_AMPERE,
                                           FLASH_ATTENTION_2_SPEED, load_calibration)
    cal = load_calibration()
    assert cal.architectures["hopper"].attention_peak_fraction is None
    ampere = cal.architectures["ampere"].attention_peak_fraction
    assert FLASH_ATTENTION_2_HOPPER_VS_AMPERE == pytest.approx(0.4595, abs=1e-4)
    fa2 = ampere * FLASH_ATTENTION_2_HOPPER_VS_AMPERE
    for profile in ("h100-sxm5-80gb", "h200-sxm-141gb"):
        assert _attention_fraction(profile, "flash-attention-2") == pytest.approx(fa2, rel=1e-3)
        assert _attention_fraction(profile, "cudnn") == pytest.approx(
            fa2 / FLASH_ATTENTION_2_SPEED["hopper"], rel=1e-3)
    _, source = cal.attention_fraction("hopper", "cudnn")
    assert "Ampere's fitted FlashAttention-2 fraction" in source
    blackwell = cal.architectures["blackwell"].attention_peak_fraction
    assert _attention_fraction("b200-sxm-180gb", "cudnn") == pytest.approx(blackwell, rel=1e-3)
    assert _attention_fraction("b200-sxm-180gb", "flash-attention-2") == pytest.approx(
        blackwell * FLASH_ATTENTION_2_SPEED["blackwell"], rel=1e-3)
    for profile in ("a100-sxm4-80gb", "a100-sxm4-40gb"):
        assert _attention_fraction(profile, "flash-attention-2") == \
            _attention_fraction(profile, "cudnn") == pytest.approx(ampere, rel=1e-3)


def test_a_calibration_with_its_own_hopper_attention_figure_keeps_it():
    """A calibration that fits Hopper's attention (a user's own) prices the cuDNN kernels
    at it and FlashAttention-2 at FLASH_ATTENTION_2_SPEED of it."""
    from dataclasses import replace as _replace

    from autoplan.cost.calibration import FLASH_ATTENTION_2_SPEED, load_calibration
    cal = load_calibration()
    own = _replace(cal, architectures={**cal.architectures, "hopper": _replace(
        cal.architectures["hopper"], attention_peak_fraction=0.5)})
    assert own.attention_fraction("hopper", "cudnn")[0] == 0.5
    assert own.attention_fraction("hopper", "flash-attention-2")[0] == pytest.approx(
        0.5 * FLASH_ATTENTION_2_SPEED["hopper"])


@pytest.mark.parametrize("profile", ["h100-sxm5-80gb", "b200-sxm-180gb", "a100-sxm4-80gb"])
def test_the_attention_kernel_changes_only_the_attention_core(profile):
    """The attention core of a fused-attention model (SDPA in the captured graph) under the
    cuDNN kernels of Megatron-Core and under FlashAttention-2: the same FLOPs, slower by at
    most the ratio of the two kernels' fractions of peak (less on small problems, where the
    per-kernel time they share weighs more), equal on Ampere; the rest of the layer is
    unchanged."""
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
    slowdown = (_attention_fraction(profile, "cudnn")
                / _attention_fraction(profile, "flash-attention-2"))
    if profile.startswith("a100"):
        assert slowdown == 1.0
        assert fa2 == cudnn
        return
    assert slowdown > 1.2
    ratio = fa2.core_forward_s / cudnn.core_forward_s
    assert 1.0 < ratio <= slowdown * (1 + 1e-9)
    # only the attention core's matmuls change, in the forward and the backward alike
    extra = fa2.core_forward_s - cudnn.core_forward_s
    assert fa2.forward_s - cudnn.forward_s == pytest.approx(extra, rel=1e-9, abs=1e-15)
    assert fa2.weight_grad_s == cudnn.weight_grad_s
    assert fa2.backward_s >= cudnn.backward_s + 2 * extra * (1 - 1e-9)


def test_each_stack_names_its_attention_kernel():
    assert CostOptions.preset("megatron-core").attention_kernel == "cudnn"
    assert CostOptions.preset("fsdp").attention_kernel == "flash-attention-2"


def test_prefetch_exposed_is_the_layerwise_overlap_for_equal_modules():
    from autoplan.cost.engine import prefetch_exposed
    for comm in (0.5, 1.0, 1.5):
        assert prefetch_exposed((0.25,) * 4, 1.0, comm) == pytest.approx(max(0.0, comm - 1.0))
    # a large module's gather hides only under the small module before it
    assert prefetch_exposed((0.1, 0.4, 0.5), 1.0, 1.0) == pytest.approx(0.3 + 0.1)
    # never less than the layer-wise overlap
    for comm in (0.2, 0.9, 1.1, 3.0):
        assert prefetch_exposed((0.25, 0.08, 0.33, 0.34), 1.0, comm) >= max(0.0, comm - 1.0)


def test_a_per_module_gather_exposes_more_near_the_balance_of_gather_and_compute():
    """DeepSpeed ZeRO-3 (per-module gathers, one module ahead) against the same layout with
    per-layer gathers: never faster, slower where gathers and compute are of a size (the
    small projection cannot hide the large MLP's gather), alike without overlap."""
    from autoplan import estimate, trace
    from autoplan.hardware import load_cluster
    from autoplan.models import GPT, GPTConfig
    from autoplan.strategy import Strategy

    graph = trace(GPT(GPTConfig(vocab_size=256, seq_len=512, hidden=512, heads=8, layers=2)),
                  seq_len=512)
    cluster = load_cluster("a100-sxm4-80gb", nodes=4)
    gaps = []
    for mb in (1, 2, 4, 8, 16):
        s = Strategy(dp=32, zero=3, recompute="full", micro_batch=mb, global_batch=32 * mb)
        t = {unit: estimate(graph, cluster, s, options=CostOptions(
                 stack="deepspeed-zero3", zero3_gather_unit=unit)).step_time_s
             for unit in ("module", "layer")}
        assert t["module"] >= t["layer"] * (1 - 1e-12)
        gaps.append(t["module"] / t["layer"] - 1)
        off = {unit: estimate(graph, cluster, s, options=CostOptions(
                   stack="deepspeed-zero3", zero3_gather_unit=unit,
                   overlap_param_gather=False)).step_time_s for unit in ("module", "layer")}
        assert off["module"] == pytest.approx(off["layer"], rel=1e-12)
    assert max(gaps) > 0.02, gaps
