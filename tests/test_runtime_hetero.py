"""Plans for heterogeneous clusters run as searched: uneven replica batches and pipeline
stages on different device types, against a single process (gloo, CPU, fp32).

The plans come from :func:`autoplan.plan` on small composed clusters of two CPU
device types, ``fast`` (2x the matmul throughput and memory bandwidth) and
``slow``, built from :func:`runtime_cases.synthetic_measurements`: the default
search splits the global batch over replicas in proportion to their speed
(e.g. 4, 2, 2 sequences of 8) and gives a pipeline's faster ranks more blocks.
Where a test needs a particular shape (pipeline, tensor parallelism, ZeRO-1)
it narrows the :class:`~autoplan.search.SearchSpace`, and it asserts that the
plan it got has that shape (uneven batches, mixed stages), so that a change in
the search cannot turn the test into one of even plans.

Each plan trains the tiny GPT for 3 steps: loss after every step and every
parameter after steps 1 and 3 within ``ATOL = 1e-5`` of the reference, which
trains the whole global batch in one process (``runtime_cases.parity``); every
rank also checks that the stages it runs, the layers they hold and its
pipeline peers are those of ``plan.stages[k].devices`` / ``plan.stage_ranks``
(``runtime_cases.stage_placement``).  One spawn per world size.
"""

from __future__ import annotations

import dataclasses

import pytest

import autoplan
import runtime_cases as rc
from autoplan.graph import ModelGraph
from autoplan.hardware import NodeGroup, compose_cluster
from autoplan.profiling.build import build_profile
from autoplan.hardware.profiles import NetworkSpec, NetworkTopology, Profile
from autoplan.plan import Plan
from autoplan.search import SearchSpace
from autoplan.strategy import Schedule
from dist_harness import run

pytestmark = pytest.mark.distributed

#: Throughput of a ``fast`` device over a ``slow`` one.
SPEEDUP = 2.0


def _profile(kind: str, speed: float, devices_per_node: int, world: int) -> Profile:
    """A node of ``devices_per_node`` CPU processes measuring ``speed`` x the synthetic
    throughput; its nodes reach other nodes over the same links as inside one (processes
    of one machine), so the profile has a network section equal to its node's."""
    raw = rc.synthetic_measurements(world)
    raw["ranks"] = raw["ranks"][:devices_per_node]
    for r in raw["ranks"]:
        r["matmul"] = {dt: [[n, t / speed] for n, t in table] for dt, table in r["matmul"].items()}
        r["copy_s"] /= speed
        r["info"]["name"] = f"test-{kind}"
    profile, _ = build_profile(kind, raw, cuda=False, nproc=world, threads=1,
                               devices_per_node=devices_per_node, quick=True, copy_bytes=2**20)
    node = profile.node
    network = NetworkSpec(1, node.bw_unidir_bytes_per_s * devices_per_node, node.latency_s,
                          NetworkTopology.SINGLE_SWITCH, 1.0, node.collective_efficiency,
                          source=node.source, latency_source=node.latency_source)
    return dataclasses.replace(profile, network=network)


def hetero_cluster(nodes: str, devices_per_node: int = 1):
    """One node per letter of ``nodes`` (``F`` fast, ``S`` slow), devices numbered node by
    node: ``"FSS"`` is process 0 fast, processes 1 and 2 slow."""
    world = len(nodes) * devices_per_node
    kinds = {"F": _profile("fast", SPEEDUP, devices_per_node, world),
             "S": _profile("slow", 1.0, devices_per_node, world)}
    return compose_cluster([NodeGroup(kinds[k], 1) for k in nodes], name=f"hetero-{nodes}")


@pytest.fixture(scope="module")
def gpt_graph() -> str:
    return rc.graph_json("gpt")


def _searched(graph: str, nodes: str, devices_per_node: int = 1, **space) -> Plan:
    """The best plan the search ranks with uneven replica batches (it prices the even split
    beside the speed-proportional one and may rank the even one first), else its best."""
    cluster = hetero_cluster(nodes, devices_per_node)
    best = autoplan.plan(ModelGraph.from_json(graph), cluster, global_batch=rc.GLOBAL_BATCH,
                         precision="fp32", space=SearchSpace(**space), top_k=8,
                         use_all_devices=True)
    ranked = [best, *getattr(best, "runners_up", ())]
    plan = next((p for p in ranked if len(set(p.replica_batch)) > 1), best)
    return Plan.from_json(plan.to_json())


def _types(plan: Plan) -> list[str]:
    return [st.device_type for st in plan.stages]


def _report(title: str, plans: dict[str, Plan], results: dict) -> None:
    print(f"\n{title}")
    for label, r in results.items():
        p = plans[label]
        print(f"  {label:34s} {p.label(compact=True):28s} batches {list(p.replica_batch)}  "
              f"loss {r['loss_err']:.1e}  params {r['param_err']:.1e}  {r['seconds']:.2f}s")


