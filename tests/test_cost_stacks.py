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
