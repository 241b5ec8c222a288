"""Two ways the search saves work without changing its plan.

* **Dominance across data-parallel degrees** (:meth:`_Search._dominated
  <autoplan.search.frontier._Search._dominated>`): the bound of a combination at more
  replicas, grown by its busiest rank's time for each micro-batch more, bounds the same
  options at fewer replicas out without computing their bound.  With
  ``check_dominance`` the search computes that bound anyway and asserts it prunes; the
  plan is byte for byte the one of the search without dominance.
* **The per-stage problem by counting** (:func:`autoplan.search.solve_stage_problem`):
  the same least bottleneck as CP-SAT on random problems, and a valid assignment.
"""

from __future__ import annotations

import random

import pytest

import autoplan
from autoplan.errors import InfeasiblePlan
from autoplan.search import StageProblem, solve_stage_problem
from autoplan.search.frontier import _Search
from autoplan.search.stage_solver import solve_stage_problem_cp_sat


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
