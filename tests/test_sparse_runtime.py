"""Parity of the sparse runtime with a single-process reference (gloo, CPU, fp32).

Each spawn trains :class:`sparse_cases.ParityModel` for three steps under a hand-made
plan and compares the loss of every step, every table and every dense parameter with
the reference (``ATOL = 1e-5``): every sharding type (table-, row-, column-wise,
data-parallel), every storage (device memory, host memory, host memory with a device
cache, parameter servers table- and row-wise), the three sparse optimizers, the dense
part under DDP and under FSDP2 (ZeRO-3), workers and servers in one job.
"""

from __future__ import annotations

import pytest
import torch

import sparse_cases as sc
from dist_harness import run
from autoplan.errors import ConfigError, PlanMismatchError
from autoplan.sparse import Sharding as Sh, Storage as St

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def graph():
    return sc.graph()


def _every_kind(workers: int, servers: int) -> dict:
    last = workers - 1
    return {
        "tw": (Sh.TABLE_WISE, St.HBM, [last]),
        "rw": (Sh.ROW_WISE, St.HBM, range(workers)),
        "cw": (Sh.COLUMN_WISE, St.HBM, [0, 1]),
        "dp": (Sh.DATA_PARALLEL, St.HBM, range(workers)),
        "ps_tw": (Sh.TABLE_WISE, St.SERVER, [servers - 1]),
        "ps_rw": (Sh.ROW_WISE, St.SERVER, range(servers)) if servers > 1
        else (Sh.TABLE_WISE, St.SERVER, [0]),
        "host": (Sh.TABLE_WISE, St.HOST, [0]),
        "cached": (Sh.ROW_WISE, St.HOST_CACHED, range(workers), 0.25),
        "seq": (Sh.ROW_WISE, St.HBM, range(workers)),
    }


def _check(out: list, kind: str, *, default_lr: bool = False) -> dict:
    ref_losses, ref = sc.reference(kind, default_lr=default_lr)
    workers = [o for o in out if o is not None]
    for o in workers:
        torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(ref_losses),
                                   atol=sc.ATOL, rtol=sc.ATOL)
    r0 = workers[0]
    for name, w in r0["tables"].items():
        torch.testing.assert_close(w, ref[name + ".weight"], atol=sc.ATOL, rtol=sc.ATOL,
                                   msg=lambda m: f"table {name}: {m}")
    for k, v in r0["dense"].items():
        torch.testing.assert_close(v, ref[k], atol=sc.ATOL, rtol=sc.ATOL,
                                   msg=lambda m: f"dense {k}: {m}")
    # the tables moved: the comparison is not of untouched weights
    init = sc.make_model().state_dict()
    moved = {n: float((r0["tables"][n] - init[n + ".weight"]).abs().max()) for n in r0["tables"]}
    assert min(moved.values()) > 1e-4, moved
    return r0


def test_every_placement_2_workers_2_servers_rowwise_adagrad(graph):
    layout = _every_kind(2, 2)
    out = run(sc.worker, 4, sc.plan_json(graph, 2, 2, "rowwise_adagrad", layout), "rowwise_adagrad")
    assert out[2] is None and out[3] is None          # the servers
    _check(out, "rowwise_adagrad")
    hits = sc.expected_hits((0, 1), 0.25)
    for rank in (0, 1):
        got_hits, misses = out[rank]["cache"]["tables.cached"]
        assert got_hits == hits[rank] and misses > 0


def test_three_workers_one_server_sgd_zero3(graph):
    # uneven row blocks over 3 workers, the dense part under FSDP2 (ZeRO-3)
    layout = _every_kind(3, 1)
    layout["cw"] = (Sh.COLUMN_WISE, St.HBM, [1, 2])
    layout["host"] = (Sh.ROW_WISE, St.HOST, [0, 2])
    out = run(sc.worker, 4, sc.plan_json(graph, 3, 1, "sgd", layout, zero=3), "sgd")
    assert out[3] is None
    _check(out, "sgd")


def test_adam_through_autoplan_parallelize(graph):
    # lazy Adam against torch.optim.SparseAdam; the dispatch of autoplan.parallelize with
    # the sparse optimizer's defaults
    layout = _every_kind(2, 1)
    out = run(sc.worker, 3, sc.plan_json(graph, 2, 1, "adam", layout), "adam", sc.STEPS, True)
    _check(out, "adam", default_lr=True)


def _wrong_world(rank: int, world: int, plan_json: str) -> str:
    from autoplan.sparse import SparsePlan
    from autoplan.sparse.runtime import parallelize_sparse

    try:
        parallelize_sparse(sc.make_model(), SparsePlan.from_json(plan_json), loss_fn=sc.loss_fn)
    except PlanMismatchError as exc:
        return str(exc)
    return "no error"


