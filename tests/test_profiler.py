"""The profiler: fitting and profile building on synthetic data, and a real quick run."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest

import yaml

from autoplan.hardware import (IntraNodeTopology, NodeGroup, available_profiles, compose_cluster,
                               load_cluster, load_profile)
from autoplan.hardware.profiles import parse_profile, profile_to_yaml
from autoplan.errors import ProfileError
from autoplan.hardware import EfficiencyTable
from autoplan.profiling import main
from autoplan.profiling.attention import (ATTENTION_HEADS, attention_call, qk_flops,
                                          tabulate_attention)
from autoplan.profiling.build import build_profile, profile_summary
from autoplan.profiling.collectives import fit_alpha_beta, p2p_partner
from autoplan.profiling.parallel import TP_PAIR_ROUNDS
from autoplan.profiling.timing import ProfilingFailed
from runtime_cases import synthetic_measurements


def test_fit_recovers_exact_alpha_beta():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    a, b = fit_alpha_beta(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert a == pytest.approx(50e-6, rel=1e-9)
    assert b == pytest.approx(1 / 2e9, rel=1e-9)


def test_fit_never_returns_negative_latency_or_bandwidth():
    # a noisy small size would give a negative intercept: fall back to a fit through 0
    a, b = fit_alpha_beta([1e3, 1e6, 2e6], [1e-9, 1e-3, 2e-3])
    assert a == 0.0 and b > 0
    # decreasing times: bandwidth from the largest size
    a, b = fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3])
    assert a >= 0 and b > 0
    a, b = fit_alpha_beta([1e6], [1e-3])
    assert (a, b) == (0.0, 1e-9)


def test_fit_keeps_the_latency_of_a_latency_bound_collective():
    """gloo's collectives on a CPU host are latency-bound over the sizes a quick profile
    measures, and noisy: a larger size measured faster must not turn the slope negative and
    the latency to 0 (pricing a 1 KiB all-gather at nothing); times are pooled monotone."""
    sizes = [2**10, 2**14, 2**18, 2**21]
    times = [3.86e-3, 3.98e-3, 4.88e-3, 3.94e-3]    # measured: 4 ranks sharing 2 cores
    a, b = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(4.0e-3, rel=0.05) and b > 0
    assert a + b * sizes[-1] == pytest.approx(4.45e-3, rel=0.05)  # the pooled 2 larger sizes
    # order of the points does not matter
    assert fit_alpha_beta(sizes[::-1], times[::-1]) == pytest.approx((a, b))


def test_build_profile_from_measurements():
    profile, measurements = build_profile("local-test", synthetic_measurements(), cuda=False,
                                          nproc=2, threads=1, devices_per_node=2, quick=True,
                                          copy_bytes=2**20)
    d, node = profile.device, profile.node
    assert d.peak_flops_per_s == {"fp32": pytest.approx(1e10, rel=1e-12)}
    assert [p[1] for p in d.matmul_efficiency["fp32"].points] == pytest.approx([0.5, 1.0, 1.0])
    assert d.memory_bytes == 4 * 2**30  # RAM shared by the 2 ranks
    assert d.memory_bw_bytes_per_s == pytest.approx(4e9, rel=1e-12)
    assert node.topology is IntraNodeTopology.SHARED_MEMORY and node.devices_per_node == 2
    assert node.bw_unidir_bytes_per_s == pytest.approx(2e9, rel=1e-9)
    assert node.latency_s == pytest.approx(100e-6, rel=1e-6)
    eff = node.collective_efficiency
    assert (eff.all_reduce, eff.all_gather, eff.broadcast) == (
        pytest.approx(0.5, rel=1e-9), pytest.approx(0.25, rel=1e-9), pytest.approx(1.0, rel=1e-9))
    assert profile.network is None
    assert "measured by `autoplan profile --quick`" in d.source
    assert d.architecture == "cpu"     # keys the fitted figures (none for CPUs: kept as measured)
    assert set(measurements["collective_fits"]) == set(synthetic_measurements()["comm"])


def test_build_profile_keeps_each_collectives_own_latency():
    """Each operation steps at its own fitted latency (gloo's all-reduce costs several times a
    send per step on a CPU host); the hop latency stays the median; the cluster prices each
    collective with its own, and the profile round-trips through YAML with them."""
    raw = synthetic_measurements()
    # all_reduce (2 steps at 2 ranks): 900 us more per step than the others' 100 us
    raw["comm"]["all_reduce"] = [[s, t + 2 * 900e-6] for s, t in raw["comm"]["all_reduce"]]
    profile, measurements = build_profile("local-test", raw, cuda=False, nproc=2, threads=1,
                                          devices_per_node=2, quick=True, copy_bytes=2**20)
    node = profile.node
    lat = node.collective_latency
    assert lat is not None and "fitted latency" in lat.source
    assert lat.all_reduce == pytest.approx(1000e-6, rel=1e-6)
    for op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p"):
        assert lat.of(op) == pytest.approx(100e-6, rel=1e-6)
        assert lat.of(op) == measurements["collective_fits"][op]["latency_per_step_s"]
    assert node.latency_s == pytest.approx(100e-6, rel=1e-6)       # the median
    cluster = compose_cluster([NodeGroup(profile, 1)])
    # ring all-reduce over 2 ranks: 2 steps at its own latency + S / bus bandwidth (1e9 B/s)
    assert cluster.collective_time("all_reduce", [0, 1], 2**20) == pytest.approx(
        2 * 1000e-6 + 2**20 / 1e9, rel=1e-6)
    assert cluster.collective_time("p2p", [0, 1], 2**20) == pytest.approx(
        100e-6 + 2**20 / 2e9, rel=1e-6)
    assert parse_profile(yaml.safe_load(profile_to_yaml(profile))) == profile
    # the source says how the ranks timed them: back to back here, after a matmul if they say so
    assert "matmul" not in lat.source
    timed_after, _ = build_profile("local-test", {**raw, "comm_after_compute": True}, cuda=False,
                                   nproc=2, threads=1, devices_per_node=2, quick=True,
                                   copy_bytes=2**20)
    assert "after a 134-MFLOP matmul" in timed_after.node.collective_latency.source
    assert "every pair" not in timed_after.node.collective_latency.source
    pairs, _ = build_profile("local-test", {**raw, "shares_cores": True}, cuda=False,
                             nproc=2, threads=1, devices_per_node=2, quick=True,
                             copy_bytes=2**20)
    assert "p2p after a 134-MFLOP matmul, every pair of ranks at once" in \
        pairs.node.collective_latency.source
    # and that a rank's own work is timed free-running with every rank busy there
    assert all("each rank free-running, every rank busy" in t.source
               for t in pairs.device.matmul_efficiency.values())
    assert not any("free-running" in t.source
                   for t in timed_after.device.matmul_efficiency.values())


def test_build_profile_keeps_the_slowest_ranks_operator_overhead():
    """Each figure of the operator overhead is the slowest rank's, as the matmuls are; the
    profile round-trips through YAML with it."""
    per_rank = [{"forward_s": 10e-6, "backward_s": 30e-6, "tp_linear_forward_s": 200e-6,
                 "tp_linear_backward_s": 500e-6, "selective_dispatch_s": 150e-6,
                 "optimizer_param_s": 40e-6, "optimizer_dtensor_param_s": 190e-6,
                 "forward_dispatch_s": 5e-6, "backward_node_s": 8e-6},
                {"forward_s": 12e-6, "backward_s": 25e-6, "tp_linear_forward_s": 150e-6,
                 "tp_linear_backward_s": 600e-6, "selective_dispatch_s": 170e-6,
                 "optimizer_param_s": 35e-6, "optimizer_dtensor_param_s": 210e-6,
                 "forward_dispatch_s": 6e-6, "backward_node_s": 7e-6}]
    profile, _ = build_profile("local-test", synthetic_measurements(overhead=per_rank),
                               cuda=False, nproc=2, threads=1, devices_per_node=2, quick=True,
                               copy_bytes=2**20)
    o = profile.device.op_overhead
    assert (o.forward_s, o.backward_s, o.tp_linear_forward_s, o.tp_linear_backward_s,
            o.selective_dispatch_s, o.optimizer_param_s, o.optimizer_dtensor_param_s) == \
        (12e-6, 30e-6, 200e-6, 600e-6, 170e-6, 40e-6, 210e-6)
    assert (o.forward_dispatch_s, o.backward_node_s) == (6e-6, 8e-6)
    assert o.selective_s == 0.0   # the per-captured-operator figure of older profiles
    assert "per autograd node" in o.source and "28 a block" in o.source
    assert "fused AdamW step autoplan.parallelize builds, over 32" in o.source
    # tensor-parallel linears: on pairs of ranks wherever the ranks pair up, whether or not
    # they share cores; on one-rank meshes where they do not (an odd number of ranks)
    shared, _ = build_profile("local-test", {**synthetic_measurements(overhead=per_rank),
                                             "shares_cores": True},
                              cuda=False, nproc=2, threads=1, devices_per_node=2, quick=True,
                              copy_bytes=2**20)
    for p in (profile, shared):
        assert "on two-rank groups, every pair at once" in p.device.op_overhead.source
        assert f"the median of {TP_PAIR_ROUNDS} rounds" in p.device.op_overhead.source
    odd, _ = build_profile("local-test", synthetic_measurements(3, overhead=per_rank * 2),
                           cuda=False, nproc=3, threads=1, devices_per_node=3, quick=True,
                           copy_bytes=2**20)
    assert "on a one-rank mesh, plus the functional" in odd.device.op_overhead.source
    text = profile_to_yaml(profile)
    assert parse_profile(yaml.safe_load(text)) == profile
    # a profile written before the optimizer's figures were measured loads with 0 for them
    old = yaml.safe_load(text)
    for key in ("optimizer_param_s", "optimizer_dtensor_param_s", "forward_dispatch_s",
                "backward_node_s"):
        del old["device"]["op_overhead"][key]
    o_old = parse_profile(old).device.op_overhead
    assert (o_old.optimizer_param_s, o_old.optimizer_dtensor_param_s) == (0.0, 0.0)
    assert (o_old.forward_dispatch_s, o_old.backward_node_s) == (0.0, 0.0)
    assert o_old.forward_s == o.forward_s
    # one written when selective recompute was measured per captured operator keeps that
    older = yaml.safe_load(text)
    older["device"]["op_overhead"]["selective_s"] = 210e-6
    del older["device"]["op_overhead"]["selective_dispatch_s"]
    o_older = parse_profile(older).device.op_overhead
    assert (o_older.selective_s, o_older.selective_dispatch_s) == (pytest.approx(210e-6), 0.0)
    # measurements without it (profiles written before it was measured): none
    plain, _ = build_profile("local-test", synthetic_measurements(), cuda=False, nproc=2,
                             threads=1, devices_per_node=2, quick=True, copy_bytes=2**20)
    assert plain.device.op_overhead is None


def _cpu_reference_profile(**figures: float):
    """``(measured, profile)``: synthetic two-rank CPU measurements with a host overhead
    (``figures`` added to it) and the profile built from them, without layer scales."""
    overhead = {"forward_s": 10e-6, "backward_s": 30e-6, "tp_linear_forward_s": 0.0,
                "tp_linear_backward_s": 0.0, "forward_dispatch_s": 5e-6,
                "backward_node_s": 8e-6, **figures}
    measured = synthetic_measurements(overhead=[overhead] * 2)
    plain, _ = build_profile("local-test", measured, cuda=False, nproc=2, threads=1,
                             devices_per_node=2, quick=True, copy_bytes=2**20)
    return measured, plain


def test_layer_scales_are_the_reference_blocks_measured_over_priced():
    """The layer scales are the reference blocks' measured forward and backward over the
    cost model's price for them from the profile's own figures: made-up measurements at
    1.3 and 0.9 times that price give scales 1.3 and 0.9, the slowest rank's deciding;
    a profile whose ranks did not time them has none."""
    from autoplan.profiling.reference import reference_scales
    measured, plain = _cpu_reference_profile()
    assert plain.device.op_overhead.layer_forward_scale is None
    _, _, (fwd, bwd), host = reference_scales(plain.device, (1.0, 1.0))
    assert fwd > 0 and bwd > 0 and host is None
    for i, r in enumerate(measured["ranks"]):
        r["reference"] = [1.3 * fwd * (1 - 0.1 * i), 0.9 * bwd * (1 - 0.1 * i)]
    scaled, _ = build_profile("local-test", measured, cuda=False, nproc=2, threads=1,
                              devices_per_node=2, quick=True, copy_bytes=2**20)
    o = scaled.device.op_overhead
    assert (o.layer_forward_scale, o.layer_backward_scale) == (pytest.approx(1.3),
                                                              pytest.approx(0.9))
    assert "layer scales: 2 such blocks at width 256 on 4 x 128 tokens" in o.source
    # the description names the machine (the reference fit's host scales once took its name)
    assert scaled.description.startswith(f"Measured on {socket.gethostname()}: ")
    assert parse_profile(yaml.safe_load(profile_to_yaml(scaled))) == scaled
    assert o.selective_byte_s == 0.0 and "selective recompute per" not in o.source
    with pytest.raises(ProfilingFailed, match="no layer scale"):
        reference_scales(plain.device, (0.0, 1.0))


def test_reference_blocks_at_two_shapes_split_the_host_work_from_the_arithmetic():
    """Timed at 4 x 128 and 1 x 32 tokens, the reference blocks' price splits into host
    work (about the same at both) and the rest: made-up timings of 1.1x the rest plus 2x
    the host work (forward) and 0.9x plus 2.5x (backward) give those four figures back.
    The profile states them in its source but prices with the 4 x 128 ratio on both
    (``HOST_SPLIT_NOT_APPLIED``); a profile that sets them (by hand) prices each layer's
    host work at its own scale, as measured at both shapes, and says so in its summary.
    Timings whose split is not positive (the small shape as slow as the large) give no
    split; a stored profile's 1 x 128 timing splits at its own shape."""
    from dataclasses import replace

    from autoplan.profiling.build import profile_summary
    from autoplan.profiling.reference import (HOST_SPLIT_NOT_APPLIED, REFERENCE_SMALL_SHAPE,
                                              _reference_stack, reference_engine, reference_scales)
    measured, plain = _cpu_reference_profile()
    engine = reference_engine(plain.device)
    small_engine = reference_engine(plain.device, REFERENCE_SMALL_SHAPE)
    # a micro-batch of one dispatches a few operators less (views that are no-ops)
    hosts = {4: engine.model_host_s(), 1: small_engine.model_host_s()}
    large = engine.model_compute_s(4)
    small = small_engine.model_compute_s(REFERENCE_SMALL_SHAPE[0])
    assert hosts[1][0] > 0 and hosts[1][1] > 0 and small[0] < large[0] / 8

    def timing(priced, arithmetic, host_scale, i, b=None):
        host = hosts[b or (4 if priced is large else 1)]
        return arithmetic * (priced[i] - host[i]) + host_scale * host[i]

    timed = (timing(large, 1.1, 2.0, 0), timing(large, 0.9, 2.5, 1),
             timing(small, 1.1, 2.0, 0), timing(small, 0.9, 2.5, 1))
    fwd, bwd, _, split = reference_scales(plain.device, timed, engine)
    assert (fwd, bwd) == (pytest.approx(1.1), pytest.approx(0.9))
    assert split == (pytest.approx(2.0), pytest.approx(2.5))
    for r in measured["ranks"]:
        r["reference"] = [*timed[:2], 0.0, *timed[2:]]
    stated, _ = build_profile("local-test", measured, cuda=False, nproc=2, threads=1,
                              devices_per_node=2, quick=True, copy_bytes=2**20)
    o = stated.device.op_overhead
    assert (o.layer_forward_scale, o.layer_backward_scale) == (
        pytest.approx(timed[0] / large[0]), pytest.approx(timed[1] / large[1]))
    assert o.host_forward_scale is None and o.host_backward_scale is None
    assert "on 1 x 32 tokens timed whole" in o.source
    assert ("would scale the layers x1.100 forward, x0.900 backward and their host work "
            "x2.000, x2.500 (not applied: " + HOST_SPLIT_NOT_APPLIED) in " ".join(o.source.split())
    assert "host work x" not in profile_summary(stated, Path("p.yaml"), 1.0)
    assert parse_profile(yaml.safe_load(profile_to_yaml(stated))) == stated
    profile = replace(stated, device=replace(stated.device, op_overhead=replace(
        o, layer_forward_scale=1.1, layer_backward_scale=0.9, host_forward_scale=2.0,
        host_backward_scale=2.5)))
    assert "host work x2.00, x2.50" in profile_summary(profile, Path("p.yaml"), 1.0)
    assert parse_profile(yaml.safe_load(profile_to_yaml(profile))) == profile
    # a profile with the host scales set prices the reference as measured at both shapes
    import torch
    from autoplan.capture import trace
    from autoplan.cost.engine import CostEngine
    cluster = compose_cluster([NodeGroup(replace(engine.cluster.profile_of(0),
                                                 device=profile.device), 1)])
    for shape, price in (((4, 128), large), (REFERENCE_SMALL_SHAPE, small)):
        stack, x = _reference_stack(torch, shape)
        graph = trace(stack, example_inputs=x, loss_fn=lambda out, *_: out.sum())
        priced = CostEngine(graph, cluster, calibration=None)
        assert priced.model_compute_s(shape[0]) == (
            pytest.approx(timing(price, 1.1, 2.0, 0)), pytest.approx(timing(price, 0.9, 2.5, 1)))
    # a stored profile's second timing at one sequence of 128 tokens: split at that shape
    # (priced on the 4 x 128 capture, as the code of its day did)
    at_128 = engine.model_compute_s(1)
    _, _, _, split = reference_scales(
        plain.device, (*timed[:2], timing(at_128, 1.1, 2.0, 0, 4),
                       timing(at_128, 0.9, 2.5, 1, 4)), engine, small_shape=(1, 128))
    assert split == (pytest.approx(2.0), pytest.approx(2.5))
    # no positive split: the large shape's ratio scales both, no host scales
    fwd, bwd, _, split = reference_scales(plain.device, (large[0], large[1], 4 * large[0],
                                                         4 * large[1]), engine)
    assert split is None and (fwd, bwd) == (pytest.approx(1.0), pytest.approx(1.0))
    assert reference_scales(plain.device, (large[0], large[1], 0.0, small[1]),
                            engine)[3] is None