def _check_placements(plans: dict[str, Plan], results: list[dict]) -> None:
    """Every process of every plan reported its placement: together they cover each
    stage's devices exactly, every replica's ranks see that replica's batch share."""
    for label, plan in plans.items():
        for k, st in enumerate(plan.stages):
            ranks = sorted(r for r, res in enumerate(results)
                           if k in res[label]["placement"]["stages"])
            assert ranks == sorted(st.devices), (label, k, ranks, st.devices)
        for r, res in enumerate(results):
            got = res[label]["placement"]
            assert got["replica_batch"] == plan.replica_batch[got["replica"]], (label, r, got)


def test_uneven_replicas_3_processes(gpt_graph):
    """dp=3 on one fast and two slow processes: (4, 2, 2) with DDP, (2, 2, 4) with ZeRO-1
    and gradient accumulation over 4 vs 2 micro-batches; a 3-stage pipeline whose fast
    stage holds more blocks."""
    plans = {
        "dp3 fast first, DDP": _searched(gpt_graph, "FSS", zero=(0,), micro_batches=(2,)),
        "dp3 fast last, zero1": _searched(gpt_graph, "SSF", zero=(1,), micro_batches=(1,),
                                          pipeline_parallel=(1, 1)),
        "pp3 1f1b, mixed stages": _searched(gpt_graph, "FSS", pipeline_parallel=(3, 3),
                                            schedules=(Schedule.ONE_F_ONE_B,)),
    }
    a, b, c = plans.values()
    assert (a.dp, a.pp, a.replica_batch, {l.zero for l in a.layers}) == (3, 1, (4, 2, 2), {0})
    assert (b.dp, b.pp, b.micro_batch, b.replica_batch) == (3, 1, 1, (2, 2, 4))
    assert {l.zero for l in b.layers} == {1}
    assert c.pp == 3 and _types(c)[0] != _types(c)[1]
    blocks = [sum(n.startswith("blocks.") for n in st.layers) for st in c.stages]
    assert blocks == [2, 1, 1], blocks        # the fast process runs twice the blocks
    results = run(rc.hetero_parity, 3, "gpt", [(k, p.to_json()) for k, p in plans.items()],
                  gpt_graph, timeout=300)
    _check_placements(plans, results)
    _report("GPT, 3 processes (1 fast, 2 slow)", plans, results[0])


def test_uneven_replicas_4_processes(gpt_graph):
    """pp=2 x dp=2 with uneven replica batches under 1F1B (replicate and ZeRO-1) and ZBV;
    a pipeline whose stages run on different device types, with uneven replicas too;
    tensor parallelism inside replicas of different speeds; dp=4 over two speeds."""
    pp2 = dict(pipeline_parallel=(2, 2), micro_batches=(1,))
    plans = {
        "pp2 x dp2 1f1b": _searched(gpt_graph, "SFSF", schedules=(Schedule.ONE_F_ONE_B,),
                                    zero=(0,), **pp2),
        "pp2 x dp2 1f1b zero1": _searched(gpt_graph, "SFSF", schedules=(Schedule.ONE_F_ONE_B,),
                                          zero=(1,), **pp2),
        "pp2 x dp2 zbv zero1": _searched(gpt_graph, "FSFS", schedules=(Schedule.ZERO_BUBBLE,),
                                         zero=(1,), **pp2),
        "pp2 x dp2 1f1b mixed stages": _searched(gpt_graph, "SFFF",
                                                 schedules=(Schedule.ONE_F_ONE_B,), **pp2),
        "tp2 x dp2": _searched(gpt_graph, "SF", 2, tensor_parallel=(2,), zero=(0,), micro_batches=(1,),
                               sequence_parallel=(False,)),
        "tp2 sp x dp2 zero1": _searched(gpt_graph, "FS", 2, tensor_parallel=(2,), zero=(1,),
                                        micro_batches=(1,), sequence_parallel=(True,)),
        "dp4": _searched(gpt_graph, "FS", 2, tensor_parallel=(1,), pipeline_parallel=(1, 1),
                         micro_batches=(1,)),
    }
    for label, p in plans.items():
        assert len(set(p.replica_batch)) > 1, f"{label}: {p.label()} has even replica batches"
    for label in ("pp2 x dp2 1f1b", "pp2 x dp2 1f1b zero1", "pp2 x dp2 zbv zero1"):
        assert plans[label].pp == 2 and plans[label].dp == 2, plans[label].label()
    assert plans["pp2 x dp2 1f1b"].replica_batch == (3, 5)
    assert {l.zero for l in plans["pp2 x dp2 1f1b zero1"].layers} == {1}
    assert plans["pp2 x dp2 zbv zero1"].schedule is Schedule.ZERO_BUBBLE
    mixed = plans["pp2 x dp2 1f1b mixed stages"]
    assert mixed.pp == 2 and _types(mixed)[0] != _types(mixed)[1], _types(mixed)
    assert [sum(n.startswith("blocks.") for n in st.layers) for st in mixed.stages] == [1, 3]
    for label in ("tp2 x dp2", "tp2 sp x dp2 zero1"):
        assert plans[label].stages[0].tp == 2 and plans[label].dp == 2, plans[label].label()
    assert plans["dp4"].dp == 4
    results = run(rc.hetero_parity, 4, "gpt", [(k, p.to_json()) for k, p in plans.items()],
                  gpt_graph, timeout=400)
    _check_placements(plans, results)
    _report("GPT, 4 processes (fast and slow)", plans, results[0])