def test_a_plan_for_another_world_fails_on_every_rank_before_any_collective(graph):
    out = run(_wrong_world, 2, sc.plan_json(graph, 2, 2, "sgd", _every_kind(2, 2)))
    assert all("2 workers + 2 servers = 4 processes, the job 2" in m for m in out)


@pytest.mark.slow
def test_every_placement_6_workers_2_servers(graph):
    layout = _every_kind(6, 2)
    layout["cw"] = (Sh.COLUMN_WISE, St.HBM, [2, 3, 4, 5])
    layout["seq"] = (Sh.ROW_WISE, St.HBM, range(5))      # 20 rows: 5 blocks of 4
    out = run(sc.worker, 8, sc.plan_json(graph, 6, 2, "rowwise_adagrad", layout),
              "rowwise_adagrad", timeout=400)
    _check(out, "rowwise_adagrad")


def test_bad_plans_are_refused_by_name(graph):
    from autoplan.sparse import TablePlacement

    with pytest.raises(ConfigError, match="column blocks do not divide"):
        TablePlacement("t", Sh.COLUMN_WISE, St.HBM, (0, 1, 2)).shards(10, 8)
    with pytest.raises(ConfigError, match="row blocks for 4 rows leave one empty"):
        TablePlacement("t", Sh.ROW_WISE, St.HBM, (0, 1, 2)).shards(4, 8)
    with pytest.raises(ConfigError, match="data-parallel table is replicated"):
        TablePlacement("t", Sh.DATA_PARALLEL, St.HOST, (0, 1))
    with pytest.raises(ConfigError, match="cache_fraction"):
        TablePlacement("t", Sh.TABLE_WISE, St.HOST_CACHED, (0,))


def _tiny_cluster(graph, workers: int, servers: int, table_room: int, host_room: int):
    """Devices with room for the dense part's peak and ``table_room`` bytes of tables
    (and ``host_room`` bytes of host memory): a model whose tables fit no one device."""
    import dataclasses

    from autoplan.cost.constants import CostOptions
    from autoplan.hardware import NodeGroup, compose_cluster, load_profile
    from autoplan.sparse import SparseCostModel

    base = load_profile("a100-sxm4-80gb")
    probe = SparseCostModel(graph, compose_cluster([NodeGroup(base, 1)]).subset(range(workers)),
                            global_batch=sc.GLOBAL_BATCH, precision="fp32", options=CostOptions())
    peak = min(probe.dense(z)[1].stages[0].peak_memory_bytes for z in (0, 1, 2, 3))
    tiny = dataclasses.replace(
        base, name="tiny-gpu",
        device=dataclasses.replace(base.device, memory_bytes=int(peak + table_room)),
        host=dataclasses.replace(base.host, memory_bytes=int(host_room / 0.8)))
    cluster = compose_cluster([NodeGroup(tiny, 1)], name="tiny").subset(range(workers))
    return cluster.with_servers("cpu-server-2s-epyc", servers)


def test_a_searched_plan_beyond_one_device_runs_in_parity_with_servers(graph):
    from autoplan.sparse import Storage, plan_sparse

    # two tables of 64 and 96 KiB beside small ones; each device has room for 16 KiB of
    # rows and buffers, its node's host memory for 1 KiB: the search must keep the large
    # tables on the servers and shard the others over the devices
    cluster = _tiny_cluster(graph, 2, 2, table_room=16384, host_room=1024)
    plan = plan_sparse(graph, cluster, global_batch=sc.GLOBAL_BATCH, precision="fp32",
                       optimizer="rowwise_adagrad")
    assert plan.estimate.fits
    storages = {p.storage for p in plan.tables}
    assert Storage.SERVER in storages and Storage.HBM in storages
    out = run(sc.worker, 4, plan.to_json(), "rowwise_adagrad")
    _check(out, "rowwise_adagrad")


def test_a_model_of_several_inputs_under_the_collective_mode():
    # parallelize + ParallelModel.step((inputs, targets)) with a tuple of inputs, split by
    # rows into replicas and micro-batches, under DDP and under ZeRO-3
    ref_losses, ref = sc.dense_reference()
    for zero, micro in ((0, 3), (3, 6)):
        out = run(sc.dense_worker, 2, zero, micro)
        for o in out:
            torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(ref_losses),
                                       atol=sc.ATOL, rtol=sc.ATOL)
        for k, v in out[0]["state"].items():
            torch.testing.assert_close(v, ref[k], atol=sc.ATOL, rtol=sc.ATOL)
