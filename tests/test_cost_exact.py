"""The cost model on hand-built graphs and clusters: answers computed by hand.

Toy numbers (autoplan.cost.toy): peak 1e12 FLOP/s at a flat efficiency of 0.5
(5e11 FLOP/s achieved), intra-node 1e11 B/s per direction, no latency, perfect
collective efficiency.  Each block: 1e9 forward FLOPs (2 ms), 2e9 backward (4 ms).
"""

from __future__ import annotations

import math

import pytest

from autoplan.cost import (
    BREAKDOWN_KEYS,
    CostOptions,
    Estimate,
    bubble_fraction,
    estimate,
    estimate_plan,
    in_flight,
    load_constants,
    pipeline_time,
)
from autoplan.cost.toy import toy_cluster, toy_graph
from autoplan.errors import StrategyError
from autoplan.plan import Plan, split_layers
from autoplan.strategy import Recompute, Schedule, Strategy

FWD_S = 1e9 / (1e12 * 0.5)     # one block's forward
BWD_S = 2 * FWD_S
#: every term priced alone: nothing overlapped, and no closing loss all-reduce (its own test)
#: the hand-computed figures are Rajbhandari et al.'s 16-bit parameters and gradients with
#: the fp32 master copy in the optimizer (2 + 2 + 12 bytes) and leave out what
#: parallelize's recipe adds on top (FSDP2's fp32 master weights and fp32 gradient
#: reduction: test_fsdp2_mixed_precision_* below; the loss's fp32 logits)
HAND = dict(autocast=False, loss_fp32_copy=False, master_weights="optimizer",
            grad_reduce_dtype="bf16")
NO_OVERLAP = CostOptions(**HAND, overlap_grad_reduce=False, overlap_param_gather=False,
                         step_loss_all_reduce=False)


def _est(graph, cluster, strategy, options=NO_OVERLAP) -> Estimate:
    return estimate(graph, cluster, strategy, options=options, calibration=None)


def test_compute_time_of_two_layers_on_two_devices():
    g = toy_graph(layers=2, fwd_flops=10**9, params=10**6)
    c = toy_cluster(devices_per_node=2)
    e = _est(g, c, Strategy(dp=2, micro_batch=1, global_batch=4))
    m = 2                                     # 4 sequences / (dp 2 x micro-batch 1)
    assert e.breakdown["compute_s"] == pytest.approx(m * 2 * (FWD_S + BWD_S), rel=1e-12)
    assert e.stages[0].forward_s == pytest.approx(2 * FWD_S, rel=1e-12)
    assert e.stages[0].backward_s == pytest.approx(2 * BWD_S, rel=1e-12)
    assert e.breakdown["bubble_s"] == pytest.approx(0.0, abs=1e-15)
    assert sum(e.breakdown.values()) == pytest.approx(e.step_time_s, rel=1e-12)
    assert list(e.breakdown) == list(BREAKDOWN_KEYS)


def test_ring_all_reduce_of_the_gradients():
    params = 10**6
    g = toy_graph(layers=2, fwd_flops=10**9, params=params)
    c = toy_cluster(devices_per_node=2)
    # the collective alone: no copies through the wrapper's buffers (those are
    # test_cost_memory_buffers.test_fsdp2_copies_through_its_flat_buffers)
    e = _est(g, c, Strategy(dp=2, global_batch=2),
             CostOptions(**HAND, overlap_grad_reduce=False, overlap_param_gather=False,
                         zero_buffer_copies=False, step_loss_all_reduce=False))
    grad_bytes = 2 * params * 2                          # two layers, 2-byte gradients
    ring = 2 * (2 - 1) / 2 * grad_bytes / 1e11           # Thakur et al. 2005, n = 2
    assert e.breakdown["dp_comm_s"] == pytest.approx(ring, rel=1e-12)
    assert e.comm_total["dp_comm_s"] == pytest.approx(ring, rel=1e-12)
    # overlapped with the last backward (8 ms >> 40 us): nothing exposed
    hidden = estimate(g, c, Strategy(dp=2, global_batch=2), calibration=None,
                      options=CostOptions(**HAND, zero_buffer_copies=False, step_loss_all_reduce=False))
    assert hidden.breakdown["dp_comm_s"] == 0.0
    assert hidden.comm_total["dp_comm_s"] == pytest.approx(ring, rel=1e-12)


