"""Re-planning after devices are lost or added."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autoplan
from autoplan.errors import ConfigError, InfeasiblePlan
from autoplan.hardware import NodeGroup, load_profile
from autoplan.plan import Plan
from autoplan.search import SearchSpace
from autoplan.search.replan import reshard_fraction

tf = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama8b():
    cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return autoplan.trace(model, seq_len=2048)


def _uses_exactly(plan: Plan, cluster) -> None:
    """A plan for ``cluster``: its devices (and, named in ``idle_reason``, those it leaves
    idle) are the cluster's, and it fits."""
    assert plan.cluster.num_devices == cluster.num_devices
    used = set(plan.mesh.devices)
    assert used <= set(range(cluster.num_devices))
    assert set(plan.idle_devices) == set(range(cluster.num_devices)) - used
    assert bool(plan.idle_devices) == bool(plan.idle_reason)
    assert plan.estimate.fits
    for st in plan.estimate.stages:
        assert st.memory.total_bytes <= st.memory_capacity_bytes * plan.estimate.memory_fraction


def test_lose_and_gain_nodes_homogeneous(llama8b):
    four = autoplan.load_cluster("a100-sxm4-80gb", nodes=4)
    old = autoplan.plan(llama8b, four, global_batch=96)
    three = four.without(range(8, 16))           # node 1 fails
    new = autoplan.replan(old, three)
    _uses_exactly(new, three)
    assert new.warm_start
    diff = autoplan.plan_diff(old, new)
    assert f"devices: {old.num_devices} -> {new.num_devices}" in diff or \
        old.num_devices == new.num_devices
    six = autoplan.load_cluster("a100-sxm4-80gb", nodes=6)
    more = autoplan.replan(new, six)
    _uses_exactly(more, six)
    # at least as fast as re-planning from scratch finds
    scratch = autoplan.plan(llama8b, six, global_batch=96)
    assert more.estimate.step_time_s <= scratch.estimate.step_time_s * (1 + 1e-9)


def test_lose_and_gain_devices_mixed(llama8b):
    mixed = autoplan.load_cluster("mixed-a100-v100")
    old = autoplan.plan(llama8b, mixed, global_batch=128)
    fewer = mixed.without(range(56, 64))         # a V100 node fails
    new = autoplan.replan(old, fewer)
    _uses_exactly(new, fewer)
    grown = autoplan.compose_cluster(
        [NodeGroup(load_profile("a100-sxm4-80gb"), 5), NodeGroup(load_profile("v100-sxm2-32gb"), 3)])
    more = autoplan.replan(new, grown)
    _uses_exactly(more, grown)


def test_nothing_fits_the_survivors(llama8b):
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    old = autoplan.plan(llama8b, cluster, global_batch=16)
    one = cluster.subset([0])
    with pytest.raises(InfeasiblePlan) as info:
        autoplan.replan(old, one)
    msg = str(info.value)
    assert "GiB per device" in msg and "1 devices" in msg


def test_plan_from_json_needs_the_graph(llama8b):
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    old = Plan.from_json(autoplan.plan(llama8b, cluster, global_batch=16).to_json())
    with pytest.raises(ConfigError, match="graph="):
        autoplan.replan(old, cluster.subset(range(4)))
    new = autoplan.replan(old, cluster.subset(range(4)), graph=llama8b)
    assert new.num_devices == 4


def test_replan_is_the_search_and_keeps_the_plan_that_reshards_least(llama8b):
    """Replanning searches as plan() does (never slower than planning from scratch, idle
    devices allowed), and among plans within its tolerance keeps the one closest to the
    old layout."""
    from autoplan.search import reshard_fraction, search

    four = autoplan.load_cluster("a100-sxm4-80gb", nodes=4)
    old = autoplan.plan(llama8b, four, global_batch=96)
    three = four.without(range(8, 16))
    new = autoplan.replan(old, three, tolerance=0.05)
    scratch = autoplan.plan(llama8b, three, global_batch=96)
    assert new.estimate.step_time_s <= scratch.estimate.step_time_s * 1.05 * (1 + 1e-9)
    result = search(llama8b, three, global_batch=96, tolerance=0.05)
    assert len(result.alternatives) > 1            # several plans within 5%
    closest = min(reshard_fraction(old, p, llama8b) for p in result.alternatives)
    assert reshard_fraction(old, new, llama8b) == closest
    # no tolerance: the fastest
    fastest = autoplan.replan(old, three, tolerance=0.0)
    assert fastest.estimate.step_time_s <= scratch.estimate.step_time_s * (1 + 1e-9)


