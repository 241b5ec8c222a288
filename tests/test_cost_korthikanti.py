"""Activation memory of a GPT layer against Korthikanti et al. 2022, Sec. 4 (within 10%).

The capture of the package GPT (eager attention, dropout 0.1, bf16) saves what
Megatron's layer saves, ``sbh (34 + 5as/h)`` bytes; the cost model's split of
those bytes must reproduce the paper's formulas under tensor parallelism,
sequence parallelism and selective / full recompute.
"""

from __future__ import annotations

import pytest
import torch

from autoplan import trace
from autoplan.cost import CostOptions, estimate, summarize
from autoplan.cost.memory import activation_bytes
from autoplan.cost.toy import toy_cluster
from autoplan.models import GPT, GPTConfig
from autoplan.strategy import Recompute, Strategy

S, H, A, B = 256, 128, 8, 2     # sequence, hidden, heads, micro-batch (h != s on purpose)
TOL = 0.10


@pytest.fixture(scope="module")
def block():
    model = GPT(GPTConfig(vocab_size=512, seq_len=S, hidden=H, heads=A, layers=3,
                          attention="eager", dropout=0.1)).to(torch.bfloat16)
    graph = trace(model, seq_len=S, micro_batch=B)
    summary = summarize(graph)
    return graph, summary, summary.layers[graph.layers.index(graph.blocks[1])]


def _sbh() -> float:
    return S * B * H


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_parallel(block, t):
    _, _, layer = block
    ours = activation_bytes(layer, tp=t) * B
    paper = _sbh() * (10 + 24 / t + 5 * A * S / (H * t))
    assert ours == pytest.approx(paper, rel=TOL)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_and_sequence_parallel(block, t):
    _, _, layer = block
    ours = activation_bytes(layer, tp=t, sequence_parallel=True) * B
    assert ours == pytest.approx(_sbh() / t * (34 + 5 * A * S / H), rel=TOL)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_selective_recompute(block, t):
    _, _, layer = block
    ours = activation_bytes(layer, tp=t, sequence_parallel=t > 1,
                            recompute=Recompute.SELECTIVE) * B
    assert ours == pytest.approx(34 * _sbh() / t, rel=TOL)


def test_full_recompute_keeps_the_layer_input(block):
    _, _, layer = block
    assert activation_bytes(layer, recompute=Recompute.FULL) * B == pytest.approx(2 * _sbh(),
                                                                                  rel=TOL)


def test_fused_attention_drops_the_quadratic_term(block):
    _, _, layer = block
    ours = activation_bytes(layer, tp=2, sequence_parallel=True) * B
    fused = activation_bytes(layer, tp=2, sequence_parallel=True, fused_attention=True) * B
    assert ours - fused == pytest.approx(_sbh() / 2 * 5 * A * S / H, rel=TOL)


def test_engine_holds_layers_times_in_flight(block):
    """With pp = 1 the engine's activations are the layers' sum (plus the stack's shared
    inputs, e.g. the causal mask), for the micro-batch in flight."""
    graph, summary, layer = block
    c = toy_cluster(devices_per_node=2)
    e = estimate(graph, c, Strategy(tp=2, sequence_parallel=True, micro_batch=B, global_batch=B),
                 calibration=None, options=CostOptions(loss_fp32_copy=False))
    layers = sum(activation_bytes(l, tp=2, sequence_parallel=True) for l in summary.layers) * B
    shared = max(l.shared_input_bytes for l in summary.layers) * B
    assert e.stages[0].memory.activations_bytes == pytest.approx(layers + shared, rel=1e-9)
