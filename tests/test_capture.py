"""Capture: FLOPs, saved activations, layer grouping and TP structure."""

from __future__ import annotations

import json
import resource

import networkx as nx
import pytest
import torch
from torch import nn

import autoplan
from autoplan.capture import find_stacks
from autoplan.errors import ConfigError, InputError, RecordError, TraceError
from autoplan.graph import LayerKind, ModelGraph
from autoplan.models import GPT, GPTConfig, SmallCNN, SmallMLP

tf = pytest.importorskip("transformers")


def _gpt(**kw) -> GPT:
    cfg = dict(vocab_size=128, seq_len=64, hidden=64, heads=4, layers=4)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg))


def _meta(cls, config):
    with torch.device("meta"):
        return cls(config)


# ------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("b,s,h,a", [(2, 64, 64, 4), (1, 128, 96, 6)])
def test_gpt_block_flops_equal_analytic_count(b, s, h, a):
    """Forward FLOPs of a GPT block are 24 b s h^2 + 4 b s^2 h (Narayanan et al. 2021,
    Eq. 2 without the logit layer) and backward exactly twice that."""
    g = autoplan.trace(_gpt(seq_len=s, hidden=h, heads=a), seq_len=s, micro_batch=b)
    fwd = 24 * b * s * h * h + 4 * b * s * s * h
    for block in g.blocks:
        assert block.fwd_flops == fwd
        assert block.bwd_flops == 2 * fwd
    # the head: a (b s, h) x (h, V) matmul
    assert g.layers[-1].fwd_flops == 2 * b * s * h * 128
    assert g.fwd_flops == 4 * fwd + 2 * b * s * h * 128


# ---------------------------------------------------------- saved activations
@pytest.mark.parametrize("b,s,h,a", [(2, 128, 256, 8), (1, 256, 512, 16)])
def test_saved_bytes_match_korthikanti(b, s, h, a):
    """Eager attention + dropout, 16-bit: sbh(34 + 5as/h) (Korthikanti et al. 2022, Sec. 4.1)
    within 10%; the TP-sharded part is sbh(24 + 5as/h) and the attention core 5as^2 b."""
    model = _gpt(seq_len=s, hidden=h, heads=a, dropout=0.1, attention="eager").to(torch.bfloat16)
    g = autoplan.trace(model, seq_len=s, micro_batch=b)
    block = g.blocks[1]
    sbh = s * b * h
    expected = sbh * (34 + 5 * a * s / h)
    assert block.saved_bytes == pytest.approx(expected, rel=0.10)
    assert block.saved_tp_sharded_bytes == pytest.approx(sbh * (24 + 5 * a * s / h), rel=0.10)
    assert block.saved_quadratic_bytes == pytest.approx(5 * a * s * s * b, rel=0.10)
    # selective recompute re-runs QK^T and attention x V: 4 b s^2 h FLOPs
    assert block.selective_recompute_flops == 4 * b * s * s * h


def test_fused_attention_saves_no_quadratic_tensors():
    """With SDPA (no attention dropout), the attention core saves q, k, v, the output and
    the log-sum-exp instead of the s x s probabilities: the 5as/h term of Korthikanti's
    formula (which assumes eager attention) vanishes and ~34 sbh remains.

    hidden == seq_len here on purpose: shapes alone cannot tell (b, s, h) from (b, s, s),
    so capture classifies the quadratic tensors with a probe at another length."""
    s, b, h, a = 128, 2, 128, 4
    model = _gpt(seq_len=s, hidden=h, heads=a, dropout=0.0, attention="sdpa").to(torch.bfloat16)
    g = autoplan.trace(model, seq_len=s, micro_batch=b)
    block = g.blocks[1]
    assert block.saved_quadratic_bytes == 0
    assert block.selective_recompute_flops == 0
    assert block.saved_bytes == pytest.approx(34 * s * b * h, rel=0.10)
    eager = autoplan.trace(_gpt(seq_len=s, hidden=h, heads=a, dropout=0.0).to(torch.bfloat16),
                           seq_len=s, micro_batch=b).blocks[1]
    # without dropout only the softmax output (2as^2b, shared by softmax-backward and the
    # attention x V matmul) and the s x s causal mask remain of Korthikanti's 5as^2b
    assert eager.saved_quadratic_bytes == 2 * a * s * s * b + s * s
    assert eager.selective_recompute_flops == 4 * b * s * s * h


