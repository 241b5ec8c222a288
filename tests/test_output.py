"""What a person reads: why-it-won differences, compact reprs, the whatif table, rates."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

import autoplan
from autoplan import Plan, Strategy
from autoplan.models import GPT, GPTConfig
from autoplan.report import legend_text, plan_differences
from autoplan.report.whatif import whatif_text
from autoplan.strategy import Recompute


@pytest.fixture(scope="module")
def graph():
    return autoplan.trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)),
                          seq_len=16)


@pytest.fixture(scope="module")
def cluster():
    return autoplan.load_cluster("a100-sxm4-80gb")


@pytest.fixture(scope="module")
def best(graph, cluster):
    return autoplan.plan(graph, cluster, global_batch=16, top_k=4)


def _priced(graph, cluster, **kw):
    p = Plan.from_strategy(graph, cluster, Strategy(global_batch=16, **kw))
    return p.with_estimate(autoplan.estimate_plan(graph, cluster, p))


def test_differences_name_each_change_and_its_effect(graph, cluster):
    a = _priced(graph, cluster, dp=8, zero=1)
    b = _priced(graph, cluster, dp=4, tp=2, zero=1)
    lines = plan_differences(a, b)
    assert "dp: 8 -> 4" in lines and "tp: 1 -> 2" in lines
    assert lines[-1].startswith("=> step ") and "peak memory" in lines[-1]
    assert plan_differences(a, a) == []


def test_per_layer_choices_are_told_apart(graph, cluster):
    a = _priced(graph, cluster, dp=8)
    # the same layout with two blocks recomputed: the labels say "rc-full" for both
    # kinds of mixed plan, the differences say which layers changed
    layers = tuple(replace(lp, recompute=Recompute.FULL) if lp.name in ("blocks.0", "blocks.1")
                   else lp for lp in a.layers)
    b = replace(a, layers=layers, estimate=None)
    assert plan_differences(a, b) == ["recompute of 2 layers: none -> full"]


def test_cli_text_lists_runners_up_not_the_winner(best, cluster):
    from autoplan.cli import _plan_text
    text = _plan_text(best, cluster)
    why = text.split("why it won", 1)[1]
    assert "#1" not in why and "#2" in why
    assert why.count("=> step") == len(best.runners_up)


def test_reprs_are_short(graph, best):
    for obj in (graph, best, best.runners_up, best.search_stats, graph.layers[1]):
        assert len(repr(obj)) < 600, type(obj)
    assert repr(best).startswith("<Plan GPT dp")


def test_whatif_table_is_rounded_and_narrow():
    df = pd.DataFrame([{
        "model": "GPT", "cluster": "a100", "device_types": "A100", "nodes": 1, "gpus": 8,
        "global_batch": 16, "seq_len": 1024, "rank": 1, "plan": "dp8 tp1 pp1 mb2 z1",
        "step_time_s": 0.0089931234, "tokens_per_s": 1821847.123, "mfu": 0.32057712,
        "peak_memory_GiB": 2.538787, "fits": True, "reason": None,
        "cost_per_step": 4.99612e-05, "cost_per_million_tokens": 0.0030491234}])
    text = whatif_text(df)
    assert "0.00899" in text and "1,821,847" in text and "32.1%" in text and "2.5" in text
    assert "0.0089931234" not in text
    assert max(len(line) for line in text.splitlines()) < 120


def test_slow_devices_print_gflops_not_zero_tflops(best):
    est = replace(best.estimate, model_tflops_per_gpu=0.0123)
    assert "12.3 GFLOP/s/device" in est.summary() and "0 TFLOP/s" not in est.summary()


def test_legend_names_every_label_term():
    text = legend_text()
    for term in ("dpN", "tpN", "ppN", "cpN", "epN", "mbBxM", "zeroK", "rc-selective", "rc-full",
                 "sp", "1f1b", "interleavedxV", "zero_bubblexV"):
        assert term in text


def test_search_results_ride_on_frozen_plans_without_being_stored(best, graph):
    import dataclasses
    assert best.runners_up and best.search_stats is not None and best.graph is graph
    assert "runners_up" not in best.to_json() and "search_stats" not in best.to_json()
    assert Plan.from_json(best.to_json()) == best           # transient fields do not compare
    with pytest.raises(dataclasses.FrozenInstanceError):
        best.runners_up = ()
    assert graph.fx_graph is not None and "fx_graph" not in graph.to_json()[:200000]


def test_models_are_named_as_people_know_them():
    from autoplan.zoo import model_title
    assert model_title("zoo:gpt3-175b") == "GPT-3 175B"
    assert model_title("zoo:gpt3-175b", {"n_layer": 2}) == "GPT-3 175B (modified)"
    assert model_title("hf:llama") is None
    g = autoplan.trace("zoo:gpt3-1.3b")
    assert g.title == "GPT-3 1.3B" and g.model == "GPT2LMHeadModel"   # the class stays the identity
    p = Plan.from_strategy(g, autoplan.load_cluster("a100-sxm4-80gb"), Strategy(dp=8, global_batch=8))
    assert p.summary().startswith("GPT-3 1.3B dp8") and Plan.from_json(p.to_json()).title == "GPT-3 1.3B"
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        vocab_size=128))
    assert autoplan.trace(llama, seq_len=16).title == "llama 98.6K"
