"""The runtime builds exactly the plan the cost model priced (one layout record).

For plans of several shapes (uniform strategies, uneven pipeline splits,
interleaved and zero-bubble schedules, per-block mixed recompute, context
parallelism, uneven replica batches, and the plans the search picks for an
8-process CPU cluster), every rank of the program ``parallelize`` builds is
inspected in one process over torch's ``fake`` process group (no collective
runs; DeviceMesh, FSDP2, DDP, DTensor and the pipeline stages are built for
real) and compared with the plan:

- the pipeline stages a rank runs, their order, and the blocks each holds;
- which blocks are checkpointed, and how (full, or the selective core);
- the ranks of every data-parallel shard group (FSDP2/replicate/DDP) and of
  every tensor-parallel mesh, against the plan's devices;
- the micro-batches this rank's replica runs and its share of the batch.

The cost engine's view of the same plans is checked layer by layer: the
layout it prices (segments, stage ranks, replica micro-batches) expands to the
plan's per-layer placements, and the search's winners compile back to the
layouts it ranked.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

import autoplan
import runtime_cases as rc
from autoplan.cost import CostEngine, layout_from_plan
from autoplan.graph import LayerKind
from autoplan.plan import Plan
from autoplan.runtime import parallelize, plan_of
from autoplan.runtime.mesh import rank_at
from autoplan.strategy import Recompute, Strategy


def S(**kw) -> Strategy:
    return Strategy(global_batch=rc.GLOBAL_BATCH, precision="fp32", **kw)


@pytest.fixture(scope="module")
def gpt_graph():
    return autoplan.trace(rc.make_gpt(0), seq_len=rc.SEQ)


def _mixed_recompute(plan: Plan) -> Plan:
    """Blocks 0, 1, 2, 3 recompute full, selective, none, selective (as refined plans emit)."""
    modes = {"blocks.0": Recompute.FULL, "blocks.1": Recompute.SELECTIVE,
             "blocks.3": Recompute.SELECTIVE}
    return dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(lp, recompute=modes.get(lp.name, Recompute.NONE))
        for lp in plan.layers))


def _uneven_replicas(plan: Plan, batches: tuple[int, ...]) -> Plan:
    return dataclasses.replace(plan, replica_batch=batches,
                               num_micro_batches=max(batches) // plan.micro_batch)


def _plans(graph) -> dict[str, Plan]:
    w8 = lambda s, **kw: plan_of(s, graph, world_size=8, **kw)  # noqa: E731
    plans = {
        "dp2 tp2 pp2 1f1b zero1 sp": w8(S(dp=2, tp=2, pp=2, micro_batch=2, zero=1,
                                          sequence_parallel=True)),
        "pp2 x dp2 x tp2 interleaved zero3": w8(S(dp=2, tp=2, pp=2, micro_batch=1, zero=3,
                                                  schedule="interleaved", virtual_stages=2)),
        "dp2 tp2 pp2 zbv zero2": w8(S(dp=2, tp=2, pp=2, micro_batch=1, zero=2,
                                      schedule="zero_bubble")),
        "pp4 uneven 1|1|1|1 gpipe x dp2": w8(S(dp=2, pp=4, micro_batch=1, schedule="gpipe")),
        "pp2 3|1 x dp4": w8(S(dp=4, pp=2, micro_batch=1), blocks_per_stage=(3, 1)),
        "dp2 cp2 tp2": w8(S(dp=2, cp=2, tp=2)),
        "cp2 pp2 dp2 zero3": w8(S(dp=2, cp=2, pp=2, micro_batch=2, zero=3)),
        "dp8 mixed recompute": _mixed_recompute(w8(S(dp=8, micro_batch=1))),
        "pp2 x dp4 mixed recompute": _mixed_recompute(w8(S(dp=4, pp=2, micro_batch=1))),
        # 16 sequences: replicas of 6, 4, 4, 2
        "dp4 tp2 uneven replicas": _uneven_replicas(
            plan_of(Strategy(dp=4, tp=2, global_batch=16, precision="fp32", zero=1), graph,
                    world_size=8), (6, 4, 4, 2)),
        # under ZeRO-3 every replica runs 3 micro-batches (padding), as priced
        "pp2 x dp4 zero3 uneven replicas": _uneven_replicas(
            plan_of(Strategy(dp=4, pp=2, global_batch=16, micro_batch=2, precision="fp32",
                             zero=3), graph, world_size=8), (6, 4, 4, 2)),
    }
    for i, p in enumerate(rc.searched_plans(graph.to_json(), world=8, top_k=3,
                                               use_all_devices=True)):
        plans[f"searched #{i + 1}"] = Plan.from_json(p)
    return plans


def _blocks(part) -> list[str]:
    """Block names a part holds (the model's own names), in order."""
    out = []
    for name, m in part.named_modules():
        if name.startswith("blocks.") and name.count(".") == 1:
            out.append(name)
    return out


def _recompute_of(part, block: str) -> Recompute:
    m = part.get_submodule(block)
    if not isinstance(m, CheckpointWrapper):
        return Recompute.NONE
    return (Recompute.SELECTIVE if m.checkpoint_fn.keywords.get("context_fn") is not None
            else Recompute.FULL)


def _group_ranks(module) -> tuple[int, ...] | None:
    """Ranks a module's gradients are reduced over (FSDP2/replicate mesh, or DDP group)."""
    if isinstance(module, DistributedDataParallel):
        return tuple(sorted(dist.get_process_group_ranks(module.process_group)))
    if isinstance(module, FSDPModule):
        from torch.distributed._composable.replicate_with_fsdp import replicate

        state = fully_shard.state(module) or replicate.state(module)
        groups = state._fsdp_param_groups
        if groups:
            mesh = groups[0].mesh_info.mesh
            return tuple(sorted(mesh.mesh.flatten().tolist()))
    return None


def _expected_dp_group(plan: Plan, c: dict[str, int]) -> tuple[int, ...]:
    return tuple(sorted(rank_at(plan, pp=c["pp"], dp=d, cp=k, tp=c["tp"])
                        for d in range(plan.dp) for k in range(plan.cp)))


def _inspect(plan: Plan, graph, rank: int) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.num_devices)
    try:
        pm = parallelize(rc.make_gpt(0), plan, seq_len=rc.SEQ, graph=graph,
                         optimizer=rc.make_optimizer)
        c = pm.coords
        assert pm.plan is plan
        kinds = {l.name: l.kind for l in graph.layers}
        local = plan.local_stages(c["pp"])
        if plan.pp > 1:
            assert [s.stage_index for s in pm.stages] == list(local)
            assert pm.schedule._n_microbatches == plan.micro_batches_run(c["dp"])
        assert len(pm.parts) == len(local)
        for wrapped, k in zip(pm.parts, local):
            part = wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped
            want = [n for n in plan.stages[k].layers if kinds[n] is LayerKind.BLOCK]
            assert _blocks(part) == want, (k, _blocks(part), want)
            for b in want:
                assert _recompute_of(part, b) is plan.placement(b).recompute, b
            # data parallelism over exactly the plan's dp x cp peers of this rank
            expected = _expected_dp_group(plan, c)
            groups = {_group_ranks(m) for m in wrapped.modules()} - {None}
            if len(expected) > 1:
                assert groups == {expected}, (groups, expected)
            else:
                assert not groups
            # tensor parallelism over the plan's tp peers
            tp_peers = tuple(sorted(rank_at(plan, pp=c["pp"], dp=c["dp"], cp=c["cp"], tp=t)
                                    for t in range(plan.stages[k].tp)))
            for p in part.parameters():
                if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
                    assert tuple(sorted(p.device_mesh["tp"].mesh.flatten().tolist())) == tp_peers
        assert pm.replica_weight == (plan.dp * plan.replica_batch[c["dp"]] / plan.global_batch)
        # the default optimizer (rc.make_optimizer is it with eps=1e-5): fused, over every
        # parameter of the rank's stages once, each group one kind of tensor (DTensor's
        # fused kernel refuses a list mixing plain tensors and DTensors, or meshes)
        assert len(pm.optimizers) == len(pm.parts)
        for opt, wrapped in zip(pm.optimizers, pm.parts):
            assert opt.defaults["fused"]
            grouped = [p for g in opt.param_groups for p in g["params"]]
            assert sorted(map(id, grouped)) == sorted(id(p) for p in wrapped.parameters())
            for g in opt.param_groups:
                kinds = {(type(p), getattr(p, "device_mesh", None)) for p in g["params"]}
                assert len(kinds) == 1, kinds
    finally:
        dist.destroy_process_group()


