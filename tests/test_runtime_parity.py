"""Parity of parallelized training with a single-process reference (gloo, CPU, fp32).

Every layout trains the tiny GPT or Llama (GQA) for 3 steps on the same global
batch as the reference; the loss after every step and every parameter after
steps 1 and 3 must match within ``ATOL = 1e-5`` (see runtime_cases.py).  Each
test is one spawn that runs many layouts one after another (a spawn costs
seconds, a layout a fraction of one); the worker raises naming the first layout
that is off, and the table of errors is printed (``pytest -s``).

Coverage (G = GPT, L = Llama): DP with DDP (G, L); ZeRO-1/2/3 on FSDP2 with
gradient accumulation (G); TP without and with sequence parallelism (G, L);
recompute full and selective (G, L); DP x TP (G, L);
PP with GPipe, 1F1B, interleaved 1F1B and ZBV (G, L); PP x DP and PP x FSDP
under 1F1B and under ZBV, the combinations where DDP or resharding after
forward would give wrong gradients (G, L); TP x PP (G, L); uneven pipeline splits
(G, L); tied input/output embeddings split over pipeline stages, also on one rank
under ZBV and with TP (G, L); plans searched by autoplan.plan for a 4-process CPU
cluster (G, L).
"""

from __future__ import annotations

import functools
import os

import pytest

import runtime_cases as rc
from dist_harness import run
from autoplan.strategy import Strategy

pytestmark = pytest.mark.distributed


def S(**kw) -> Strategy:
    return Strategy(global_batch=rc.GLOBAL_BATCH, precision="fp32", **kw)


def _report(title: str, results: dict) -> None:
    print(f"\n{title}")
    for label, r in results.items():
        print(f"  {label:28s} loss {r['loss_err']:.1e}  params {r['param_err']:.1e}  "
              f"{r['seconds']:.2f}s")


@pytest.fixture(scope="module")
def llama_graph() -> dict[str, str]:
    pytest.importorskip("transformers")
    return {name: rc.graph_json(name) for name in ("llama", "llama-tied")}


@pytest.fixture(scope="module")
def gpt_graph() -> dict[str, str]:
    return {name: rc.graph_json(name) for name in ("gpt", "gpt-tied")}


def test_gpt_parity_2_ranks():
    # the workers trace the model themselves here (graph=None), as a user's ranks do
    targets = [
        ("dp2 (DDP)", S(dp=2)),
        ("zero1 dp2 x2 micro", S(dp=2, zero=1, micro_batch=2)),
        ("zero2 dp2 x2 micro", S(dp=2, zero=2, micro_batch=2)),
        ("zero3 dp2 x2 micro", S(dp=2, zero=3, micro_batch=2)),
        ("recompute full dp2", S(dp=2, recompute="full")),
        ("recompute selective zero3", S(dp=2, zero=3, recompute="selective")),
        ("pp2 gpipe", S(pp=2, micro_batch=2, schedule="gpipe")),
        ("pp2 1f1b", S(pp=2, micro_batch=2, schedule="1f1b")),
        ("pp2 interleaved", S(pp=2, micro_batch=2, schedule="interleaved", virtual_stages=2)),
        ("pp2 zbv", S(pp=2, micro_batch=2, schedule="zero_bubble")),
        ("pp2 1f1b recompute sel", S(pp=2, micro_batch=2, recompute="selective")),
        ("tp2", S(tp=2)),
        ("tp2 sp", S(tp=2, sequence_parallel=True)),
        ("tp2 sp recompute sel", S(tp=2, sequence_parallel=True, recompute="selective")),
        # embedding and head share a weight: split over stages, or on one rank under ZBV
        ("tied: dp2 (DDP)", S(dp=2), "gpt-tied"),
        ("tied: pp2 1f1b", S(pp=2, micro_batch=2), "gpt-tied"),
        ("tied: pp2 zbv", S(pp=2, micro_batch=2, schedule="zero_bubble"), "gpt-tied"),
    ]
    _report("GPT, 2 ranks", run(rc.parity, 2, "gpt", targets)[0])


