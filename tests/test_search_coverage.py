"""The search against exhaustive enumeration on small clusters and models: never slower.

:func:`autoplan.search.exhaustive.exhaustive` prices every uniform layout of the search
space (every device count of every pool, every degree, micro-batch, schedule, ZeRO stage
and recompute option) without bounds; the search visits them best bound first and
prunes.  On each case below:

* the search's plan is at least as fast as the fastest uniform layout that fits (it may
  be faster: refinement mixes recompute per block and moves blocks between stages);
* every bound the search prunes with holds for every priced layout: the coarse bound of
  its devices and degrees, the bound of its micro-batch, the bound of its schedule and
  of its ZeRO stage are at most its step time, and a uniform option the memory bound
  rules out does not fit.

The memory fraction of each case is set from the layouts' own peaks so that some fit and
some do not (recompute, sharding and pipelining then matter), on one and two node
clusters of GPUs, a mixed A100 + V100 one, and odd global batches (uneven replicas,
shorter micro-batches).
"""

from __future__ import annotations

import math
import sys
import time

import pytest

import autoplan
from autoplan.hardware import NodeGroup, compose_cluster, load_profile
from autoplan.models import GPT, GPTConfig
from autoplan.search import SearchSpace, search
from autoplan.search.exhaustive import exhaustive
from autoplan.strategy import Precision

_search_module = sys.modules["autoplan.search.search"]


@pytest.fixture(scope="module")
def gpt():
    return autoplan.trace(GPT(GPTConfig(vocab_size=512, seq_len=256, hidden=256, heads=8,
                                        layers=4)), seq_len=256)


@pytest.fixture(scope="module")
def deep():
    """Eight blocks: pipelines of up to eight stages, interleaved and zero-bubble ones."""
    return autoplan.trace(GPT(GPTConfig(vocab_size=512, seq_len=512, hidden=128, heads=4,
                                        layers=8)), seq_len=512)


@pytest.fixture(scope="module")
def dense_then_moe():
    """A DeepSeek-V3-shaped model: two dense blocks, then four mixtures of experts whose
    banks hold most of the parameters (blocks of two templates, of very different sizes)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=6, first_k_dense_replace=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    return autoplan.trace(transformers.DeepseekV3ForCausalLM(cfg), seq_len=256)


def _mixed():
    c = compose_cluster([NodeGroup(load_profile("a100-sxm4-80gb"), 1),
                         NodeGroup(load_profile("v100-sxm2-32gb"), 1)])
    return c.subset(list(range(4)) + list(range(8, 12)))      # 4 A100 + 4 V100


CASES = {
    # name: (cluster, global batch, quantile of the layouts' peaks the memory allows)
    "one-node-8": (lambda: autoplan.load_cluster("a100-sxm4-80gb"), 16, 0.3),
    "one-node-odd-batch": (lambda: autoplan.load_cluster("a100-sxm4-80gb"), 13, 0.3),
    "two-nodes-of-4": (lambda: autoplan.load_cluster("a100-sxm4-80gb", nodes=2,
                                                     devices_per_node=4), 12, 0.2),
    "mixed-a100-v100": (_mixed, 8, 0.4),
    "deep-two-nodes-tight": (lambda: autoplan.load_cluster("a100-sxm4-80gb", nodes=2,
                                                           devices_per_node=4), 16, 0.08),
    # blocks of two templates: the memory bound sizes each at its own (Bounds._most_blocks)
    "moe-one-node": (lambda: autoplan.load_cluster("a100-sxm4-80gb", devices_per_node=4),
                     16, 0.3),
}

SPACE = SearchSpace(virtual_stages=(2,), max_micro_batch=8)


def _fraction(graph, cluster, batch: int, quantile: float) -> float:
    peaks = sorted(x.peak_bytes for x in exhaustive(graph, cluster, global_batch=batch,
                                                   memory_fraction=1.0, space=SPACE))
    cap = min(t.memory_bytes for t in cluster.device_types)
    return min(1.0, peaks[int(quantile * (len(peaks) - 1))] / cap)


def _bounds_of(graph, cluster, batch: int, fraction: float):
    """A search's state with its bounds (not run): what the pruning reads."""
    from autoplan.cost import CostEngine, CostOptions
    from autoplan.search.builder import _Builder
    from autoplan.search.fleet import pools

    engine = CostEngine(graph, cluster, options=CostOptions(memory_fraction=fraction))
    builder = _Builder(graph, engine, cluster, Precision.BF16, pools(cluster))
    return _search_module._Search(graph, cluster, engine, builder, SPACE, batch, False, None,
                                  math.inf, 0.0, 1, time.perf_counter(), math.inf)