def test_every_rank_builds_the_plans_stages_recompute_and_groups(gpt_graph):
    plans = _plans(gpt_graph)
    assert any(len(set(p.replica_batch)) > 1 for p in plans.values())
    for label, plan in plans.items():
        for rank in range(plan.num_devices):
            try:
                _inspect(plan, gpt_graph, rank)
            except AssertionError as e:
                raise AssertionError(f"{label} ({plan.label()}), rank {rank}: {e}") from None


def _per_layer(summary, lay) -> list[tuple]:
    """(stage, pipeline rank, tp, sp, zero, recompute) of every layer of an engine layout."""
    out = [None] * summary.num_layers
    for k, chunk in enumerate(lay.chunks):
        for seg in chunk:
            for i in range(seg.lo, seg.hi):
                out[i] = (k, lay.stage_ranks[k], seg.tp, seg.sequence_parallel, seg.zero,
                          seg.recompute)
    return out


def test_the_cost_engine_prices_the_plans_layout(gpt_graph):
    engine = CostEngine(gpt_graph, rc.cpu_cluster(8))
    for label, plan in _plans(gpt_graph).items():
        lay = layout_from_plan(engine.summary, plan)
        want = [(lp.stage, plan.stages[lp.stage].rank, lp.tp, lp.sequence_parallel, lp.zero,
                 lp.recompute) for lp in sorted(plan.layers, key=lambda lp: engine.summary.index[lp.name])]
        assert _per_layer(engine.summary, lay) == want, label
        assert lay.replica_micro_batches == tuple(plan.micro_batches_of(r) for r in range(plan.dp))
        assert [lay.micro_batches_run(r) for r in range(plan.dp)] == \
            [plan.micro_batches_run(r) for r in range(plan.dp)]
        assert lay.stage_ranks == plan.stage_ranks


