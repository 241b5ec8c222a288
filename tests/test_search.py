"""Search: tiny CP-SAT problems with known optima, hand-made cases with known best plans."""

from __future__ import annotations

import pytest
import torch

import autoplan
from autoplan.errors import ConfigError, InfeasiblePlan, StrategyError
from autoplan.models import GPT, GPTConfig
from autoplan.plan import Plan
from autoplan.search import StageProblem, solve_stage_problem

tf = pytest.importorskip("transformers")


# ----------------------------------------------------------- tiny problems
def test_stage_problem_balances_by_speed():
    # rank 1 is twice as slow: 6 blocks split 4 / 2 -> bottleneck 40
    data = StageProblem(num_blocks=6, options=("none",), time_us=((10,), (20,)),
                        memory_mib=((1,), (1,)), fixed_time_us=(0, 0), fixed_memory_mib=(0, 0),
                        capacity_mib=(100, 100))
    sol = solve_stage_problem(data)
    assert sol.status == "OPTIMAL"
    assert sol.counts == ((4,), (2,)) and sol.bottleneck_us == 40


def test_stage_problem_recomputes_only_what_memory_forces():
    # 4 blocks on one rank; none: 10 us / 10 MiB, full: 13 us / 3 MiB; 25 MiB available.
    # n_none * 10 + n_full * 3 <= 25 with n_none + n_full = 4 -> at most 1 block without
    # recompute: optimum 1 x 10 + 3 x 13 = 49 us.
    data = StageProblem(num_blocks=4, options=("none", "full"), time_us=((10, 13),),
                        memory_mib=((10, 3),), fixed_time_us=(0,), fixed_memory_mib=(0,),
                        capacity_mib=(25,))
    sol = solve_stage_problem(data)
    assert sol.status == "OPTIMAL"
    assert sol.counts == ((1, 3),) and sol.bottleneck_us == 49


def test_stage_problem_fixed_terms_and_hint():
    # the first rank also holds the embedding (fixed 15 us, 50 MiB): it gets fewer blocks
    data = StageProblem(num_blocks=5, options=("none",), time_us=((10,), (10,)),
                        memory_mib=((10,), (10,)), fixed_time_us=(15, 0),
                        fixed_memory_mib=(50, 0), capacity_mib=(80, 80), hint=((3,), (2,)))
    sol = solve_stage_problem(data)
    assert sol.status == "OPTIMAL"
    assert sol.counts == ((2,), (3,)) and sol.bottleneck_us == 35


def test_stage_problem_infeasible():
    data = StageProblem(num_blocks=4, options=("none",), time_us=((1,),), memory_mib=((30,),),
                        fixed_time_us=(0,), fixed_memory_mib=(0,), capacity_mib=(100,))
    with pytest.raises(InfeasiblePlan):
        solve_stage_problem(data)


# ----------------------------------------------------------- hand-made plans
def _meta(cls, config):
    with torch.device("meta"):
        return cls(config).to(torch.bfloat16)


@pytest.fixture(scope="module")
def llama8b():
    cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    return autoplan.trace(_meta(tf.LlamaForCausalLM, cfg), seq_len=2048)


@pytest.fixture(scope="module")
def llama70b():
    cfg = tf.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    return autoplan.trace(_meta(tf.LlamaForCausalLM, cfg), seq_len=4096)


def _check_memory(plan: Plan, fraction: float) -> None:
    est = plan.estimate
    assert est is not None and est.fits
    for st in est.stages:
        assert st.memory.total_bytes <= st.memory_capacity_bytes * fraction


def test_model_that_does_not_fit_one_device_is_split(llama8b):
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    one = autoplan.compose_cluster([autoplan.hardware.NodeGroup(
        autoplan.hardware.load_profile("a100-sxm4-80gb"), 1)]).subset([0])
    with pytest.raises(InfeasiblePlan) as info:
        autoplan.plan(llama8b, one, global_batch=8)
    assert "GiB" in str(info.value) and info.value.binding
    assert info.value.required_bytes > info.value.available_bytes
    plan = autoplan.plan(llama8b, cluster, global_batch=64)
    states = 8.03e9 * 16                    # bf16 params + grads, fp32 Adam + master weights
    assert states > 80 * 2**30              # would not fit one GPU unsplit
    assert plan.pp > 1 or max(s.tp for s in plan.stages) > 1 or \
        any(lp.zero > 0 for lp in plan.layers)
    _check_memory(plan, 0.9)


