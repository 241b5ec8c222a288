"""Capture of embedding models: tables, their traffic, the dense rest, multi-input models."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import autoplan
from autoplan.capture import find_stacks
from autoplan.errors import InputError
from autoplan.sparse import EmbeddingTable, Pooling, TableTraffic, find_tables, trace_sparse
from autoplan.sparse.models import DLRM, MLPERF_DCNV2_HOT, MLPERF_DCNV2_ROWS, TwoTower


class Shared(nn.Module):
    """One table two features use, a padded bag, a 1-D input with offsets, a row per id."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.EmbeddingBag(30, 4, mode="sum")
        self.padded = nn.EmbeddingBag(10, 4, mode="mean", padding_idx=0)
        self.flat = nn.EmbeddingBag(20, 4, mode="sum")
        self.seq = nn.Embedding(15, 4)
        self.head = nn.Linear(16, 1)

    def forward(self, a, b, pad, flat, offsets, seq):
        x = self.shared(a) + self.shared(b)
        return self.head(torch.cat([x, self.padded(pad), self.flat(flat, offsets),
                                    self.seq(seq).sum(1)], dim=1)).squeeze(-1)


def _inputs(batch=4):
    a = torch.randint(0, 30, (batch, 3))
    b = torch.randint(0, 30, (batch, 2))
    pad = torch.tensor([[1, 2, 0], [0, 0, 3], [4, 5, 6], [0, 0, 0]])
    flat = torch.arange(10) % 20
    offsets = torch.tensor([0, 1, 3, 6])
    seq = torch.randint(0, 15, (batch, 5))
    return a, b, pad, flat, offsets, seq


def test_tables_and_their_traffic_are_counted_from_the_batch():
    tables = {t.name: t for t in find_tables(Shared(), _inputs())}
    assert list(tables) == ["shared", "padded", "flat", "seq"]
    shared = tables["shared"]
    # two features of 3 and 2 ids each look the shared table up: 5 ids, 2 bags per sample
    assert (shared.ids_per_sample, shared.bags_per_sample, shared.pooling) == (5.0, 2.0, Pooling.SUM)
    # padding ids are not lookups: 6 of 12 ids are 0
    assert tables["padded"].ids_per_sample == 6 / 4 and tables["padded"].padding_idx == 0
    # 10 ids in 4 bags (offsets) over 4 samples
    assert (tables["flat"].ids_per_sample, tables["flat"].bags_per_sample) == (2.5, 1.0)
    # nn.Embedding: every id is its own output row
    seq = tables["seq"]
    assert (seq.pooling, seq.ids_per_sample, seq.bags_per_sample) == (Pooling.NONE, 5.0, 5.0)


def test_stated_traffic_overrides_the_batch_and_is_checked():
    tables = find_tables(Shared(), _inputs(), traffic={
        "shared": TableTraffic(ids_per_sample=40.0, hot_rows_fraction=0.1, hot_lookups_fraction=0.9)})
    t = tables[0]
    assert (t.ids_per_sample, t.bags_per_sample, t.stated) == (40.0, 2.0, True)
    assert (t.hot_rows_fraction, t.hot_lookups_fraction) == (0.1, 0.9)
    with pytest.raises(InputError, match=r"tables \['nope'\] the model does not have"):
        find_tables(Shared(), _inputs(), traffic={"nope": TableTraffic()})
    with pytest.raises(InputError, match="hot_lookups_fraction=0.05 < hot_rows_fraction=0.1"):
        TableTraffic(hot_rows_fraction=0.1, hot_lookups_fraction=0.05)
    with pytest.raises(InputError, match="ids_per_sample must be a number > 0"):
        TableTraffic(ids_per_sample=0)


def test_the_access_model_on_small_cases():
    t = EmbeddingTable("t", 100, 4, 4, Pooling.SUM, 1.0, 1.0, 0.1, 0.9)
    # the hot tenth of the rows gets 90% of the lookups, uniformly
    assert t.lookup_share(0, 5) == pytest.approx(0.45)
    assert t.lookup_share(0, 50) + t.lookup_share(50, 100) == pytest.approx(1.0)
    u = EmbeddingTable("u", 1000, 4, 4, Pooling.SUM, 1.0, 1.0)
    # n draws over R rows: R (1 - (1 - 1/R)^n) distinct
    assert u.distinct_rows(500) == pytest.approx(1000 * (1 - (1 - 1 / 1000) ** 500))
    # half the rows get half the draws: 250 over 500 rows
    assert u.distinct_rows(500, 0, 500) == pytest.approx(500 * (1 - (1 - 1 / 500) ** 250))
    # skew means fewer distinct rows for the same lookups
    assert t.distinct_rows(100) < EmbeddingTable("v", 100, 4, 4, Pooling.SUM, 1.0, 1.0).distinct_rows(100)
    assert EmbeddingTable("one", 1, 4, 4, Pooling.SUM, 1.0, 1.0).distinct_rows(7) == 1.0