# ----------------------------------------------------------------- grouping
def _families():
    return {
        "gpt2": _meta(tf.GPT2LMHeadModel, tf.GPT2Config(
            n_embd=64, n_layer=5, n_head=4, vocab_size=256, n_positions=64)),
        "llama": _meta(tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=256)),
        "bert": _meta(tf.BertForMaskedLM, tf.BertConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
            vocab_size=256)),
        "t5": _meta(tf.T5ForConditionalGeneration, tf.T5Config(
            d_model=64, d_ff=128, num_layers=5, num_decoder_layers=4, num_heads=4, d_kv=16,
            vocab_size=256)),
        "mixtral": _meta(tf.MixtralForCausalLM, tf.MixtralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)),
        # a shared expert beside the routed ones, scaled by sigmoid(nn.Linear(hidden, 1))
        "qwen2moe": _meta(tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            shared_expert_intermediate_size=96, num_hidden_layers=5, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=256, num_experts=4, num_experts_per_tok=2)),
    }


EXPECTED_ROLES = {
    "gpt2": {"attn.c_attn": "column", "attn.c_proj": "row", "mlp.c_fc": "column", "mlp.c_proj": "row"},
    "llama": {"self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
              "self_attn.o_proj": "row", "mlp.gate_proj": "column", "mlp.up_proj": "column",
              "mlp.down_proj": "row"},
    "bert": {"attention.self.query": "column", "attention.self.key": "column",
             "attention.self.value": "column", "attention.output.dense": "row",
             "intermediate.dense": "column", "output.dense": "row"},
    "t5": {"layer.0.SelfAttention.q": "column", "layer.0.SelfAttention.k": "column",
           "layer.0.SelfAttention.v": "column", "layer.0.SelfAttention.o": "row",
           "layer.1.DenseReluDense.wi": "column", "layer.1.DenseReluDense.wo": "row"},
    "mixtral": {"self_attn.q_proj": "column", "self_attn.k_proj": "column",
                "self_attn.v_proj": "column", "self_attn.o_proj": "row", "mlp.gate": "router",
                "mlp.experts.gate_up_proj": "expert_column", "mlp.experts.down_proj": "expert_row"},
    # the shared expert splits as a dense MLP (its output reaches the residual through the
    # gate's per-token scale); the one-feature gate stays whole (replicated)
    "qwen2moe": {"self_attn.q_proj": "column", "self_attn.k_proj": "column",
                 "self_attn.v_proj": "column", "self_attn.o_proj": "row", "mlp.gate": "router",
                 "mlp.experts.gate_up_proj": "expert_column", "mlp.experts.down_proj": "expert_row",
                 "mlp.shared_expert.gate_proj": "column", "mlp.shared_expert.up_proj": "column",
                 "mlp.shared_expert.down_proj": "row"},
}
EXPECTED_STACKS = {"gpt2": ["transformer.h"], "llama": ["model.layers"], "bert": ["bert.encoder.layer"],
                   "t5": ["encoder.block", "decoder.block"], "mixtral": ["model.layers"],
                   "qwen2moe": ["model.layers"]}


@pytest.fixture(scope="module")
def hf_graphs():
    return {name: (model, autoplan.trace(model, seq_len=32)) for name, model in _families().items()}


@pytest.mark.parametrize("family", sorted(EXPECTED_ROLES))
def test_hf_family_layers_and_tp_roles(family, hf_graphs):
    model, g = hf_graphs[family]
    assert g.capture == "torch.export"
    assert [s.path for s in find_stacks(model)] == EXPECTED_STACKS[family]
    kinds = [l.kind for l in g.layers]
    assert kinds[0] is LayerKind.PRE and kinds[-1] is LayerKind.POST
    n_blocks = 9 if family == "t5" else 5
    assert len(g.blocks) == n_blocks
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert sum(l.param_count for l in g.layers) == g.num_params
    # identical blocks share templates: at most first/middle/last per stack, plus T5's
    # distinct block 0 and short stacks kept whole; pre, post and glue segments
    assert len(g.templates) <= 3 + 4 * len(EXPECTED_STACKS[family])
    middle = g.blocks[2]
    roles = middle.tp.roles()
    assert {k: v for k, v in roles.items() if v != "replicated"} == EXPECTED_ROLES[family]
    # one all-reduce forward and one backward per row matmul (attention and MLP)
    n_rows = sum(1 for v in roles.values() if v in ("row", "expert_row"))
    assert len(middle.tp.tp_collectives) == 2 * n_rows
    assert len(middle.tp.sp_collectives) == 4 * n_rows
    assert middle.cut_bytes > 0 and middle.fwd_flops > 0 and middle.saved_bytes > 0
    assert g.layers[-1].cut_bytes == 0