def test_optimizer_step_is_memory_bound():
    params = 10**6
    g = toy_graph(layers=2, params=params)
    e = _est(g, toy_cluster(devices_per_node=1), Strategy(global_batch=1))
    per_param = load_constants().optimizer.mixed_bytes_accessed_per_param
    assert e.breakdown["optimizer_s"] == pytest.approx(2 * params * per_param / 1e12, rel=1e-12)


def test_1f1b_bubble_on_two_stages():
    g = toy_graph(layers=2, fwd_flops=10**9, params=10**6)      # no boundary bytes: no p2p
    c = toy_cluster(devices_per_node=2)
    m = 4
    e = _est(g, c, Strategy(pp=2, global_batch=m, schedule="1f1b"))
    t = FWD_S + BWD_S                                         # one block per stage
    assert e.breakdown["compute_s"] == pytest.approx(m * t, rel=1e-12)
    assert e.breakdown["bubble_s"] == pytest.approx((2 - 1) * t, rel=1e-12)
    assert e.breakdown["bubble_s"] / e.breakdown["compute_s"] == pytest.approx(
        bubble_fraction(Schedule.ONE_F_ONE_B, pp=2, m=m))
    assert bubble_fraction(Schedule.ONE_F_ONE_B, pp=2, m=4) == 0.25
    assert [s.micro_batches_in_flight for s in e.stages] == [2.0, 1.0]


def test_pipeline_point_to_point():
    stream = 10**8                                           # 100 MB per boundary
    g = toy_graph(layers=2, params=10**6, stream_bytes=stream)
    c = toy_cluster(devices_per_node=2)
    e = _est(g, c, Strategy(pp=2, global_batch=2))
    send = stream / 1e11
    # each rank pays the sends it makes: rank 0 the activation in its forward, rank 1
    # the activation's gradient in its backward
    assert e.stages[0].forward_s == pytest.approx(FWD_S + send, rel=1e-12)
    assert e.stages[0].backward_s == pytest.approx(BWD_S, rel=1e-12)
    assert e.stages[1].forward_s == pytest.approx(FWD_S, rel=1e-12)
    assert e.stages[1].backward_s == pytest.approx(BWD_S + send, rel=1e-12)
    assert e.breakdown["pp_comm_s"] == pytest.approx(2 * send, rel=1e-12)     # 2 micro-batches


def test_a_middle_pipeline_stage_sends_both_ways():
    stream = 10**8
    g = toy_graph(layers=3, params=10**6, stream_bytes=stream)
    e = _est(g, toy_cluster(devices_per_node=3), Strategy(pp=3, global_batch=3))
    send = stream / 1e11
    first, middle, last = e.stages
    assert (first.forward_s, first.backward_s) == pytest.approx((FWD_S + send, BWD_S), rel=1e-12)
    assert (middle.forward_s, middle.backward_s) == pytest.approx(
        (FWD_S + send, BWD_S + send), rel=1e-12)
    assert (last.forward_s, last.backward_s) == pytest.approx((FWD_S, BWD_S + send), rel=1e-12)
    # the middle rank is the slowest: the pipeline runs at its pace
    assert e.breakdown["pp_comm_s"] == pytest.approx(3 * 2 * send, rel=1e-12)


@pytest.mark.parametrize("zero, params_b, grads_b, optim_b", [
    (0, 2, 2, 12), (1, 2, 2, 6), (2, 2, 1, 6), (3, 1, 1, 6)])
