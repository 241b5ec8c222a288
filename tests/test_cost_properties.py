"""Properties of the cost model over random layouts (hypothesis).

A small GPT is captured once; layouts are drawn over 16 devices (2 nodes x 8)
of a toy cluster whose bandwidths the tests scale.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from autoplan import trace
from autoplan.cost import CostOptions, estimate, estimate_plan
from autoplan.cost.toy import toy_cluster
from autoplan.models import GPT, GPTConfig
from autoplan.plan import Plan
from autoplan.strategy import Recompute, Schedule, Strategy, schedule_problem

GRAPH = trace(GPT(GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=4,
                            dropout=0.1)), seq_len=64)
DEVICES = 16
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _cluster(scale: float = 1.0, latency_s: float = 1e-6):
    return toy_cluster(nodes=2, devices_per_node=8, intra_bw_bytes_per_s=1e11 * scale,
                       inter_bw_bytes_per_s=1e10 * scale, latency_s=latency_s,
                       peak_flops_per_s=1e12)


CLUSTER = _cluster()


@st.composite
def layouts(draw) -> Strategy:
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 2]))
    assume(DEVICES % (tp * pp * cp) == 0)
    dp = DEVICES // (tp * pp * cp)
    schedule = draw(st.sampled_from(list(Schedule))) if pp > 1 else Schedule.ONE_F_ONE_B
    v = 2 if schedule in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE) else 1
    assume(pp * v <= 4)
    mb = draw(st.sampled_from([1, 2]))
    m = draw(st.integers(min_value=pp, max_value=pp + 4))
    # what torch's schedules run (ZBV: >= 2 pp - 1 micro-batches, never with ZeRO-3)
    assume(schedule_problem(schedule, pp, v, m) is None)
    zbv = schedule is Schedule.ZERO_BUBBLE and pp > 1
    return Strategy(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=mb, global_batch=dp * mb * m,
                    zero=draw(st.integers(0, 2 if zbv else 3)),
                    recompute=draw(st.sampled_from([r for r in Recompute
                                                    if not (zbv and r is Recompute.SELECTIVE)])),
                    sequence_parallel=tp > 1 and draw(st.booleans()), schedule=schedule,
                    virtual_stages=v)


def _est(s: Strategy, cluster=CLUSTER, options: CostOptions | None = None):
    return estimate(GRAPH, cluster, s, options=options, calibration=None)


def _max_activations(e) -> float:
    return max(st.memory.activations_bytes for st in e.stages)


@SETTINGS
@given(layouts(), st.floats(min_value=1.0, max_value=8.0), st.booleans())
def test_more_bandwidth_is_never_slower(s, factor, overlap):
    opts = CostOptions(overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                       tp_comm_overlap=overlap)
    slow = _est(s, _cluster(1.0), opts)
    fast = _est(s, _cluster(factor), opts)
    assert fast.step_time_s <= slow.step_time_s * (1 + 1e-12)


@SETTINGS
@given(layouts())
def test_recompute_never_raises_activation_memory(s):
    none = _est(dataclasses.replace(s, recompute=Recompute.NONE))
    zbv = s.pp > 1 and s.schedule is Schedule.ZERO_BUBBLE     # never with selective
    for rc in (Recompute.FULL,) if zbv else (Recompute.SELECTIVE, Recompute.FULL):
        other = _est(dataclasses.replace(s, recompute=rc))
        assert _max_activations(other) <= _max_activations(none) * (1 + 1e-12)
        for a, b in zip(other.stages, none.stages):
            assert a.memory.activations_bytes <= b.memory.activations_bytes * (1 + 1e-12)


@SETTINGS
@given(layouts())
def test_zero3_never_holds_more_parameter_memory_than_zero1(s):
    assume(s.pp == 1 or s.schedule is not Schedule.ZERO_BUBBLE)   # never combined with ZeRO-3
    z1 = _est(dataclasses.replace(s, zero=1))
    z3 = _est(dataclasses.replace(s, zero=3))
    for a, b in zip(z3.stages, z1.stages):
        assert a.memory.params_bytes <= b.memory.params_bytes
        states = lambda m: m.params_bytes + m.grads_bytes + m.optimizer_bytes  # noqa: E731
        assert states(a.memory) <= states(b.memory)


@SETTINGS
@given(layouts())
def test_doubling_the_global_batch_never_lowers_step_time(s):
    double = dataclasses.replace(s, global_batch=2 * s.global_batch)
    assert _est(double).step_time_s >= _est(s).step_time_s


@SETTINGS
@given(layouts())
def test_breakdown_partitions_the_step_and_plan_agrees(s):
    e = _est(s)
    assert sum(e.breakdown.values()) == pytest.approx(e.step_time_s, rel=1e-9)
    assert all(v >= -1e-12 for v in e.breakdown.values())
    assert 0 < e.mfu <= e.hfu < 1
    plan = Plan.from_strategy(GRAPH, CLUSTER, s)
    assert estimate_plan(GRAPH, CLUSTER, plan, calibration=None) == e
    assert Plan.from_json(plan.to_json()) == plan


@SETTINGS
@given(layouts(), st.floats(min_value=0.3, max_value=1.0))
def test_memory_fraction_only_changes_the_fit(s, fraction):
    full = _est(s)
    part = _est(s, options=CostOptions(memory_fraction=fraction))
    assert part.step_time_s == full.step_time_s
    assert part.peak_memory_bytes == full.peak_memory_bytes
    assert part.fits == all(st.peak_memory_bytes <= fraction * st.memory_capacity_bytes
                            for st in part.stages)