def test_sequence_parallel_gradients_are_reduced_together_once_per_step():
    # the norms' weights and biases (4 tensors per block, 2 in the final norm) see a
    # sequence shard under sequence parallelism and get partial gradients; two
    # micro-batches accumulate them and one collective reduces them (AdamW would reduce
    # each, three times: at lerp_ and at both operands of addcmul_)
    counts = run(functools.partial(rc.sp_grad_reductions, model_name="gpt",
                                   strategy=S(tp=2, sequence_parallel=True, micro_batch=4)), 2)
    assert counts == [{"reduced": 18, "dtensor_1d_all_reduces": 0}] * 2, counts


def test_the_builtin_loss_hides_fsdp2s_view_warning_for_the_root_only():
    # FSDP2 warns when a module it wraps returns a view; under tensor parallelism the logits
    # are one, and the built-in loss reads them out of place, so its steps do not warn; with
    # a loss of the user's (anything may follow) the warning stays
    strategy = S(dp=2, tp=2, zero=1, micro_batch=2)
    for custom, expect in ((False, 0), (True, 1)):
        got = run(functools.partial(rc.view_warnings, strategy=strategy, custom_loss=custom), 4)
        for warned, root, heap_kept in got:
            assert root == "FSDPGPT" and min(warned, 1) == expect, (custom, got)
            assert heap_kept, "parallelize on CPU keeps the heap (autoplan/runtime/cpu_heap.py)"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_parallelize_again_reuses_its_process_groups():
    # a process that parallelizes again (a replan, a notebook, a benchmark's next layout)
    # reuses the mesh's and the tied weights' groups: no new groups or threads per call
    targets = [("tp2", S(tp=2)), ("tied: pp2 1f1b", S(pp=2, micro_batch=2), "gpt-tied"),
               ("dp2 (DDP)", S(dp=2))]
    rounds = run(rc.repeated_parallelize, 2, targets)[0]
    assert rounds[0] == rounds[1] == rounds[2], rounds
    # destroyed groups are not handed out again: the next call builds a new set, as many
    assert rounds[3][0] == rounds[0][0], rounds


def test_gpt_parity_4_ranks(gpt_graph):
    targets = [
        ("dp4 (DDP) x2 micro", S(dp=4, micro_batch=1)),
        ("zero3 dp4", S(dp=4, zero=3, micro_batch=2)),
        ("pp2 x dp2 1f1b", S(pp=2, dp=2, micro_batch=2)),
        ("pp2 x dp2 zbv", S(pp=2, dp=2, micro_batch=1, schedule="zero_bubble")),
        ("pp2 x zero3 1f1b", S(pp=2, dp=2, zero=3, micro_batch=2)),
        ("pp2 x zero2 zbv", S(pp=2, dp=2, zero=2, micro_batch=1, schedule="zero_bubble")),
        ("pp2 x zero1 interleaved", S(pp=2, dp=2, zero=1, micro_batch=1, schedule="interleaved",
                                      virtual_stages=2)),
        ("pp4 gpipe", S(pp=4, micro_batch=2, schedule="gpipe")),
        ("uneven 1|3 x zero2", rc.uneven_plan(gpt_graph["gpt"], dp=2, zero=2, micro_batch=1)),
        ("zero3 dp2 x tp2 sp", S(dp=2, tp=2, zero=3, sequence_parallel=True)),
        ("pp2 x tp2 1f1b", S(pp=2, tp=2, micro_batch=2)),
        ("tied: pp2 x zero3 1f1b", S(pp=2, dp=2, zero=3, micro_batch=2), "gpt-tied"),
        ("tied: pp2 x tp2 zbv", S(pp=2, tp=2, micro_batch=1, schedule="zero_bubble"), "gpt-tied"),
        ("tied: pp2 x dp2 zbv", S(pp=2, dp=2, micro_batch=1, schedule="zero_bubble"), "gpt-tied"),
    ]
    _report("GPT, 4 ranks", run(functools.partial(rc.parity, graph=gpt_graph), 4, "gpt", targets)[0])