def test_selective_byte_figure_is_the_reference_extra_less_its_operators_per_byte():
    """``selective_byte_s``: the reference blocks' extra under a selective checkpoint that
    recomputes nothing, less their dispatched operators at ``selective_dispatch_s``, over
    the bytes they save without recompute; the slowest rank's extra decides; never below
    0; in the YAML and the profile's summary."""
    from autoplan.profiling.reference import (REFERENCE_SHAPE, reference_engine, reference_scales,
                                              reference_selective_byte_s)
    from autoplan.strategy import Recompute
    measured, plain = _cpu_reference_profile(selective_dispatch_s=100e-6)
    engine = reference_engine(plain.device)
    blocks = [l for l in engine.summary.layers if l.is_block]
    ops = sum(l.dispatched_ops for l in blocks)
    nbytes = sum(engine.activation_bytes(l, 1, False, Recompute.NONE, 1)
                 for l in blocks) * REFERENCE_SHAPE[0] * 4 / engine.summary.activation_bytes
    assert ops > 0 and nbytes > 0
    _, _, (fwd, bwd), _ = reference_scales(plain.device, (1.0, 1.0), engine)
    extra = ops * 100e-6 + 2e-9 * nbytes
    for i, r in enumerate(measured["ranks"]):
        r["reference"] = [fwd, bwd, extra * (1 - 0.2 * i)]
    profile, _ = build_profile("local-test", measured, cuda=False, nproc=2, threads=1,
                               devices_per_node=2, quick=True, copy_bytes=2**20)
    o = profile.device.op_overhead
    assert o.selective_byte_s == pytest.approx(2e-9)
    assert "recomputing nothing" in o.source
    assert parse_profile(yaml.safe_load(profile_to_yaml(profile))) == profile
    assert "+2.00 ns per activation byte" in profile_summary(profile, Path("p.yaml"), 1.0)
    # less than the operators' own figure: 0
    assert reference_selective_byte_s(plain.device, ops * 50e-6, engine)[0] == 0.0


