"""Parity at 8 processes (fp32) and in bf16 against a single-process reference (gloo, CPU).

The fp32 tests follow tests/test_runtime_parity.py: every layout trains the tiny
GPT or Llama (GQA) for 3 AdamW steps on the same global batch as the reference;
the loss after every step and every parameter after steps 1 and 3 must match
within ``ATOL = 1e-5``.  The pipelined layouts use the 8-block variants
(``gpt-8``, ``llama-8``), so that pp=2 with 4 chunks per rank has a block per chunk.

Coverage at 8 ranks (G = GPT, L = Llama):

- dp2 x tp2 x pp2 under 1F1B, interleaved 1F1B with v=2 and v=4, and zero-bubble
  (ZBV), with ZeRO-0/1/2/3 (ZeRO-3 only with 1F1B/interleaved: ZBV_ZERO3), sequence
  parallelism, and per-block mixed recompute (full / selective / none on one rank, laid
  out as the search's CP-SAT refinement emits it) (G, L);
- context parallelism: dp2 x cp2 x tp2 (+SP), cp2 x pp2 x dp2 (G, L);
- uneven replica batches (the search's speed-proportional split; ZeRO <= 1): on
  dp2 x tp2 x pp2 under 1F1B and ZBV, dp4 x cp2 and dp4 x tp2 (G, L);
- the three best plans autoplan.plan finds on an 8-process CPU cluster (G, L);
- bf16 (the default precision): 10 steps of DP, TP+SP, PP 1F1B, ZeRO-3, CP and a
  3-D layout against the fp32 reference, within 3x the single-process bf16 error
  (runtime_cases.bf16_bounds says why).

An 8-rank spawn costs ~8 s on 2 cores and each layout a few seconds, so each test
runs many layouts in one spawn; all are marked ``slow`` (the long suite, ``pytest -m slow``,
which .ci/run also runs); test_runtime_parity.py covers the same features at 2-4 ranks.  Tables of errors: ``pytest -s``.
"""

from __future__ import annotations

import functools

import pytest

import runtime_cases as rc
from dist_harness import run
from autoplan.strategy import Strategy

pytestmark = pytest.mark.distributed

#: An 8-rank spawn of many layouts takes a minute or more on 2 cores.
TIMEOUT_S = 600.0


def S(**kw) -> Strategy:
    kw.setdefault("precision", "fp32")
    return Strategy(global_batch=rc.GLOBAL_BATCH, **kw)


def D3(**kw) -> Strategy:
    """dp2 x tp2 x pp2, one sequence per micro-batch (4 micro-batches per replica)."""
    return S(dp=2, tp=2, pp=2, micro_batch=1, **kw)


def _report(title: str, results: dict) -> None:
    print(f"\n{title}")
    for label, r in results.items():
        rel = f"  rel {r['rel_err']:.1e}" if "rel_err" in r else ""
        print(f"  {label:44s} loss {r['loss_err']:.1e}  params {r['param_err']:.1e}{rel}  "
              f"{r['seconds']:.2f}s")


@pytest.fixture(scope="module")
def graphs() -> dict[str, str]:
    pytest.importorskip("transformers")
    return {name: rc.graph_json(name) for name in ("gpt", "llama", "gpt-8", "llama-8")}


def _pipelines(g: str) -> list[tuple]:
    """dp2 x tp2 x pp2 under every schedule, ZeRO stage, SP and mixed recompute."""
    return [
        ("1f1b", D3()),
        ("1f1b zero3 sp", D3(zero=3, sequence_parallel=True)),
        ("1f1b zero1 mixed recompute", rc.mixed_recompute(rc.plan_for(D3(zero=1), g))),
        ("interleaved v2 zero1", D3(zero=1, schedule="interleaved", virtual_stages=2)),
        ("interleaved v4 zero3 sp", D3(zero=3, sequence_parallel=True, schedule="interleaved",
                                       virtual_stages=4)),
        ("interleaved v2 zero3 mixed recompute",
         rc.mixed_recompute(rc.plan_for(D3(zero=3, schedule="interleaved", virtual_stages=2), g))),
        ("zbv zero1", D3(zero=1, schedule="zero_bubble")),
        # full and none only: selective recompute is refused under ZBV (strategy.ZBV_SELECTIVE)
        ("zbv zero2 sp mixed recompute full/none",
         rc.mixed_recompute(rc.plan_for(D3(zero=2, sequence_parallel=True,
                                           schedule="zero_bubble"), g), ("full", "none"))),
    ]


@pytest.mark.slow
def test_gpt_parity_8_ranks_3d(graphs):
    targets = _pipelines(graphs["gpt-8"])
    _report("GPT-8, dp2 x tp2 x pp2, 8 ranks",
            run(functools.partial(rc.parity, graph=graphs), 8, "gpt-8", targets,
                timeout=TIMEOUT_S)[0])


@pytest.mark.slow
def test_llama_parity_8_ranks_3d(graphs):
    targets = _pipelines(graphs["llama-8"])
    _report("Llama-8 (GQA), dp2 x tp2 x pp2, 8 ranks",
            run(functools.partial(rc.parity, graph=graphs), 8, "llama-8", targets,
                timeout=TIMEOUT_S)[0])


