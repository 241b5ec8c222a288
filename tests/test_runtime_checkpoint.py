"""Checkpoints saved under one layout load under another, at another world size.

One 4-rank spawn saves a Llama under dp2 x tp2 ZeRO-3, a GPT under pp2 x dp2
ZeRO-3 and a GPT with tied embeddings under ZeRO-2, and loads each under other
4-rank layouts (the tied one split over pipeline stages); one 2-rank spawn
loads them under 2-rank layouts.  Loading into a differently initialised model
must give exactly (``atol=0``) the saved parameters and optimizer state, and one
more step must match the step the saving run took (``ATOL``).
"""

from __future__ import annotations

import os

import pytest

import runtime_cases as rc
from dist_harness import run
from autoplan.strategy import Strategy

pytestmark = pytest.mark.distributed


def S(**kw) -> Strategy:
    return Strategy(global_batch=rc.GLOBAL_BATCH, precision="fp32", **kw)


def test_checkpoints_reshard_across_layouts_and_world_sizes(tmp_path):
    pytest.importorskip("transformers")
    graphs = {name: rc.graph_json(name) for name in ("gpt", "llama", "gpt-tied")}
    llama, gpt, tied = str(tmp_path / "llama"), str(tmp_path / "gpt"), str(tmp_path / "tied")
    four = [
        ("save", "llama", llama, S(dp=2, tp=2, zero=3)),
        ("save", "gpt", gpt, S(pp=2, dp=2, zero=3, micro_batch=2)),
        # tied embedding/head: one weight here, a copy per stage there
        ("save", "gpt-tied", tied, S(dp=4, zero=2)),
        # a second save replaces the first atomically
        ("save", "gpt", gpt, S(pp=2, dp=2, zero=3, micro_batch=2)),
        ("load", "llama", llama, [("dp4 zero1", S(dp=4, zero=1)),
                                  ("pp2 x tp2", S(pp=2, tp=2, micro_batch=2)),
                                  ("pp2 x zero2 zbv", S(pp=2, dp=2, zero=2,
                                                        schedule="zero_bubble"))]),
        ("load", "gpt", gpt, [("dp4 (DDP)", S(dp=4)),
                              ("pp4 gpipe", S(pp=4, micro_batch=2, schedule="gpipe")),
                              ("interleaved zero3", S(pp=2, dp=2, zero=3, micro_batch=1,
                                                      schedule="interleaved", virtual_stages=2))]),
        ("load", "gpt-tied", tied, [("pp2 x dp2 zbv", S(pp=2, dp=2, micro_batch=1,
                                                        schedule="zero_bubble"))]),
    ]
    out = run(rc.checkpoint_suite, 4, four, graphs)[0]
    print("\n4 ranks:", *out[4:], sep="\n  ")
    assert sorted(os.listdir(tmp_path)) == ["gpt", "gpt.expected.pt", "llama", "llama.expected.pt",
                                            "tied", "tied.expected.pt"]
    assert os.path.isfile(os.path.join(gpt, "autoplan.json"))
    two = [
        ("load", "llama", llama, [("tp2", S(tp=2)), ("pp2 1f1b", S(pp=2, micro_batch=2))]),
        ("load", "gpt", gpt, [("zero3 dp2", S(dp=2, zero=3)), ("tp1 dp2 (DDP)", S(dp=2))]),
        ("load", "gpt-tied", tied, [("pp2 1f1b", S(pp=2, micro_batch=2))]),
    ]
    out = run(rc.checkpoint_suite, 2, two, graphs)[0]
    print("2 ranks:", *out, sep="\n  ")
    for result in out:
        for label, r in result.items():
            assert r["steps"] == 3, label
