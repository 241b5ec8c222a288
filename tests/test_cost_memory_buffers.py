"""Communication buffers of the memory model, exactly, on a tiny GPT (fp32, dp=2)."""

from __future__ import annotations

import functools

import pytest

from autoplan import trace
from autoplan.cost import estimate, summarize
from autoplan.cost.constants import load_constants
from autoplan.hardware import load_cluster
from autoplan.models import GPT, GPTConfig
from autoplan.strategy import Strategy


@functools.lru_cache(maxsize=None)
def _graph():
    return trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)), seq_len=16)


def _buffers(zero: int, options=None) -> float:
    cluster = load_cluster("a100-sxm4-80gb")
    s = Strategy(dp=8, micro_batch=1, global_batch=8, zero=zero, precision="fp32")
    return estimate(_graph(), cluster, s, calibration=None,
                    options=options).stages[0].memory.buffers_bytes


def test_zero2_and_zero3_hold_unsharded_gradients_of_the_largest_layer():
    k = load_constants()
    largest = max(l.params for l in summarize(_graph()).layers)
    grads = largest * k.memory.zero3_unsharded_grad_layers * k.model_states.fp32_grad_bytes
    gathered = largest * k.memory.zero3_gathered_layers * k.model_states.fp32_param_bytes
    assert _buffers(2) == pytest.approx(grads, rel=1e-12)
    assert _buffers(3) == pytest.approx(grads + gathered, rel=1e-12)