def test_tp_degrees_respect_heads(hf_graphs):
    _, g = hf_graphs["llama"]
    # 8 query heads, 2 KV heads (GQA): TP may be 1 or 2
    assert g.blocks[1].tp.valid_degrees() == (1, 2)
    _, g = hf_graphs["gpt2"]
    assert g.blocks[1].tp.valid_degrees() == (1, 2, 4)


def test_a_one_feature_gate_stays_whole_and_leaves_tp_to_the_heads(hf_graphs):
    """Qwen2-MoE's ``shared_expert_gate`` is ``nn.Linear(hidden, 1)``: as a column its one
    output feature made 1 a divisor and forbade any tp > 1.  Like the router it is
    replicated, so the 2 KV heads bound tp again."""
    _, g = hf_graphs["qwen2moe"]
    block = g.blocks[2]
    assert block.tp.roles()["mlp.shared_expert_gate"] == "replicated"
    assert 1 not in block.tp.divisors
    assert block.tp.valid_degrees() == (1, 2)
    # attention, the shared expert and the routed experts' region: one all-reduce each way
    assert len(block.tp.tp_collectives) == 2 * 3


def test_t5_has_two_stacks_and_glue(hf_graphs):
    _, g = hf_graphs["t5"]
    names = [l.name for l in g.layers]
    assert names[1:6] == [f"encoder.block.{i}" for i in range(5)]
    assert g.layers[6].kind is LayerKind.SEGMENT
    assert names[7:11] == [f"decoder.block.{i}" for i in range(4)]
    # decoder blocks have cross attention: two attention regions + MLP
    assert len(g.layer("decoder.block.2").tp.tp_collectives) == 6


def test_tied_embedding_counted_once(hf_graphs):
    model, g = hf_graphs["gpt2"]
    assert g.layers[0].tp.roles()["transformer.wte"] == "vocab_embedding"
    assert g.layers[-1].tp.roles()["lm_head"] == "vocab_head"
    assert "lm_head.weight" in g.layers[-1].tied_params
    assert g.layers[-1].param_count == 2 * 64  # only ln_f: the head weight is the embedding


def test_mixtral_counts_active_experts_only(hf_graphs):
    _, g = hf_graphs["mixtral"]
    block = g.blocks[2]
    tokens, k, h, f = 32, 2, 64, 128
    expert_flops = sum(n.fwd_flops for n in g.nodes(block) if n.module.startswith("mlp.experts"))
    assert expert_flops == 2 * tokens * k * (h * 2 * f + f * h)
    assert len(block.tp.ep_collectives) == 4
    # dispatch and combine move the routed tokens (one row per token and chosen expert),
    # not the expert weights the batched_mm path gathers per token
    item = torch.empty(0, dtype=getattr(torch, g.param_dtype)).element_size()
    assert {c.nbytes for c in block.tp.ep_collectives} == {tokens * k * h * item}
    # the MoE region's tensor-parallel collectives carry the block's tokens, like attention's
    assert {c.nbytes for c in block.tp.tp_collectives} == {tokens * h * item}
    assert {c.nbytes for c in block.tp.sp_collectives} == {tokens * h * item}


def test_moe_families_experts_layout_and_sink_attention():
    """DeepSeek-V3 (fp32 router, shared expert, dense first layers) and gpt-oss (expert
    banks stored [experts, in, out], attention sinks): collectives and expert shapes."""
    s, h = 32, 64
    dsv3 = _meta(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
        hidden_size=h, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, vocab_size=256)).to(torch.bfloat16)
    g = autoplan.trace(dsv3, seq_len=s)
    assert g.num_params == sum(p.numel() for p in dsv3.parameters())
    assert not g.blocks[0].tp.ep_collectives               # the dense first layer
    moe = g.blocks[2]
    assert {c.nbytes for c in moe.tp.ep_collectives} == {s * 2 * h * 2}
    assert {c.nbytes for c in moe.tp.tp_collectives} == {s * h * 2}  # not the fp32 router input
    lin = {x.name: x for x in moe.tp.linears}
    assert (lin["mlp.experts.gate_up_proj"].in_features, lin["mlp.experts.gate_up_proj"].out_features,
            lin["mlp.experts.gate_up_proj"].num_experts) == (h, 2 * 32, 8)

    oss = _meta(tf.GptOssForCausalLM, tf.GptOssConfig(
        hidden_size=h, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=8, vocab_size=256)).to(torch.bfloat16)
    g = autoplan.trace(oss, seq_len=s)
    block = g.blocks[2]
    lin = {x.name: x for x in block.tp.linears}
    assert (lin["mlp.experts.gate_up_proj"].in_features,
            lin["mlp.experts.gate_up_proj"].out_features) == (h, 2 * 48)
    assert (lin["mlp.experts.down_proj"].in_features, lin["mlp.experts.down_proj"].out_features) == (48, h)
    assert {c.nbytes for c in block.tp.ep_collectives} == {s * 2 * h * 2}
    # eager attention with a sink logit per head: the s x (s + 1) scores are quadratic
    assert block.saved_quadratic_bytes >= 4 * s * s * 2   # (a probe at another length, scaled)
    assert block.selective_recompute_flops > 0