def test_optimizer_overhead_is_per_parameter_tensor_and_element():
    """The optimizer's figures are one step of the optimizer autoplan.parallelize builds
    (a fused AdamW): over tiny tensors, per tensor (the DTensor figure needs a process
    group: 0 without one); over large ones, less that, per element."""
    import torch

    from autoplan.profiling.overhead import (OPTIMIZER_LARGE, OPTIMIZER_TENSORS,
                                             measure_optimizer_overhead)

    steps = []

    def timed(fn):
        fn()
        steps.append(fn)
        return 0.0032 if len(steps) == 1 else 0.0121

    plain, dtensor, element = measure_optimizer_overhead(torch, timed)
    count, size = OPTIMIZER_LARGE
    assert (plain, dtensor) == (pytest.approx(0.0032 / OPTIMIZER_TENSORS), 0.0)
    assert element == pytest.approx((0.0121 / count - 0.0032 / OPTIMIZER_TENSORS) / size)
    for fn, n, numel in ((steps[0], OPTIMIZER_TENSORS, 8), (steps[1], count, size)):
        opt = fn.__self__
        assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"]
        params = opt.param_groups[0]["params"]
        assert len(params) == n and all(p.numel() == numel for p in params)
        assert int(opt.state[params[0]]["step"]) == 1     # it stepped