def test_plan_diff_shows_idle_devices(llama8b):
    from autoplan.models import GPT, GPTConfig

    g = autoplan.trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=16, heads=1, layers=1)),
                       seq_len=16)
    cluster = autoplan.load_cluster("a100-sxm4-80gb", nodes=2)
    every = autoplan.plan(g, cluster, global_batch=48, use_all_devices=True)
    some = autoplan.plan(g, cluster, global_batch=3)
    assert not every.idle_devices and some.idle_devices
    diff = autoplan.plan_diff(every, some)
    assert f"idle: none -> {len(some.idle_devices)} of 16 devices" in diff
    if len(some.idle_devices) >= 8:
        assert "node" in diff.split("idle:")[1].splitlines()[0]


# ------------------------------------------------------------------ a plan proven fastest
def _tiny():
    from autoplan.models import GPT, GPTConfig

    return autoplan.trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4,
                                        layers=4)), seq_len=16)


def _layout(p: Plan) -> dict:
    """The plan's JSON without the cluster it is on and the words about its idle devices."""
    import json

    out = json.loads(p.to_json())
    for key in ("cluster", "idle_reason", "fastest_for"):
        out.pop(key, None)
    return out


def test_a_plan_proven_fastest_is_kept_where_its_devices_remain():
    """A complete search with idle devices allowed proves its plan the fastest of every
    subset of its cluster's nodes; on fewer of those nodes that still hold the plan, the
    full search finds the same plan, and replan keeps it without searching."""
    graph = _tiny()
    cluster = autoplan.load_cluster("a100-sxm4-80gb", nodes=3)
    old = autoplan.plan(graph, cluster, global_batch=16)
    assert old.num_devices == 8 and old.fastest_for.startswith("sha256:")
    assert Plan.from_json(old.to_json()).fastest_for == old.fastest_for
    survivors = cluster.without(range(8))                   # node 0 failed
    kept = autoplan.replan(old, survivors)
    assert kept.search_stats.steps == 0 and kept.warm_start
    assert kept.cluster.num_devices == 16 and kept.fastest_for == old.fastest_for
    assert "fastest layout of every subset of the 24 devices it was planned for" \
        in kept.idle_reason
    searched = autoplan.replan(replace(old, fastest_for=""), survivors)
    assert searched.search_stats.steps > 0
    assert _layout(kept) == _layout(searched)
    assert reshard_fraction(old, kept, graph) == 0.0
    # a plan read back from JSON (an elastic restart's) is kept alike
    again = autoplan.replan(Plan.from_json(old.to_json()), survivors, graph=graph)
    assert again.search_stats.steps == 0 and _layout(again) == _layout(kept)


def test_what_was_not_proven_is_searched_again():
    graph = _tiny()
    cluster = autoplan.load_cluster("a100-sxm4-80gb", nodes=3)
    survivors = cluster.without(range(8))
    old = autoplan.plan(graph, cluster, global_batch=16)
    # the layouts of every device only, a work budget that stops the search: nothing proved
    assert autoplan.plan(graph, cluster, global_batch=16, use_all_devices=True).fastest_for == ""
    assert autoplan.plan(graph, cluster, global_batch=16, work_limit=20).fastest_for == ""
    # another search space, more devices than the plan was made for: searched
    other = SearchSpace(zero=(0, 1))
    assert autoplan.replan(old, survivors, space=other).search_stats.steps > 0
    more = autoplan.load_cluster("a100-sxm4-80gb", nodes=4)
    assert autoplan.replan(old, more).search_stats.steps > 0
    # a plan of more devices than are left: searched
    wide = autoplan.plan(graph, cluster, global_batch=72)
    assert wide.num_devices == 24 and wide.fastest_for
    assert autoplan.replan(wide, survivors).search_stats.steps > 0