def test_plain_mlp_and_cnn():
    g = autoplan.trace(SmallMLP(inputs=16, hidden=32, outputs=4, depth=3),
                       example_inputs=(torch.randn(8, 16),))
    assert g.objective.startswith("sum of outputs")
    assert g.fwd_flops == 2 * 8 * (16 * 32 + 32 * 32 * 2 + 32 * 4)
    g = autoplan.trace(SmallCNN(channels=8, depth=3), example_inputs=(torch.randn(2, 3, 8, 8),))
    assert [l.kind.value for l in g.layers] == ["pre", "block", "block", "block", "post"]
    conv = 2 * 2 * 8 * 8 * 8 * 8 * 9       # b * H * W * C_out * C_in * k * k * 2
    assert g.blocks[0].fwd_flops == conv
    assert g.blocks[0].bwd_flops == 2 * conv


def test_symbolic_trace_path():
    g = autoplan.trace(SmallMLP(inputs=16, hidden=32, outputs=4, depth=2),
                       example_inputs=(torch.randn(8, 16),), method="symbolic_trace")
    assert g.capture == "torch.fx.symbolic_trace"
    assert g.fwd_flops == 2 * 8 * (16 * 32 + 32 * 32 + 32 * 4)
    assert g.num_params == sum(l.param_count for l in g.layers)


# ------------------------------------------------------------ meta / large
def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_70b_meta_model_allocates_no_parameter_storage():
    cfg = tf.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    model = _meta(tf.LlamaForCausalLM, cfg).to(torch.bfloat16)
    before = _rss_bytes()
    g = autoplan.trace(model, seq_len=4096)
    grown = _rss_bytes() - before
    assert all(p.is_meta for p in model.parameters())
    assert 69e9 < g.num_params < 72e9
    assert len(g.blocks) == 80 and len(g.templates) <= 5
    assert grown < 512 * 2**20, f"capture grew RSS by {grown / 2**20:.0f} MiB"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 4 * 2**30


# ------------------------------------------------------------- round trip
def test_json_round_trip_is_exact(hf_graphs):
    for _, g in hf_graphs.values():
        text = g.to_json()
        back = ModelGraph.from_json(text)
        assert back == g
        assert back.to_json() == text


def test_trace_is_deterministic():
    a = autoplan.trace(_gpt(), seq_len=32).to_json()
    b = autoplan.trace(_gpt(), seq_len=32).to_json()
    assert a == b


def test_json_rejects_missing_and_unknown_keys():
    g = autoplan.trace(_gpt(layers=2), seq_len=16)
    data = json.loads(g.to_json())
    del data["layers"][1]["cut_bytes"]
    with pytest.raises(RecordError, match=r"layers\[1\].*cut_bytes"):
        ModelGraph.from_dict(data)
    data = json.loads(g.to_json())
    data["layers"][0]["tp"]["colour"] = 1
    with pytest.raises(RecordError, match="colour"):
        ModelGraph.from_dict(data)
    data = json.loads(g.to_json())
    data["layers"][0]["kind"] = "middle"
    with pytest.raises(RecordError, match="kind"):
        ModelGraph.from_dict(data)


def test_networkx_views():
    g = autoplan.trace(_gpt(layers=3), seq_len=16)
    lg = g.to_networkx()
    assert list(nx.topological_sort(lg)) == [l.name for l in g.layers]
    assert lg.edges["blocks.0", "blocks.1"]["nbytes"] == g.layer("blocks.0").cut_bytes
    ng = g.to_networkx("node")
    assert nx.is_directed_acyclic_graph(ng)
    assert ng.number_of_nodes() == sum(len(g.nodes(l)) for l in g.layers)
    assert sum(d["fwd_flops"] for _, d in ng.nodes(data=True)) == g.fwd_flops


def test_fx_graph_is_kept():
    g = autoplan.trace(_gpt(layers=2), seq_len=16)
    assert isinstance(g.fx_graph, torch.fx.GraphModule)