def test_bad_models_and_inputs_are_named():
    with pytest.raises(InputError, match="has no nn.Embedding or nn.EmbeddingBag"):
        find_tables(nn.Linear(3, 1), torch.zeros(2, 3))
    with pytest.raises(InputError, match="a tensor whose first dimension is the samples"):
        find_tables(Shared(), (torch.tensor(3),))
    with pytest.raises(InputError, match="running Shared on the example batch failed"):
        find_tables(Shared(), (torch.zeros(4, 3, dtype=torch.long),))

    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.EmbeddingBag(5, 2, mode="sum")

        def forward(self, ids, w):
            return self.t(ids, per_sample_weights=w)

    with pytest.raises(InputError, match="per_sample_weights"):
        find_tables(Weighted(), (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)))


def test_dense_part_without_tables_and_no_table_stacks():
    m = DLRM([100, 50, 50, 30], 8, hot=[2, 1, 3, 1], bottom=(16,), top=(32, 1), interaction="dcn",
             cross_rank=4)
    g = trace_sparse(m, (torch.randn(4, 13), torch.randint(0, 30, (4, 7))))
    n_tables = sum(t.rows * t.dim for t in g.tables)
    assert g.dense.num_params == sum(p.numel() for p in m.parameters()) - n_tables
    assert sum(l.param_count for l in g.dense.layers) == g.dense.num_params
    # two tables of one shape are features, not a stack of layers; the cross layers are one
    assert [s.path for s in find_stacks(m)] == ["cross"]
    assert [l.name for l in g.dense.blocks] == ["cross.0", "cross.1", "cross.2"]


def test_multi_input_models_trace_with_a_3d_ids_tensor_on_the_meta_device():
    class D(nn.Module):
        def __init__(self):
            super().__init__()
            self.bottom = nn.Linear(13, 8)
            self.emb = nn.ModuleList(nn.EmbeddingBag(r, 8) for r in (100, 50, 60))
            self.top = nn.Linear(32, 1)

        def forward(self, dense, ids):          # ids: (batch, tables, ids per bag)
            p = [e(ids[:, t, :]) for t, e in enumerate(self.emb)]
            return self.top(torch.cat([self.bottom(dense)] + p, 1)).squeeze(-1)

    with torch.device("meta"):
        m = D()
    inputs = (torch.randn(4, 13), torch.randint(0, 50, (4, 3, 8)))
    graph = autoplan.trace(m, example_inputs=inputs, loss_fn=lambda out, *a: out.sum())
    assert [i[1] for i in graph.inputs] == [(4, 13), (4, 3, 8)]
    sg = trace_sparse(m, inputs)
    assert [(t.rows, t.ids_per_sample) for t in sg.tables] == [(100, 8.0), (50, 8.0), (60, 8.0)]


def test_zoo_entries_have_their_published_shapes():
    g = trace_sparse("zoo:dlrm-dcnv2")
    assert len(g.tables) == 26 and max(t.rows for t in g.tables) == 40_000_000
    assert {t.dim for t in g.tables} == {128}
    assert [t.ids_per_sample for t in g.tables] == [float(h) for h in MLPERF_DCNV2_HOT]
    assert [t.rows for t in g.tables] == list(MLPERF_DCNV2_ROWS)
    assert [l.name for l in g.dense.blocks] == ["cross.0", "cross.1", "cross.2"]
    # 97 GiB of rows: more than any one GPU's memory
    assert g.table_bytes > 80 * 2**30
    tt = trace_sparse("zoo:two-tower")
    assert [(t.name, t.pooling) for t in tt.tables] == [
        ("user_id", Pooling.NONE), ("user_history", Pooling.MEAN), ("item_id", Pooling.NONE),
        ("item_category", Pooling.NONE)]
    assert tt.table("user_history").ids_per_sample == 50.0
    with torch.device("meta"):
        assert isinstance(TwoTower(10, 10, 10, 4), nn.Module)
    assert math.isclose(g.table("tables.20").ids_per_bag, 100.0)