def test_tensor_parallel_groups_stay_inside_a_node(llama8b):
    cluster = autoplan.load_cluster("a100-sxm4-80gb", nodes=4)
    plan = autoplan.plan(llama8b, cluster, global_batch=128, top_k=4)
    for p in (plan, *plan.runners_up):
        for st in p.stages:
            for start in range(0, len(st.devices), st.tp):
                group = st.devices[start:start + st.tp]
                assert len({cluster.devices[d].node for d in group}) == 1
        assert max(s.tp for s in p.stages) <= 8


def test_mixed_cluster_gives_faster_devices_more_layers(llama70b):
    cluster = autoplan.load_cluster("mixed-a100-v100")
    plan = autoplan.plan(llama70b, cluster, global_batch=256)
    _check_memory(plan, 0.9)
    assert plan.pp >= 2
    by_type: dict[str, list[int]] = {}
    for st in plan.stages:
        by_type.setdefault(st.device_type, []).append(len(st.layers))
    a100 = sum(by_type["A100-SXM4-80GB"]) / len(by_type["A100-SXM4-80GB"])
    v100 = sum(by_type["V100-SXM2-32GB"]) / len(by_type["V100-SXM2-32GB"])
    assert a100 > v100


def test_two_sites_only_the_pipeline_crosses_the_slow_link(llama70b):
    """Two A100 pods joined by 100 Gb/s: pipelines cut at the link, data parallelism stays
    inside a site.  (With a much larger batch -- 16k tokens per micro-batch and layer --
    the cost model predicts ZeRO-3 gathers across the link hidden behind compute, and pure
    data parallelism can win: see notebooks/heterogeneous.ipynb.)"""
    cluster = autoplan.load_cluster("two-sites")
    plan = autoplan.plan(llama70b, cluster, global_batch=128, top_k=3)
    for p in (plan, *plan.runners_up):
        for st in p.stages:      # data- and tensor-parallel groups live inside one site
            assert len({cluster.devices[d].site for d in st.devices}) == 1
        assert len({cluster.devices[d].site for d in p.mesh.devices}) == 2


def test_plans_fit_and_round_trip(llama8b):
    cluster = autoplan.load_cluster("h100-sxm5-80gb", nodes=2)
    plan = autoplan.plan(llama8b, cluster, global_batch=64, top_k=3, memory_fraction=0.8)
    for p in (plan, *plan.runners_up):
        _check_memory(p, 0.8)
        assert Plan.from_json(p.to_json()) == p
    times = [p.estimate.step_time_s for p in (plan, *plan.runners_up)]
    assert times == sorted(times)
    # one engine: estimating the plan again gives the same figures
    again = autoplan.estimate_plan(llama8b, cluster, plan, memory_fraction=0.8)
    assert again.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-12)


def test_search_is_deterministic(llama8b):
    cluster = autoplan.load_cluster("a100-sxm4-80gb", nodes=2)
    a = autoplan.plan(llama8b, cluster, global_batch=64).to_json()
    b = autoplan.plan(llama8b, cluster, global_batch=64).to_json()
    assert a == b


def test_plan_from_module_and_strategy_baseline():
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=4))
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    plan = autoplan.plan(model, cluster, global_batch=16, seq_len=64)
    best = plan.estimate.step_time_s
    # no uniform layout of the same degrees beats the plan
    for dp in (8, 4, 2):          # 4 heads: tp <= 4
        st = autoplan.Strategy(dp=dp, tp=8 // dp, global_batch=16)
        est = autoplan.estimate(autoplan.trace(model, seq_len=64), cluster, st, memory_fraction=0.9)
        assert best <= est.step_time_s * (1 + 1e-9)


def test_bad_arguments():
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=16, heads=1, layers=1))
    g = autoplan.trace(model, seq_len=16)
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    with pytest.raises(ConfigError, match="global_batch"):
        autoplan.plan(g, cluster, global_batch=0)
    from autoplan.search import SearchSpace
    with pytest.raises(ConfigError, match="multiple of"):
        # 1 head (tp=1), one stage, no context parallelism: only dp=8 uses every device
        autoplan.plan(g, cluster, global_batch=3, space=SearchSpace(context_parallel=(1,)),
                      use_all_devices=True)
    # on fewer of them the batch splits: the others idle, and the plan says so
    fewer = autoplan.plan(g, cluster, global_batch=3, space=SearchSpace(context_parallel=(1,)))
    assert fewer.num_devices in (1, 3)
    assert fewer.idle_devices == tuple(range(fewer.num_devices, 8))
    assert f"{8 - fewer.num_devices} of 8 devices idle" in fewer.idle_reason
    assert "no layout of all 8" in fewer.idle_reason
    with pytest.raises(ConfigError, match="top_k"):
        autoplan.plan(g, cluster, global_batch=8, top_k=0)


