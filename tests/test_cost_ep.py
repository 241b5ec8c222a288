"""Pricing and search of expert parallelism, computed by hand.

Toy cluster (autoplan.cost.toy): intra-node 1e11 B/s, inter-node 1e10 B/s per device,
no latency, perfect collective efficiency, a flat matmul efficiency of 0.5 at 1e12
FLOP/s.  Each rank of an ep group sends ``tokens x top-k x hidden x bytes`` per token
all-to-all, ``(ep - 1) / ep`` of it to the other ranks (pairwise exchange, Thakur et al.
2005); per MoE layer and micro-batch the runtime runs the dispatch and the combine in
the forward and their transposes in the backward, blocking.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import autoplan
from autoplan import Plan, trace
from autoplan.cost import CostOptions, estimate, estimate_plan
from autoplan.cost.summary import summarize
from autoplan.cost.toy import toy_cluster
from autoplan.graph import ModelGraph
from autoplan.models import GPT, GPTConfig
from autoplan.search import SearchSpace, search
from autoplan.strategy import Strategy

transformers = pytest.importorskip("transformers")

SEQ, HIDDEN, TOP_K, EXPERTS, LAYERS = 16, 32, 2, 4, 2
INTRA, INTER, PEAK = 1e11, 1e10, 1e12 * 0.5      # toy bytes/s and achieved FLOP/s


@pytest.fixture(scope="module")
def moe():
    cfg = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=64,
                                     num_hidden_layers=LAYERS, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=64,
                                     num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    return trace(transformers.MixtralForCausalLM(cfg), seq_len=SEQ)


#: The ``moe`` fixture's graph as transformers 5.23.0 captured it (torch 2.13.0), for the
#: recorded figures below: transformers 5.24.0 inlined Mixtral's rotary embedding (eleven
#: elementwise operators where 5.23 had one no-grad region), which moves the tiny model's
#: step by 0.17% outside the experts.  Pricing is checked on a fixed graph; capture of the
#: installed transformers is exercised by the ``moe`` fixture's tests.
MOE_SNAPSHOT = Path(__file__).resolve().parent / "data" / "mixtral-tiny-transformers-5.23.json"


@pytest.fixture(scope="module")
def moe_snapshot():
    return ModelGraph.from_json(MOE_SNAPSHOT.read_text())


@pytest.fixture(scope="module")
def gpt():
    return trace(GPT(GPTConfig(vocab_size=64, seq_len=SEQ, hidden=32, heads=4, layers=4)),
                 seq_len=SEQ)


def _estimate(graph, cluster, options=None, **kw):
    kw.setdefault("precision", "fp32")
    if "imbalance" in kw:
        options = CostOptions(expert_imbalance=kw.pop("imbalance"))
    return estimate(graph, cluster, Strategy(**kw), options=options, calibration=None)


# ------------------------------------------------------------------ ep = 1
#: Step time and peak memory of each layout on toy_cluster(nodes=2, devices_per_node=4),
#: fp32, recorded before expert parallelism was priced (main at 3054163), then again
#: when integer and boolean tensors came to be counted at their own bytes and ZeRO-2
#: came to hold unsharded gradients as ZeRO-3 does (branch stack).  Not the MoE
#: model under tp > 1: its experts are now priced whole on every tp rank, as the runtime
#: runs them (test_experts_whole_on_every_tp_rank).  Layouts 1 and 2 again when the
#: autoplan stack came to send pipeline boundaries whole from every tp rank and to copy
#: through FSDP2's buffers (pp_scatter_gather=True, zero_buffer_copies=False give the
#: figures before: 2.9616270000000004e-05 and 4.1117952e-05).  Layouts 0 and 3 again
#: when the step's data-parallel reduction and gather came to copy through the
#: wrappers' buffers too (zero_buffer_copies=False gives the figures before:
#: 1.824412e-05, 2.4191588000000005e-05 and 2.9825928000000002e-05).  Layout 2 again
#: when sequence parallelism's norm gradients came to be all-reduced over tp once per
#: step, one all-reduce per tensor under FSDP2 (before: 4.430054400000001e-05).  Without
#: the step's closing loss all-reduce, which the autoplan stack came to price later
#: (``step_loss_all_reduce``; its own test in test_cost_exact).  Layout 0 again when
#: ZeRO-1 came to hold one layer's unsharded gradients for its per-layer reduce-scatter
#: (FSDP2, ``zero_step_per_layer``) instead of a bucket's (before: 1074705442.6 and
#: 1074666298.6); without the loss's fp32 logits (``loss_fp32_copy``) and without the
#: gradient accumulation pass the autoplan stack came to price in fp32 too
#: (``grad_accumulate_add``; its own test in test_cost_autocast).  The cp layout came to
#: price the runtime's copies around its key/value gather (before: 3.0280584e-05).
#: Layouts 0, 1 and 3 (and the MoE's) again when the memory-bound operators' backward came
#: to move the bytes each one's derivative moves rather than twice the forward's where the
#: host is the device (the toy's architecture is not a GPU's; before:
#: 1.8782391999999996e-05, 2.4690980000000007e-05, 3.1435406000000004e-05 and
#: 3.0673800000000004e-05).  Layouts 1 and 3 again when the loss came to run over the
#: head's vocabulary-sharded logits, three small all-reduces a micro-batch over tp
#: (``loss_parallel``; before: 3.0238606000000002e-05 and 2.9748104e-05).  Layout 1's peak
#: again when autoplan's pipeline stages came to hold receive buffers for the micro-batches
#: in flight only (``pp_buffers_per_micro_batch=False``; before: 1074109214.8).  The MoE's
#: again when its captured SDPA came to be priced as the kernel computes it: the causal
#: half, at the device's fused-attention speed (before: 1.85777e-05).
BEFORE = {
    ("moe", 0): (1.8381092e-05, 1074688105.0),
    ("gpt", 0): (2.409706e-05, 1074539962.6),
    ("gpt", 1): (3.0253906e-05, 1074079109.2),   # + a pipeline receive and send buffer
    ("gpt", 2): (4.432358400000001e-05, 1073996984.5),
    ("gpt", 3): (2.9755784000000004e-05, 1074445412.2),
}
LAYOUTS = [dict(dp=8, global_batch=16, zero=1),
           dict(dp=2, tp=2, pp=2, global_batch=16, zero=2, schedule="zero_bubble", virtual_stages=2),
           dict(dp=4, tp=2, global_batch=16, zero=3, recompute="full", sequence_parallel=True),
           dict(dp=2, cp=2, tp=2, global_batch=16, micro_batch=2)]


@pytest.mark.parametrize("model, layout", sorted(BEFORE))
def test_ep1_prices_as_before(moe_snapshot, gpt, model, layout):
    # the tiny model's expert GEMMs are far below any efficiency table's first point, so
    # pricing them at one expert's size changes nothing here (it does at scale)
    e = _estimate(moe_snapshot if model == "moe" else gpt,
                  toy_cluster(nodes=2, devices_per_node=4),
                  options=CostOptions(step_loss_all_reduce=False, loss_fp32_copy=False,
                                      grad_accumulate_add=False),
                  **LAYOUTS[layout])
    step, peak = BEFORE[(model, layout)]
    assert e.step_time_s == pytest.approx(step, rel=1e-12)
    assert e.peak_memory_bytes == pytest.approx(peak, rel=1e-12)
    assert e.breakdown["ep_comm_s"] == e.comm_total["ep_comm_s"] == 0.0


def test_experts_whole_on_every_tp_rank(moe):
    s = summarize(moe)
    block = s.layers[1]
    nodes = s.templates[block.template]
    assert all(not n.sharded for n in nodes if n.expert)
    assert any(n.sharded for n in nodes if not n.expert)            # attention splits
    # only attention's row projection all-reduces over tp (forward and backward)
    assert len(block.tp_collectives) == 2
    c = toy_cluster(devices_per_node=8)
    e = _estimate(moe, c, dp=4, tp=2, global_batch=16, precision="bf16")
    per_device = sum(l.sharded_params / 2 + l.params - l.sharded_params for l in s.layers)
    experts = sum(l.expert_params for l in s.layers)
    assert experts and sum(l.sharded_params for l in s.layers) + experts <= s.num_params
    # ZeRO-0 under FSDP2's policy: fp32 master weights and their bf16 compute copies
    assert e.stages[0].memory.params_bytes == pytest.approx((4 + 2) * per_device, rel=1e-12)


def test_imbalance_needs_ep(moe):
    c = toy_cluster(devices_per_node=8)
    assert _estimate(moe, c, dp=8, global_batch=16, imbalance=1.7).step_time_s == \
        _estimate(moe, c, dp=8, global_batch=16).step_time_s


# ------------------------------------------------------------------ all-to-all
@pytest.mark.parametrize("ep, mb, recompute", [(2, 1, "none"), (4, 1, "none"), (4, 2, "none"),
                                               (4, 1, "full")])
def test_all_to_all_bytes_by_hand(moe, ep, mb, recompute):
    c = toy_cluster(devices_per_node=8)
    e = _estimate(moe, c, dp=8, ep=ep, global_batch=16, micro_batch=mb, recompute=recompute)
    send = mb * SEQ * TOP_K * HIDDEN * 4                  # tokens x top-k x hidden x fp32 bytes
    weights = mb * SEQ * TOP_K * 4                        # one fp32 routing weight a row
    counts = EXPERTS * 8                                  # the int64 token counts
    # the dispatch carries the weights, the combine only the outputs; both run in the
    # forward and back in the backward; the counts only in a forward; full recompute runs
    # the forward's three again
    runs = 2 if recompute == "full" else 1
    per_layer = (runs + 1) * (send + weights) + (runs + 1) * send + runs * counts
    m = 16 // (8 * mb)
    want = m * LAYERS * (ep - 1) / ep * per_layer / INTRA  # the part that leaves the rank
    assert e.comm_total["ep_comm_s"] == pytest.approx(want, rel=1e-12)
    assert e.breakdown["ep_comm_s"] == pytest.approx(want, rel=1e-12)     # blocking: exposed
    block = summarize(moe).layers[1]
    assert block.expert_tokens == SEQ * TOP_K and block.expert_hidden == HIDDEN
    fp32 = 4 / summarize(moe).activation_bytes     # the recipe's bytes over the summary's unit
    assert autoplan.cost.engine_for(moe, c, calibration=None).dispatch_bytes(block, mb, 1, fp32) == send


def test_a_deepep_dispatcher_sends_one_copy_per_destination(moe):
    """CostOptions.moe_dispatcher="deepep" (DeepEP / HybridEP): a token goes once to each
    rank (inside a node) or node (across nodes) that holds any of its top-k experts.  With
    4 experts, top-2: over 2 destinations of 2 experts each a token misses one with
    probability C(2,2)/C(4,2) = 1/6, so it reaches 2 x 5/6 = 5/3 of them, 5/6 of its 2
    copies; over 4 ranks of one expert each every copy has its own rank (share 1)."""
    from autoplan.cost import engine_for
    one_node = toy_cluster(devices_per_node=8)
    deepep = CostOptions(moe_dispatcher="deepep")
    block = summarize(moe).layers[1]
    engine = engine_for(moe, one_node, options=deepep, calibration=None)
    assert engine.dispatch_share(block, (0, 1)) == pytest.approx(5 / 6, rel=1e-12)
    assert engine.dispatch_share(block, (0, 1, 2, 3)) == pytest.approx(1.0, rel=1e-12)
    assert engine.dispatch_share(block, ()) == 1.0
    assert engine_for(moe, one_node, calibration=None).dispatch_share(block, (0, 1)) == 1.0
    # ranks 0, 1 on node 0 and 4, 5 on node 1: two destinations (nodes) of 2 experts each
    two_nodes = toy_cluster(nodes=2, devices_per_node=4)
    across = engine_for(moe, two_nodes, options=deepep, calibration=None)
    assert across.dispatch_share(block, (0, 1, 4, 5)) == pytest.approx(5 / 6, rel=1e-12)
    # the step prices the all-to-alls at that share of their bytes
    s = Strategy(dp=8, ep=2, global_batch=16, precision="fp32")
    plain = estimate(moe, one_node, s, calibration=None)
    dedup = estimate(moe, one_node, s, options=deepep, calibration=None)
    # (the per-expert token counts exchanged before each dispatch are not deduplicated)
    counts = (16 // 8) * LAYERS * 0.5 * EXPERTS * 8 / INTRA
    assert dedup.comm_total["ep_comm_s"] - counts == pytest.approx(
        5 / 6 * (plain.comm_total["ep_comm_s"] - counts), rel=1e-12)
    assert dedup.step_time_s < plain.step_time_s


def test_an_unknown_dispatcher_is_refused():
    from autoplan.errors import ConfigError
    with pytest.raises(ConfigError, match="moe_dispatcher must be one of alltoall, deepep"):
        CostOptions(moe_dispatcher="nccl")


def test_capture_sizes_the_all_to_all_alike(moe):
    # the capture's expert-parallel collective records carry the same routed-token bytes
    block = moe.blocks[0]
    assert [r.nbytes for r in block.tp.ep_collectives] == [SEQ * TOP_K * HIDDEN * 4] * 4


def test_ep_group_across_nodes_costs_more(moe):
    c = toy_cluster(nodes=2, devices_per_node=4)
    s = Strategy(dp=8, ep=2, global_batch=8, precision="fp32")
    inside = estimate_plan(moe, c, Plan.from_strategy(moe, c, s), calibration=None)
    # ep groups of consecutive dp ranks: (0, 4), (1, 5), ... on two nodes
    across = estimate_plan(moe, c, Plan.from_strategy(moe, c, s, devices=(0, 4, 1, 5, 2, 6, 3, 7)),
                           calibration=None)
    send = SEQ * TOP_K * HIDDEN * 4
    # dispatch (with a routing weight a row) and combine, forward and backward, and the
    # forward's token counts (test_all_to_all_bytes_by_hand)
    sent = 2 * (send + SEQ * TOP_K * 4) + 2 * send + EXPERTS * 8
    assert inside.comm_total["ep_comm_s"] == pytest.approx(LAYERS * 0.5 * sent / INTRA, rel=1e-12)
    # one member per node: each sends half its buffer over its own NIC share
    assert across.comm_total["ep_comm_s"] == pytest.approx(LAYERS * 0.5 * sent / INTER, rel=1e-12)
    assert across.comm_total["ep_comm_s"] > inside.comm_total["ep_comm_s"]
    # (the step need not be slower: the expert gradients then reduce inside a node, over
    # edp groups (0, 1, 2, 3) and (4, 5, 6, 7), instead of across the two)


# ------------------------------------------------------------------ compute and memory
def test_imbalance_scales_the_expert_gemms(moe):
    c = toy_cluster(devices_per_node=8)
    flat = _estimate(moe, c, dp=8, ep=4, global_batch=16)
    skew = _estimate(moe, c, dp=8, ep=4, global_batch=16, imbalance=1.5)
    expert = [n for n in summarize(moe).templates[summarize(moe).layers[1].template] if n.expert]
    assert len(expert) == 2                                # gate_up and down banks
    per_mb = LAYERS * sum(n.fwd_flops + n.bwd_flops for n in expert) / PEAK
    m = 2
    assert skew.breakdown["compute_s"] - flat.breakdown["compute_s"] == \
        pytest.approx(0.5 * m * per_mb, rel=1e-9)
    assert skew.comm_total["ep_comm_s"] == flat.comm_total["ep_comm_s"]


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_states_divided_by_ep(moe, ep, zero):
    c = toy_cluster(devices_per_node=8)
    e = _estimate(moe, c, dp=8, ep=ep, zero=zero, global_batch=16, precision="bf16")
    s = summarize(moe)
    total = sum(l.params for l in s.layers)
    experts = sum(l.expert_params for l in s.layers) if ep > 1 else 0
    dense, mine = total - experts, experts / ep           # per device, before ZeRO
    edp = 8 // ep                                         # ranks holding the same experts

    def states(nbytes, sharded):
        return dense * nbytes / (8 if sharded else 1) + mine * nbytes / (edp if sharded else 1)

    # FSDP2's policy (autoplan.cost.memory.fsdp2_state_bytes): fp32 master weights sharded
    # from ZeRO-1 on, bf16 compute copies held for the step below ZeRO-3, fp32 gradients
    # whole while they accumulate (two micro-batches here) under ZeRO-0/1
    mem = e.stages[0].memory
    copies = states(2, False) if zero <= 2 else 0.0
    assert mem.params_bytes == pytest.approx(states(4, zero >= 1) + copies, rel=1e-12)
    assert mem.grads_bytes == pytest.approx(states(4, zero >= 2), rel=1e-12)
    assert mem.optimizer_bytes == pytest.approx(states(8, zero >= 1), rel=1e-12)


def test_shared_and_dense_layers_keep_dp_sharding():
    cfg = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, vocab_size=128,
        n_group=1, topk_group=1)
    g = trace(transformers.DeepseekV3ForCausalLM(cfg), seq_len=SEQ)
    s = summarize(g)
    dense_block, moe_block = s.layers[1], s.layers[2]
    assert dense_block.expert_params == 0 and dense_block.expert_tokens == 0
    # routed experts only: 8 x (64 x 2*32 + 32 x 64); the shared expert is a dense MLP
    assert moe_block.expert_params == 8 * (64 * 64 + 32 * 64)
    assert moe_block.expert_tokens == SEQ * 2 and moe_block.expert_hidden == 64
    e = _estimate(g, toy_cluster(devices_per_node=8), dp=8, ep=8, zero=1, global_batch=8,
                  precision="bf16")
    total = sum(l.params for l in s.layers)
    experts = sum(l.expert_params for l in s.layers)
    # ZeRO-1 under FSDP2's policy: fp32 master shards (dense over dp 8, the experts one
    # per rank already) and bf16 compute copies of what this rank computes with
    mine = total - experts + experts / 8
    assert e.stages[0].memory.params_bytes == pytest.approx(
        (total - experts) * 4 / 8 + experts / 8 * 4 + mine * 2)


def test_report_prints_ep_comm(moe):
    e = _estimate(moe, toy_cluster(devices_per_node=8), dp=8, ep=4, global_batch=16)
    assert "ep_comm" in e.report()


# ------------------------------------------------------------------ search
def _valid(plans, graph, cluster):
    for p in plans:
        assert Plan.from_json(p.to_json()) == p          # round-trips, validated on load
        p.check(graph, cluster)
        again = estimate_plan(graph, cluster, p, memory_fraction=0.9)
        assert again.step_time_s == pytest.approx(p.estimate.step_time_s, rel=1e-12)


def test_search_tries_ep_for_moe_models(moe):
    c = toy_cluster(devices_per_node=8)
    result = search(moe, c, global_batch=16, top_k=12,
                             space=SearchSpace(expert_parallel=(2, 4)))
    assert result.plans and {p.ep for p in result.plans} <= {2, 4}
    assert all("ep" in p.label() for p in result.plans)
    _valid(result.plans, moe, c)
    best = search(moe, c, global_batch=16, top_k=12)
    assert {p.ep for p in best.plans} <= {1, 2, 4}
    _valid(best.plans, moe, c)
    # what the runtime runs on MoE blocks: no sequence parallelism, no selective recompute
    assert not any(lp.sequence_parallel or lp.recompute.value == "selective"
                   for p in result.plans + best.plans for lp in p.layers)


def test_search_keeps_ep1_for_dense_models(gpt):
    c = toy_cluster(devices_per_node=8)
    result = search(gpt, c, global_batch=16, top_k=12)
    assert result.plans and all(p.ep == 1 for p in result.plans)
    _valid(result.plans, gpt, c)


# ------------------------------------------------------------------ Megatron-Core's MoE
def test_tokens_split_over_tp_halves_expert_work_and_all_to_all(moe):
    """Megatron-Core routes each tp rank's sequence-parallel shard (expert tp = 1): the
    expert GEMMs and the dispatch bytes of a tp rank are 1/tp of autoplan's runtime's,
    where every tp rank routes all tokens."""
    c = toy_cluster(devices_per_node=8)
    kw = dict(dp=4, tp=2, ep=2, global_batch=16, precision="fp32", sequence_parallel=True)
    own = estimate(moe, c, Strategy(**kw), calibration=None)
    split = estimate(moe, c, Strategy(**kw), calibration=None,
                     options=CostOptions(moe_tokens_split_over_tp=True))
    # the tokens' all-to-alls halve; the per-expert counts exchanged before each are the same
    counts = (16 // 4) * LAYERS * 0.5 * EXPERTS * 8 / INTRA
    assert split.comm_total["ep_comm_s"] - counts == pytest.approx(
        (own.comm_total["ep_comm_s"] - counts) / 2, rel=1e-12)
    expert = [n for n in summarize(moe).templates[summarize(moe).layers[1].template] if n.expert]
    m = 16 // 4
    per_mb = LAYERS * sum(n.fwd_flops + n.bwd_flops for n in expert) / PEAK
    assert own.breakdown["compute_s"] - split.breakdown["compute_s"] == \
        pytest.approx(0.5 * m * per_mb, rel=1e-9)
    # without tp nothing changes
    kw.update(dp=8, tp=1, sequence_parallel=False)
    assert estimate(moe, c, Strategy(**kw), calibration=None).step_time_s == estimate(
        moe, c, Strategy(**kw), calibration=None,
        options=CostOptions(moe_tokens_split_over_tp=True)).step_time_s


def test_grouped_gemm_prices_local_experts_as_one_kernel():
    """One expert's GEMM of a fine-grained MoE is small: at a per-kernel overhead it runs
    far below peak; Transformer Engine's grouped GEMM (megatron-core: one kernel per local
    expert, 4 streams at a time) pays it once per 4 of the 8 local experts here."""
    cfg = transformers.MixtralConfig(hidden_size=256, intermediate_size=256,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=64,
                                     num_local_experts=16, num_experts_per_tok=2)
    graph = trace(transformers.MixtralForCausalLM(cfg), seq_len=64)
    c = autoplan.load_cluster("h100-sxm5-80gb")
    s = Strategy(dp=8, ep=2, global_batch=64, micro_batch=8)
    loop = estimate(graph, c, s, options=CostOptions(stack="megatron-core",
                                                     expert_grouped_gemm=False))
    grouped = estimate(graph, c, s, options=CostOptions(stack="megatron-core"))
    assert CostOptions(stack="megatron-core").expert_grouped_gemm
    # autoplan runs Hugging Face's default grouped_mm experts (test_grouped_gemm.py: the
    # profile's measured grouped speed)
    assert CostOptions().expert_grouped_gemm
    assert grouped.breakdown["compute_s"] < loop.breakdown["compute_s"]
    assert grouped.comm_total["ep_comm_s"] == loop.comm_total["ep_comm_s"]


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_banks_copy_through_buffers_only_where_reduced(moe, ep):
    """zero_buffer_copies, ZeRO-0 on dp 4: every dense gradient is copied into the
    all-reduce's buffer and back (read + write each); an expert bank's only where its edp
    group (dp / ep) has more than one rank to reduce over."""
    c = toy_cluster(devices_per_node=4)
    s = Strategy(dp=4, ep=ep, global_batch=16, precision="fp32")
    copies = estimate(moe, c, s, calibration=None)
    views = estimate(moe, c, s, calibration=None, options=CostOptions(zero_buffer_copies=False))
    layers = summarize(moe).layers
    dense = sum(l.params - l.expert_params for l in layers)
    experts = sum(l.expert_params for l in layers) / ep if 4 // ep > 1 else 0.0
    bw = c.device_type_of(0).memory_bw_bytes_per_s
    assert copies.comm_total["dp_comm_s"] - views.comm_total["dp_comm_s"] == pytest.approx(
        2 * 2 * (dense + experts) * 4 / bw, rel=1e-9)


def test_autocast_casts_only_this_ranks_experts(moe):
    """Under autocast each micro-batch casts the weights this rank computes with: with
    expert parallelism, ``1/ep`` of the expert banks (the rest live on other ranks)."""
    from autoplan.cost.engine import AUTOCAST_CAST_BYTES
    c = toy_cluster(devices_per_node=8)
    bw = c.device_type_of(0).memory_bw_bytes_per_s
    experts = sum(l.expert_params for l in summarize(moe).layers)

    def cast_s(ep):
        kw = dict(dp=8, ep=ep, global_batch=8, precision="bf16")
        on = _estimate(moe, c, CostOptions(autocast=True), **kw)
        off = _estimate(moe, c, CostOptions(autocast=False), **kw)
        return on.breakdown["compute_s"] - off.breakdown["compute_s"]

    # forward and backward, one micro-batch: 2 casts of each weight this rank holds
    assert cast_s(1) - cast_s(4) == pytest.approx(
        2 * AUTOCAST_CAST_BYTES * experts * (1 - 1 / 4) / bw, rel=1e-6)
