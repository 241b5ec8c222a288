"""The precision recipe, not the dtype a model was built in, decides the estimate.

The same small Llama and GPT built in fp32, in bf16 and on the meta device (bf16) are
traced; for one ``Strategy.precision`` their estimates (step time, peak memory, the
activations alone) agree within 1 % and :func:`autoplan.plan` picks the same layout.
"""

from __future__ import annotations

import functools

import pytest
import torch

import autoplan
from autoplan import trace
from autoplan.cost import estimate
from autoplan.hardware import load_cluster
from autoplan.models import GPT, GPTConfig
from autoplan.strategy import Strategy

#: Largest relative difference between builds of the same model (the issue's bound).
REL_TOL = 0.01
SEQ = 64
BUILDS = (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
          ("meta", torch.bfloat16, True))


def _llama(dtype, meta):
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    with torch.device("meta" if meta else "cpu"):
        return tf.LlamaForCausalLM(cfg).to(dtype)


def _gpt(dtype, meta):
    with torch.device("meta" if meta else "cpu"):
        return GPT(GPTConfig(vocab_size=256, seq_len=SEQ, hidden=64, heads=4, layers=4)).to(dtype)


@functools.lru_cache(maxsize=None)
def _graphs(model: str):
    make = _llama if model == "llama" else _gpt
    return {name: trace(make(dtype, meta), seq_len=SEQ) for name, dtype, meta in BUILDS}


@functools.lru_cache(maxsize=None)
def _cluster():
    return load_cluster("a100-sxm4-80gb")


@pytest.mark.parametrize("model", ["llama", "gpt"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("layout", [dict(dp=8), dict(dp=2, tp=2, pp=2, zero=1),
                                    dict(dp=4, tp=2, zero=3, recompute="selective")])
def test_estimate_does_not_depend_on_the_build_dtype(model, precision, layout):
    graphs = _graphs(model)
    s = Strategy(micro_batch=2, global_batch=16, precision=precision, **layout)
    est = {name: estimate(g, _cluster(), s) for name, g in graphs.items()}
    ref = est["fp32"]
    for name, e in est.items():
        assert e.step_time_s == pytest.approx(ref.step_time_s, rel=REL_TOL), name
        assert e.peak_memory_bytes == pytest.approx(ref.peak_memory_bytes, rel=REL_TOL), name
        # the runtime reserve dominates the peak of so small a model: check the activations
        acts = max(st.memory.activations_bytes for st in e.stages)
        ref_acts = max(st.memory.activations_bytes for st in ref.stages)
        assert acts == pytest.approx(ref_acts, rel=REL_TOL), name


@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_plan_does_not_depend_on_the_build_dtype(model):
    graphs = _graphs(model)
    plans = {name: autoplan.plan(g, _cluster(), global_batch=16)
             for name, g in graphs.items()}
    ref = plans["fp32"]
    for name, p in plans.items():
        assert p.describe() == ref.describe(), name
        assert p.estimate.step_time_s == pytest.approx(ref.estimate.step_time_s, rel=REL_TOL)


def test_attention_sink_scores_are_inside_the_fused_kernel():
    """gpt-oss appends a learned sink column to its attention scores (s x (s + 1)); those
    tensors are the attention core's, so a fused kernel never moves them: the memory-bound
    bytes per token outside the core do not grow with the sequence (they did, 4.3 GB per
    sequence and layer at s = 4096, pricing gpt-oss-120b ~70% slow)."""
    transformers = pytest.importorskip("transformers")
    from autoplan.cost.summary import summarize
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
                                    sliding_window=8, layer_types=["sliding_attention",
                                                                   "full_attention"])
    per_token = {}
    for seq in (32, 64):
        s = summarize(autoplan.trace(transformers.GptOssForCausalLM(cfg), seq_len=seq))
        rep, shd, quad = s.elementwise[[l for l in s.layers if l.is_block][0].template]
        per_token[seq] = ((rep + shd) / seq, quad / seq)
    assert per_token[64][1] > 1.8 * per_token[32][1] > 0                 # the scores: s^2
    assert per_token[64][0] == pytest.approx(per_token[32][0], rel=0.05)  # the rest: s
