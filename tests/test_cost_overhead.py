"""The host's time per operator (``DeviceType.op_overhead``), computed by hand.

On a CPU every operator of an eager step pays the dispatcher before its arithmetic; the
profiler measures that per captured operator (:mod:`autoplan.hardware.profiler`) and the
cost model adds it per captured operator of each layer and micro-batch, whatever the
micro-batch's size, plus the DTensor machinery of each tensor-parallel linear when tp > 1.
"""

from __future__ import annotations

import pytest

from autoplan import trace
from autoplan.cost import CostOptions, estimate
from autoplan.cost.summary import summarize
from autoplan.models import GPT, GPTConfig
from autoplan.strategy import Strategy
from runtime_cases import cpu_cluster

CONFIG = GPTConfig(vocab_size=128, seq_len=16, hidden=32, heads=4, layers=4)
OVERHEAD = {"forward_s": 10e-6, "backward_s": 20e-6, "tp_linear_forward_s": 300e-6,
            "tp_linear_backward_s": 700e-6, "selective_s": 150e-6}
NO_OVERLAP = CostOptions(overlap_grad_reduce=False, overlap_param_gather=False,
                         tp_comm_overlap=False, pp_comm_overlap=False)


@pytest.fixture(scope="module")
def graph():
    return trace(GPT(CONFIG), seq_len=CONFIG.seq_len)


def _step(graph, strategy, overhead):
    cluster = cpu_cluster(2, overhead=overhead)
    return estimate(graph, cluster, strategy, calibration=None, options=NO_OVERLAP)


def test_operators_are_counted_per_layer(graph):
    """Each block of the GPT captures 31 nodes: 28 operators and 3 getitem; the embedding
    layer's guard function is not an operator; tensor parallelism shards the block's four
    linears and the vocabulary embedding and head."""
    counts = summarize(graph).op_counts
    blocks = [t for t in counts if t.startswith("blocks")]
    assert blocks and all(counts[t] == (28, 4) for t in blocks)
    assert counts["pre"] == (5, 1) and counts["post"] == (8, 1)


@pytest.mark.parametrize("tp", [1, 2])
def test_overhead_is_per_operator_and_micro_batch(graph, tp):
    s = Strategy(dp=2 // tp, tp=tp, micro_batch=2, global_batch=8, precision="fp32")
    base = _step(graph, s, None)
    with_overhead = _step(graph, s, OVERHEAD)
    micro_batches = 8 // (2 // tp) // 2
    ops = 5 + 4 * 28 + 8                      # pre, four blocks, post
    per_micro_batch = ops * (10e-6 + 20e-6)
    if tp > 1:
        per_micro_batch += (1 + 4 * 4 + 1) * (300e-6 + 700e-6)
    added = with_overhead.breakdown["compute_s"] - base.breakdown["compute_s"]
    assert added == pytest.approx(micro_batches * per_micro_batch, rel=1e-9)
    others = {k: v for k, v in with_overhead.breakdown.items() if k != "compute_s"}
    assert others == pytest.approx({k: v for k, v in base.breakdown.items() if k != "compute_s"})


def test_selective_recompute_pays_the_dispatch_mode_per_operator(graph):
    """torch's selective checkpoint runs every operator of a block's forward and recompute
    through a Python dispatch mode: ``selective_s`` per captured operator of each block."""
    s = Strategy(dp=2, micro_batch=2, global_batch=8, recompute="selective", precision="fp32")
    added = (_step(graph, s, OVERHEAD).breakdown["recompute_s"]
             - _step(graph, s, None).breakdown["recompute_s"])
    micro_batches = 8 // 2 // 2
    assert added == pytest.approx(micro_batches * 4 * 28 * 150e-6, rel=1e-9)


def test_overhead_does_not_grow_with_the_micro_batch(graph):
    """Twice the sequences per micro-batch, half the micro-batches: half the overhead."""
    def added(mb):
        s = Strategy(dp=2, micro_batch=mb, global_batch=16, precision="fp32")
        return (_step(graph, s, OVERHEAD).breakdown["compute_s"]
                - _step(graph, s, None).breakdown["compute_s"])

    assert added(4) == pytest.approx(added(2) / 2, rel=1e-9)


def _shared(cores: int | None, world: int = 4):
    """``cpu_cluster(world)`` with its ranks sharing ``cores`` cores."""
    import dataclasses

    from autoplan.hardware import NodeGroup, compose_cluster
    cluster = cpu_cluster(world)
    p = next(iter(cluster.profiles.values()))
    p = dataclasses.replace(p, node=dataclasses.replace(p.node, shared_cores=cores))
    return compose_cluster([NodeGroup(p, 1)], name=f"shared-{cores}")


def test_ranks_sharing_cores_run_faster_in_the_pipeline_bubble(graph):
    """4 ranks on 2 cores, measured all busy at once: while pipeline ranks wait in the
    bubble the others get their cores.  The pipeline's part of the step is the largest of
    the critical path at a whole core's speed (2/4 of the measured time), the total work
    over the 4 ranks' share of the cores, and the busiest rank's own work."""
    from autoplan.cost import pipeline_time
    from autoplan.strategy import Schedule

    s = Strategy(pp=4, micro_batch=1, global_batch=8, schedule="1f1b", precision="fp32")
    alone = estimate(graph, _shared(None), s, calibration=None, options=NO_OVERLAP)
    shared = estimate(graph, _shared(2), s, calibration=None, options=NO_OVERLAP)
    m = 8
    times = [st.forward_s + st.backward_s for st in alone.stages]
    t_pipe = pipeline_time(Schedule.ONE_F_ONE_B, times, m)
    expected = max(t_pipe * 2 / 4, m * sum(times) / 4, m * max(times))
    assert expected < t_pipe
    assert alone.step_time_s - shared.step_time_s == pytest.approx(t_pipe - expected, rel=1e-9)
    assert shared.breakdown["bubble_s"] >= 0


@pytest.mark.parametrize("cores", [1, 3])
def test_without_a_pipeline_bubble_sharing_changes_nothing(graph, cores):
    """Data parallelism keeps every rank busy: the measured (all busy) figures hold."""
    dp = Strategy(dp=4, micro_batch=1, global_batch=8, precision="fp32")
    assert estimate(graph, _shared(cores), dp, calibration=None).step_time_s == \
        estimate(graph, _shared(None), dp, calibration=None).step_time_s


def test_shared_cores_round_trips_and_is_checked():
    import yaml

    from autoplan.errors import ProfileError
    from autoplan.hardware.profiles import parse_profile, profile_to_yaml
    p = next(iter(_shared(2).profiles.values()))
    assert parse_profile(yaml.safe_load(profile_to_yaml(p))).node.shared_cores == 2
    import dataclasses
    with pytest.raises(ProfileError, match="shared_cores"):
        dataclasses.replace(p.node, shared_cores=4)      # as many cores as ranks: not shared
