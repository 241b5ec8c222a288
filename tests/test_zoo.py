"""Model specs and ``--model-arg`` overrides: keys checked against the config, values typed."""

from __future__ import annotations

import pytest

from autoplan.errors import ConfigError
from autoplan.zoo import build_model, check_overrides, parse_model_args

FIELDS = {"layers": 12, "dropout": 0.0, "bias": True, "act": "gelu", "ffn": None}
ANNOTATIONS = {"ffn": "int | None"}


@pytest.mark.parametrize("given,expected", [
    ({"layers": 4}, {"layers": 4}),
    ({"layers": 4.0}, {"layers": 4}),              # a whole float is taken for an int field
    ({"dropout": 1}, {"dropout": 1.0}),            # an int for a float field
    ({"bias": False, "act": "relu"}, {"bias": False, "act": "relu"}),
    ({"ffn": 256}, {"ffn": 256}),                  # None default: typed from the annotation
    ({"ffn": None}, {"ffn": None}),
    ({}, {}),
])
def test_good_overrides_are_typed(given, expected):
    out = check_overrides("toy", given, FIELDS, ANNOTATIONS)
    assert out == expected and all(type(out[k]) is type(v) for k, v in expected.items())


@pytest.mark.parametrize("given,message", [
    ({"layers": "abc"}, "--model-arg layers='abc': toy expects an integer (default layers=12)"),
    ({"layers": 4.5}, "expects an integer"),
    ({"layers": True}, "expects an integer"),
    ({"bias": 1}, "expects true or false (default bias=True)"),
    ({"act": 3}, "expects a string"),
    ({"ffn": "wide"}, "--model-arg ffn='wide': toy expects an integer"),
    ({"layer": 4}, "toy has no field 'layer'; did you mean layers?"),
    ({"zzz": 4}, "toy has no field 'zzz'; its fields are act, bias, dropout, ffn, layers"),
])
def test_bad_overrides_name_the_field_and_the_closest_choice(given, message):
    with pytest.raises(ConfigError) as info:
        check_overrides("toy", given, FIELDS, ANNOTATIONS)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_hf_config_keys_aliases_and_values():
    pytest.importorskip("transformers")
    # GPT-2 names its width n_embd; hidden_size is an alias (attribute_map) and is accepted
    model, _ = build_model("hf:gpt2", parse_model_args(
        ["hidden_size=64", "n_layer=2", "n_head=4", "vocab_size=128", "n_positions=32"]))
    assert model.config.n_embd == 64 and model.config.n_layer == 2
    with pytest.raises(ConfigError, match="has no field 'n_layers'; did you mean n_layer"):
        build_model("hf:gpt2", {"n_layers": 2})
    with pytest.raises(ConfigError, match="num_hidden_layers='abc'"):
        build_model("zoo:llama3-8b", parse_model_args(["num_hidden_layers=abc"]))
    # a zoo entry's own settings are kept, the override wins
    model, _ = build_model("zoo:llama3-8b", parse_model_args(["num_hidden_layers=2"]))
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 4096


def test_gpt_config_is_checked_too():
    with pytest.raises(ConfigError, match="gpt \\(GPTConfig\\) has no field 'hiden'; did you mean hidden"):
        build_model("gpt", {"hiden": 64})
    with pytest.raises(ConfigError, match="hidden \\(65\\) must be divisible by heads"):
        build_model("gpt", {"hidden": 65})


# published total parameters (billions) of the mixture-of-experts zoo entries
MOE_PUBLISHED = {
    "mixtral-8x22b": 141.0,     # Mistral AI: 141B total, 39B active
    "qwen3-235b-a22b": 235.0,   # Qwen3 Technical Report: 235B total, 22B active
    "deepseek-v3": 671.0,       # DeepSeek-V3 report / README_WEIGHTS.md: 671B (MTP module excluded)
    "gpt-oss-120b": 117.0,      # gpt-oss model card: 116.8B total, 5.1B active
}


@pytest.mark.parametrize("name", sorted(MOE_PUBLISHED))
def test_moe_zoo_entries_build_with_published_size(name):
    pytest.importorskip("transformers")
    model, seq = build_model(f"zoo:{name}")
    assert next(model.parameters()).device.type == "meta" and seq == 4096
    total = sum(p.numel() for p in model.parameters()) / 1e9
    assert total == pytest.approx(MOE_PUBLISHED[name], rel=0.02)
    assert any(p.dim() == 3 for p in model.parameters())     # expert banks


@pytest.mark.parametrize("name,experts,moe_blocks", [("mixtral-8x22b", 8, 56),
                                                     ("qwen3-235b-a22b", 128, 94)])
def test_moe_zoo_entries_trace(name, experts, moe_blocks):
    pytest.importorskip("transformers")
    import autoplan
    g = autoplan.trace(f"zoo:{name}")
    assert g.num_params / 1e9 == pytest.approx(MOE_PUBLISHED[name], rel=0.02)
    assert g.attributes["num_experts"] == experts
    assert sum(1 for b in g.blocks if b.tp.ep_collectives) == moe_blocks
