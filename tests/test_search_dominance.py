"""Four ways the search saves work without changing its plan.

* **Dominance across data-parallel degrees** (:meth:`_Search._dominated
  <autoplan.search.frontier._Search._dominated>`): the bound of a combination at more
  replicas, grown by its busiest rank's time for each micro-batch more, bounds the same
  options at fewer replicas out without computing their bound.  With
  ``check_dominance`` the search computes that bound anyway and asserts it prunes; the
  plan is byte for byte the one of the search without dominance.
* **A replan's band held to the best** (:meth:`_Search.cutoff
  <autoplan.search.frontier._Search.cutoff>`): where no layout keeps a shard of the old
  plan, every plan within the tolerance reshards all and the fastest is chosen, so the
  layouts that leave devices idle are priced only where they can be faster than the best;
  the plan is byte for byte the one of the search over the whole band.
* **Terms shared with the previous search** (:func:`autoplan.search.bounds._shared_tables`):
  a replan after its plan reads the terms of the ranks both priced.  With
  ``Bounds.check_shared`` each is priced again and checked to be the same.
* **The per-stage problem by counting** (:func:`autoplan.search.solve_stage_problem`):
  the same least bottleneck as CP-SAT on random problems, and a valid assignment.
"""

from __future__ import annotations

import importlib
import random

import pytest

import autoplan
from autoplan.errors import InfeasiblePlan
from autoplan.search import StageProblem, solve_stage_problem
from autoplan.search.frontier import _Search
from autoplan.search import bounds as bounds_module
from autoplan.search.bounds import Bounds
from autoplan.search.stage_solver import solve_stage_problem_cp_sat
from autoplan.strategy import Recompute, Strategy

replan_module = importlib.import_module("autoplan.search.replan")


@pytest.fixture(scope="module")
def gpt3():
    return autoplan.trace("zoo:gpt3-175b", seq_len=2048)


def test_dominance_prunes_only_what_the_bound_prunes(gpt3, monkeypatch):
    cluster = autoplan.load_cluster("a100-sxm4-80gb", nodes=16)
    monkeypatch.setattr(_Search, "use_dominance", False)
    plain = autoplan.plan(gpt3, cluster, global_batch=512)
    monkeypatch.setattr(_Search, "use_dominance", True)
    monkeypatch.setattr(_Search, "check_dominance", True)     # asserts each prune holds
    pruned = []
    dominated = _Search._dominated

    def counted(self, *args):
        out = dominated(self, *args)
        pruned.append(out)
        return out

    monkeypatch.setattr(_Search, "_dominated", counted)
    plan = autoplan.plan(gpt3, cluster, global_batch=512)
    assert sum(pruned) > 10
    assert plan.to_json() == plain.to_json()
    assert plan.search_stats.steps < plain.search_stats.steps


def _sharded_plan(graph, cluster) -> autoplan.Plan:
    """A layout of 16 replicas of 4 GPUs, every layer's states sharded over them."""
    return autoplan.Plan.from_strategy(graph, cluster, Strategy(
        dp=16, tp=4, zero=3, recompute=Recompute.FULL, micro_batch=1, global_batch=256))


def test_which_old_plans_no_layout_keeps_a_shard_of(gpt3):
    eight = autoplan.load_cluster("a100-sxm4-80gb", nodes=8)
    old = _sharded_plan(gpt3, eight)
    keeps = replan_module._may_keep_shards
    assert keeps(old, eight)                            # 16 x 4 GPUs are there
    assert not keeps(old, eight.without(range(8)))      # 56 GPUs: no 16 replicas of tp 4
    replicated = autoplan.Plan.from_strategy(gpt3, eight, Strategy(
        dp=16, tp=4, zero=0, recompute=Recompute.FULL, micro_batch=1, global_batch=256))
    assert keeps(replicated, eight.without(range(8)))   # a replicated layer may stay put


def test_replan_holds_what_keeps_no_shard_to_the_best(gpt3, monkeypatch):
    eight = autoplan.load_cluster("a100-sxm4-80gb", nodes=8)
    old = _sharded_plan(gpt3, eight)
    seven = eight.without(range(8))
    held = autoplan.replan(old, seven, graph=gpt3)
    monkeypatch.setattr(replan_module, "_may_keep_shards", lambda *args: True)
    whole = autoplan.replan(old, seven, graph=gpt3)     # every layout of the band priced
    assert held.to_json() == whole.to_json()
    assert held.search_stats.steps < whole.search_stats.steps
    # what the band rests on: every plan within the tolerance reshards every parameter
    alternatives = whole.search_stats.alternatives
    assert len(alternatives) > 1
    assert all(replan_module.reshard_fraction(old, p, gpt3) == 1.0 for p in alternatives)


@pytest.mark.slow
def test_replan_held_to_the_best_keeps_the_idle_reason(monkeypatch):
    """GPT-3 on 1,016 GPUs leaves a node idle: the idle reason quotes the bound of the
    layouts of every device, which the band leaves as the whole search proves it."""
    g = autoplan.trace("zoo:gpt3-175b", seq_len=2048)
    cluster = autoplan.load_cluster("a100-sxm4-80gb", nodes=128)
    old = autoplan.plan(g, cluster, global_batch=1536)
    survivors = cluster.without(range(8))
    held = autoplan.replan(old, survivors)
    monkeypatch.setattr(replan_module, "_may_keep_shards", lambda *args: True)
    whole = autoplan.replan(old, survivors)
    assert held.idle_reason and held.to_json() == whole.to_json()
    assert held.search_stats.steps < whole.search_stats.steps


