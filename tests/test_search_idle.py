"""A two-speed cluster whose slow part is left idle: planned that way, and run on CPU ranks.

Two CPU "devices" of a ``fast`` kind and two of a ``slow`` one (a twentieth of the
matmul throughput and memory bandwidth), slow first: ``SSFF``.  The search prices
layouts of all four, of the fast two and of the slow two (:mod:`autoplan.search.fleet`)
and plans on the fast pair, leaving processes 0 and 1 idle, saying why.  Run under
:func:`autoplan.parallelize` on four gloo processes, processes 2 and 3 train in a group of
their own while 0 and 1 wait, each step's loss reaching every process; after three steps
the losses and every parameter match a single process training the whole global batch
(fp32, ``ATOL = 1e-5``), and ``finish`` puts all four back in one process group.  The same
plan under :func:`autoplan.elastic.run_elastic` (what an emitted program runs) trains the
same losses.  Plans of different active processes run in turn in one launch.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import autoplan
import runtime_cases as rc
from autoplan.graph import ModelGraph
from autoplan.hardware import NodeGroup, compose_cluster
from autoplan.profiling.build import build_profile
from autoplan.hardware.profiles import NetworkSpec, NetworkTopology
from autoplan.plan import Plan
from dist_harness import run

#: Throughput of a ``slow`` device over a ``fast`` one.
SLOWDOWN = 20.0


def _profile(kind: str, speed: float, world: int):
    """One CPU process measuring ``speed`` x the synthetic throughput, reaching the others
    over the same links as inside a node (processes of one machine)."""
    raw = rc.synthetic_measurements(world)
    raw["ranks"] = raw["ranks"][:1]
    for r in raw["ranks"]:
        r["matmul"] = {dt: [[n, t / speed] for n, t in table] for dt, table in r["matmul"].items()}
        r["copy_s"] /= speed
        r["info"]["name"] = f"test-{kind}"
    profile, _ = build_profile(kind, raw, cuda=False, nproc=world, threads=1,
                                devices_per_node=1, quick=True, copy_bytes=2**20)
    node = profile.node
    network = NetworkSpec(1, node.bw_unidir_bytes_per_s, node.latency_s,
                          NetworkTopology.SINGLE_SWITCH, 1.0, node.collective_efficiency,
                          source=node.source, latency_source=node.latency_source)
    return dataclasses.replace(profile, network=network)


def two_speed(nodes: str = "SSFF"):
    """One single-process node per letter (``F`` fast, ``S`` slow), in that order."""
    kinds = {"F": _profile("fast", 1.0, len(nodes)),
             "S": _profile("slow", 1.0 / SLOWDOWN, len(nodes))}
    return compose_cluster([NodeGroup(kinds[k], 1) for k in nodes], name=f"two-speed-{nodes}")


@pytest.fixture(scope="module")
def graph_json() -> str:
    return rc.graph_json("gpt")


@pytest.fixture(scope="module")
def planned(graph_json):
    cluster = two_speed()
    graph = ModelGraph.from_json(graph_json)
    plan = autoplan.plan(graph, cluster, global_batch=rc.GLOBAL_BATCH, precision="fp32")
    every = autoplan.plan(graph, cluster, global_batch=rc.GLOBAL_BATCH, precision="fp32",
                          use_all_devices=True)
    return cluster, plan, every


def test_idling_the_slow_part_is_planned_and_said(planned):
    cluster, plan, every = planned
    slow = tuple(d for d in range(cluster.num_devices)
                 if "test-slow" in cluster.device_type_of(d).name)
    assert slow == (0, 1)
    assert plan.idle_devices == slow and set(plan.mesh.devices) == {2, 3}
    assert all("test-fast" in st.device_type for st in plan.stages)
    assert plan.estimate.step_time_s < every.estimate.step_time_s
    assert "2 of 4 devices idle" in plan.idle_reason
    assert every.idle_reason == "" and not every.idle_devices
    # the plan says so in JSON, and plans that use every device write what they always did
    assert Plan.from_json(plan.to_json()) == plan
    assert '"idle_reason"' in plan.to_json() and '"idle_reason"' not in every.to_json()
    assert autoplan.plan_diff(every, plan).count("idle: none -> 2 of 4 devices") == 1


def _train(rank: int, world: int, plan_json: str, graph_json: str) -> dict:
    from autoplan.runtime import parallelize
    import torch.distributed as dist

    plan = Plan.from_json(plan_json)
    ref = rc.reference("gpt", 3)
    ids = rc.make_batch()
    pm = parallelize(rc.make_gpt(0), plan, seq_len=rc.SEQ, optimizer=rc.make_optimizer,
                     graph=ModelGraph.from_json(graph_json))
    active = getattr(pm, "active", True)
    group = dist.get_world_size()
    losses, param_err = [], 0.0
    for step in range(1, 4):
        losses.append(pm.step(ids))
        sd = pm.full_state_dict()
        if sd is not None:
            for k, v in ref["params"][step].items():
                param_err = max(param_err, rc._max_err(sd[k], v))
    pm.finish()
    return {"active": active, "group": group, "world_after": dist.get_world_size(),
            "loss_err": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
            "losses": losses, "param_err": param_err, "checked": sd is not None}


@pytest.mark.distributed
def test_the_plan_runs_with_its_idle_processes_waiting(planned, graph_json):
    _, plan, _ = planned
    out = run(_train, 4, plan.to_json(), graph_json)
    assert [o["active"] for o in out] == [False, False, True, True]
    assert [o["group"] for o in out] == [2, 2, 2, 2]          # two groups of two
    assert all(o["world_after"] == 4 for o in out)          # finish: one group again
    for o in out:                                            # every process sees the losses
        assert o["loss_err"] <= rc.ATOL, o
        assert o["losses"] == out[2]["losses"]
    checked = [o for o in out if o["checked"]]
    assert len(checked) == 1 and checked[0]["param_err"] <= rc.ATOL


@pytest.mark.distributed
def test_plans_of_different_active_worlds_run_in_turn_in_one_launch(planned, graph_json):
    """The idle plan, the all-device plan, then the idle plan again on the same four
    processes: each ``finish`` rejoins the world for the next (runtime_cases.parity)."""
    _, plan, every = planned
    targets = [("fast pair", plan), ("all four", every), ("fast pair again", plan)]
    results = run(functools.partial(rc.parity, graph=graph_json), 4, "gpt", targets)[0]
    assert list(results) == [label for label, _ in targets]
    assert all(r["loss_err"] <= rc.ATOL for r in results.values()), results


def _elastic(rank: int, world: int, plan_json: str, cluster_json: str) -> dict:
    from autoplan.elastic import run_elastic
    from autoplan.hardware.cluster import Cluster

    res = run_elastic(lambda: rc.make_gpt(0), Plan.from_json(plan_json),
                      cluster=Cluster.from_json(cluster_json), steps=3, checkpoint_dir=None,
                      vocab_size=rc.VOCAB, data=lambda step: rc.make_batch(), seed=0,
                      optimizer=rc.make_optimizer, log_every=0)
    return {"active": res.active, "losses": res.losses, "replanned": res.replanned}


@pytest.mark.distributed
def test_run_elastic_runs_the_plan_as_it_is(planned):
    cluster, plan, _ = planned
    out = run(_elastic, 4, plan.to_json(), cluster.to_json())
    assert [o["active"] for o in out] == [False, False, True, True]
    assert not any(o["replanned"] for o in out)
    ref = rc.reference("gpt", 3)["losses"]
    torch.testing.assert_close([out[2]["losses"][s] for s in (1, 2, 3)], ref,
                               atol=rc.ATOL, rtol=0)