@pytest.mark.parametrize("name", list(CASES))
def test_search_is_never_slower_than_exhaustive(gpt, deep, dense_then_moe, name):
    make, batch, quantile = CASES[name]
    gpt = deep if name.startswith("deep") else dense_then_moe if name.startswith("moe") \
        else gpt
    cluster = make()
    fraction = _fraction(gpt, cluster, batch, quantile)
    priced = list(exhaustive(gpt, cluster, global_batch=batch, memory_fraction=fraction,
                             space=SPACE))
    fitting = [x for x in priced if x.fits]
    assert fitting and len(fitting) < len(priced)        # memory binds somewhere
    best = min(x.step_time_s for x in fitting)
    result = search(gpt, cluster, global_batch=batch, memory_fraction=fraction, space=SPACE)
    plan = result.best
    assert plan.estimate.fits
    assert plan.estimate.step_time_s <= best * (1 + 1e-9), (name, plan.summary(), best)
    # and it priced a small share of the layouts
    assert result.evaluated < len(priced) / 4

    # every bound the search prunes with holds for every layout it would prune
    s = _bounds_of(gpt, cluster, batch, fraction)
    bounds, tol = s.bounds, 1 + 1e-9
    for x in priced:
        c = x.combo
        table = s._sigma_of(c.pool, c.tp, c.cp)
        sigma, sigma_block = table[min(batch // c.dp, len(table) - 1)]
        coarse = 0.0 if bounds.shared_cores(c.n) else \
            batch / c.dp * max(sigma / c.pp, -(-s.blocks // c.pp) * sigma_block)
        assert coarse <= x.step_time_s * tol, (x, coarse)
        counts = tuple(-(-b // c.micro_batch) for b in x.replica_batch)
        micro = s._micro_bound(c.pool, c.n, c.tp, c.cp, c.pp, [c.ep], c.sp, c.micro_batch,
                               counts)
        assert micro <= x.step_time_s * tol, (x, micro)
        if not x.fits:
            continue
        cheap = s.cheap_bound(c, counts, x.zero)
        assert cheap is not None and cheap <= x.step_time_s * tol, (x, cheap)
        zb = dict((z, lb) for lb, z in s.zero_bounds(c, counts))
        assert x.zero in zb and zb[x.zero] <= x.step_time_s * tol, (x, zb)
        # the bound a ZeRO-2/3 combination is queued at before its exact one
        quick = s.zero_bound(c, counts, x.zero, exact=False)
        assert quick is not None and quick <= x.step_time_s * tol, (x, quick)
        assert all(bounds.fits(c.pool, c.n, kinds[0], c.pp, c.v, c.tp, c.cp, c.ep, c.sp,
                               x.zero, x.recompute, c.micro_batch, c.schedule, m, caps)
                   for kinds, m, caps in s._classes(c, x.zero, counts)), x


def test_exhaustive_lists_every_device_count(gpt):
    """The enumeration the search is held to covers layouts that leave devices idle."""
    cluster = autoplan.load_cluster("a100-sxm4-80gb")
    counts = {x.combo.n for x in exhaustive(gpt, cluster, global_batch=6, space=SPACE)}
    assert counts == set(range(1, 9)) - {7} or counts >= {1, 2, 3, 4, 6, 8}
    only_all = {x.combo.n for x in exhaustive(gpt, cluster, global_batch=6, space=SPACE,
                                              use_all_devices=True)}
    assert only_all == {8}