def test_zero0_holds_gradient_buckets_and_zero1_as_its_stack_reduces():
    """ZeRO-0 reduces its replicated gradients in buckets; ZeRO-1 per wrapped layer where
    the stack reduce-scatters per layer (FSDP2, what autoplan.parallelize runs: one layer's
    unsharded gradients, as ZeRO-2) and in buckets where it does not (Megatron's
    distributed optimizer)."""
    from autoplan.cost import CostOptions
    k = load_constants()
    layers = summarize(_graph()).layers
    params = sum(l.params for l in layers)
    bucket = min(k.memory.grad_bucket_bytes * k.memory.grad_buckets_in_flight,
                 params * k.model_states.fp32_grad_bytes)
    per_layer = (max(l.params for l in layers) * k.memory.zero3_unsharded_grad_layers
                 * k.model_states.fp32_grad_bytes)
    assert _buffers(0) == pytest.approx(bucket, rel=1e-12)
    assert _buffers(1) == pytest.approx(per_layer, rel=1e-12) == _buffers(2)
    megatron = CostOptions(stack="megatron-core")
    assert _buffers(1, megatron) == pytest.approx(bucket, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_receive_buffers_per_micro_batch_or_in_flight(tp):
    """torch.distributed.pipelining's stages as they come allocate, per micro-batch of the
    step, a receive buffer for a stage's input activation and one for its output gradient,
    whole on every tp rank (``pp_buffers_per_micro_batch``); autoplan's stages allocate them
    for the micro-batches in flight only, as Megatron does: one receive and one send buffer
    beyond the activations (whole on every tp rank; Megatron's tp-scattered).
    (tests/test_memory_truth.py measures the runtime's.)"""
    from autoplan.cost import CostOptions
    from autoplan.cost.toy import toy_cluster
    cluster = toy_cluster(devices_per_node=2 * tp)
    s = Strategy(pp=2, tp=tp, micro_batch=2, global_batch=16, precision="fp32")
    # (without the accumulated gradients' fresh one: the test below)
    kept = estimate(_graph(), cluster, s, calibration=None,
                    options=CostOptions(grad_accumulate_add=False,
                                        pp_buffers_per_micro_batch=True))
    own = estimate(_graph(), cluster, s, calibration=None,
                   options=CostOptions(grad_accumulate_add=False))
    mega = estimate(_graph(), cluster, s, calibration=None,
                    options=CostOptions(stack="megatron-core"))
    cut = 2 * 16 * 32 * 4            # micro-batch x seq x hidden x fp32 bytes at the cut
    m = 16 // 2
    for st in kept.stages:           # stage 0 receives gradients, stage 1 activations
        assert st.memory.buffers_bytes == pytest.approx(m * cut, rel=1e-12)
    for st in own.stages:
        assert st.memory.buffers_bytes == pytest.approx(2 * cut, rel=1e-12)
    for st in mega.stages:
        assert st.memory.buffers_bytes == pytest.approx(2 * cut / tp, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pipeline_sends_whole_from_every_tp_rank_unless_scattered(tp):
    """torch.distributed.pipelining (autoplan's runtime) sends a boundary's whole activation
    and gradient from every tp rank to its peer, all pairs at once; Megatron scatters them
    over the tp ranks (1/tp each) and all-gathers on arrival (``pp_scatter_gather``).  The
    toy node has no latency and 1e11 B/s per direction, so a send of S bytes takes S/1e11."""
    from autoplan.cost import CostOptions
    from autoplan.cost.toy import toy_cluster
    cluster = toy_cluster(devices_per_node=2 * tp)
    s = Strategy(pp=2, tp=tp, micro_batch=2, global_batch=16, precision="fp32")
    torch_sends = CostOptions(pp_comm_overlap=False)
    scattered = CostOptions(pp_comm_overlap=False, pp_scatter_gather=True)
    whole = estimate(_graph(), cluster, s, calibration=None, options=torch_sends)
    split = estimate(_graph(), cluster, s, calibration=None, options=scattered)
    cut = 2 * 16 * 32 * 4            # micro-batch x seq x hidden x fp32 bytes at the cut
    one_way = cluster.collective_time("p2p", [0, tp], cut)      # stage 0's rank to stage 1's
    assert one_way == pytest.approx(cut / 1e11, rel=1e-12)
    # each stage pays its own sends: stage 0 the activation in its forward, stage 1 the
    # activation's gradient (the same bytes) in its backward
    bare = estimate(_graph(), cluster, s, calibration=None,
                    options=CostOptions(pp_comm_overlap=True))
    for e, sent in ((whole, one_way), (split, one_way / tp)):
        first, last = e.stages
        assert first.forward_s - bare.stages[0].forward_s == pytest.approx(sent, rel=1e-9)
        assert first.backward_s == pytest.approx(bare.stages[0].backward_s, rel=1e-12)
        assert last.forward_s == pytest.approx(bare.stages[1].forward_s, rel=1e-12)
        assert last.backward_s - bare.stages[1].backward_s == pytest.approx(sent, rel=1e-9)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_fsdp2_copies_through_its_flat_buffers(zero):
    """FSDP2 (autoplan's runtime) copies each layer's gradients into the reduce-scatter
    input and, under ZeRO-3, its local shards into the all-gather input and the gathered
    output into the parameters, forward and backward: read + write at the device's memory
    bandwidth, per layer and micro-batch.  Once per step: ZeRO-0's all-reduce (DDP's
    buckets, FSDP2's replicate) copies the gradients in and back out, ZeRO-1's
    reduce-scatter copies them in, and the step's all-gather (ZeRO-1 and 2) copies the
    shard in and the parameters out.  fp32 on 8 A100: 4-byte parameters and gradients."""
    from autoplan.cost import CostOptions
    cluster = load_cluster("a100-sxm4-80gb")
    s = Strategy(dp=8, micro_batch=1, global_batch=16, zero=zero, precision="fp32")
    no_overlap = dict(overlap_grad_reduce=False, overlap_param_gather=False)
    copies = estimate(_graph(), cluster, s, calibration=None,
                      options=CostOptions(**no_overlap))
    views = estimate(_graph(), cluster, s, calibration=None,
                     options=CostOptions(zero_buffer_copies=False, **no_overlap))
    bw = cluster.device_type_of(0).memory_bw_bytes_per_s
    params = sum(l.params for l in summarize(_graph()).layers)
    m = 16 // 8
    per_micro_batch = 0.0
    if zero >= 2:
        per_micro_batch = 2 * params * 4 / bw                   # gradients into the buffer
    if zero == 3:
        per_micro_batch += 2 * (2 * params * 4 * (1 + 1 / 8) / bw)  # forward and backward
    gather = 2 * params * 4 * (1 + 1 / 8) / bw                  # shard in, parameters out
    per_step = {0: 2 * 2 * params * 4 / bw, 1: 2 * params * 4 / bw + gather, 2: gather,
                3: 0.0}[zero]
    assert copies.comm_total["dp_comm_s"] - views.comm_total["dp_comm_s"] == pytest.approx(
        m * per_micro_batch + per_step, rel=1e-9)
    assert CostOptions().zero_buffer_copies and not CostOptions(stack="megatron-core").zero_buffer_copies


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_accumulated_gradients_hold_one_fresh_module_gradient(zero):
    """With micro-batches after the first, torch's AccumulateGrad (the autoplan stack's
    ``grad_accumulate_add``) adds a module's new gradient, a tensor of its own, to the
    accumulated one: the largest module's gradient more in the buffers under ZeRO-0/1;
    none with one micro-batch, none where ZeRO-3's unsharded gradients already hold it,
    none on a stack that accumulates in place (Megatron's main_grad)."""
    from autoplan.cost import CostOptions
    cluster = load_cluster("a100-sxm4-80gb")

    def buffers(global_batch: int, options=None) -> float:
        s = Strategy(dp=8, micro_batch=1, global_batch=global_batch, zero=zero,
                     precision="fp32")
        return estimate(_graph(), cluster, s, calibration=None,
                        options=options).stages[0].memory.buffers_bytes
    largest = max(l.largest_module_params for l in summarize(_graph()).layers)
    fresh = largest * load_constants().model_states.fp32_grad_bytes if zero <= 1 else 0.0
    assert largest > 0
    assert buffers(16) - buffers(8) == pytest.approx(fresh, rel=1e-12, abs=1e-6)
    megatron = CostOptions(stack="megatron-core")
    assert buffers(16, megatron) == pytest.approx(buffers(8, megatron), rel=1e-12)