# ------------------------------------------------------------------ the plan's software stack
def test_replan_prices_for_the_stack_the_plan_was_made_for(llama8b):
    """A plan made for another software stack (``megatron-core``) records it, and replan
    searches for that stack: the plan a search for it finds, not the default stack's."""
    from autoplan.cost import CostOptions

    mc = CostOptions.preset("megatron-core")
    four = autoplan.load_cluster("h100-sxm5-80gb", nodes=4)
    three = four.without(range(8, 16))
    old = autoplan.plan(llama8b, four, global_batch=96, options=mc)
    assert old.cost_options == {"stack": "megatron-core"}
    assert Plan.from_json(old.to_json()).cost_options == old.cost_options
    new = autoplan.replan(old, three)
    assert new.cost_options == old.cost_options
    for_stack = autoplan.plan(llama8b, three, global_batch=96, options=mc)
    default = autoplan.plan(llama8b, three, global_batch=96)
    assert for_stack.describe() != default.describe()        # (the stacks pick differently)
    assert new.estimate.step_time_s <= for_stack.estimate.step_time_s * 1.01 * (1 + 1e-9)
    # priced as the search priced it (estimate_plan defaults to the plan's options)
    assert autoplan.estimate_plan(llama8b, three, new).step_time_s == \
        pytest.approx(new.estimate.step_time_s, rel=1e-12)
    assert autoplan.estimate_plan(llama8b, three, new, options=CostOptions()).step_time_s != \
        pytest.approx(new.estimate.step_time_s, rel=1e-3)
    # read back from JSON (an elastic restart's): the same; options= overrides the record
    again = autoplan.replan(Plan.from_json(old.to_json()), three, graph=llama8b)
    assert again.to_json() == new.to_json()
    mine = autoplan.replan(old, three, options=CostOptions())
    assert mine.cost_options == {} and mine.describe() == default.describe()


def test_default_plans_write_no_options_and_bad_ones_are_refused():
    import json

    from autoplan.errors import RecordError

    graph = _tiny()
    plan = autoplan.plan(graph, autoplan.load_cluster("a100-sxm4-80gb"), global_batch=16)
    assert plan.cost_options == {} and "cost_options" not in json.loads(plan.to_json())
    data = json.loads(plan.to_json())
    data["cost_options"] = {"stak": "megatron-core"}
    with pytest.raises(RecordError, match="unknown cost option 'stak' \\(did you mean 'stack'"):
        Plan.from_json(json.dumps(data))
    data["cost_options"] = {"stack": "megatron"}
    with pytest.raises(RecordError, match="cost_options: unknown software stack 'megatron'"):
        Plan.from_json(json.dumps(data))


def test_replan_keeps_the_plans_objective_the_price_of_a_sample():
    """A plan made the cheapest per sample records the prices it weighed; replan makes the
    new plan the cheapest too (not the fastest), from JSON alike."""
    graph = _tiny()
    three = autoplan.load_cluster("a100-sxm4-80gb", nodes=3)
    two = three.without(range(8))
    cheap = autoplan.plan(graph, three, global_batch=48, price_per_gpu_hour=2.0)
    assert cheap.price_per_gpu_hour == {"A100-SXM4-80GB": 2.0}
    assert autoplan.plan(graph, three, global_batch=48).price_per_gpu_hour == {}
    new = autoplan.replan(cheap, two)
    assert new.price_per_gpu_hour == cheap.price_per_gpu_hour
    for_price = autoplan.plan(graph, two, global_batch=48, price_per_gpu_hour=2.0)
    fastest = autoplan.plan(graph, two, global_batch=48)
    assert for_price.num_devices < fastest.num_devices          # (the objectives differ)
    assert _layout(new) == _layout(for_price)
    again = autoplan.replan(Plan.from_json(cheap.to_json()), two, graph=graph)
    assert _layout(again) == _layout(new)
    # the fastest instead: without the recorded prices
    assert _layout(autoplan.replan(replace(cheap, price_per_gpu_hour={}), two)) == \
        _layout(fastest)
    # a device type the record has no price for: said, with what to pass
    grown = autoplan.compose_cluster([NodeGroup(load_profile("a100-sxm4-80gb"), 2),
                                      NodeGroup(load_profile("h100-sxm5-80gb"), 1)])
    with pytest.raises(ConfigError, match="no price for \\['H100-SXM5-80GB'\\].*pass "
                                          "price_per_gpu_hour= to replan"):
        autoplan.replan(cheap, grown)
    priced = autoplan.replan(cheap, grown, price_per_gpu_hour={"A100-SXM4-80GB": 2.0,
                                                               "H100-SXM5-80GB": 3.0})
    assert priced.price_per_gpu_hour == {"A100-SXM4-80GB": 2.0, "H100-SXM5-80GB": 3.0}


