"""Attention FLOPs as the kernel runs them (issue 65, item 4).

A causal kernel that skips the score blocks above the diagonal (SDPA called with
``is_causal`` and no mask) is priced, and counted by the ledger's recorder, at
``CAUSAL_BLOCK_FRACTION`` of the full scores; a kernel handed an explicit mask (the
context-parallel attention of ``autoplan.runtime.cp``) computes, and is priced at, every
block; eager attention (scores, then the mask) at every block too.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import autoplan
from autoplan.cost.engine import CAUSAL_BLOCK_FRACTION, CostEngine
from autoplan.models import GPT, GPTConfig
from autoplan.runtime.ledger import StepRecorder


def _recorded_flops(**sdpa_kwargs) -> float:
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    with StepRecorder({}) as rec:
        F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs).sum().backward()
    return sum(rec.step.flops.values())


def test_the_recorder_counts_a_causal_kernel_at_the_causal_fraction():
    full = 2 * 2 * 4 * 16 * 16 * (8 + 8) * 3      # forward, and the backward's four products
    assert _recorded_flops() == pytest.approx(full)
    assert _recorded_flops(is_causal=True) == pytest.approx(full * CAUSAL_BLOCK_FRACTION)
    # an explicit mask, even a causal one, is computed whole
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    assert _recorded_flops(attn_mask=mask) == pytest.approx(full)


@functools.lru_cache(maxsize=None)
def _graph(attention: str):
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=2,
                          attention=attention))
    return autoplan.trace(model, seq_len=64)


def _core_flops(attention: str, cp: int, **options) -> float:
    engine = CostEngine(_graph(attention), autoplan.load_cluster("a100-sxm4-80gb"),
                        options=autoplan.cost.CostOptions(**options))
    block = next(l for l in engine.summary.layers if l.is_block)
    return engine.template_flops(block.template, 1, 1, cp)[2]


def test_a_captured_sdpa_is_priced_causal_alone_and_whole_under_context_parallelism():
    eager_full = _core_flops("eager", 1)
    # the captured SDPA call runs is_causal without a mask: half the scores
    assert _core_flops("sdpa", 1) == pytest.approx(eager_full * CAUSAL_BLOCK_FRACTION)
    # under autoplan's context parallelism the kernel gets a mask of global positions:
    # every block of this rank's queries against all keys
    assert _core_flops("sdpa", 2) == pytest.approx(eager_full / 2)
    # eager attention computes every score, then masks
    assert _core_flops("eager", 2) == pytest.approx(eager_full / 2)


def test_a_stack_with_a_fused_kernel_skips_the_masked_blocks_under_context_parallelism():
    # FlashAttention/cuDNN ring attention skips above the diagonal at any cp
    eager_full = _core_flops("eager", 1)
    assert _core_flops("eager", 2, stack="megatron-core") == pytest.approx(
        eager_full / 2 * CAUSAL_BLOCK_FRACTION)