@pytest.mark.slow   # CP inside 3-D layouts; 4-rank CP and uneven replicas: test_runtime_parity
def test_context_parallel_and_uneven_batches_8_ranks(graphs):
    """CP in 3-D layouts, and replicas with different batch shares (ZeRO <= 1: the
    replicas' per-micro-batch collectives must match), weighted by their share."""
    targets = [
        ("dp2 x cp2 x tp2 sp", S(dp=2, cp=2, tp=2, sequence_parallel=True), "gpt"),
        ("cp2 x pp2 x dp2 1f1b zero2", S(cp=2, pp=2, dp=2, micro_batch=1, zero=2), "gpt-8"),
        ("uneven 3|2|2|1 dp4 x cp2",
         rc.uneven_batches(rc.plan_for(S(dp=4, cp=2), graphs["gpt"]), (3, 2, 2, 1)), "gpt"),
        ("llama dp2 x cp2 x tp2 zero3", S(dp=2, cp=2, tp=2, zero=3), "llama"),
        ("llama cp2 x pp2 x dp2 interleaved", S(cp=2, pp=2, dp=2, micro_batch=1,
                                                schedule="interleaved", virtual_stages=2),
         "llama-8"),
        ("llama uneven 1|3|2|2 dp4 x tp2 zero1",
         rc.uneven_batches(rc.plan_for(S(dp=4, tp=2, zero=1), graphs["llama"]), (1, 3, 2, 2)),
         "llama"),
    ]
    _report("context parallel and uneven replica batches, 8 ranks",
            run(functools.partial(rc.parity, graph=graphs), 8, "gpt", targets,
                timeout=TIMEOUT_S)[0])


@pytest.mark.slow
def test_uneven_batches_pipelined_8_ranks(graphs):
    """Replicas with different batch shares under 1F1B and ZBV (ZeRO <= 1)."""
    targets = [
        ("uneven 6|2 dp2 x tp2 x pp2 1f1b zero1",
         rc.uneven_batches(rc.plan_for(D3(zero=1), graphs["gpt-8"]), (6, 2)), "gpt-8"),
        ("llama uneven 5|3 dp2 x tp2 x pp2 zbv",
         rc.uneven_batches(rc.plan_for(D3(schedule="zero_bubble"), graphs["llama-8"]), (5, 3)),
         "llama-8"),
    ]
    _report("uneven replica batches, pipelined, 8 ranks",
            run(functools.partial(rc.parity, graph=graphs), 8, "gpt-8", targets,
                timeout=TIMEOUT_S)[0])


@pytest.mark.slow   # 8-rank searched plans; 4-rank ones: test_runtime_parity.test_searched_plans_parity
def test_searched_plans_parity_8_ranks(graphs):
    """The three best plans autoplan.plan finds for each model on an 8-process CPU cluster."""
    names = ("gpt", "llama")
    plans = {name: rc.searched_plans(graphs[name], world=8) for name in names}
    assert all(len(p) == 3 for p in plans.values()), plans
    results = run(rc.searched_plans_parity, 8, {n: graphs[n] for n in names}, plans,
                  timeout=TIMEOUT_S)[0]
    _report("plans from autoplan.plan, 8 ranks", results)


@pytest.mark.slow   # bf16 of 3-D layouts; 2-rank bf16: test_runtime_parity.test_bf16_parity_2_ranks
def test_bf16_parity_8_ranks(graphs):
    """10 bf16 steps (autocast, fp32 master weights and AdamW) of DP, TP+SP, PP 1F1B,
    ZeRO-3, CP and a 3-D layout against the fp32 single process, within
    ``BF16_FACTOR`` (3) times the single-process bf16 error (runtime_cases.bf16_bounds:
    why 3, and that the bounds sit well below the error of a missing reduction)."""
    B = functools.partial(S, precision="bf16")
    targets = [
        ("dp8 (DDP)", B(dp=8), "gpt"),
        ("dp4 x tp2 sp", B(dp=4, tp=2, sequence_parallel=True), "gpt"),
        ("pp2 x dp4 1f1b", B(pp=2, dp=4, micro_batch=1), "gpt"),
        ("zero3 dp8", B(dp=8, zero=3), "gpt"),
        ("cp2 x dp4", B(cp=2, dp=4), "gpt"),
        ("dp2 x tp2 x pp2 zero1 sp 1f1b", B(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True),
         "gpt"),
        ("llama dp2 x tp2 x pp2 1f1b", B(dp=2, tp=2, pp=2), "llama"),
        ("llama cp2 x tp2 x dp2 zero3", B(cp=2, tp=2, dp=2, zero=3), "llama"),
    ]
    bounds = {name: rc.bf16_bounds(name) for name in ("gpt", "llama")}
    for name, b in bounds.items():
        print(f"\n{name}: single-process bf16 vs fp32 after {b['steps']} steps: "
              + ", ".join(f"{k} {v:.2e}" for k, v in b["single_bf16"].items())
              + "; tolerance " + ", ".join(f"{k} {v:.2e}" for k, v in b["tol"].items())
              + "; half-batch bug " + ", ".join(f"{k} {v:.2e}" for k, v in b["bug"].items()))
    _report("bf16, 10 steps vs fp32 single process, 8 ranks",
            run(rc.bf16_parity, 8, targets, bounds, graphs, timeout=TIMEOUT_S)[0])