def test_prices_by_type_are_recorded_per_type_and_bad_ones_refused(llama8b):
    import json

    from autoplan.errors import RecordError

    mixed = autoplan.load_cluster("mixed-a100-v100")
    prices = {"a100-sxm4-80gb": 4.0, "V100-SXM2-32GB": 0.5}
    cheap = autoplan.plan(llama8b, mixed, global_batch=128, price_per_gpu_hour=prices)
    assert cheap.price_per_gpu_hour == {"A100-SXM4-80GB": 4.0, "V100-SXM2-32GB": 0.5}
    data = json.loads(cheap.to_json())
    data["price_per_gpu_hour"]["V100-SXM2-32GB"] = "cheap"
    with pytest.raises(RecordError, match="price_per_gpu_hour"):
        Plan.from_json(json.dumps(data))


def test_replan_searches_the_space_the_plan_was_chosen_from():
    """A plan chosen from a narrower space (say, what another runtime runs) records it, and
    replan keeps to it; a plan proven fastest in it is kept alike."""
    import json

    from autoplan.errors import RecordError
    from autoplan.strategy import Schedule

    graph = _tiny()
    three = autoplan.load_cluster("a100-sxm4-80gb", nodes=3)
    narrow = SearchSpace(zero=(0, 1), schedules=(Schedule.ONE_F_ONE_B,), tensor_parallel=(1,))
    old = autoplan.plan(graph, three, global_batch=48, space=narrow)
    assert old.search_space == {"schedules": ["1f1b"], "zero": [0, 1], "tensor_parallel": [1]}
    assert autoplan.plan(graph, three, global_batch=48).search_space == {}
    two = three.without(range(8))
    for new in (autoplan.replan(old, two),
                autoplan.replan(Plan.from_json(old.to_json()), two, graph=graph)):
        assert new.search_space == old.search_space
        assert _layout(new) == _layout(autoplan.plan(graph, two, global_batch=48, space=narrow))
    kept = autoplan.replan(autoplan.plan(graph, three, global_batch=16, space=narrow),
                           three.without(range(16, 24)))
    assert kept.search_stats.steps == 0
    data = json.loads(old.to_json())
    data["search_space"] = {"zeros": [0]}
    with pytest.raises(RecordError, match="unknown search space field 'zeros' \\(did you mean"):
        Plan.from_json(json.dumps(data))
    data["search_space"] = {"schedules": ["2f2b"]}
    with pytest.raises(RecordError, match="search_space: schedules"):
        Plan.from_json(json.dumps(data))


def test_replan_searches_every_recipe_the_plan_was_chosen_among(llama8b):
    """A plan searched over several precision recipes records them, and replan searches
    them all again (not only the one that won)."""
    import json

    from autoplan.errors import RecordError

    four = autoplan.load_cluster("h100-sxm5-80gb", nodes=4)
    three = four.without(range(8, 16))
    both = autoplan.plan(llama8b, four, global_batch=96, precision=["bf16", "fp8"])
    assert both.searched_precisions == ("bf16", "fp8")
    assert autoplan.plan(llama8b, four, global_batch=96).searched_precisions == ()
    new = autoplan.replan(both, three)
    assert new.searched_precisions == ("bf16", "fp8")
    scratch = autoplan.plan(llama8b, three, global_batch=96, precision=["bf16", "fp8"])
    assert new.estimate.step_time_s <= scratch.estimate.step_time_s * 1.01 * (1 + 1e-9)
    again = autoplan.replan(Plan.from_json(both.to_json()), three, graph=llama8b)
    assert _layout(again) == _layout(new)
    # the recipe that lost is searched too: from a plan that won in bf16 alone
    bf16 = replace(autoplan.plan(llama8b, four, global_batch=96), searched_precisions=(
        "bf16", "fp8"))
    assert scratch.precision.value == "fp8" and bf16.precision.value == "bf16"
    assert autoplan.replan(bf16, three).precision == scratch.precision
    data = json.loads(both.to_json())
    data["searched_precisions"] = ["bf16", "fp9"]
    with pytest.raises(RecordError, match="searched_precisions: 'fp9' is not one of"):
        Plan.from_json(json.dumps(data))