def test_llama_parity_2_ranks(llama_graph):
    targets = [
        ("dp2 (DDP)", S(dp=2)),
        ("tp2", S(tp=2)),
        ("tp2 sp", S(tp=2, sequence_parallel=True)),
        ("tp2 sp recompute full", S(tp=2, sequence_parallel=True, recompute="full")),
        ("zero2 recompute selective", S(dp=2, zero=2, micro_batch=2, recompute="selective")),
        ("pp2 1f1b", S(pp=2, micro_batch=2)),
        ("pp2 interleaved", S(pp=2, micro_batch=2, schedule="interleaved", virtual_stages=2)),
        ("pp2 zbv", S(pp=2, micro_batch=2, schedule="zero_bubble")),
    ]
    _report("Llama, 2 ranks", run(functools.partial(rc.parity, graph=llama_graph), 2, "llama", targets)[0])


def test_llama_parity_4_ranks(llama_graph):
    targets = [
        ("dp2 x tp2", S(dp=2, tp=2)),
        ("zero3 dp2 x tp2 sp", S(dp=2, tp=2, zero=3, sequence_parallel=True)),
        ("pp2 x tp2 1f1b", S(pp=2, tp=2, micro_batch=2)),
        ("pp2 x tp2 sp zbv", S(pp=2, tp=2, micro_batch=1, sequence_parallel=True,
                               schedule="zero_bubble")),
        ("pp2 x dp2 gpipe", S(pp=2, dp=2, micro_batch=2, schedule="gpipe")),
        ("pp2 x zero2 zbv", S(pp=2, dp=2, zero=2, micro_batch=1, schedule="zero_bubble")),
        ("uneven 1|3 x tp2", rc.uneven_plan(llama_graph["llama"], tp=2)),
        ("tied: dp2 x tp2 sp", S(dp=2, tp=2, sequence_parallel=True), "llama-tied"),
        ("tied: pp2 x tp2 sp zbv", S(pp=2, tp=2, micro_batch=1, sequence_parallel=True,
                                     schedule="zero_bubble"), "llama-tied"),
    ]
    _report("Llama, 4 ranks", run(functools.partial(rc.parity, graph=llama_graph), 4, "llama", targets)[0])


def test_searched_plans_parity(gpt_graph, llama_graph):
    """The three best plans autoplan.plan finds for each model on a 4-process CPU cluster."""
    graphs = {"gpt": gpt_graph["gpt"], "llama": llama_graph["llama"]}
    plans = {name: rc.searched_plans(g) for name, g in graphs.items()}
    assert all(len(p) >= 1 for p in plans.values())
    results = run(rc.searched_plans_parity, 4, graphs, plans)[0]
    _report("plans from autoplan.plan, 4 ranks", results)


def test_model_without_tokens_parity():
    """An nn.Sequential MLP with a user loss_fn and (inputs, targets) batches."""
    targets = [
        ("dp2 (DDP)", S(dp=2)),
        ("zero3 dp2 x2 micro", S(dp=2, zero=3, micro_batch=2)),
        ("zero1 recompute full", S(dp=2, zero=1, micro_batch=2, recompute="full")),
    ]
    _report("SmallMLP, 2 ranks", run(rc.mlp_parity, 2, targets)[0])