def test_the_overhead_block_has_the_operators_it_counts():
    """``OVERHEAD_BLOCK_OPS`` is what the capture records for one block: the per-captured
    figures are per that unit, the one older graphs are priced by."""
    import torch

    from autoplan.cost.summary import _NOT_OPERATORS
    from autoplan.profiling.overhead import OVERHEAD_BLOCK_OPS, overhead_model

    ep = torch.export.export(overhead_model(torch, 8, 1), (torch.randn(1, 4, 8),))
    targets = [getattr(n.target, "__name__", str(n.target)) if n.target.__module__ == "_operator"
               else str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    ops = [t for t in targets if not any(t.startswith(p) for p in _NOT_OPERATORS)]
    assert len(ops) == OVERHEAD_BLOCK_OPS, ops


def test_the_host_figures_are_per_unit_the_capture_counts():
    """The forward figure is divided by the operators the blocks' forward dispatches and the
    backward figure by the autograd nodes their backward runs, each counted as the capture
    counts a layer's (``dispatched_ops``, ``autograd_nodes``: the capture of the same blocks
    gives the same totals, less what its objective adds); the selective figure by one
    block's dispatched operators.  Both counts exceed the captured operators (``linear``
    dispatches ``t`` + ``addmm``; views have nodes), which the older figures stay per."""
    import torch

    from autoplan import trace
    from autoplan.opstream import DispatchCount, autograd_nodes
    from autoplan.profiling import overhead

    h, k = overhead.OVERHEAD_WIDTH, overhead.OVERHEAD_BLOCKS
    stack = overhead.overhead_model(torch, h, k)
    x = torch.randn(1, 4, h)
    with DispatchCount() as eager:
        y = stack(x.requires_grad_(True))
    nodes = autograd_nodes([y], lambda t: isinstance(t, torch.nn.Parameter))
    with DispatchCount() as one:
        stack[0](x)
    graph = trace(stack, example_inputs=x.detach())
    objective = 1     # the capture's objective: a sum (one operator, one node)
    assert sum(layer.dispatched_ops for layer in graph.layers) == eager.total + objective
    assert sum(layer.autograd_nodes for layer in graph.layers) == nodes + objective
    assert eager.total == k * one.total
    assert one.total > overhead.OVERHEAD_BLOCK_OPS and nodes > k * overhead.OVERHEAD_BLOCK_OPS

    # forward, forward + backward, one block, selective, split backward, whole backward
    calls = iter([0.28, 0.84, 0.5, 0.66, 0.9, 0.7])
    got = overhead.measure_op_overhead(torch, lambda fn: next(calls))
    n = overhead.OVERHEAD_BLOCK_OPS * k
    assert got["forward_s"] == pytest.approx(0.28 / n)
    assert got["backward_s"] == pytest.approx(0.56 / n)
    assert got["forward_dispatch_s"] == pytest.approx(0.28 / (eager.total + objective))
    assert got["backward_node_s"] == pytest.approx(0.56 / (nodes + objective))
    assert got["selective_dispatch_s"] == pytest.approx(0.16 / one.total)
    assert got["zero_bubble_node_s"] == pytest.approx(0.2 / (nodes + objective))


def test_matmuls_are_timed_cold_over_sets_that_span_the_cache():
    """Each timed matmul takes the next of distinct operand sets spanning at least the cold
    size, so none finds its operands in cache; every call is a real product."""
    import torch

    from autoplan.profiling.matmul import COLD_BYTES, cold_matmul
    assert COLD_BYTES >= 2 * 32 * 2**20        # twice this machine's last-level cache
    n, per_set = 8, 3 * 8 * 8 * 4
    call = cold_matmul(torch, n, torch.float32, "cpu", 5 * per_set)
    sets = call.sets
    assert len(sets) == 5
    starts = sorted(t.data_ptr() for trio in sets for t in trio)
    assert len(set(starts)) == 15                 # no two sets share memory
    assert all(b - a >= n * n * 4 for a, b in zip(starts, starts[1:]))
    for trio in sets:
        trio[2].zero_()
    for _ in range(len(sets)):
        call()
    for a, b, out in sets:
        torch.testing.assert_close(out, a @ b)
    # at least two sets, however small the cold size
    assert len(cold_matmul(torch, n, torch.bfloat16, "cpu", 1).sets) == 2


def test_cpu_collectives_are_timed_up_to_a_bandwidth_bound_size():
    """Both CPU plans time collectives from 1 KiB to 16 MiB: the fit's slope (the bandwidth)
    needs sizes where bytes, not the per-call latency, take most of the time (on 4 ranks of
    2 cores a 2 MiB all-reduce is still mostly latency)."""
    from autoplan.profiling.plan import MeasurementPlan
    for quick in (True, False):
        sizes = MeasurementPlan.for_machine(cuda=False, quick=quick).comm_sizes_bytes
        assert min(sizes) <= 2**10 and max(sizes) >= 16 * 2**20


def test_ranks_that_share_cores_are_timed_by_the_mean_of_long_batches(monkeypatch):
    """More CPU ranks than cores: every figure is the mean of batches of several calls each
    (a step pays the usual share of the cores); a rank with cores of its own keeps the best
    batch and as few calls as fill the target; CUDA ranks never share."""
    from autoplan.profiling import timing
    monkeypatch.setattr(timing, "usable_cores", lambda: 2)
    assert timing.ranks_share_cores(cuda=False, world=4, threads=1)
    assert timing.ranks_share_cores(cuda=False, world=2, threads=2)
    assert not timing.ranks_share_cores(cuda=False, world=2, threads=1)
    assert not timing.ranks_share_cores(cuda=True, world=8, threads=1)
    # a quick point (60 ms over 3 batches) of a 10 ms call: 2 calls a batch alone,
    # _MIN_SHARED_CALLS where the ranks share cores
    assert timing.calls_per_batch(0.06, 3, 0.01, shares_cores=False) == 2
    assert timing.calls_per_batch(0.06, 3, 0.01, shares_cores=True) == timing._MIN_SHARED_CALLS
    assert timing.calls_per_batch(0.06, 3, 1e-6, shares_cores=True) == 10_000   # capped
    assert timing.calls_per_batch(0.06, 3, 10.0, shares_cores=False) == 1


def test_a_ranks_own_work_where_ranks_share_cores_is_timed_in_free_running_windows(monkeypatch):
    """Where ranks share cores, a rank's own work (no collective inside) is timed in windows
    of its own wall time after a common start, each at least _MIN_FREE_WINDOW_S long
    whatever the point's target: the skew with which ranks leave a barrier is paid once a
    window, not once per short batch.  Each window's figure is the mean over the ranks;
    the fastest window is kept (what else runs on the machine only adds time)."""
    import types

    from autoplan.profiling import timing
    warm = timing.WARMUP_CALLS
    clock = [96.0]
    steps = iter([2.0**-6] * warm + [2.0**-6] * 10 + [2.0**-7] * 20 + [2.0**-6] * 10)
    calls, events = [], []

    def fn():   # the warm-up, then windows of 10, 20 and 10 calls (exact in binary)
        clock[0] += next(steps)
        calls.append(clock[0])

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    got = timing.free_running(fn, lambda: None, 0.06,
                              agreed_mean=lambda v: events.append(("mean", v)) or v * 3,
                              barrier=lambda: events.append(("barrier", len(calls))),
                              windows=3)
    assert timing.MIN_FREE_WINDOW_S == 0.15   # the call counts below assume it
    # a barrier before each window, after the warm-up; each window >= 0.15 s, not 20 ms
    assert [e for e in events if e[0] == "barrier"] == [("barrier", warm),
                                                         ("barrier", warm + 10),
                                                         ("barrier", warm + 30)]
    assert len(calls) == warm + 40
    assert [e[1] for e in events if e[0] == "mean"] == [2.0**-6, 2.0**-7, 2.0**-6]
    assert got == 3 * 2.0**-7                    # the fastest window, as the ranks agreed
    with pytest.raises(StopIteration):           # and nothing more was called
        fn()


def test_usage_errors_return_2(capsys):
    assert main(["--nproc", "0", "--device", "cpu"]) == 2
    assert "--nproc must be at least 1" in capsys.readouterr().err
    assert main(["--no-such-option"]) == 2


def _slowed(raw: dict, factor: float) -> dict:
    """``raw`` with every matmul and copy time times ``factor`` (a slow spell)."""
    import copy
    out = copy.deepcopy(raw)
    for rank in out["ranks"]:
        rank["copy_s"] *= factor
        for points in rank["matmul"].values():
            for point in points:
                point[1] *= factor
    return out


def test_median_of_runs_is_taken_figure_by_figure():
    from autoplan.profiling.build import median_raw
    from autoplan.profiling.timing import ProfilingFailed
    runs = [{"n": 128, "t": [1.0, 5.0], "name": "cpu", "flag": True},
            {"n": 128, "t": [3.0, 4.0], "name": "cpu", "flag": True},
            {"n": 128, "t": [2.0, 9.0], "name": "cpu", "flag": True}]
    got = median_raw(runs)
    assert got == {"n": 128, "t": [2.0, 5.0], "name": "cpu", "flag": True}
    assert isinstance(got["n"], int)       # a figure alike in every run keeps its type
    assert median_raw([{"t": 1.0}, {"t": 2.0}]) == {"t": 1.5}
    with pytest.raises(ProfilingFailed, match="different things"):
        median_raw([{"t": [1.0]}, {"t": [1.0, 2.0]}])
    with pytest.raises(ProfilingFailed, match="different things"):
        median_raw([{"t": 1.0}, {"u": 1.0}])


def test_repeat_keeps_each_figures_median_over_the_runs(tmp_path, monkeypatch, capsys):
    """``autoplan profile --repeat 3``: three runs, one of them in a slow spell; the
    profile is the one the middle run's figures give, and its sources say how it was made."""
    from autoplan import profiling
    raw = synthetic_measurements()
    runs = iter([_slowed(raw, 2.0), raw, _slowed(raw, 1.1)])
    monkeypatch.setattr(profiling, "run_ranks", lambda *args, **kwargs: next(runs))
    out = tmp_path / "median.yaml"
    assert main(["--quick", "--nproc", "2", "--device", "cpu", "--repeat", "3",
                 "--out", str(out)]) == 0
    assert "run 3 of 3" in capsys.readouterr().err
    with pytest.raises(StopIteration):
        next(runs)                                   # each run once
    got = load_cluster(out).device_type_of(0)
    plan = profiling.MeasurementPlan.for_machine(cuda=False, quick=True)
    want, _ = build_profile("median", _slowed(raw, 1.1), cuda=False, nproc=2, threads=1,
                            devices_per_node=2, quick=True, copy_bytes=plan.copy_bytes)
    assert got.peak_flops_per_s == pytest.approx(want.device.peak_flops_per_s)
    assert got.memory_bw_bytes_per_s == pytest.approx(want.device.memory_bw_bytes_per_s)
    assert "--repeat 3" in got.source and "the median of 3 runs" in got.source
    assert "the median of 3 runs" in out.read_text().splitlines()[0]
    assert main(["--device", "cpu", "--repeat", "0"]) == 2
    assert "--repeat must be at least 1" in capsys.readouterr().err


def test_one_device_profile_has_no_collectives_and_loads(tmp_path):
    """A machine of one GPU (or one CPU rank) profiles with --nproc 1: no collective can run,
    none is measured, and the node's link stands at the device's copy bandwidth (a plan of
    one device never uses it); the profile is marked measured and round-trips."""
    raw = synthetic_measurements(world=1)
    raw["comm"] = {}
    profile, measurements = build_profile("one", raw, cuda=False, nproc=1, threads=2,
                                          devices_per_node=1, quick=True, copy_bytes=2**20)
    node = profile.node
    assert node.devices_per_node == 1 and node.latency_s == 0.0
    assert node.bw_unidir_bytes_per_s == pytest.approx(profile.device.memory_bw_bytes_per_s)
    assert "no collective was measured" in node.source
    assert profile.device.measured and "collective_fits" not in measurements
    assert parse_profile(yaml.safe_load(profile_to_yaml(profile))) == profile
    path = tmp_path / "one.yaml"
    path.write_text(profile_to_yaml(profile))
    assert load_cluster(path).num_devices == 1


def test_attention_table_prices_the_measured_calls():
    """The CUDA profile's attention table: 4 QK^T products' FLOPs (what the engine prices a
    causal fused attention's forward and backward at) over the measured time, over the best
    16-bit matmul, for the first (heads, head dim) of the measured shapes; the other shapes
    stay in the measurements only."""
    heads, head_dim = ATTENTION_HEADS[0]
    other = ATTENTION_HEADS[1]
    calls = [(8, heads, 2048, head_dim, 2e-3), (8, other[0], 2048, other[1], 3e-3),
             (2, heads, 8192, head_dim, 6e-3)]
    ranks = [{"attention": calls}, {"attention": [c[:4] + (c[4] * 1.5,) for c in calls]}]
    rows, table = tabulate_attention(ranks, {"bf16": 1e15, "fp32": 1e14}, "measured here")
    assert [r["seconds"] for r in rows] == pytest.approx([3e-3, 4.5e-3, 9e-3])  # slowest rank
    qk = [qk_flops(8, heads, 2048, head_dim), qk_flops(2, heads, 8192, head_dim)]
    assert [p[0] for p in table.points] == qk
    assert [p[1] for p in table.points] == pytest.approx(
        [4 * qk[0] / 3e-3 / 1e15, 4 * qk[1] / 9e-3 / 1e15])
    assert "scaled_dot_product_attention" in table.source
    assert tabulate_attention([{"attention": []}], {"bf16": 1e15}, "x") == ([], None)
    assert tabulate_attention([{}], {"bf16": 1e15}, "x") == ([], None)


def test_attention_call_runs_sdpa_forward_and_backward():
    import torch
    call = attention_call(torch, 2, 2, 16, 8, torch.device("cpu"))
    call()   # gradients returned, nothing accumulated: repeatable
    call()


def test_measured_profile_fields_round_trip_and_reject_bad_values():
    profile, _ = build_profile("local-test", synthetic_measurements(), cuda=False, nproc=2,
                               threads=1, devices_per_node=2, quick=True, copy_bytes=2**20)
    table = EfficiencyTable(((1e9, 0.3), (1e11, 0.6)), source="measured attention")
    from dataclasses import replace
    p2 = replace(profile, device=replace(profile.device, attention_efficiency=table))
    data = yaml.safe_load(profile_to_yaml(p2))
    assert data["device"]["measured"] is True
    assert parse_profile(data) == p2
    data["device"]["measured"] = "maybe"
    with pytest.raises(ProfileError, match="measured.*true or false"):
        parse_profile(data)


def test_p2p_partners():
    """Ranks 0 and 1 alone where each rank has its cores; every pair at once where ranks
    share cores (the others busy, as data-parallel pipelines' stages are)."""
    assert [p2p_partner(r, 4, every_pair=False) for r in range(4)] == [1, 0, None, None]
    assert [p2p_partner(r, 4, every_pair=True) for r in range(4)] == [1, 0, 3, 2]
    assert [p2p_partner(r, 3, every_pair=True) for r in range(3)] == [1, 0, None]
    assert [p2p_partner(r, 2, every_pair=flag) for r in range(2) for flag in (False, True)] \
        == [1, 1, 0, 0]


def _slowest_mean(fn, calls: int, warmup: int) -> float:
    """Seconds per call of ``fn``: the mean of ``calls`` after ``warmup``, the slowest
    rank's (every rank of the default group calls it)."""
    import time

    import torch
    import torch.distributed as dist
    for _ in range(warmup):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = torch.tensor([(time.perf_counter() - t0) / calls])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _tp_overhead_both_ways(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from autoplan.profiling.parallel import measure_tp_overhead

    def timed(fn) -> float:
        return _slowest_mean(fn, calls=20, warmup=3)

    # three rounds of scripted timings (plain forward, plain forward + backward, sharded
    # forward, sharded forward + backward, bare all-reduce): (forward, backward) per
    # linear (1, 3), (2.5, 1), (0.5, 1.5): the medians come from different rounds, and
    # neither is the first, the last or the mean; each function still runs once
    script = iter([0, 0, 2, 8, 0, 0, 0, 5, 7, 0, 0, 0, 1, 4, 0])

    def scripted(fn) -> float:
        fn()
        return next(script)

    returned: list[str] = []

    def recording(fn) -> float:   # what each timed call returns, in order
        returned.append(type(fn()).__name__)
        return 0.0

    own = dist.new_subgroups(group_size=1)[0]
    pair = dist.new_subgroups(group_size=2)[0]
    measure_tp_overhead(torch, dist, recording, own, pair)
    return {"one": measure_tp_overhead(torch, dist, timed, own),
            "pair": measure_tp_overhead(torch, dist, timed, own, pair, rounds=2),
            "median": measure_tp_overhead(torch, dist, scripted, own, pair, rounds=3),
            "returned": returned}


@pytest.mark.distributed
def test_tp_overhead_on_one_rank_and_on_a_pair():
    """Both ways of measuring a tensor-parallel linear's extra time run and give seconds:
    on a one-rank mesh (no collective; funcol's Python side added) and on a real pair
    (its collectives run, one all-reduce each way taken off), the pair's rounds reduced
    to each direction's median."""
    from dist_harness import run
    for got in run(_tp_overhead_both_ways, 2):
        for way in ("one", "pair"):
            fwd, bwd = got[way]
            assert 0 <= fwd < 0.1 and 0 <= bwd < 0.1 and math.isfinite(fwd + bwd), (way, got)
        assert sum(got["one"]) > 0 and sum(got["pair"]) > 0, got   # DTensor is never free
        assert got["median"] == (1.0, 1.5), got   # each direction's median of the rounds
        # the sharded forward is timed to its all-reduce's end: a plain tensor, not one
        # still in flight (timings: plain fwd, plain fwd+bwd, sharded fwd, ..., bare)
        assert got["returned"][2] == "Tensor", got["returned"]


def _tp_byte_overhead(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from autoplan.profiling.parallel import measure_tp_byte_overhead

    def timed(fn) -> float:
        return _slowest_mean(fn, calls=5, warmup=2)

    # one round, the large MLP then the tiny one, each timed as (local forward, local
    # forward + backward, sharded forward, sharded forward + backward, bare all-reduce):
    # extras (2.5, 3.5) and (0.75, 0.75)
    script = iter([1, 3, 4, 10, 0.5, 0, 0, 1, 2, 0.25])

    def scripted(fn) -> float:
        fn()
        return next(script)

    pair = dist.new_subgroups(group_size=2)[0]
    return {"scripted": measure_tp_byte_overhead(torch, dist, scripted, pair),
            "timed": measure_tp_byte_overhead(torch, dist, timed, pair, rounds=1)}


@pytest.mark.distributed
def test_tp_collective_host_work_per_byte():
    """The per-byte figure is the large MLP's extra less the tiny one's, forward and
    backward averaged, over the difference of their payloads (one all-reduce of the MLP's
    output each way), in seconds per byte; measured for real it is finite and >= 0."""
    from dist_harness import run

    from autoplan.profiling.overhead import OVERHEAD_WIDTH
    from autoplan.profiling.parallel import TP_BYTES_SHAPE
    tokens, h = TP_BYTES_SHAPE
    span = 4 * (tokens * h - 4 * OVERHEAD_WIDTH)
    for got in run(_tp_byte_overhead, 2):
        assert got["scripted"] == pytest.approx(((2.5 - 0.75) + (3.5 - 0.75)) / 2 / span)
        assert 0 <= got["timed"] < 1e-6 and math.isfinite(got["timed"]), got


def test_a_split_backward_costs_more_host_time_than_a_whole_one():
    """torch's zero-bubble split (input gradients, then the weights' in a pass of their
    own) over the tiny blocks takes longer than the whole backward: the extra is what the
    profile states per autograd node (``zero_bubble_node_s``)."""
    import time

    import torch

    from autoplan.profiling.overhead import OVERHEAD_WIDTH, _split_backward_extra, overhead_model

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        for _ in range(30):
            fn()
        return (time.perf_counter() - t0) / 30

    stack = overhead_model(torch, OVERHEAD_WIDTH, 4)
    x = torch.randn(1, 4, OVERHEAD_WIDTH).requires_grad_(True)
    assert 0 < _split_backward_extra(torch, stack, x, timed) < 0.05


def _agreed_mean(x: float) -> float:
    """The ranks' mean of ``x`` (what the profiler's workers agree on)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _pipeline_overhead(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from autoplan.profiling.parallel import measure_pipeline_overhead

    pair = dist.new_subgroups(group_size=2)[0]
    return {"once": measure_pipeline_overhead(torch, dist, pair, _agreed_mean, 1.0, rounds=2)}


@pytest.mark.distributed
def test_pipeline_host_work_is_measured_on_a_real_two_stage_pipeline():
    """A two-stage 1F1B of a tiny linear on a pair of ranks runs and costs its ranks CPU
    time beyond the module's own work: the main thread's per stage action and the other
    threads' (gloo's transport) per message end, both agreed over the ranks."""
    from dist_harness import run
    got = run(_pipeline_overhead, 2)
    assert got[0] == got[1], got                       # the ranks' mean: one figure
    action, message = got[0]["once"]
    assert 0 < action < 0.05 and 0 <= message < 0.05, got   # the schedule is never free


def _core_seconds_of_work_and_waits(rank: int, world: int) -> dict:
    import time

    import torch.distributed as dist

    from autoplan.profiling.parallel import core_seconds

    def busy() -> None:   # 4 ms of this thread's CPU
        end = time.thread_time() + 0.004
        while time.thread_time() < end:
            pass

    def asleep() -> None:  # 4 ms of waiting: no CPU
        time.sleep(0.004)

    return {"busy": core_seconds(dist, _agreed_mean, 2.0, busy, calls=5),
            "asleep": core_seconds(dist, _agreed_mean, 2.0, asleep, calls=5)}


@pytest.mark.distributed
def test_core_seconds_count_a_ranks_cpu_not_its_waits():
    """The tensor-parallel figure on ranks that share cores is read in main-thread CPU
    time times the share: work counts (4 ms of CPU a call, share 2: 8 ms), waiting does
    not, and the ranks agree on one figure."""
    from dist_harness import run
    got = run(_core_seconds_of_work_and_waits, 2)
    assert got[0] == got[1], got
    assert 0.0079 < got[0]["busy"] < 0.0095, got
    assert got[0]["asleep"] < 0.001, got


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_cpu_profile_loads_and_is_plausible(tmp_path, monkeypatch):
    """``autoplan profile --quick`` as a user runs it (a new process; one run serves every
    check: a quick profile of 2 ranks takes about a minute on 2 cores)."""
    import os
    import subprocess
    import sys

    # without --out the profile goes to $AUTOPLAN_HOME/profiles (not the checkout), by name
    home = tmp_path / "home"
    proc = subprocess.run([sys.executable, "-m", "autoplan.cli", "profile", "--quick", "--nproc",
                           "2", "--device", "cpu", "--name", "local-test", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "AUTOPLAN_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert "[autoplan profile]" in proc.stderr and "matmul fp32" in proc.stderr  # progress
    assert "Traceback" not in proc.stderr
    # its speed target (<= 20 s on 2 cores) is a benchmark figure, not a timed test
    out = home / "profiles" / "local-test.yaml"
    assert report["path"] == str(out) and report["elapsed_s"] > 0 and out.is_file()
    assert [p.name for p in out.parent.iterdir()] == ["local-test.yaml"]  # no temp file left
    monkeypatch.setenv("AUTOPLAN_HOME", str(home))
    assert load_cluster("local-test").num_devices == 2       # found by name there

    cluster = load_cluster(out)
    assert cluster.num_devices == 2 and cluster.num_nodes == 1
    device = cluster.device_type_of(0)
    assert set(device.peak_flops_per_s) == {"fp32", "bf16"}
    assert 1e8 < device.peak_flops_per_s["fp32"] < 1e14  # 0.1 GFLOP/s .. 100 TFLOP/s per rank
    assert 1e7 < device.peak_flops_per_s["bf16"] < 1e14
    assert 0 < device.efficiency(1e6, "fp32") <= 1
    assert "timed cold" in device.matmul_efficiency["fp32"].source
    assert 2**27 < device.memory_bytes < 2**50
    assert 1e8 < device.memory_bw_bytes_per_s < 1e13
    node = cluster.profiles["local-test"].node
    assert 1e6 < node.bw_unidir_bytes_per_s < 1e12  # gloo through shared memory
    # every byte a collective moves goes through memory: no faster than a copy
    assert node.bw_unidir_bytes_per_s < device.memory_bw_bytes_per_s
    assert 1e-7 < node.latency_s < 0.1
    lat = node.collective_latency   # each collective's own, timed after a matmul
    assert lat is not None and all(0 <= lat.of(op) < 0.1 for op in
                                   ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                    "broadcast", "p2p"))
    t_small = cluster.collective_time("all_reduce", [0, 1], 1e3)
    t_big = cluster.collective_time("all_reduce", [0, 1], 1e8)
    assert 0 < t_small < t_big < 100 and math.isfinite(t_big)
    assert cluster.collective_time("p2p", [0, 1], 1e6) > 0
    o = device.op_overhead     # on CPU the host's time per operator adds to the device's
    assert o is not None and 1e-8 < o.forward_s < 1e-2 and 1e-8 < o.backward_s < 1e-2
    assert 1e-8 < o.forward_dispatch_s < o.forward_s and 1e-8 < o.backward_node_s < 1e-2
    assert 0 <= o.tp_linear_forward_s < 0.1 and 0 <= o.tp_linear_backward_s < 0.1
    # torch's selective checkpoint: Python per dispatched operator
    assert 1e-8 < o.selective_dispatch_s < 0.1 and o.selective_s == 0.0
    # AdamW per parameter tensor: a DTensor's operators go through sharding propagation
    assert 1e-8 < o.optimizer_param_s < o.optimizer_dtensor_param_s < 0.1
    # ... and per parameter element (28 bytes moved: well under a microsecond)
    assert 1e-12 < o.optimizer_element_s < 1e-6
    # a split backward's extra per autograd node, and a two-stage pipeline's host work
    # per stage action (and per message end)
    assert 1e-8 < o.zero_bubble_node_s < 1e-3
    assert 1e-7 < o.pipeline_action_s < 0.05 and 0 <= o.pipeline_message_s < 0.05
    assert "two-stage 1F1B" in o.source
    # the reference blocks timed whole against their parts as the profile prices them
    assert 0.5 < o.layer_forward_scale < 2 and 0.5 < o.layer_backward_scale < 2
    assert "layer scales" in o.source
    # selective checkpointing's cost per activation byte (a few ns: copy-bandwidth scale)
    assert 0 <= o.selective_byte_s < 1e-7 and "recomputing nothing" in o.source
    # FSDP2's work around its collectives: per call (well under a second) and per byte
    # (copy-bandwidth scale: a few ns), measured on the pair of ranks
    assert o.fsdp_measured and "FSDP2 beyond its collectives" in o.source
    assert 0 <= o.fsdp_gather_call_s < 0.5 and 0 <= o.fsdp_reduce_call_s < 0.5
    assert 0 <= o.fsdp_gather_byte_s < 1e-7 and 0 <= o.fsdp_reduce_byte_s < 1e-7
    # and replicate's around its all-reduce
    assert o.replicate_measured and "replicate's (one all-reduce" in o.source
    assert 0 <= o.replicate_call_s < 0.5 and 0 <= o.replicate_byte_s < 1e-7
    # and context parallelism's collectives in a step beyond back to back (0 where the
    # ranks have cores of their own and lose nothing to each other's turns)
    assert "context-parallel collectives in a step" in o.source
    assert 0 <= o.cp_gather_call_s < 0.5 and 0 <= o.cp_scatter_call_s < 0.5
    assert 0 <= o.cp_gather_byte_s < 1e-7 and 0 <= o.cp_scatter_byte_s < 1e-7

    # found by name through AUTOPLAN_PROFILES, and the file round-trips
    monkeypatch.delenv("AUTOPLAN_HOME")
    monkeypatch.setenv("AUTOPLAN_PROFILES", str(out.parent))
    assert "local-test" in available_profiles()
    profile = load_profile("local-test")
    assert profile.to_dict() == report["profile"]


def test_the_arrival_cost_is_the_median_extra_of_a_collective_after_compute(monkeypatch):
    """Per round and group: compute then collective, less the compute alone, less the
    collective back to back, each the ranks' mean per call of one loop timed on each
    rank's own clock after a barrier; the mean over rounds and groups, never below 0."""
    import types

    from autoplan.profiling import collectives
    clock = [0.0]
    state = {"last": None, "extra": 0.0}
    barriers = []

    def work():
        clock[0] += 8e-3
        state["last"] = "work"

    def collective():   # 2 ms back to back, more right after compute
        clock[0] += 2e-3 + (state["extra"] if state["last"] == "work" else 0.0)
        state["last"] = "collective"

    def barrier():      # three loops per group and round: alone, back to back, after compute
        barriers.append(clock[0])
        state["last"] = None
        if len(barriers) % 3 == 0:
            state["extra"] = next(extras)

    monkeypatch.setattr(collectives, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    extras = iter([1e-3, 3e-3, 2e-3, 5e-3, -4e-3, 2.5e-3])
    got = collectives.measure_arrival(work, [collective, collective], barrier,
                                      agreed_mean=lambda v: v, rounds=3, loop=4)
    assert len(barriers) == 3 * 2 * 3
    assert got == pytest.approx(9.5e-3 / 6, abs=1e-12)        # the mean of the six
    extras = iter([-1e-3] * 3)
    assert collectives.measure_arrival(work, [collective], barrier, agreed_mean=lambda v: v,
                                       rounds=3, loop=4) == 0.0   # clamped


def test_a_cuda_profile_keeps_the_hosts_time_per_operator():
    """On CUDA the tiny blocks measure the host (their kernels take less than a launch):
    the profile keeps it as op_overhead, which the cost model sets against the device's work
    per layer (the host runs ahead), with the optimizer and tensor-parallel figures at 0."""
    overhead = {"forward_s": 1.4e-5, "backward_s": 4.4e-5, "forward_dispatch_s": 7.9e-6,
                "backward_node_s": 2.1e-5, "selective_dispatch_s": 1.6e-4, "selective_s": 0.0,
                "optimizer_param_s": 0.0, "optimizer_dtensor_param_s": 0.0,
                "optimizer_element_s": 0.0, "tp_linear_forward_s": 0.0,
                "tp_linear_backward_s": 0.0}
    matmul = {d: [[1024, 2 * 1024**3 / 5e14], [4096, 2 * 4096**3 / 7e14]]
              for d in ("fp32", "bf16")}
    raw = {"ranks": [{"rank": 0, "matmul": matmul, "copy_s": 2 * 2**30 / 3e12,
                      "info": {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30,
                               "capability": [9, 0]},
                      "overhead": overhead, "attention": []}],
           "comm": {}, "world": 1}
    profile, _ = build_profile("gpu", raw, cuda=True, nproc=1, threads=1, devices_per_node=1,
                               quick=False, copy_bytes=2**30)
    d = profile.device
    assert d.architecture == "hopper" and d.measured
    assert d.op_overhead.forward_dispatch_s == 7.9e-6
    assert "host runs ahead" in d.op_overhead.source
    assert parse_profile(yaml.safe_load(profile_to_yaml(profile))) == profile


def test_the_fsdp_figures_are_a_line_through_two_unit_sizes():
    """Per call and per byte from the extras at two unit sizes; a negative slope reads 0
    and a negative intercept puts the line through the origin and the larger point."""
    from autoplan.profiling.parallel import _line
    assert _line(1e6, 3e-3, 4e6, 9e-3) == pytest.approx((1e-3, 2e-9))
    assert _line(1e6, 3e-3, 4e6, 2e-3) == (3e-3, 0.0)
    assert _line(1e6, 1e-3, 4e6, 8e-3) == pytest.approx((0.0, 2e-9))


def test_sigterm_interrupts_while_the_ranks_run():
    """While ``_run_ranks`` has ranks out, SIGTERM raises KeyboardInterrupt (its ``finally``
    stops them, as on Ctrl-C); the handler before it is back afterwards."""
    import os
    import signal
    import sys
    import threading

    from autoplan.profiling.workers import _terminate_as_interrupt
    if sys.platform == "win32" or threading.current_thread() is not threading.main_thread():
        pytest.skip("a SIGTERM to this process would end it here, not raise")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with _terminate_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):      # the handler runs between bytecodes
                pass
    assert signal.getsignal(signal.SIGTERM) == before


def _state_and_parent(pid: int | str) -> tuple[str, int] | None:
    """A process's state letter and parent pid from Linux's /proc, or None once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s living children that multiprocessing spawned (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        got = _state_and_parent(entry.name) if entry.name.isdigit() else None
        if got is None or got[1] != pid or got[0] == "Z":
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.append(int(entry.name))
    return out


def _running(pid: int) -> bool:
    got = _state_and_parent(pid)
    return got is not None and got[0] != "Z"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stopped_profile_leaves_no_rank_running(tmp_path, how):
    """``autoplan profile`` stopped while its ranks measure: by SIGTERM (a ``kill``, a job
    scheduler) it stops them as on Ctrl-C and says so (exit 130, no traceback); by SIGKILL
    (no chance to) each rank sees its parent gone and ends within a second or so."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ranks: list[int] = []
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoplan.cli", "profile", "--quick", "--nproc", "2",
         "--device", "cpu", "--out", str(tmp_path / "p.yaml")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            ranks = _children(proc.pid)
        assert len(ranks) == 2, "the profile never started its two ranks"
        time.sleep(1.0)
        os.kill(proc.pid, getattr(signal, how))
        _, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while any(_running(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_running(r) for r in ranks), f"ranks {ranks} still running after {how}"
        if how == "SIGTERM":
            assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err)
            assert "Traceback" not in err
        assert not (tmp_path / "p.yaml").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for r in ranks:       # (what a failure left: not the next test's load)
            if _running(r):
                os.kill(r, signal.SIGKILL)
