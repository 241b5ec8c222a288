"""Checkpoints saved under one layout load under another, at another world size (issue #8).

Three spawns, in order: 2 ranks save; 4 ranks save and load (the 2-rank
checkpoints too); 2 ranks load the 4-rank checkpoints.  Each load is labelled
``"<pair>: <saved layout> -> <loading layout>"`` and these pairs are each
covered explicitly (the test checks from the layouts that every label names
what it runs):

- DP (DDP) -> FSDP (ZeRO-3): a GPT saved under dp4 DDP loads under dp4 ZeRO-3;
- FSDP (ZeRO-3) -> DP (DDP): a GPT saved under dp4 ZeRO-3 loads under dp4 DDP;
- TP -> PP: a GPT saved under tp4 loads under pp4;
- PP -> TP: a GPT saved under pp4 loads under tp4;
- 4 -> 2 ranks: the 4-rank checkpoints (a Llama under dp2 x tp2 ZeRO-3, GPTs
  under pp2 x dp2 ZeRO-3 and dp4 ZeRO-3, a tied GPT under ZeRO-2) load under
  2-rank layouts (tp2, pp2, dp2 ZeRO-3, DDP);
- 2 -> 4 ranks: 2-rank checkpoints (a GPT under dp2 ZeRO-3, a tied GPT split
  over two pipeline stages, a Llama under tp2) load under 4-rank layouts.

Besides, at 4 ranks the Llama and pp2 x dp2 GPT checkpoints load under other
4-rank layouts (ZeRO-1, pp x tp, zero-bubble, GPipe, interleaved), the tied GPT
saved with one weight loads split over pipeline stages, and a second save
replaces the first atomically.

A load goes into a differently initialised model (seed 7) with a fresh
optimizer.  Every parameter and every optimizer state tensor (Adam's
``exp_avg``, ``exp_avg_sq`` and ``step`` of every parameter; the saved state
is checked to have all of them, as full unsharded tensors of the model's
shapes) must equal what was saved with ``atol=0, rtol=0`` and bit for bit:
the full state on rank 0, and on every rank the full tensors of the parts it
holds (a data-parallel replica or another pipeline group included).  One more
step must then match the step the saving run took (``ATOL``).
"""

from __future__ import annotations

import os

import pytest

import runtime_cases as rc
from dist_harness import run
from autoplan.strategy import Strategy

pytestmark = pytest.mark.distributed

DP_FSDP = "DP (DDP) -> FSDP (ZeRO-3)"
FSDP_DP = "FSDP (ZeRO-3) -> DP (DDP)"
TP_PP = "TP -> PP"
PP_TP = "PP -> TP"
FOUR_TWO = "4 -> 2 ranks"
TWO_FOUR = "2 -> 4 ranks"


def _pure(f: dict, *, dp: int = 1, tp: int = 1, pp: int = 1) -> bool:
    return (f["dp"], f["tp"], f["pp"]) == (dp, tp, pp)


#: what the saving (``src``) and the loading (``dst``) layout of each pair must be
PAIRS = {
    DP_FSDP: lambda src, dst: (src["wrap"] == "DDP" and src["zero"] == [0]
                               and dst["wrap"] == "FSDP" and dst["zero"] == [3]),
    FSDP_DP: lambda src, dst: (src["wrap"] == "FSDP" and src["zero"] == [3]
                               and dst["wrap"] == "DDP" and dst["zero"] == [0]),
    TP_PP: lambda src, dst: _pure(src, tp=src["world"]) and _pure(dst, pp=dst["world"]),
    PP_TP: lambda src, dst: _pure(src, pp=src["world"]) and _pure(dst, tp=dst["world"]),
    FOUR_TWO: lambda src, dst: src["world"] == 4 and dst["world"] == 2,
    TWO_FOUR: lambda src, dst: src["world"] == 2 and dst["world"] == 4,
}


def S(**kw) -> Strategy:
    return Strategy(global_batch=rc.GLOBAL_BATCH, precision="fp32", **kw)


def _record(jobs: list[tuple], results: list, saved: dict[str, dict],
            loaded: list[tuple[str, dict, dict]]) -> None:
    """Note what each save wrote (by path) and each load ran, with the saving layout."""
    for (kind, _, path, _), result in zip(jobs, results, strict=True):
        if kind == "save":
            saved[path] = result
        else:
            loaded.extend((label, saved[path], r) for label, r in result.items())


