"""Pricing of context parallelism as autoplan.runtime.cp runs it, computed by hand.

Toy cluster (autoplan.cost.toy): intra-node 1e11 B/s, no latency, perfect
collective efficiency, so a ring all-gather or reduce-scatter of ``n`` gathered
bytes over ``c`` devices takes ``(c - 1) / c * n / 1e11`` s (Thakur et al. 2005).
Per block and micro-batch the runtime all-gathers the keys and values of the
whole sequences (``2 * hidden * kv_heads / heads`` elements per token, over
``tp``) in the forward and reduce-scatters their gradients in the backward,
both on the critical path, with the memory-bound copies around them (read + write at
the device's copy bandwidth): the local keys and values stacked and the gathered ones
put in position order, and the same two copies of their gradients in the backward.
"""

from __future__ import annotations

import pytest

import runtime_cases as rc
from autoplan import trace
from autoplan.cost import estimate
from autoplan.cost.toy import toy_cluster
from autoplan.strategy import Strategy

BW = 1e11          # toy intra-node bytes/s
LAYERS, HIDDEN, FP32 = 4, 32, 4


@pytest.fixture(scope="module")
def gpt_graph():
    return trace(rc.make_gpt(0, layers=LAYERS), seq_len=rc.SEQ)


@pytest.mark.parametrize("cp,tp,recompute", [(2, 1, "none"), (4, 1, "none"), (2, 2, "none"),
                                             (2, 1, "full")])
def test_cp_all_gathers_keys_and_values(gpt_graph, cp, tp, recompute):
    c = toy_cluster(devices_per_node=cp * tp)
    batch, m = 4, 2                                     # micro-batch 2, two micro-batches
    e = estimate(gpt_graph, c, Strategy(cp=cp, tp=tp, global_batch=batch, micro_batch=batch // m,
                                        precision="fp32", recompute=recompute), calibration=None)
    kv_bytes = 2 * HIDDEN * FP32 * rc.SEQ * (batch // m) / tp      # K and V, whole sequences
    one = (cp - 1) / cp * kv_bytes / BW                            # all-gather = reduce-scatter
    mem_bw = c.device_type_of(0).memory_bw_bytes_per_s
    copies_fwd = (2 * kv_bytes / cp + 2 * kv_bytes) / mem_bw
    copies_bwd = 4 * kv_bytes / mem_bw
    gathers = 2 if recompute == "full" else 1                      # recompute gathers again
    want = m * LAYERS * ((gathers + 1) * one + gathers * copies_fwd + copies_bwd)
    assert e.comm_total["cp_comm_s"] == pytest.approx(want, rel=1e-12)
    assert e.breakdown["cp_comm_s"] == pytest.approx(want, rel=1e-12)   # exposed


def test_no_cp_no_cp_comm(gpt_graph):
    e = estimate(gpt_graph, toy_cluster(devices_per_node=2),
                 Strategy(dp=2, global_batch=4, precision="fp32"), calibration=None)
    assert e.comm_total["cp_comm_s"] == 0.0
