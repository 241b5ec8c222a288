"""Expert parallelism in the layout records: Strategy(ep), Plan.mesh's ep sub-dimension."""

import pytest

from autoplan import Plan, Strategy, trace
from autoplan.errors import StrategyError
from autoplan.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_graph():
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    return trace(transformers.MixtralForCausalLM(cfg), seq_len=16)


def test_expert_layers_are_counted(moe_graph):
    assert [l.num_experts for l in moe_graph.layers] == [1, 4, 4, 1]


def test_plan_carries_ep(moe_graph):
    p = Plan.from_strategy(moe_graph, 4, Strategy(dp=2, cp=2, ep=4, global_batch=8))
    assert p.ep == 4 and p.mesh.degree("ep") == 4 and "ep4" in p.label()
    assert Plan.from_json(p.to_json()) == p
    assert Plan.from_strategy(moe_graph, 4, Strategy(dp=4, global_batch=8)).ep == 1


@pytest.mark.parametrize("kw, says", [
    (dict(dp=2, ep=4), "ep=4 must divide dp=2 x cp=1 = 2"),
    (dict(dp=8, ep=8), "must divide the model's 4 experts"),
])
def test_ep_that_does_not_divide_says_what_would(moe_graph, kw, says):
    with pytest.raises(StrategyError, match="would") as err:
        Plan.from_strategy(moe_graph, kw["dp"], Strategy(global_batch=8, **kw))
    assert says in str(err.value)


def test_ep_on_a_dense_model_is_refused():
    g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)), seq_len=16)
    with pytest.raises(StrategyError, match="has none: use ep=1"):
        Plan.from_strategy(g, 2, Strategy(dp=2, ep=2, global_batch=8))


def test_ep_must_be_positive():
    with pytest.raises(StrategyError, match="ep must be a positive integer"):
        Strategy(ep=0)
