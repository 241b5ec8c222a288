"""Priced = run: the collectives and matmuls of real steps against the estimate's ledger.

For each layout a tiny model of one of three families (the package GPT, a Hugging Face
Llama with grouped-query attention, Mixtral and Qwen3-MoE for experts) trains on gloo
ranks; its third step is recorded operator by operator (autoplan.runtime.ledger: every
collective's kind, group, dtype and bytes; every matmul's dtype and FLOPs) and compared
with the ledger of the same plan's estimate (autoplan.cost.ledger), within 5%
(ledger_cases.TOLERANCE).  Every collective that runs must be priced, every collective
priced must run, and a bf16 plan must run every matmul and move every activation and
weight in bf16 (gradients are reduced in fp32, as the autoplan stack states); an FP8 plan
(torchao, emulated) its converted linears' GEMMs in fp8 and the rest in bf16, with the
scale all-reduces and FP8 all-gathers of autoplan.cost.fp8.  Where
tokens are routed to experts, how much a rank sends and computes depends on the router
(the estimate prices balanced routing): those all-to-alls and the FLOPs are compared
summed over the ranks, everything else rank by rank.

Coverage: DP (DDP at fp32, FSDP2's replicate at bf16), ZeRO-1/2/3 (with gradient
accumulation), TP and TP + SP, full and selective recompute, PP under GPipe, 1F1B,
interleaved 1F1B and ZBV, CP, EP (with ZeRO and with PP), and on 4 ranks DP x TP x SP,
PP x DP x ZeRO, CP x TP, TP x PP with a tied embedding, EP x PP; FP8: DP, ZeRO-3 with
FP8 all-gathers (also under full recompute), TP + SP with torchao's float8 styles, rowwise
TP + SP, PP, EP (its experts in bf16), and on 4 ranks DP x TP with ZeRO-3's FP8
all-gathers and scales over both.
"""

from __future__ import annotations

import functools

import pytest

import ledger_cases as lc
import runtime_cases as rc
from dist_harness import run
from autoplan.strategy import Strategy

pytestmark = pytest.mark.distributed

B = functools.partial(Strategy, precision="bf16", global_batch=rc.GLOBAL_BATCH)

TWO_RANKS = [
    ("gpt dp2 fp32 (DDP)", B(dp=2, precision="fp32"), "gpt"),
    ("gpt dp2 (replicate)", B(dp=2), "gpt"),
    ("llama dp2 zero1 mb2", B(dp=2, zero=1, micro_batch=2), "llama"),
    ("llama dp2 zero2 mb2", B(dp=2, zero=2, micro_batch=2), "llama"),
    ("llama dp2 zero3 full recompute", B(dp=2, zero=3, recompute="full"), "llama"),
    ("gpt tp2", B(tp=2), "gpt"),
    ("gpt tp2 sp selective", B(tp=2, sequence_parallel=True, recompute="selective"), "gpt"),
    ("llama tp2 sp", B(tp=2, sequence_parallel=True, micro_batch=8), "llama"),
    ("gpt pp2 gpipe", B(pp=2, micro_batch=2, schedule="gpipe"), "gpt"),
    ("gpt pp2 1f1b", B(pp=2, micro_batch=1, schedule="1f1b"), "gpt"),
    ("llama-8 pp2 interleaved", B(pp=2, micro_batch=2, schedule="interleaved",
                                  virtual_stages=2), "llama-8"),
    ("gpt pp2 zbv", B(pp=2, micro_batch=2, schedule="zero_bubble"), "gpt"),
    ("llama cp2", B(cp=2), "llama"),
    ("mixtral ep2", B(dp=2, ep=2), "mixtral"),
    ("qwen3moe ep2 zero2", B(dp=2, ep=2, zero=2, micro_batch=2), "qwen3moe"),
    # FP8 (torchao, emulated): GEMMs, scale all-reduces, FP8 all-gathers
    ("gpt dp2 fp8", B(dp=2, precision="fp8"), "gpt"),
    ("llama dp2 zero3 fp8 (FP8 all-gather)", B(dp=2, zero=3, micro_batch=2, precision="fp8"),
     "llama"),
    ("llama tp2 sp fp8 (float8 styles)", B(tp=2, sequence_parallel=True, micro_batch=4,
                                          precision="fp8"), "llama"),
    ("gpt tp2 sp fp8-rowwise", B(tp=2, sequence_parallel=True, micro_batch=4,
                                 precision="fp8-rowwise"), "gpt"),
    ("gpt dp2 zero3 full recompute fp8", B(dp=2, zero=3, recompute="full", precision="fp8"),
     "gpt"),
    ("gpt pp2 1f1b fp8", B(pp=2, micro_batch=2, schedule="1f1b", precision="fp8"), "gpt"),
    ("mixtral ep2 fp8 (experts bf16)", B(dp=2, ep=2, precision="fp8"), "mixtral"),
]
FOUR_RANKS = [
    ("gpt dp2 tp2 sp zero1", B(dp=2, tp=2, sequence_parallel=True, zero=1, micro_batch=2),
     "gpt"),
    ("llama pp2 dp2 zero2 1f1b", B(pp=2, dp=2, zero=2, micro_batch=1, schedule="1f1b"),
     "llama"),
    ("llama cp2 tp2", B(cp=2, tp=2), "llama"),
    ("gpt-tied tp2 pp2", B(tp=2, pp=2, micro_batch=2), "gpt-tied"),
    ("mixtral dp2 pp2 ep2", B(dp=2, pp=2, ep=2, micro_batch=2), "mixtral"),
    ("llama pp2 dp2 zero3 gpipe", B(pp=2, dp=2, zero=3, micro_batch=1, schedule="gpipe"),
     "llama"),
    ("llama pp2 dp2 zero3 1f1b", B(pp=2, dp=2, zero=3, micro_batch=1, schedule="1f1b"),
     "llama"),
    # (2-D FP8 all-gathers; with sequence parallelism too, ZeRO-3 x TP reduces the norms'
    # partial gradients in bf16 at the first micro-batch, which the bf16 ledger prices in
    # fp32 as well: not an FP8 matter)
    ("llama dp2 tp2 zero3 fp8 (2-D FP8 all-gather)",
     B(dp=2, tp=2, zero=3, micro_batch=2, precision="fp8"), "llama"),
]


