"""What a bf16 recipe run as torch.autocast over fp32 weights costs (``CostOptions.autocast``:
``autoplan.parallelize``'s recipe until it ran FSDP2's mixed-precision policy, and still the
recipe of trainers built on autocast), the loss's working set, and measured GPU profiles under
the calibration (all measured on an H100: ``benchmarks/gpu_truth.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from autoplan import Strategy, estimate, trace
from autoplan.cost import CostOptions
from autoplan.cost.calibration import apply_calibration, attention_tables, load_calibration
from autoplan.cost.engine import (AUTOCAST_CAST_BYTES, AUTOCAST_COPY_BYTES,
                                  GRAD_ACCUMULATE_READS_WRITES, loss_bytes_per_logit)
from autoplan.hardware import EfficiencyTable, load_cluster
from autoplan.hardware.cluster import Cluster
from autoplan.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=512, seq_len=64, hidden=128, heads=4, layers=4)


@pytest.fixture(scope="module")
def graph():
    return trace(GPT(CFG), seq_len=CFG.seq_len)


@pytest.fixture(scope="module")
def one_gpu():
    return load_cluster("h100-sxm5-80gb", nodes=1, devices_per_node=1)


def _memory(e):
    return e.stages[0].memory


#: the autocast program against the same program without autocast (16-bit parameters and
#: gradients, the master copy in the optimizer)
AUTOCAST = dict(autocast=True, master_weights="optimizer", grad_reduce_dtype="bf16")
NO_AUTOCAST = dict(AUTOCAST, autocast=False)


def test_autocast_holds_a_bf16_copy_of_every_weight(graph, one_gpu):
    s = Strategy(global_batch=4, micro_batch=2, precision="bf16")
    # (the accumulated gradients' fresh one apart: its dtype is the weights', fp32 under
    # autocast, the recipe's without)
    on = estimate(graph, one_gpu, s, options=CostOptions(**AUTOCAST, grad_accumulate_add=False))
    off = estimate(graph, one_gpu, s, options=CostOptions(**NO_AUTOCAST,
                                                          grad_accumulate_add=False))
    extra = _memory(on).buffers_bytes - _memory(off).buffers_bytes
    assert extra == pytest.approx(AUTOCAST_COPY_BYTES * graph.num_params, rel=0.01)
    # in fp32 there is no autocast: nothing to cache, no casts
    s32 = dataclasses.replace(s, precision="fp32")
    assert (estimate(graph, one_gpu, s32, options=CostOptions(**AUTOCAST)).to_dict()
            == estimate(graph, one_gpu, s32, options=CostOptions(**NO_AUTOCAST)).to_dict())


def test_autocast_costs_casts_fp32_elementwise_and_gradient_accumulation(graph, one_gpu):
    """Slower with autocast: each micro-batch casts the weights down and their gradients
    up, the memory-bound operators run in fp32, and micro-batches after the first add
    their fp32 gradients (in the optimizer's share)."""
    opts = CostOptions(**NO_AUTOCAST, grad_accumulate_add=False)
    one = Strategy(global_batch=2, micro_batch=2, precision="bf16")
    two = Strategy(global_batch=4, micro_batch=2, precision="bf16")
    bw = one_gpu.device_type_of(0).memory_bw_bytes_per_s
    for s in (one, two):
        on = estimate(graph, one_gpu, s, options=CostOptions(**AUTOCAST))
        off = estimate(graph, one_gpu, s, options=opts)
        m = s.global_batch // s.micro_batch
        assert on.breakdown["compute_s"] > off.breakdown["compute_s"] + (
            2 * m * AUTOCAST_CAST_BYTES * graph.num_params * 0.9 / bw)
        accumulate = GRAD_ACCUMULATE_READS_WRITES * 4 * (m - 1) * graph.num_params / bw
        assert on.breakdown["optimizer_s"] - off.breakdown["optimizer_s"] == pytest.approx(
            accumulate, rel=0.02, abs=1e-12)


def test_gradient_accumulation_is_priced_in_every_precision(graph):
    """Micro-batches after the first add their gradients to the accumulated ones (torch's
    AccumulateGrad, 12 bytes per fp32 parameter): in fp32 too, on the whole gradients under
    ZeRO-0 and on the reduce-scattered shard under ZeRO-3; a stack that accumulates inside
    its GEMMs (``grad_accumulate_add=False``) pays nothing."""
    two = load_cluster("h100-sxm5-80gb", nodes=1, devices_per_node=2)
    bw = two.device_type_of(0).memory_bw_bytes_per_s
    off = CostOptions(grad_accumulate_add=False)
    for zero, share in ((0, 1.0), (3, 0.5)):
        for m in (1, 4):
            s = Strategy(dp=2, zero=zero, global_batch=4 * m, micro_batch=2, precision="fp32")
            extra = (estimate(graph, two, s).breakdown["optimizer_s"]
                     - estimate(graph, two, s, options=off).breakdown["optimizer_s"])
            # (the tied embedding and head count once: graph.num_params)
            want = GRAD_ACCUMULATE_READS_WRITES * 4 * (m - 1) * graph.num_params * share / bw
            assert extra == pytest.approx(want, rel=0.02, abs=1e-12), (zero, m)
    assert CostOptions(stack="megatron-core").grad_accumulate_add is False
    assert CostOptions().grad_accumulate_add is True


def test_the_loss_working_set_is_on_the_stage_that_computes_it(graph, monkeypatch):
    """The cross-entropy's fp32 logits (8 bytes per logit beyond what capture counts, for a
    shifted next-token loss) are held on the last pipeline stage only."""
    import autoplan.cost.engine as engine
    from autoplan.cost.summary import summarize
    assert loss_bytes_per_logit("bf16", shifts=True) == loss_bytes_per_logit("fp32", True) == 8
    assert loss_bytes_per_logit("fp32", shifts=False) == 4
    summary = summarize(graph)
    assert summary.loss_logits == CFG.vocab_size and summary.loss_shifts
    two = load_cluster("h100-sxm5-80gb", nodes=1, devices_per_node=2)
    s = Strategy(pp=2, global_batch=4, micro_batch=2, precision="bf16")
    with_loss = [st.memory.activations_bytes for st in estimate(graph, two, s).stages]
    monkeypatch.setattr(engine, "loss_bytes_per_logit", lambda dtype, shifts: 0.0)
    without = [st.memory.activations_bytes for st in estimate(graph, two, s).stages]
    logits = s.micro_batch * CFG.seq_len * CFG.vocab_size
    assert with_loss[0] == without[0]
    assert with_loss[1] - without[1] == pytest.approx(8 * logits)


def test_a_measured_gpu_profile_keeps_its_own_figures(one_gpu):
    """A measured profile's peak is the best achieved: the fitted fraction of a datasheet
    peak is not applied on top (it would count the shortfall twice), and its measured
    attention table prices attention."""
    cal = load_calibration()
    profile = one_gpu.profiles[next(iter(one_gpu.profiles))]
    table = EfficiencyTable(((1e9, 0.2), (1e12, 0.7)), source="measured SDPA")
    measured = dataclasses.replace(profile, device=dataclasses.replace(
        profile.device, measured=True, attention_efficiency=table))
    cluster = Cluster(one_gpu.name, {profile.name: measured}, one_gpu.nodes, one_gpu.site_links)
    kept = apply_calibration(cluster, cal).profiles[profile.name].device
    assert kept.matmul_efficiency == profile.device.matmul_efficiency
    assert attention_tables(cluster, cal)[profile.device.name] is table
    # the datasheet profile itself takes the fitted curve
    fitted = apply_calibration(one_gpu, cal).profiles[profile.name].device
    assert fitted.matmul_efficiency["default"].source.startswith("fitted")


def test_the_committed_measured_h100_profile_loads():
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "profiles" / "measured" / \
        "h100-sxm5-80gb-2026-11-26.yaml"
    device = load_cluster(path).device_type_of(0)
    assert device.measured and device.architecture == "hopper"
    assert device.attention_efficiency is not None
    assert 5e14 < device.peak("bf16") < 1e15      # measured, below the 989 TFLOP/s datasheet


def _with_host(cluster, per_op_s: float, selective_s: float = 0.0):
    """``cluster``'s GPU with a measured host time per operator (as ``autoplan profile``
    measures it on CUDA)."""
    from autoplan.hardware import OpOverhead
    profile = cluster.profiles[next(iter(cluster.profiles))]
    overhead = OpOverhead(forward_s=per_op_s, backward_s=per_op_s, tp_linear_forward_s=0.0,
                          tp_linear_backward_s=0.0, selective_dispatch_s=selective_s,
                          forward_dispatch_s=per_op_s, backward_node_s=per_op_s,
                          source="test host")
    device = dataclasses.replace(profile.device, measured=True, op_overhead=overhead)
    return Cluster(cluster.name, {profile.name: dataclasses.replace(profile, device=device)},
                   cluster.nodes, cluster.site_links)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_gpus_host_runs_ahead_each_layer_takes_the_longer(graph, one_gpu, recompute):
    """On a GPU the host's dispatch overlaps the device's work: a negligible host time
    leaves the step as the device prices it, a large one sets it (every layer's operators
    and autograd nodes at that time each, selective checkpointing's Python mode on top),
    never the sum of the two as on a CPU."""
    from autoplan.cost.engine import host_runs_ahead
    from autoplan.cost.summary import summarize
    s = Strategy(global_batch=2, micro_batch=2, recompute=recompute, precision="bf16")
    device_only = estimate(graph, _with_host(one_gpu, 0.0), s, calibration=None)
    tiny = estimate(graph, _with_host(one_gpu, 1e-12), s, calibration=None)
    assert host_runs_ahead(_with_host(one_gpu, 0.0).device_type_of(0))
    assert tiny.step_time_s == pytest.approx(device_only.step_time_s, rel=1e-9)
    slow = estimate(graph, _with_host(one_gpu, 1e-3, selective_s=2e-3), s, calibration=None)
    layers = summarize(graph).layers
    host = sum(l.dispatched_ops + l.autograd_nodes for l in layers) * 1e-3
    if recompute == "full":
        host += sum(l.dispatched_ops for l in layers if l.is_block) * 1e-3
    elif recompute == "selective":
        host += sum(l.dispatched_ops for l in layers if l.is_block) * 2e-3
    compute = slow.breakdown["compute_s"] + slow.breakdown["recompute_s"]
    assert compute == pytest.approx(host, rel=1e-6)
