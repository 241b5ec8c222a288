"""whatif(): one row per scenario, costs, infeasible rows with reasons, traces reused."""

from __future__ import annotations

import math

import pandas as pd
import pytest

import autoplan
import autoplan.capture
from autoplan.errors import ConfigError
from autoplan.models import GPT, GPTConfig
from autoplan.report import WHATIF_COLUMNS, cluster_price_per_hour, whatif

CONFIG = GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=4)
COST = ("cost_per_hour", "cost_per_step", "cost_per_million_tokens")


@pytest.fixture(scope="module")
def model():
    return GPT(CONFIG)


@pytest.fixture(scope="module")
def graph(model):
    return autoplan.trace(model, seq_len=64)


@pytest.fixture(scope="module")
def table(graph):
    return whatif(graph, [("a100-sxm4-80gb", 1), ("a100-sxm4-80gb", 2)], global_batch=[16, 32],
                  price_per_gpu_hour=2.5)


def test_one_row_per_scenario_in_cross_product_order(table):
    assert list(table.columns) == list(WHATIF_COLUMNS)
    assert len(table) == 4
    assert table[["gpus", "global_batch"]].values.tolist() == [[8, 16], [8, 32], [16, 16], [16, 32]]
    assert (table["rank"] == 1).all() and table["fits"].all()
    assert (table["reason"] == "").all()
    assert (table["seq_len"] == 64).all() and (table["nodes"] == table["gpus"] // 8).all()
    assert (table["device_types"] == "A100-SXM4-80GB").all()


def test_degrees_multiply_to_the_gpus(table):
    assert (table["dp"] * table["tp"] * table["pp"] * table["cp"] == table["gpus"]).all()
    per_replica = table["micro_batch"] * table["num_micro_batches"]
    assert (per_replica * table["dp"] == table["global_batch"]).all()


def test_throughput_is_tokens_over_step_time(table):
    tokens = table["global_batch"] * table["seq_len"]
    assert (abs(table["tokens_per_s"] * table["step_time_s"] - tokens) <= 1e-9 * tokens).all()
    assert ((table["mfu"] > 0) & (table["mfu"] < 1)).all()


def test_cost_is_price_times_gpus_times_time(table):
    price = 2.5
    assert (table["cost_per_hour"] == price * table["gpus"]).all()
    expected = price * table["gpus"] * table["step_time_s"] / 3600.0
    assert ((table["cost_per_step"] - expected).abs() <= 1e-12 * expected).all()
    per_million = table["cost_per_step"] / (table["global_batch"] * table["seq_len"]) * 1e6
    assert ((table["cost_per_million_tokens"] - per_million).abs() <= 1e-12 * per_million).all()


def test_no_price_no_cost_columns(graph):
    df = whatif(graph, "a100-sxm4-80gb", global_batch=16)
    assert list(df.columns) == [c for c in WHATIF_COLUMNS if c not in COST]
    assert len(df) == 1


def test_price_by_device_type_on_a_mixed_cluster(graph):
    mixed = autoplan.load_cluster("mixed-a100-v100")
    prices = {"A100-SXM4-80GB": 3.0, "v100-sxm2-32gb": 1.0}   # by type name or profile name
    counts = {}
    for i in range(mixed.num_devices):
        name = mixed.device_type_of(i).name
        counts[name] = counts.get(name, 0) + 1
    expected = 3.0 * counts["A100-SXM4-80GB"] + 1.0 * counts["V100-SXM2-32GB"]
    assert cluster_price_per_hour(mixed, prices) == expected
    df = whatif(graph, mixed, global_batch=64, price_per_gpu_hour=prices)
    assert df["cost_per_hour"].tolist() == [expected]


def test_missing_price_fails_before_planning(graph):
    with pytest.raises(ConfigError, match="V100-SXM2-32GB"):
        whatif(graph, "mixed-a100-v100", global_batch=64, price_per_gpu_hour={"A100-SXM4-80GB": 3.0})


def test_infeasible_scenario_is_a_row_with_its_reason(graph):
    # a memory budget nothing fits in: the planner's InfeasiblePlan becomes the reason
    df = whatif(graph, ["a100-sxm4-80gb", ("a100-sxm4-80gb", 2)], global_batch=16,
                memory_fraction=1e-6, price_per_gpu_hour=1.0)
    assert len(df) == 2 and not df["fits"].any()
    assert df["reason"].str.startswith("InfeasiblePlan: no layout").all()
    assert df["reason"].str.contains("binding constraint").all()
    assert df["step_time_s"].isna().all() and df["dp"].isna().all() and df["rank"].isna().all()
    assert df["cost_per_hour"].tolist() == [8.0, 16.0]        # the cluster still costs money
    assert df["cost_per_step"].isna().all()


def test_unsplittable_batch_is_a_row_not_an_exception(graph):
    # 1 sequence on 64 GPUs: dp=1, and tp x cp x pp = 64 is more than 4 heads x 2 (tp x cp
    # within a node of 8) x 4 blocks allow
    df = whatif(graph, ("a100-sxm4-80gb", 8), global_batch=[32, 1])
    assert df["fits"].tolist() == [True, False]
    assert df["reason"].iloc[1].startswith("ConfigError: global_batch=1 cannot be split")


def test_capture_failure_is_a_row(model):
    # the GPT has 64 learned positions: 128 tokens cannot be captured
    df = whatif(model, "a100-sxm4-80gb", global_batch=16, seq_len=[64, 128])
    assert df["seq_len"].tolist() == [64, 128]
    assert df["fits"].tolist() == [True, False]
    assert df["reason"].iloc[1].startswith("capture failed")


def test_each_model_and_seq_len_is_traced_once(model, monkeypatch):
    calls = []
    real = autoplan.capture.trace

    def counting(m, **kwargs):
        calls.append(kwargs.get("seq_len"))
        return real(m, **kwargs)

    monkeypatch.setattr(autoplan.capture, "trace", counting)
    df = whatif(model, ["a100-sxm4-80gb", ("a100-sxm4-80gb", 2)], global_batch=[16, 32],
                seq_len=[32, 64])
    assert sorted(calls) == [32, 64]
    assert len(df) == 2 * 2 * 2


def test_cluster_forms_agree(graph):
    by_name = whatif(graph, [("a100-sxm4-80gb", 2)], global_batch=32)
    by_object = whatif(graph, [autoplan.load_cluster("a100-sxm4-80gb", nodes=2)], global_batch=32)
    pd.testing.assert_frame_equal(by_name, by_object)


def test_deterministic(graph, table):
    again = whatif(graph, [("a100-sxm4-80gb", 1), ("a100-sxm4-80gb", 2)], global_batch=[16, 32],
                   price_per_gpu_hour=2.5)
    pd.testing.assert_frame_equal(table, again)


def test_more_gpus_never_lower_the_throughput_of_a_fixed_plan(graph):
    # a plan made for one node runs unchanged on the first node of a larger cluster: the
    # GPUs it does not use cost nothing in time, so the best throughput over plans that
    # may leave GPUs idle never falls as GPUs are added
    small = whatif(graph, ("a100-sxm4-80gb", 1), global_batch=16)
    best = autoplan.plan(graph, autoplan.load_cluster("a100-sxm4-80gb", nodes=1), global_batch=16,
                         use_all_devices=True)
    assert best.estimate.tokens_per_s == small["tokens_per_s"].iloc[0]
    for nodes in (2, 4):
        bigger = autoplan.load_cluster("a100-sxm4-80gb", nodes=nodes)
        e = autoplan.estimate_plan(graph, bigger, best)
        assert e.tokens_per_s == best.estimate.tokens_per_s and e.num_devices == 8


def test_top_k_rows_are_ranked(graph):
    df = whatif(graph, ("a100-sxm4-80gb", 2), global_batch=64, top_k=3)
    assert 1 <= len(df) <= 3
    assert df["rank"].tolist() == list(range(1, len(df) + 1))
    times = df["step_time_s"].tolist()
    assert times == sorted(times)
    assert df["plan"].is_unique or len(df) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(clusters=[("a100-sxm4-80gb", "two")]), "nodes must be an integer"),
    (dict(clusters=[42]), "clusters\\[0\\]"),
    (dict(global_batch=[0]), "global_batch"),
    (dict(seq_len=[128]), "fixes seq_len=64"),
    (dict(top_k=0), "top_k"),
    (dict(price_per_gpu_hour="cheap"), "price_per_gpu_hour"),
])
def test_bad_arguments(graph, kwargs, match):
    args = dict(clusters="a100-sxm4-80gb", global_batch=16)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        whatif(graph, **args)


def test_costs_are_nan_free_for_feasible_rows(table):
    for c in COST:
        assert not any(math.isnan(v) for v in table[c])
