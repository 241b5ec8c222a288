"""The runtime's single-process parts: layouts, validation, stage splitting, TP plans, AC.

Nothing here starts a process group: every check that ``parallelize`` makes before
its first collective is exercised without one, so a check that needed a collective
would fail here with torch's "default process group has not been initialized".
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import autoplan
import runtime_cases as rc
from autoplan.errors import CheckpointError, ConfigError, PlanMismatchError, StrategyError
from autoplan.runtime import parallelize, plan_of, resolve_plan
from autoplan.runtime.adapters import adapter_for
from autoplan.runtime.checkpoint import load_checkpoint
from autoplan.runtime.mesh import mesh_coordinates
from autoplan.runtime.pipeline import build_stage_module
from autoplan.runtime.tp import tp_plan
from autoplan.strategy import Strategy

GPT_NAMES = rc.layer_names("gpt")


@pytest.fixture(scope="module")
def gpt_graph():
    return autoplan.trace(rc.make_gpt(0), seq_len=rc.SEQ)


@pytest.fixture(scope="module")
def llama_graph():
    pytest.importorskip("transformers")
    return autoplan.trace(rc.make_llama(0), seq_len=rc.SEQ)


def _S(**kw) -> Strategy:
    return Strategy(global_batch=8, precision="fp32", **kw)


# ---------------------------------------------------------------------- plans
def test_strategy_plan_splits_blocks_evenly_with_pre_and_post_at_the_ends(gpt_graph):
    plan = plan_of(_S(pp=2, micro_batch=2), gpt_graph, world_size=2)
    assert [s.layers for s in plan.stages] == [("pre", "blocks.0", "blocks.1"),
                                               ("blocks.2", "blocks.3", "post")]
    plan = plan_of(_S(pp=3, micro_batch=2), gpt_graph, world_size=3)
    # 1, 1, 2 blocks: the first stage, which holds the most micro-batches under 1F1B,
    # gets the fewest, as the cost model prices it
    assert [len(s.layers) for s in plan.stages] == [2, 1, 3]
    assert plan.placement("pre").recompute.value == "none"
    uneven = plan_of(_S(pp=2, micro_batch=2), gpt_graph, world_size=2, blocks_per_stage=(3, 1))
    assert [len(s.layers) for s in uneven.stages] == [4, 2]
    with pytest.raises(StrategyError, match="add up to the model's 4 blocks"):
        plan_of(_S(pp=2, micro_batch=2), gpt_graph, world_size=2, blocks_per_stage=(3, 2))


def test_stage_to_rank_is_looped_for_interleaved_and_v_shaped_for_zero_bubble(gpt_graph):
    inter = plan_of(_S(pp=2, micro_batch=2, schedule="interleaved", virtual_stages=2),
                    gpt_graph, world_size=2)
    assert inter.stage_ranks == (0, 1, 0, 1)
    zbv = plan_of(_S(pp=2, micro_batch=1, schedule="zero_bubble"), gpt_graph, world_size=2)
    assert zbv.stage_ranks == (0, 1, 1, 0)
    assert zbv.local_stages(0) == (0, 3)


def test_mesh_coordinates_put_tp_innermost_and_follow_a_rank_permutation(gpt_graph):
    plan = plan_of(_S(dp=2, tp=2, pp=2, micro_batch=2), gpt_graph, world_size=8)
    assert [(c["tp"], c["dp"], c["pp"]) for c in (mesh_coordinates(plan, r) for r in range(4))] \
        == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    perm = dataclasses.replace(plan, mesh=dataclasses.replace(
        plan.mesh, devices=(1, 0, 2, 3, 4, 5, 6, 7)))
    assert mesh_coordinates(perm, 1)["tp"] == 0 and mesh_coordinates(perm, 0)["tp"] == 1


def test_plans_refuse_schedules_torch_cannot_run_with_the_reason(gpt_graph):
    with pytest.raises(StrategyError, match="1F1B needs at least as many micro-batches"):
        _S(pp=2, micro_batch=8)
    with pytest.raises(StrategyError, match="ZBV needs at least 2 x pp - 1 = 3"):
        Strategy(pp=2, micro_batch=4, global_batch=8, schedule="zero_bubble")
    # ZeRO-3 reshards after forward: wrong gradients under zero-bubble, so never planned
    with pytest.raises(StrategyError, match="zero_bubble"):
        _S(pp=2, dp=2, zero=3, schedule="zero_bubble")
    # the zero-bubble schedule runs two backwards per block; selective checkpointing allows one
    with pytest.raises(StrategyError, match="backward twice"):
        _S(pp=2, recompute="selective", schedule="zero_bubble")
    plan = plan_of(_S(pp=2, dp=2, zero=2, schedule="zero_bubble"), gpt_graph, world_size=4)
    with pytest.raises(StrategyError, match="zero_bubble"):
        dataclasses.replace(plan, layers=tuple(dataclasses.replace(lp, zero=3)
                                               for lp in plan.layers))


# ---------------------------------------------------------------------- validation
def test_world_size_mismatch_names_every_factor(gpt_graph):
    with pytest.raises(StrategyError, match=r"dp=2 x tp=2 x pp=1 x cp=1 = 4, but the world has 2"):
        resolve_plan(rc.make_gpt(0), _S(dp=2, tp=2), gpt_graph, world_size=2)


def test_unknown_layer_names_are_listed(gpt_graph):
    bad = rc.renamed_layer(_S(), "blocks.2", "blocks.9")
    with pytest.raises(PlanMismatchError, match=r"blocks\.9"):
        resolve_plan(rc.make_gpt(0), bad, gpt_graph, world_size=1)


def test_stages_out_of_model_order_are_rejected(gpt_graph):
    plan = plan_of(_S(pp=2, micro_batch=2), gpt_graph, world_size=2)
    a, b = plan.stages
    swapped = (dataclasses.replace(a, layers=("pre", "blocks.1", "blocks.0")), b)
    layers = tuple(dataclasses.replace(lp, stage=0) if lp.name in ("blocks.0", "blocks.1") else lp
                   for lp in plan.layers)
    bad = dataclasses.replace(plan, stages=swapped, layers=layers)
    with pytest.raises(PlanMismatchError, match="model order"):
        resolve_plan(rc.make_gpt(0), bad, gpt_graph, world_size=2)


def test_tp_must_divide_heads_and_key_value_heads(llama_graph):
    # the tiny Llama has 4 query heads but 2 key/value heads: tp=4 cannot shard it
    with pytest.raises(StrategyError, match="tp=4 does not divide"):
        resolve_plan(rc.make_llama(0), _S(tp=4), llama_graph, world_size=4)


def test_mixed_replicated_and_sharded_layers_in_one_stage_are_rejected(gpt_graph):
    plan = plan_of(_S(dp=2), gpt_graph, world_size=2)
    bad = dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(lp, zero=3) if lp.name.startswith("blocks") else lp
        for lp in plan.layers))
    with pytest.raises(PlanMismatchError, match="mixes replicated"):
        resolve_plan(rc.make_gpt(0), bad, gpt_graph, world_size=2)


def test_global_batch_must_agree(gpt_graph):
    with pytest.raises(ConfigError, match="global_batch=16 but the strategy says global_batch=8"):
        resolve_plan(rc.make_gpt(0), _S(dp=2), gpt_graph, world_size=2, global_batch=16)
    plan = plan_of(_S(dp=2), gpt_graph, world_size=2)
    with pytest.raises(ConfigError, match="global_batch=16 but the plan says global_batch=8"):
        resolve_plan(rc.make_gpt(0), plan, gpt_graph, world_size=2, global_batch=16)


def test_parallelize_needs_a_process_group():
    with pytest.raises(ConfigError, match="init_process_group"):
        parallelize(rc.make_gpt(0), _S(), seq_len=rc.SEQ)


def test_load_of_an_incomplete_checkpoint_is_refused_before_any_collective(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(None, tmp_path / "ckpt")


# ---------------------------------------------------------------------- searched plans
def test_a_searched_plan_is_checked_as_it_is(gpt_graph):
    plan = autoplan.Plan.from_strategy(gpt_graph, autoplan.load_cluster("a100-sxm4-80gb"),
                                       _S(dp=2, tp=2, pp=2, micro_batch=2), devices=tuple(range(8)))
    assert resolve_plan(rc.make_gpt(0), plan, gpt_graph, world_size=8) is plan
    with pytest.raises(StrategyError, match="but the world has 4 processes"):
        resolve_plan(rc.make_gpt(0), plan, gpt_graph, world_size=4)


def test_a_zero_bubble_plan_runs_its_stages_in_a_v(gpt_graph):
    # the plan lists virtual stages in model order; torch's ZBV places stage k on
    # pipeline rank k for k < pp and on 2 pp - 1 - k after that, and so does the plan
    plan = autoplan.Plan.from_strategy(gpt_graph, autoplan.load_cluster("a100-sxm4-80gb"),
                                       _S(pp=2, micro_batch=1, schedule="zero_bubble"),
                                       devices=(0, 1))
    assert plan.stage_ranks == (0, 1, 1, 0)
    assert [st.devices for st in plan.stages] == [(0,), (1,), (1,), (0,)]


# ---------------------------------------------------------------------- pipeline stages
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_stages_chained_compute_the_model_and_keep_parameter_names(name):
    if name == "llama":
        pytest.importorskip("transformers")
    model = rc.MODELS[name](0)
    adapter = adapter_for(model)
    ids = rc.make_batch()
    blocks = rc.layer_names(name)[1:-1]
    splits = [blocks[:1], blocks[1:3], blocks[3:]]
    stages = [build_stage_module(model, adapter, b, is_first=i == 0, is_last=i == 2, seq_len=rc.SEQ)
              for i, b in enumerate(splits)]
    x = ids
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for st in stages:
            x = st(x)
    # the adapters call the installed transformers by its own names (5.24 renamed
    # create_causal_mask's and the decoder layer's past_key_values to cache, and warns)
    ours = [str(w.message) for w in caught
            if issubclass(w.category, (FutureWarning, DeprecationWarning))
            and ("autoplan" in w.filename or "past_key_values" in str(w.message))]
    assert not ours, ours
    torch.testing.assert_close(x, rc._logits(model, ids), atol=0, rtol=0)
    names = [n for st in stages for n in st.state_dict()]
    assert sorted(names) == sorted(model.state_dict())
    # parameters are shared with the model, not copied
    assert stages[1].get_parameter(f"{blocks[1]}.mlp.{'fc' if name == 'gpt' else 'up_proj'}.weight") \
        is model.get_parameter(f"{blocks[1]}.mlp.{'fc' if name == 'gpt' else 'up_proj'}.weight")


# ---------------------------------------------------------------------- TP plans
def test_gpt_fused_qkv_column_shards_hold_whole_heads():
    # the TP plan shards the fused qkv projection contiguously; that is only right when
    # its rows are laid out per head (Megatron's order), simulated here on one process
    assert rc.gpt_qkv_splits_by_head(tp=2) and rc.gpt_qkv_splits_by_head(tp=4)


def test_tp_plan_comes_from_the_captured_roles(gpt_graph):
    model = rc.make_gpt(0)
    block = gpt_graph.layer("blocks.0")
    plan = tp_plan(block, model.blocks[0], sequence_parallel=False)
    assert {k: type(v) for k, v in plan.items()} == {
        "attn.qkv": ColwiseParallel, "attn.proj": RowwiseParallel,
        "mlp.fc": ColwiseParallel, "mlp.proj": RowwiseParallel,
        # each region takes its input once (its column linears' input gradients are
        # reduced by one all-reduce there)
        "attn": PrepareModuleInput, "mlp": PrepareModuleInput}
    assert plan["attn"].input_layouts == (Replicate(),)
    sp = tp_plan(block, model.blocks[0], sequence_parallel=True, first_block=True)
    assert {k: type(v) for k, v in sp.items() if k not in plan} == {
        "ln_1": SequenceParallel, "ln_2": SequenceParallel, "": PrepareModuleInput}
    assert sp["attn"].input_layouts == (Shard(1),)
    post = tp_plan(gpt_graph.layer("post"), model, sequence_parallel=True)
    assert {k: type(v) for k, v in post.items()} == {"head": ColwiseParallel,
                                                      "ln_f": SequenceParallel}
    # the capture counts the parameters of the same modules (the cost model reduces their
    # gradients over tp once per step): the norms' weights and biases
    hidden = model.config.hidden
    assert block.tp.sp_replicated_params == (hidden,) * 4
    assert gpt_graph.layer("post").tp.sp_replicated_params == (hidden,) * 2


def test_tp_plan_of_llama_gathers_attention_input_by_keyword(llama_graph):
    model = rc.make_llama(0)
    plan = tp_plan(llama_graph.layer("model.layers.0"), model.model.layers[0],
                   sequence_parallel=True, region_kwargs=adapter_for(model).region_kwargs)
    assert sorted(k for k, v in plan.items() if isinstance(v, ColwiseParallel)) == [
        "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert plan["self_attn"].input_kwarg_layouts.keys() == {"hidden_states"}
    assert sorted(k for k, v in plan.items() if isinstance(v, SequenceParallel)) == [
        "input_layernorm", "post_attention_layernorm"]
    assert llama_graph.layer("model.layers.0").tp.sp_replicated_params == (32, 32)
    # without sp too: q, k and v share one input, gate and up another (two input-gradient
    # all-reduces in the backward, not five)
    plain = tp_plan(llama_graph.layer("model.layers.0"), model.model.layers[0],
                    sequence_parallel=False, region_kwargs=adapter_for(model).region_kwargs)
    assert plain["self_attn"].input_kwarg_layouts == {"hidden_states": Replicate()}
    assert plain["mlp"].input_layouts == (Replicate(),)
    assert tp_plan(llama_graph.layer("pre"), model, sequence_parallel=False).keys() == \
        {"model.embed_tokens"}


