"""Placing tables: CP-SAT against brute force, the greedy baseline, memory, prices."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import nn

from autoplan.errors import InfeasiblePlan
from autoplan.hardware import load_cluster
from autoplan.sparse import (Prices, SparseCostModel, SparsePlan, Storage, greedy_plan,
                             plan_sparse, table_options, trace_sparse)


class Two(nn.Module):
    def __init__(self, rows=(5000, 300)) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(rows[0], 64, mode="sum")
        self.b = nn.EmbeddingBag(rows[1], 64, mode="sum")
        self.head = nn.Linear(128, 1)

    def forward(self, x, y):
        return self.head(torch.cat([self.a(x), self.b(y)], 1)).squeeze(-1)


@pytest.fixture(scope="module")
def graph():
    return trace_sparse(Two(), (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 2, dtype=torch.long)))


def test_cp_sat_finds_the_brute_force_optimum(graph):
    cluster = load_cluster("a100-sxm4-80gb", devices_per_node=2)
    m = SparseCostModel(graph, cluster, global_batch=256)
    opts = [table_options(m, t, storages=[Storage.HBM]) for t in graph.tables]
    best = min(m.estimate(combo, m.dense(z)[0]).step_time_s
               for combo in itertools.product(*opts) for z in (0, 1, 2, 3))
    plan = plan_sparse(graph, cluster, global_batch=256, storages=["hbm"])
    assert plan.search == "cp-sat optimal"
    assert plan.estimate.step_time_s == pytest.approx(best, rel=1e-4)
    assert plan.baseline_step_time_s >= plan.estimate.step_time_s
    assert plan.bound_step_time_s <= plan.estimate.step_time_s * (1 + 1e-4)


def test_greedy_is_torchrec_style_and_never_better(graph):
    cluster = load_cluster("a100-sxm4-80gb", devices_per_node=4).with_servers("cpu-server-2s-epyc", 1)
    g = greedy_plan(graph, cluster, global_batch=256)
    p = plan_sparse(graph, cluster, global_batch=256)
    assert g.search == "greedy" and g.estimate.fits
    assert p.estimate.step_time_s <= g.estimate.step_time_s
    assert p.baseline_step_time_s == pytest.approx(g.estimate.step_time_s)


def test_a_plan_is_deterministic_and_round_trips(graph):
    cluster = load_cluster("a100-sxm4-80gb", devices_per_node=2).with_servers("cpu-server-2s-epyc", 2)
    a = plan_sparse(graph, cluster, global_batch=256)
    b = plan_sparse(graph, cluster, global_batch=256)
    assert a.to_json() == b.to_json()
    assert SparsePlan.from_json(a.to_json()) == a
    assert a.placement("a").table == "a"


def test_tables_that_fit_nowhere_say_what_to_add(graph):
    huge = dataclasses.replace(graph, tables=tuple(
        dataclasses.replace(t, rows=t.rows * 10**8) for t in graph.tables))
    with pytest.raises(InfeasiblePlan, match="add devices, host memory or servers"):
        plan_sparse(huge, load_cluster("a100-sxm4-80gb", devices_per_node=2), global_batch=256,
                    storages=["hbm"])


def test_rows_beyond_device_memory_go_to_host_memory_or_servers(graph):
    big = dataclasses.replace(graph, tables=(
        dataclasses.replace(graph.tables[0], rows=400_000_000), graph.tables[1]))   # 95 GiB
    cluster = load_cluster("a100-sxm4-80gb", devices_per_node=1).with_servers("cpu-server-2s-epyc", 1)
    plan = plan_sparse(big, cluster, global_batch=256)
    assert plan.estimate.fits
    assert plan.placement("a").storage in (Storage.HOST, Storage.HOST_CACHED, Storage.SERVER)
    only_hbm = pytest.raises(InfeasiblePlan)
    with only_hbm:
        plan_sparse(big, cluster, global_batch=256, storages=["hbm"])


def test_the_cost_objective_rents_no_server_that_does_not_pay(graph):
    cluster = load_cluster("a100-sxm4-80gb", devices_per_node=2).with_servers("cpu-server-2s-epyc", 2)
    prices = Prices(device_hour=4.0, server_hour=8.0, source="test prices")
    plan = plan_sparse(graph, cluster, global_batch=256, objective="cost", prices=prices)
    assert all(p.storage is not Storage.SERVER for p in plan.tables)
    with pytest.raises(Exception, match="objective='cost' needs prices"):
        plan_sparse(graph, cluster, global_batch=256, objective="cost")


def test_dlrm_dcnv2_beyond_one_gpu_plans_sharded_on_a_shipped_profile():
    g = trace_sparse("zoo:dlrm-dcnv2")
    cluster = load_cluster("a100-sxm4-80gb")            # 8 GPUs: 97 GiB of rows > 80 GiB
    plan = plan_sparse(g, cluster, global_batch=65536, max_deterministic_time_s=0.5)
    assert plan.estimate.fits and plan.gain_over_baseline >= 1.0
    owners = {d for p in plan.tables if p.storage is Storage.HBM for d in p.devices}
    assert len(owners) == 8
    # no device holds the four 40M-row tables (76 GiB) at once
    big = [p for p in plan.tables if g.table(p.table).rows == 40_000_000]
    assert max(sum(d in p.devices for p in big) for d in range(8)) < 4
    assert max(plan.estimate.hbm_bytes) <= min(plan.estimate.hbm_capacity_bytes)


def test_the_planner_prices_every_option_as_the_cost_model_does(graph):
    # Problem prices options of like tables together and moves one device's prices to
    # devices of the same figures: every entry must equal pricing that option alone
    from autoplan.sparse.options import Problem
    from autoplan.sparse.tables import TableColumns

    cluster = load_cluster("a100-sxm4-80gb", nodes=2, devices_per_node=2).with_servers(
        "cpu-server-2s-epyc", 2)
    m = SparseCostModel(graph, cluster, global_batch=256)
    prob = Problem.build(m)
    assert {p.storage for p in prob.options[0]} == set(Storage)
    for i, t in enumerate(graph.tables):
        for o in range(prob.count[i]):
            ld = m.price(TableColumns.of([t]), prob.placement(i, o))
            for got, want in ((prob.device_s[i, o], ld.device_s()[0]),
                              (prob.srv[i, o], ld.server_s[0].sum(axis=1)),
                              (prob.device_hbm[i, o], ld.hbm_bytes[0]),
                              (prob.host[i, o], ld.host_bytes[0]),
                              (prob.smem[i, o], ld.server_bytes[0])):
                assert got.tolist() == pytest.approx(want.tolist(), rel=1e-12, abs=1e-15)


def test_beyond_the_window_cp_sat_improves_windows_and_a_bound_still_holds(graph):
    cluster = load_cluster("a100-sxm4-80gb", devices_per_node=4).with_servers("cpu-server-2s-epyc", 1)
    whole = plan_sparse(graph, cluster, global_batch=256)
    windows = plan_sparse(graph, cluster, global_batch=256, window=1)   # one table at a time
    assert "of 1 table around the busiest device" in windows.search
    assert windows.estimate.fits
    assert windows.estimate.step_time_s <= windows.baseline_step_time_s
    for p in (whole, windows):
        assert p.bound_step_time_s <= p.estimate.step_time_s * (1 + 1e-6)
    assert windows.to_json() == plan_sparse(graph, cluster, global_batch=256, window=1).to_json()