def test_checkpoints_reshard_across_layouts_and_world_sizes(tmp_path):
    pytest.importorskip("transformers")
    graphs = {name: rc.graph_json(name) for name in ("gpt", "llama", "gpt-tied")}
    ck = {name: str(tmp_path / name) for name in (
        "llama", "gpt", "tied", "gpt-ddp", "gpt-fsdp", "gpt-tp", "gpt-pp",    # 4 ranks
        "gpt-dp2z3", "tied-pp2", "llama-tp2")}                                 # 2 ranks
    saved: dict[str, dict] = {}
    loaded: list[tuple[str, dict, dict]] = []

    two_save = [
        ("save", "gpt", ck["gpt-dp2z3"], S(dp=2, zero=3)),
        # tied embedding/head: a copy per stage here
        ("save", "gpt-tied", ck["tied-pp2"], S(pp=2, micro_batch=2)),
        ("save", "llama", ck["llama-tp2"], S(tp=2)),
    ]
    _record(two_save, run(rc.checkpoint_suite, 2, two_save, graphs)[0], saved, loaded)

    four = [
        ("save", "llama", ck["llama"], S(dp=2, tp=2, zero=3)),
        ("save", "gpt", ck["gpt"], S(pp=2, dp=2, zero=3, micro_batch=2)),
        # tied embedding/head: one weight here, a copy per stage there
        ("save", "gpt-tied", ck["tied"], S(dp=4, zero=2)),
        # a second save replaces the first atomically
        ("save", "gpt", ck["gpt"], S(pp=2, dp=2, zero=3, micro_batch=2)),
        ("save", "gpt", ck["gpt-ddp"], S(dp=4)),
        ("save", "gpt", ck["gpt-fsdp"], S(dp=4, zero=3)),
        ("save", "gpt", ck["gpt-tp"], S(tp=4)),
        ("save", "gpt", ck["gpt-pp"], S(pp=4, micro_batch=2)),
        ("load", "gpt", ck["gpt-ddp"], [(f"{DP_FSDP}: dp4 -> dp4 zero3", S(dp=4, zero=3))]),
        ("load", "gpt", ck["gpt-fsdp"], [(f"{FSDP_DP}: dp4 zero3 -> dp4", S(dp=4))]),
        ("load", "gpt", ck["gpt-tp"], [(f"{TP_PP}: tp4 -> pp4", S(pp=4, micro_batch=2))]),
        ("load", "gpt", ck["gpt-pp"], [(f"{PP_TP}: pp4 -> tp4", S(tp=4))]),
        ("load", "gpt", ck["gpt-dp2z3"], [(f"{TWO_FOUR}: dp2 zero3 -> dp4 zero3",
                                           S(dp=4, zero=3)),
                                          (f"{TWO_FOUR}: dp2 zero3 -> pp2 x tp2",
                                           S(pp=2, tp=2, micro_batch=2))]),
        ("load", "gpt-tied", ck["tied-pp2"], [(f"{TWO_FOUR}: tied pp2 -> dp2 x tp2 zero3",
                                               S(dp=2, tp=2, zero=3))]),
        ("load", "llama", ck["llama-tp2"], [(f"{TWO_FOUR}: tp2 -> pp2 x dp2 zero1",
                                             S(pp=2, dp=2, zero=1, micro_batch=2))]),
        ("load", "llama", ck["llama"], [("dp2 x tp2 zero3 -> dp4 zero1", S(dp=4, zero=1)),
                                        ("dp2 x tp2 zero3 -> pp2 x tp2",
                                         S(pp=2, tp=2, micro_batch=2)),
                                        ("dp2 x tp2 zero3 -> pp2 x dp2 zero2 zbv",
                                         S(pp=2, dp=2, zero=2, schedule="zero_bubble"))]),
        ("load", "gpt", ck["gpt"], [("pp2 x dp2 zero3 -> dp4 (DDP)", S(dp=4)),
                                    ("pp2 x dp2 zero3 -> pp4 gpipe",
                                     S(pp=4, micro_batch=2, schedule="gpipe")),
                                    ("pp2 x dp2 zero3 -> interleaved zero3",
                                     S(pp=2, dp=2, zero=3, micro_batch=1,
                                       schedule="interleaved", virtual_stages=2))]),
        ("load", "gpt-tied", ck["tied"], [("tied dp4 zero2 -> pp2 x dp2 zbv",
                                           S(pp=2, dp=2, micro_batch=1,
                                             schedule="zero_bubble"))]),
    ]
    _record(four, run(rc.checkpoint_suite, 4, four, graphs)[0], saved, loaded)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [n for name in ck for n in (name, name + ".expected.pt")])
    assert os.path.isfile(os.path.join(ck["gpt"], "autoplan.json"))

    two_load = [
        ("load", "llama", ck["llama"], [(f"{FOUR_TWO}: dp2 x tp2 zero3 -> tp2", S(tp=2)),
                                        (f"{FOUR_TWO}: dp2 x tp2 zero3 -> pp2 1f1b",
                                         S(pp=2, micro_batch=2))]),
        ("load", "gpt", ck["gpt"], [(f"{FOUR_TWO}: pp2 x dp2 zero3 -> dp2 zero3",
                                     S(dp=2, zero=3)),
                                    (f"{FOUR_TWO}: pp2 x dp2 zero3 -> dp2 (DDP)", S(dp=2))]),
        ("load", "gpt", ck["gpt-fsdp"], [(f"{FOUR_TWO}: dp4 zero3 -> dp2 zero3",
                                          S(dp=2, zero=3))]),
        ("load", "gpt-tied", ck["tied"], [(f"{FOUR_TWO}: tied dp4 zero2 -> pp2 1f1b",
                                           S(pp=2, micro_batch=2))]),
    ]
    _record(two_load, run(rc.checkpoint_suite, 2, two_load, graphs)[0], saved, loaded)

    for label, src, dst in loaded:
        print(f"\n  {label}: loss {dst['loss_err']:.2g}, params {dst['param_err']:.2g} "
              f"after the next step  [{src['world']} ranks {src['layout']} ({src['wrap']}) -> "
              f"{dst['world']} ranks {dst['layout']} ({dst['wrap']})]", end="")
        assert dst["steps"] == 3, label
    labels = [label for label, _, _ in loaded]
    assert len(set(labels)) == len(labels), "labels name one load each"
    for pair, holds in PAIRS.items():
        runs = [(label, src, dst) for label, src, dst in loaded if label.startswith(pair + ":")]
        assert runs, f"no load covers {pair}"
        for label, src, dst in runs:
            assert holds(src, dst), f"{label} runs {src} -> {dst}"