@pytest.fixture(scope="module")
def graphs() -> dict[str, str]:
    pytest.importorskip("transformers")
    names = {name for _, _, name in TWO_RANKS + FOUR_RANKS}
    return {name: rc.graph_json(name) for name in sorted(names)}


def _summed(results: list[dict], key: str) -> dict:
    out: dict = {}
    for r in results:
        for k, v in r[key].items():
            out[k] = out.get(k, 0.0) + v
    return out


def _check(label: str, target: Strategy, ranks: list[dict]) -> list[str]:
    """What differs between the run and the estimate of one layout (empty: nothing)."""
    problems = []
    routed = target.ep > 1
    want = (["bf16", "fp8"] if target.precision.is_fp8 else
            ["bf16"] if target.precision.value == "bf16" else ["fp32"])
    for rank, r in enumerate(ranks):
        if r["matmul_dtypes"] != want:
            problems.append(f"rank {rank}: matmuls in {r['matmul_dtypes']}, not {want}")
        run_keys, priced_keys = set(r["run"]), set(r["priced"])
        for k in sorted(run_keys - priced_keys):
            problems.append(f"rank {rank}: {k} runs ({r['run'][k]:.0f} B) but is not priced")
        for k in sorted(priced_keys - run_keys):
            problems.append(f"rank {rank}: {k} is priced ({r['priced'][k]:.0f} B) but never runs")
    per_rank = [(f"rank {i}", r["run"], r["priced"]) for i, r in enumerate(ranks)]
    pairs = ([("all ranks", _summed(ranks, "run"), _summed(ranks, "priced"))] if routed
             else per_rank)
    pairs += [("all ranks" if routed else f"rank {i}", {"flops " + k: v for k, v in
               (_summed(ranks, "run_flops") if routed else r["run_flops"]).items()},
               {"flops " + k: v for k, v in
               (_summed(ranks, "priced_flops") if routed else r["priced_flops"]).items()})
              for i, r in (enumerate(ranks[:1]) if routed else enumerate(ranks))]
    for where, run_, priced in pairs:
        for k in sorted(set(run_) & set(priced), key=str):
            if abs(run_[k] - priced[k]) > lc.TOLERANCE * priced[k]:
                problems.append(f"{where}: {k} runs {run_[k]:.0f}, priced {priced[k]:.0f} "
                                f"({run_[k] / priced[k]:.3f}x)")
    return problems


def _run_and_check(world: int, targets: list[tuple], graphs: dict[str, str]) -> None:
    results = run(lc.measure, world, targets, graphs, timeout=600)
    problems = []
    print()
    for label, target, _ in targets:
        ranks = [r[label] for r in results]
        moved = sum(sum(r["run"].values()) for r in ranks)
        print(f"  {label:34s} {moved / 1e3:9.1f} kB moved, "
              f"{sum(sum(r['run_flops'].values()) for r in ranks) / 1e6:8.2f} MFLOP")
        problems += [f"{label}: {p}" for p in _check(label, target, ranks)]
    assert not problems, "\n".join(problems)


def test_two_rank_layouts_run_what_they_price(graphs):
    _run_and_check(2, TWO_RANKS, graphs)


def test_four_rank_layouts_run_what_they_price(graphs):
    _run_and_check(4, FOUR_RANKS, graphs)