def test_zero_memory_split(zero, params_b, grads_b, optim_b):
    """Rajbhandari et al. 2020, Sec. 5: bytes per parameter on each of 2 ranks."""
    p = 2 * 10**6
    g = toy_graph(layers=2, params=p // 2)
    e = _est(g, toy_cluster(devices_per_node=2), Strategy(dp=2, global_batch=2, zero=zero))
    mem = e.stages[0].memory
    assert (mem.params_bytes, mem.grads_bytes, mem.optimizer_bytes) == (
        params_b * p, grads_b * p, optim_b * p)


#: What autoplan.parallelize runs at bf16 (autoplan.precision): FSDP2's policy over fp32
#: master weights, gradients reduced in fp32
FSDP2_PROGRAM = dict(autocast=False, loss_fp32_copy=False, master_weights="fsdp2",
                     grad_reduce_dtype="fp32", overlap_grad_reduce=False,
                     overlap_param_gather=False, step_loss_all_reduce=False)


@pytest.mark.parametrize("zero, micro_batches, params_b, grads_b, optim_b", [
    (0, 1, 4 + 2, 4, 8),            # replicate: everything whole, bf16 copies for the step
    (1, 1, 4 / 2 + 2, 4 / 2, 8 / 2),    # one micro-batch: gradients reduce-scattered at once
    (1, 2, 4 / 2 + 2, 4, 8 / 2),    # two: fp32 gradients accumulate whole before it
    (2, 2, 4 / 2 + 2, 4 / 2, 8 / 2),
    (3, 2, 4 / 2, 4 / 2, 8 / 2)])   # ZeRO-3's bf16 copies are the gathered-layer buffers
def test_fsdp2_mixed_precision_memory_split(zero, micro_batches, params_b, grads_b, optim_b):
    """FSDP2 holds the fp32 master weights as the (sharded) parameters and their bf16
    compute copies for the step (ZeRO-0/1/2); gradients and Adam's moments in fp32."""
    p = 2 * 10**6
    g = toy_graph(layers=2, params=p // 2)
    e = _est(g, toy_cluster(devices_per_node=2),
             Strategy(dp=2, global_batch=2 * micro_batches, micro_batch=1, zero=zero),
             CostOptions(**FSDP2_PROGRAM))
    mem = e.stages[0].memory
    assert (mem.params_bytes, mem.grads_bytes, mem.optimizer_bytes) == pytest.approx(
        (params_b * p, grads_b * p, optim_b * p), rel=1e-12)


def test_fsdp2_mixed_precision_reduces_fp32_gradients_and_gathers_bf16_weights():
    """The data-parallel collectives move the gradients at the reduction dtype's 4 bytes
    and the gathered weights at bf16's 2 (ring all-reduce, all-gather: Thakur et al.)."""
    params = 10**6
    g = toy_graph(layers=2, fwd_flops=10**9, params=params)
    c = toy_cluster(devices_per_node=2)
    opts = CostOptions(**FSDP2_PROGRAM, zero_buffer_copies=False)
    e = _est(g, c, Strategy(dp=2, global_batch=2), opts)
    assert e.breakdown["dp_comm_s"] == pytest.approx(2 * (2 - 1) / 2 * 2 * params * 4 / 1e11,
                                                     rel=1e-12)
    bf16 = _est(g, c, Strategy(dp=2, global_batch=2),
                CostOptions(**{**FSDP2_PROGRAM, "grad_reduce_dtype": "bf16"},
                            zero_buffer_copies=False))
    assert bf16.breakdown["dp_comm_s"] == pytest.approx(e.breakdown["dp_comm_s"] / 2, rel=1e-12)
    # fp32 plans reduce fp32 whatever the stack says
    fp32 = _est(g, c, Strategy(dp=2, global_batch=2, precision="fp32"),
                CostOptions(**{**FSDP2_PROGRAM, "grad_reduce_dtype": "bf16"},
                            zero_buffer_copies=False))
    assert fp32.breakdown["dp_comm_s"] == pytest.approx(e.breakdown["dp_comm_s"], rel=1e-12)


def test_activation_memory_in_flight_and_reserve():
    saved = 10**8
    g = toy_graph(layers=2, params=10**3, saved_bytes=saved)
    e = _est(g, toy_cluster(devices_per_node=2), Strategy(pp=2, global_batch=4))
    k = load_constants().memory
    first = e.stages[0].memory
    assert first.activations_bytes == pytest.approx(2 * saved)       # 1F1B: rank 0 holds pp = 2
    allocated = first.total_bytes - first.reserve_bytes
    assert first.reserve_bytes == pytest.approx(
        k.runtime_reserved_bytes + k.allocator_fragmentation_fraction * allocated)


def test_tensor_parallel_all_reduce_and_sharding():
    g = toy_graph(layers=2, fwd_flops=10**9, params=10**6, saved_bytes=4 * 10**6,
                  tp_allreduce_bytes=10**8)
    e = _est(g, toy_cluster(devices_per_node=2), Strategy(tp=2, global_batch=1))
    ar = 2 * (2 - 1) / 2 * 1e8 / 1e11                   # one ring all-reduce per block
    assert e.breakdown["tp_comm_s"] == pytest.approx(2 * ar, rel=1e-12)
    assert e.breakdown["compute_s"] == pytest.approx(2 * (FWD_S + BWD_S) / 2, rel=1e-12)
    assert e.stages[0].memory.params_bytes == pytest.approx(2 * 10**6 * 2 / 2)
    assert e.stages[0].memory.activations_bytes == pytest.approx(2 * 4e6 / 2)


def test_full_recompute_adds_one_forward():
    g = toy_graph(layers=2, fwd_flops=10**9, params=10**3)
    e = _est(g, toy_cluster(devices_per_node=1), Strategy(global_batch=1, recompute="full"))
    assert e.breakdown["recompute_s"] == pytest.approx(2 * FWD_S, rel=1e-12)
    assert e.hardware_flops_per_step == pytest.approx(e.model_flops_per_step * 4 / 3)


def test_schedule_formulas():
    # Narayanan et al. 2021: (m + p - 1) t for 1F1B, bubble / v for interleaving
    assert pipeline_time(Schedule.ONE_F_ONE_B, [1.0] * 4, 8) == 11.0
    assert pipeline_time(Schedule.GPIPE, [1.0] * 4, 8) == 11.0
    assert pipeline_time(Schedule.INTERLEAVED, [1.0] * 4, 8, virtual_stages=3) == 9.0
    assert pipeline_time(Schedule.ONE_F_ONE_B, [2.0], 5) == 10.0
    assert bubble_fraction(Schedule.INTERLEAVED, pp=4, m=8, virtual_stages=3) == 3 / 24
    # Korthikanti et al. 2022 Sec. 4.2.3: the first rank holds pp (1 + (pp-1)/(pp v))
    assert in_flight(Schedule.INTERLEAVED, 0, pp=4, m=16, virtual_stages=2) == \
        pytest.approx(4 * (1 + 3 / 8))
    assert in_flight(Schedule.GPIPE, 2, pp=4, m=16) == 16
    assert in_flight(Schedule.ZERO_BUBBLE, 3, pp=4, m=16) == 4


def test_strategy_and_plan_are_one_engine():
    g = toy_graph(layers=4, params=10**4, saved_bytes=10**6, stream_bytes=10**6,
                  tp_allreduce_bytes=10**6)
    c = toy_cluster(devices_per_node=4, nodes=2)
    s = Strategy(dp=2, tp=2, pp=2, global_batch=8, zero=1, recompute="selective",
                 sequence_parallel=True)
    plan = Plan.from_strategy(g, c, s)
    assert estimate(g, c, s) == estimate_plan(g, c, plan)
    assert Plan.from_json(plan.with_estimate(estimate(g, c, s)).to_json()).estimate == \
        estimate(g, c, s)


def test_degenerate_and_invalid_layouts():
    g = toy_graph(layers=2)
    c = toy_cluster(devices_per_node=2)
    with pytest.raises(StrategyError, match="devices"):
        _est(g, c, Strategy(dp=4, global_batch=4))
    with pytest.raises(StrategyError, match="blocks"):
        _est(g, toy_cluster(devices_per_node=4), Strategy(pp=4, global_batch=4))
    one = _est(toy_graph(layers=1), toy_cluster(devices_per_node=1), Strategy(global_batch=1))
    assert one.step_time_s > 0 and math.isfinite(one.mfu)
    assert split_layers(g, 2) == [["blocks.0"], ["blocks.1"]]


def test_estimate_round_trips_and_reports():
    e = _est(toy_graph(layers=2), toy_cluster(devices_per_node=2), Strategy(pp=2, global_batch=2))
    assert Estimate.from_json(e.to_json()) == e
    table = e.stage_table()
    assert list(table["rank"]) == [0, 1] and table["fits"].all()
    assert "breakdown" in e.report() and "GiB" in e.summary()


def _two_speed_cluster():
    """One fast node (2e12 FLOP/s) and one slow node (1e12), one device each."""
    from autoplan.cost.toy import toy_profile
    from autoplan.hardware import NodeGroup, compose_cluster
    fast = toy_profile(name="fast", devices_per_node=1, peak_flops_per_s=2e12,
                       inter_bw_bytes_per_s=1e10)
    slow = toy_profile(name="slow", devices_per_node=1, peak_flops_per_s=1e12,
                       inter_bw_bytes_per_s=1e10)
    return compose_cluster([NodeGroup(fast, 1), NodeGroup(slow, 1)], name="two-speed")


def test_heterogeneous_replicas_the_slowest_sets_the_step():
    import dataclasses
    g = toy_graph(layers=2, fwd_flops=10**9, params=10**3)
    c = _two_speed_cluster()
    s = Strategy(dp=2, global_batch=4)
    e = _est(g, c, s)
    slow_mb = 2 * (FWD_S + BWD_S)                     # both layers on the slow device
    assert e.breakdown["compute_s"] == pytest.approx(2 * slow_mb, rel=1e-12)
    assert e.stages[0].device_type == "SLOW"
    # give the fast replica three of the four sequences: 3 x slow_mb / 2 on it, 1 x on the other
    plan = Plan.from_strategy(g, c, s)
    uneven = dataclasses.replace(plan, replica_batch=(3, 1), num_micro_batches=3)
    u = estimate_plan(g, c, uneven, options=NO_OVERLAP, calibration=None)
    assert u.breakdown["compute_s"] == pytest.approx(3 * slow_mb / 2, rel=1e-12)
    assert u.step_time_s < e.step_time_s
    assert any("replica" in n for n in u.notes)


def test_sequence_parallel_norm_gradients_are_reduced_once_per_step():
    # under sequence parallelism the norms (here 2 tensors of 1000 elements per block) see
    # a sequence shard; their partial gradients are all-reduced over tp once per step, whatever
    # the micro-batches: all in one all-reduce without FSDP2, each in its own where FSDP2
    # wraps the rank (the autoplan stack), all in one under Megatron-Core's
    import dataclasses

    g = toy_graph(layers=2, fwd_flops=10**9, params=10**6)
    g = dataclasses.replace(g, layers=tuple(
        dataclasses.replace(l, tp=dataclasses.replace(l.tp, sp_replicated_params=(1000, 1000)))
        for l in g.layers))
    lat = 1e-5
    grad = load_constants().model_states.mixed_grad_bytes     # bf16 mixed precision

    def ring(nbytes: float) -> float:       # two tp ranks: 2 steps, half the bytes each way
        return 2 * lat + nbytes / 1e11

    def tp_comm(strategy: Strategy, stack: str = "autoplan") -> float:
        c = toy_cluster(devices_per_node=strategy.dp * strategy.tp, latency_s=lat)
        return _est(g, c, strategy, CostOptions(**HAND, stack=stack, overlap_grad_reduce=False,
                                                overlap_param_gather=False)).breakdown["tp_comm_s"]

    for mb in (1, 2):
        alone = Strategy(tp=2, sequence_parallel=True, global_batch=2, micro_batch=mb)
        assert tp_comm(alone) == pytest.approx(ring(4 * 1000 * grad), rel=1e-12)
        assert tp_comm(dataclasses.replace(alone, sequence_parallel=False)) == 0.0
    wrapped = Strategy(dp=2, tp=2, zero=1, sequence_parallel=True, global_batch=4)
    assert tp_comm(wrapped) == pytest.approx(4 * ring(1000 * grad), rel=1e-12)
    assert tp_comm(wrapped, "megatron-core") == pytest.approx(ring(4 * 1000 * grad), rel=1e-12)


def test_zero1_step_collectives_one_per_wrapped_layer():
    """ZeRO-1's once-per-step reduce-scatter and all-gather: FSDP2 (the ``autoplan`` stack)
    issues one of each per wrapped block, each paying the collective's latency; a bucketing
    stack (``zero_step_per_layer=False``, Megatron's distributed optimizer) one over all the
    blocks.  The bytes are the same; the difference is the latency of the extra calls."""
    layers, params, latency = 3, 10**6, 1e-3
    g = toy_graph(layers=layers, fwd_flops=10**9, params=params)
    c = toy_cluster(devices_per_node=4, latency_s=latency)
    s = Strategy(dp=4, zero=1, global_batch=4)
    base = dict(overlap_grad_reduce=False, overlap_param_gather=False, zero_buffer_copies=False,
                step_loss_all_reduce=False)
    per_layer = _est(g, c, s, CostOptions(**HAND, zero_step_per_layer=True, **base))
    bucketed = _est(g, c, s, CostOptions(**HAND, zero_step_per_layer=False, **base))
    ring_steps = 4 - 1
    extra = (layers - 1) * 2 * ring_steps * latency      # reduce-scatter + all-gather per block
    assert per_layer.breakdown["dp_comm_s"] - bucketed.breakdown["dp_comm_s"] == \
        pytest.approx(extra, rel=1e-9)
    # the bucketed figure by hand: one reduce-scatter of the bf16 gradients and one
    # all-gather of the parameters, 3/4 of the bytes each over the link, 3 latencies each
    nbytes = layers * params * 2
    by_hand = 2 * (ring_steps * latency + 3 / 4 * nbytes / 1e11)
    assert bucketed.breakdown["dp_comm_s"] == pytest.approx(by_hand, rel=1e-9)
    assert CostOptions(**HAND).zero_step_per_layer
    assert not CostOptions(**HAND, stack="megatron-core").zero_step_per_layer


def test_the_steps_loss_all_reduce_is_one_small_all_reduce_over_every_rank():
    """The ``autoplan`` stack ends every step with the mean loss all-reduced over all the
    ranks of the job (``ParallelModel.step``): one 16-byte all-reduce over the whole world,
    whatever the layout, in the data-parallel communication; other stacks leave it out."""
    latency = 1e-3
    g = toy_graph(layers=8, fwd_flops=10**9, params=10**6)
    c = toy_cluster(devices_per_node=8, latency_s=latency)
    for s in (Strategy(dp=8, global_batch=8), Strategy(dp=2, tp=2, pp=2, global_batch=8),
              Strategy(pp=8, global_batch=8, micro_batch=1)):
        on = _est(g, c, s, CostOptions(**HAND, step_loss_all_reduce=True, overlap_grad_reduce=False))
        off = _est(g, c, s, CostOptions(**HAND, step_loss_all_reduce=False, overlap_grad_reduce=False))
        # a ring over 8 ranks: 2 x 7 steps of latency and 2 x 7/8 of the 16 bytes each way
        by_hand = 2 * 7 * latency + 2 * 7 / 8 * 16 / 1e11
        assert on.step_time_s - off.step_time_s == pytest.approx(by_hand, rel=1e-9), s
        assert on.breakdown["dp_comm_s"] - off.breakdown["dp_comm_s"] == \
            pytest.approx(by_hand, rel=1e-9)
        assert sum(on.breakdown.values()) == pytest.approx(on.step_time_s, rel=1e-12)
    assert CostOptions(**HAND).step_loss_all_reduce
    assert not any(CostOptions(**HAND, stack=name).step_loss_all_reduce
                   for name in ("megatron-2021", "megatron-core", "deepspeed-zero3", "fsdp"))
