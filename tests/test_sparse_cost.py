"""The sparse cost model on hand-built cases: each term against its formula."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autoplan.errors import ConfigError, InputError
from autoplan.hardware import load_cluster
from autoplan.sparse import (EmbeddingTable, Pooling, Sharding as Sh, SparseCostModel,
                             Storage as St, TablePlacement, load_sparse_constants, trace_sparse)
from autoplan.sparse.cost import A2A_CALLS_PER_TABLE, PS_MESSAGES_PER_SHARD
from autoplan.sparse.plan import ID_MESSAGE_BYTES, ROW_ID_BYTES, SparseOptimizer

B = 64          # global batch
ROWS, DIM, HOT = 1000, 64, 4


class One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.head(self.t(ids)).squeeze(-1)


@pytest.fixture(scope="module")
def model():
    g = trace_sparse(One(), torch.zeros(4, HOT, dtype=torch.long))
    c = load_cluster("a100-sxm4-80gb", devices_per_node=2).with_servers("cpu-server-2s-epyc", 2)
    return SparseCostModel(g, c, global_batch=B, optimizer="rowwise_adagrad", precision="fp32")


def _place(sharding, storage, devices, cf=0.0):
    return TablePlacement("t", sharding, storage, tuple(devices), cf)


def test_table_wise_in_device_memory(model):
    t = model.graph.tables[0]
    k = load_sparse_constants()
    ld = model.loads(t, _place(Sh.TABLE_WISE, St.HBM, [0]))
    dev = model.devices[0]
    row = DIM * 4                                    # 256 bytes: a half block
    gather_bw = dev.hbm_bw * k.hbm_gather_efficiency / k.penalty(row)
    assert k.penalty(row) == 1.15
    n = B * HOT
    u = t.distinct_rows(n)
    lookup, update, comm = ld.owner[0]
    assert lookup == pytest.approx(n * row / gather_bw + B * row / dev.hbm_bw)
    assert update == pytest.approx((n * row + u * row) / gather_bw + u * (2 * row + 2 * 4) / gather_bw)
    # the ids of the other worker's half of the batch in, its partial sums out and their
    # gradients back, all over NVLink (one node)
    assert comm == pytest.approx((n * ID_MESSAGE_BYTES / 2 + 2 * B * row / 2) / dev.intra_bw)
    assert ld.hbm[0] == pytest.approx(ROWS * (row + 4) + n * ID_MESSAGE_BYTES + B * row)
    assert 1 not in ld.owner and ld.host == {} and ld.server == {}
    # every worker sends its ids, gets its partial sums, returns their gradients
    share = (B / 2 * HOT * ID_MESSAGE_BYTES / 2 + 2 * B / 2 * row / 2) / dev.intra_bw \
        + 2 * B / 2 * row / dev.hbm_bw + A2A_CALLS_PER_TABLE * dev.a2a_latency_s
    assert ld.worker_s[0] == pytest.approx(share) and ld.worker_s[1] == pytest.approx(share)


def test_row_and_column_blocks_split_lookups_and_memory(model):
    t = model.graph.tables[0]
    tw = model.loads(t, _place(Sh.TABLE_WISE, St.HBM, [0]))
    rw = model.loads(t, _place(Sh.ROW_WISE, St.HBM, [0, 1]))
    cw = model.loads(t, _place(Sh.COLUMN_WISE, St.HBM, [0, 1]))
    # uniform access: each row block gets half the lookups, each column block all of them
    assert rw.owner[0][0] < tw.owner[0][0] and rw.owner[0][0] == pytest.approx(rw.owner[1][0])
    assert sum(v for d, v in rw.hbm.items()) < tw.hbm[0] + 2 * B * DIM * 4
    assert cw.hbm[0] == pytest.approx(cw.hbm[1])
    skewed = dataclasses.replace(t, hot_rows_fraction=0.1, hot_lookups_fraction=0.9)
    hot = model.loads(skewed, _place(Sh.ROW_WISE, St.HBM, [0, 1]))
    # frequency-ranked ids: the first block holds the hot rows and does most lookups
    assert hot.owner[0][0] > 2 * hot.owner[1][0]


def test_host_memory_with_and_without_a_cache(model):
    t = dataclasses.replace(model.graph.tables[0], hot_rows_fraction=0.1, hot_lookups_fraction=0.9)
    k = load_sparse_constants()
    hbm = model.loads(t, _place(Sh.TABLE_WISE, St.HBM, [0]))
    host = model.loads(t, _place(Sh.TABLE_WISE, St.HOST, [0]))
    cached = model.loads(t, _place(Sh.TABLE_WISE, St.HOST_CACHED, [0], 0.1))
    row = DIM * 4
    n = B * HOT
    u = t.distinct_rows(n)
    link = model.devices[0].host_link_bw * k.host_link_efficiency
    gather = model.devices[0].hbm_bw * k.hbm_gather_efficiency / k.penalty(row)
    written = B * row / model.devices[0].hbm_bw           # the partial sums
    # the distinct rows cross the host link, every lookup reads its row on the device
    assert host.owner[0][0] == pytest.approx(u * row / link + n * row / gather + written)
    assert host.host == {0: pytest.approx(ROWS * (row + 4))}
    # the cache holds the hot tenth: its distinct rows come from device memory
    hot = t.distinct_rows(n, 0, 100)
    assert 0 < hot < u
    assert cached.owner[0][0] == pytest.approx((n + hot) * row / gather + (u - hot) * row / link
                                               + written)
    assert hbm.owner[0][0] < cached.owner[0][0] < host.owner[0][0]
    assert cached.hbm[0] - host.hbm[0] == pytest.approx(100 * row)


def test_parameter_servers(model):
    t = model.graph.tables[0]
    ld = model.loads(t, _place(Sh.ROW_WISE, St.SERVER, [0, 1]))
    srv = model.servers[0]
    row = DIM * 4
    per_worker = t.distinct_rows(B / 2 * HOT, 0, 500)
    pulled = 2 * per_worker
    u = t.distinct_rows(B * HOT, 0, 500)
    lookup, update, comm = ld.server[0]
    assert lookup == pytest.approx(pulled * row / srv.dram_bw)
    assert update == pytest.approx((pulled * row + u * (2 * row + 2 * 4)) / srv.dram_bw)
    assert comm == pytest.approx((pulled * row + pulled * (ROW_ID_BYTES + row)) / srv.nic_bw
                                 + 2 * 2 * srv.latency_s)
    assert ld.server_mem[0] == pytest.approx(500 * (row + 4) + pulled * (row + ROW_ID_BYTES))
    assert ld.owner == {} and set(ld.worker_s) == {0, 1}
    dev = model.devices[0]
    uw = t.distinct_rows(B / 2 * HOT)
    assert ld.worker_s[0] == pytest.approx(
        uw * row / dev.ps_bw + uw * (ROW_ID_BYTES + row) / dev.ps_bw
        + 2 * B / 2 * HOT * row / (dev.hbm_bw * load_sparse_constants().hbm_gather_efficiency / 1.15)
        + PS_MESSAGES_PER_SHARD * 2 * dev.a2a_latency_s)


def test_data_parallel_all_reduces_the_whole_table(model):
    t = model.graph.tables[0]
    ld = model.loads(t, _place(Sh.DATA_PARALLEL, St.HBM, [0, 1]))
    weight = ROWS * DIM * 4
    assert ld.hbm == {0: 2 * weight + ROWS * 4, 1: 2 * weight + ROWS * 4}
    assert ld.owner[0][2] == pytest.approx(model.cluster.collective_time("all_reduce", (0, 1), weight))


def test_a_step_is_dense_plus_busiest_worker_plus_busiest_server(model):
    t = model.graph.tables[0]
    dense, est_dense = model.dense(0)
    e = model.estimate([_place(Sh.TABLE_WISE, St.SERVER, [1])], dense)
    assert e.step_time_s == pytest.approx(e.dense_s + max(e.worker_s) + max(e.server_s))
    assert e.dense_s == est_dense.step_time_s and e.server_s[0] == 0.0 and e.server_s[1] > 0
    assert e.samples_per_s == pytest.approx(B / e.step_time_s) and e.fits
    assert e.hbm_bytes[0] == pytest.approx(est_dense.stages[0].peak_memory_bytes
                                           + model.loads(t, _place(Sh.TABLE_WISE, St.SERVER, [1])).hbm[0])
    big = dataclasses.replace(model.graph, tables=(dataclasses.replace(t, rows=30_000_000_000),))
    m2 = SparseCostModel(big, model.cluster, global_batch=B)
    e2 = m2.estimate([_place(Sh.TABLE_WISE, St.HBM, [0])], m2.dense(0)[0])
    assert not e2.fits and e2.hbm_bytes[0] > e2.hbm_capacity_bytes[0]


def test_bad_inputs_are_refused(model):
    t = model.graph.tables[0]
    with pytest.raises(ConfigError, match="positive multiple of the 2 workers"):
        SparseCostModel(model.graph, model.cluster, global_batch=63)
    with pytest.raises(ConfigError, match="servers \\[5\\] are not among the cluster's 2 servers"):
        model.loads(t, _place(Sh.TABLE_WISE, St.SERVER, [5]))
    with pytest.raises(ConfigError, match="devices \\[7\\] are not in the cluster's 2 devices"):
        model.loads(t, _place(Sh.TABLE_WISE, St.HBM, [7]))
    with pytest.raises(ConfigError, match="places every table once"):
        model.estimate([], model.dense(0)[0])
    maxed = dataclasses.replace(t, pooling=Pooling.MAX)
    with pytest.raises(InputError, match="max-pools"):
        model.loads(maxed, _place(Sh.TABLE_WISE, St.HBM, [0]))
    no_host = SparseCostModel(model.graph, load_cluster("a100-sxm4-80gb", devices_per_node=2),
                              global_batch=B)
    assert no_host.devices[0].host_link_bw is not None
    assert SparseOptimizer.ADAM.state_bytes(DIM) == 8 * DIM
    assert EmbeddingTable("x", 1, 1, 4, Pooling.SUM, 1.0, 1.0).weight_bytes == 4