def test_a_replan_reads_the_terms_its_plan_priced(gpt3, monkeypatch):
    eight = autoplan.load_cluster("a100-sxm4-80gb", nodes=8)
    seven = eight.without(range(8))
    monkeypatch.setattr(bounds_module, "_SHARED", [])
    monkeypatch.setattr(Bounds, "check_shared", True)       # asserts each shared term
    old = autoplan.plan(gpt3, eight, global_batch=256)
    tables = bounds_module._SHARED[-1][2]
    priced = len(tables["_sums"])
    new = autoplan.replan(old, seven)
    assert bounds_module._SHARED[-1][2] is tables             # the same tables, grown
    assert priced > 100 and len(tables["_sums"]) < 2 * priced
    monkeypatch.setattr(Bounds, "check_shared", False)
    monkeypatch.setattr(bounds_module, "_SHARED_KEPT", 0)   # nothing shared
    alone = autoplan.replan(old, seven)
    assert new.to_json() == alone.to_json()
    assert bounds_module._SHARED == []


def test_terms_are_shared_only_where_they_are_the_same(gpt3, monkeypatch):
    from autoplan.cost import CostEngine, CostOptions
    from autoplan.strategy import Precision

    monkeypatch.setattr(bounds_module, "_SHARED", [])
    eight = autoplan.load_cluster("a100-sxm4-80gb", nodes=8)

    def tables(cluster, precision=Precision.BF16, recompute=tuple(Recompute), **options):
        engine = CostEngine(gpt3, cluster, options=CostOptions(**options))
        return bounds_module._shared_tables(engine, cluster, precision, recompute)

    first = tables(eight)
    assert tables(eight.without(range(8))) is first
    assert tables(autoplan.load_cluster("a100-sxm4-80gb", nodes=3)) is first
    assert tables(autoplan.load_cluster("h100-sxm5-80gb", nodes=8)) is not first
    assert tables(eight, memory_fraction=0.8) is not first
    assert tables(eight, precision=Precision.FP32) is not first
    assert tables(eight, recompute=(Recompute.NONE,)) is not first
    assert len(bounds_module._SHARED) == bounds_module._SHARED_KEPT


@pytest.mark.slow
def test_refinement_bounds_hold_on_blocks_of_two_sizes(monkeypatch):
    """DeepSeek-V3 (3 dense blocks, 58 of experts, 17x their size) on 1,024 H100: every
    candidate whose refinement bound the search takes is refined as well, and no
    refinement that fits beats its bound.  Reading the priced layout's extra bytes against
    the smallest block's model claimed no split of one candidate fits (an infinite bound)
    where one does at 40.6 s."""
    g = autoplan.trace("zoo:deepseek-v3", seq_len=4096)
    cluster = autoplan.load_cluster("h100-sxm5-80gb", nodes=128)
    monkeypatch.setattr(_Search, "check_refine_bounds", True)
    plan = autoplan.plan(g, cluster, global_batch=8192)
    assert plan.estimate.fits and plan.search_stats.refined > 13


def _random_problem(rng: random.Random) -> StageProblem:
    ranks, options = rng.randint(1, 8), rng.randint(1, 3)
    return StageProblem(
        num_blocks=rng.randint(ranks, 60 if rng.random() < 0.3 else 16),
        options=("none", "selective", "full")[:options],
        time_us=tuple(tuple(rng.randint(1, 50) for _ in range(options)) for _ in range(ranks)),
        memory_mib=tuple(tuple(rng.randint(1, 40) for _ in range(options))
                         for _ in range(ranks)),
        fixed_time_us=tuple(rng.randint(0, 100) for _ in range(ranks)),
        fixed_memory_mib=tuple(rng.randint(0, 50) for _ in range(ranks)),
        capacity_mib=tuple(rng.randint(50, 400) for _ in range(ranks)),
        min_blocks=rng.randint(0, 2))


def test_counting_solves_the_stage_problem_as_cp_sat_does():
    rng = random.Random(0)
    solved = infeasible = 0
    for _ in range(300):
        data = _random_problem(rng)
        try:
            exact = solve_stage_problem_cp_sat(data)
        except InfeasiblePlan:
            with pytest.raises(InfeasiblePlan):
                solve_stage_problem(data)
            infeasible += 1
            continue
        got = solve_stage_problem(data)
        assert got.bottleneck_us == exact.bottleneck_us, data
        assert sum(map(sum, got.counts)) == data.num_blocks
        for p, row in enumerate(got.counts):
            assert sum(row) >= data.min_blocks
            assert data.fixed_memory_mib[p] + sum(
                k * m for k, m in zip(row, data.memory_mib[p])) <= data.capacity_mib[p]
            assert data.fixed_time_us[p] + sum(
                k * t for k, t in zip(row, data.time_us[p])) <= got.bottleneck_us
        solved += 1
    assert solved > 100 and infeasible > 10          # both kinds were tried


def test_counting_refuses_more_ranks_than_blocks_at_their_minimum():
    data = StageProblem(num_blocks=3, options=("none",), time_us=((1,),) * 4,
                        memory_mib=((1,),) * 4, fixed_time_us=(0,) * 4,
                        fixed_memory_mib=(0,) * 4, capacity_mib=(100,) * 4)
    with pytest.raises(InfeasiblePlan, match="at least 1 each"):
        solve_stage_problem(data)