# -------------------------------------------------------------- bad input
class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > 0:   # data-dependent control flow: not traceable
            return self.lin(x)
        return x


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.inner = _Inner()

    def forward(self, x):
        return self.inner(self.first(x))


def test_untraceable_model_names_module_and_line():
    with pytest.raises(TraceError) as info:
        autoplan.trace(_Outer(), example_inputs=(torch.randn(2, 8),))
    err = info.value
    assert err.module_path == "inner"
    assert "x.sum().item() > 0" in (err.source_line or "")
    assert "test_capture.py" in str(err) and "what to do" in str(err)
    assert "Traceback" not in str(err)


def test_missing_and_mismatched_inputs():
    with pytest.raises(InputError, match="seq_len"):
        autoplan.trace(_gpt())
    with pytest.raises(InputError, match="example_inputs"):
        autoplan.trace(SmallMLP())
    with pytest.raises(InputError, match=r"example_inputs\[0\].*\(batch, 64\)"):
        autoplan.trace(SmallMLP(), example_inputs=(torch.randn(2, 9),))
    with pytest.raises(InputError, match="token ids"):
        autoplan.trace(SmallMLP(), seq_len=16)
    with pytest.raises(InputError, match="exceeds the model's maximum of 64"):
        autoplan.trace(_gpt(), seq_len=128)
    with pytest.raises(InputError, match="integer token ids"):
        autoplan.trace(_gpt(), example_inputs=(torch.randn(2, 16),))
    with pytest.raises(InputError, match="nn.Module"):
        autoplan.trace(3)
    # a string is a model spec (as whatif takes): an unknown one names the valid forms
    with pytest.raises(ConfigError, match="cannot understand model spec 'gpt2': use zoo:<name>"):
        autoplan.trace("gpt2")


OTHER_FAMILIES = {
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=256,
                word_embed_proj_dim=64, max_position_embeddings=128),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     vocab_size=256),
    "falcon": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=256),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, pad_token_id=0),
}


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_other_causal_lm_families_need_no_adapter(family):
    """Causal LMs beyond the listed families: Megatron roles found from the data flow alone
    (Falcon's custom linear multiplies by weight.T; Phi-3 fuses qkv and gate/up)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config = CONFIG_MAPPING[family](**OTHER_FAMILIES[family])
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    g = autoplan.trace(model, seq_len=32)
    assert len(g.blocks) == 3
    assert sum(l.param_count for l in g.layers) == g.num_params
    roles = [r for r in g.blocks[1].tp.roles().values() if r != "replicated"]
    assert roles.count("row") == 2 and roles.count("column") >= 2
    assert g.blocks[1].tp.max_degree() >= 2


class _ResidualBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(torch.relu(self.fc(self.ln(x))))


class _ResidualModel(nn.Module):
    """Blocks run as ``h = h + block(h)`` (or with dropout around them) by the caller."""

    def __init__(self, style: str, d: int = 32, n: int = 5, v: int = 64):
        super().__init__()
        self.style = style
        self.emb = nn.Embedding(v, d)
        self.layers = nn.ModuleList(_ResidualBlock(d) for _ in range(n))
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(d, v)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.layers:
            if self.style == "add":
                h = h + block(h)
            elif self.style == "add-first":
                h = block(h) + h
            else:
                h = h + self.drop(block(h))
        return self.head(h)


@pytest.mark.parametrize("style", ["add", "add-first", "dropout-add"])
def test_residual_style_blocks_are_captured(style):
    g = autoplan.trace(_ResidualModel(style), seq_len=16)
    blocks = [l for l in g.layers if l.kind is LayerKind.BLOCK]
    assert [l.name for l in blocks] == [f"layers.{i}" for i in range(5)]
    assert [l.kind for l in g.layers] == [LayerKind.PRE] + [LayerKind.BLOCK] * 5 + [LayerKind.POST]
    # every block holds its residual add: the same operators, the same FLOPs
    assert len({len(g.nodes(l)) for l in blocks}) == 1
    assert len({l.fwd_flops for l in blocks}) == 1
    assert any("add" in n.target for n in g.nodes(blocks[-1]))
    assert not any("add" in n.target for n in g.nodes(g.layers[-1]))
    # FLOPs sum to the whole model's: nothing dropped or counted twice
    ref = autoplan.trace(_ResidualModel(style, n=1), seq_len=16)
    per_block = blocks[0].fwd_flops
    assert g.fwd_flops == ref.fwd_flops + 4 * per_block