# ----------------------------------------------------------- what the runtime runs
def test_uneven_replica_batches_are_plans_the_runtime_accepts():
    from autoplan.runtime import check_plan
    from autoplan.search import SearchSpace

    graph = autoplan.trace(GPT(GPTConfig(vocab_size=128, seq_len=32, hidden=64, heads=4, layers=8)),
                           seq_len=32)
    mixed = autoplan.load_cluster("mixed-a100-v100")
    # 60 sequences over 32 replicas split unevenly, A100 replicas taking more; the runtime
    # weights each replica's gradient by its share, and runs the plan as it is
    free = autoplan.plan(graph, mixed, global_batch=60, use_all_devices=True)
    assert len(set(free.replica_batch)) > 1
    check_plan(free, free.num_devices, graph)
    even = autoplan.plan(graph, mixed, global_batch=64, space=SearchSpace(even_batches=True),
                         use_all_devices=True)
    assert len(set(even.replica_batch)) == 1
    check_plan(even, even.num_devices, graph)
    # a batch no replica count divides evenly: a clear error, not an uneven plan
    one_node = autoplan.load_cluster("a100-sxm4-80gb")
    with pytest.raises(ConfigError, match="equal replica batches"):
        autoplan.plan(graph, one_node.subset(range(7)), global_batch=9,
                      space=SearchSpace(even_batches=True, tensor_parallel=(1,),
                                        pipeline_parallel=(1, 1), context_parallel=(1,)),
                      use_all_devices=True)


# ----------------------------------------------------------- labels and inputs
def test_a_plan_recomputing_some_blocks_reads_as_mixed():
    """3 of 4 blocks fully recomputed: the label lists 'none' too (never 'rc-full' alone,
    which a plan recomputing every block reads as)."""
    from dataclasses import replace

    from autoplan.strategy import Recompute

    graph = autoplan.trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4,
                                         layers=4)), seq_len=16)
    uniform = Plan.from_strategy(graph, 2, autoplan.Strategy(dp=2, global_batch=4,
                                                             recompute="full"))
    assert "rc-full" in uniform.label() and "none" not in uniform.label()
    mixed = replace(uniform, layers=tuple(
        replace(lp, recompute=Recompute.NONE) if lp.name == "blocks.3" else lp
        for lp in uniform.layers))
    assert "rc-full/none" in mixed.label()
    selective = replace(uniform, layers=tuple(
        replace(lp, recompute=Recompute.SELECTIVE) if lp.name == "blocks.0" else lp
        for lp in uniform.layers))
    assert "rc-full/selective" in selective.label() and "none" not in selective.label()


def test_a_one_block_model_has_its_block_and_a_blockless_one_refuses_tp():
    """A Llama of one layer is captured as embeddings, one block and the head (tp splits
    its block as in deeper ones); a model with no repeated block refuses tp, cp and pp
    rather than pricing them as replicated work."""
    cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=512)
    graph = autoplan.trace(_meta(tf.LlamaForCausalLM, cfg), seq_len=128)
    assert [l.kind.value for l in graph.layers] == ["pre", "block", "post"]
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    assert autoplan.estimate(graph, cluster, autoplan.Strategy(dp=2, tp=4, global_batch=8))

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    mlp = autoplan.trace(MLP(), example_inputs=torch.randn(4, 64))
    assert [l.kind.value for l in mlp.layers] == ["pre"]
    for bad in (dict(tp=2, dp=4), dict(pp=2, dp=4)):
        with pytest.raises(StrategyError, match="no repeated blocks"):
            autoplan.estimate(mlp, cluster, autoplan.Strategy(global_batch=8, **bad))
    plan = autoplan.plan(mlp, cluster, global_batch=8)
    assert plan.pp == 1 and max(s.tp for s in plan.stages) == 1