def test_context_parallel_parity(gpt_graph, llama_graph):
    """``cp > 1`` through ``parallelize``: sequences split over ranks (load-balanced),
    keys/values all-gathered, gradients averaged over dp x cp, with DP, ZeRO, TP, PP."""
    targets = [
        ("cp2 x dp2 (DDP)", S(dp=2, cp=2)),
        ("cp4", S(cp=4)),
        ("cp2 x dp2 recompute selective", S(dp=2, cp=2, recompute="selective")),
        ("cp2 x pp2 recompute full", S(cp=2, pp=2, micro_batch=2, recompute="full")),
        ("cp2 x zero3 dp2", S(dp=2, cp=2, zero=3, micro_batch=2)),
        ("cp2 x tp2 sp", S(cp=2, tp=2, sequence_parallel=True)),
        ("cp2 x pp2 1f1b", S(cp=2, pp=2, micro_batch=2)),
        ("cp2 x pp2 zbv", S(cp=2, pp=2, micro_batch=1, schedule="zero_bubble")),
        ("llama cp2 x dp2 zero2", S(dp=2, cp=2, zero=2, micro_batch=2), "llama"),
        ("llama cp2 x tp2", S(cp=2, tp=2), "llama"),
        ("llama cp2 x pp2 interleaved", S(cp=2, pp=2, micro_batch=2, schedule="interleaved",
                                          virtual_stages=2), "llama"),
    ]
    graphs = {"gpt": gpt_graph["gpt"], "llama": llama_graph["llama"]}
    _report("context parallel, 4 ranks",
            run(functools.partial(rc.parity, graph=graphs), 4, "gpt", targets)[0])


def test_uneven_replicas_under_zero2_and_zero3_run_padded(gpt_graph, llama_graph):
    """Replicas of uneven batches under ZeRO-2/3 all run the largest replica's number of
    micro-batches, the extra ones with zero weight (Plan.pads_micro_batches): their
    per-micro-batch gathers and reduce-scatters match, and the gradient is still that of
    the mean loss over the global batch."""
    g, l = gpt_graph["gpt"], llama_graph["llama"]
    targets = [
        ("zero3 dp2 x tp2 6|2", rc.uneven_batches(rc.plan_for(S(dp=2, tp=2, zero=3), g), (6, 2))),
        ("zero2 dp4 3|1|2|2", rc.uneven_batches(rc.plan_for(S(dp=4, zero=2), g), (3, 1, 2, 2))),
        ("zero3 pp2 x dp2 1f1b 5|3", rc.uneven_batches(
            rc.plan_for(S(pp=2, dp=2, zero=3, micro_batch=1), g), (5, 3))),
        ("zero2 pp2 x dp2 zbv 5|3", rc.uneven_batches(
            rc.plan_for(S(pp=2, dp=2, zero=2, micro_batch=1, schedule="zero_bubble"), g), (5, 3))),
        ("llama zero3 dp2 x tp2 sp 2|6", rc.uneven_batches(
            rc.plan_for(S(dp=2, tp=2, zero=3, sequence_parallel=True), l), (2, 6)), "llama"),
        ("llama zero3 cp2 x dp2 3|5", rc.uneven_batches(
            rc.plan_for(S(dp=2, cp=2, zero=3), l), (3, 5)), "llama"),
    ]
    assert all(t[1].pads_micro_batches for t in targets)
    graphs = {"gpt": g, "llama": l}
    _report("uneven replicas under ZeRO-2/3 (padded), 4 ranks",
            run(functools.partial(rc.parity, graph=graphs), 4, "gpt", targets)[0])


def test_bf16_parity_2_ranks(gpt_graph):
    """bf16 (the default precision) at 2 ranks: 10 steps of DDP, FSDP2 (ZeRO-3), TP+SP and
    PP 1F1B against the fp32 single process, within ``BF16_FACTOR`` times the single-process
    bf16 error (the 8-rank version, with CP, Llama and 3-D layouts, is
    test_runtime_parity_8's, in the slow suite)."""
    B = functools.partial(Strategy, global_batch=rc.GLOBAL_BATCH, precision="bf16")
    targets = [
        ("dp2 (DDP)", B(dp=2), "gpt"),
        ("zero3 dp2", B(dp=2, zero=3), "gpt"),
        ("tp2 sp", B(tp=2, sequence_parallel=True), "gpt"),
        ("pp2 1f1b", B(pp=2, micro_batch=1), "gpt"),
    ]
    bounds = {"gpt": rc.bf16_bounds("gpt")}
    _report("bf16, 10 steps vs fp32 single process, 2 ranks",
            run(rc.bf16_parity, 2, targets, bounds, {"gpt": gpt_graph["gpt"]})[0])