def test_the_searchs_winners_compile_back_to_the_layouts_it_ranked(gpt_graph, monkeypatch):
    import importlib

    search_module = importlib.import_module("autoplan.search.search")

    seen = []
    original = search_module._Builder.plan

    def record(self, lay, global_batch, *args, **kwargs):
        plan = original(self, lay, global_batch, *args, **kwargs)
        seen.append((self.summary, lay, plan))
        return plan

    monkeypatch.setattr(search_module._Builder, "plan", record)
    for cluster, batch in ((rc.cpu_cluster(8), 8), (autoplan.load_cluster("mixed-a100-v100"), 60),
                           (autoplan.load_cluster("a100-sxm4-80gb", nodes=2), 64)):
        search_module.search(gpt_graph, cluster, global_batch=batch, top_k=3)
    assert len(seen) >= 6
    for summary, lay, plan in seen:
        assert _per_layer(summary, layout_from_plan(summary, plan)) == _per_layer(summary, lay)
        assert layout_from_plan(summary, plan).replica_micro_batches == lay.replica_micro_batches
        assert layout_from_plan(summary, plan).padded == lay.padded


def test_default_optimizer_is_torchs_adamw_fused():
    """``default_optimizer``: ``torch.optim.AdamW`` with ``fused=True`` and the caller's
    hyper-parameters; ``fused=False`` is honoured; no parameters is torch's own error.
    (Groups by tensor kind: the structure test above, over every plan's stages.)"""
    import torch

    from autoplan.runtime.optim import default_optimizer

    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = default_optimizer(params, lr=3e-4, eps=1e-5)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"]
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == params
    assert (opt.defaults["lr"], opt.defaults["eps"]) == (3e-4, 1e-5)
    for p in params:
        p.grad = torch.ones_like(p)
    reference = [p.detach().clone() for p in params]
    plain = torch.optim.AdamW(reference, lr=3e-4, eps=1e-5)
    for r in reference:
        r.grad = torch.ones_like(r)
    opt.step()
    plain.step()
    torch.testing.assert_close(params, reference, rtol=1e-6, atol=1e-7)  # the same update
    assert not default_optimizer(params, fused=False).defaults["fused"]
    with pytest.raises(ValueError, match="empty parameter list"):
        default_optimizer([])
