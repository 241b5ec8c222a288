"""``benchmarks/memory_cpu.py`` without real runs, and the live-bytes count it measures with
(autoplan.runtime.ledger.LiveBytes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import memory_cpu as mc  # noqa: E402

from autoplan.runtime.ledger import LiveBytes  # noqa: E402


def test_live_bytes_counts_storages_at_their_current_size():
    """FSDP2 frees a layer's unsharded parameters by resizing their storages to 0 and
    gathers them again by resizing back, with no operator dispatched: the count follows
    the size (first-sight sizes counted every gathered layer until the step ended)."""
    import torch
    gathered = torch.empty(1000)                  # 4000 bytes, alive at entry
    resharded = torch.empty(250)
    resharded.untyped_storage().resize_(0)        # at entry as FSDP2 leaves it: 0 bytes
    with LiveBytes() as live:
        entry = live.current
        gathered.untyped_storage().resize_(0)     # resharded after its forward
        grad = torch.ones(500)                    # 2000 bytes, an operator's output
        assert live.current == entry - 4000 + 2000
        resharded.untyped_storage().resize_(1000)  # gathered for its forward
        assert live.current == entry - 2000 + 1000
    assert live.peak == entry
    del grad


def test_the_worst_rank_is_judged_against_its_own_stage():
    predicted = [(100.0, 40.0), (50.0, 20.0)]       # stage 0, stage 1
    ranks = [{"pp_rank": 0, "peak_bytes": 104.0}, {"pp_rank": 1, "peak_bytes": 40.0},
             {"pp_rank": 0, "peak_bytes": 98.0}]
    worst, err = mc.worst_rank(predicted, ranks)
    assert worst is ranks[1] and err == pytest.approx(0.25)


def test_every_layout_is_predicted_and_an_unknown_one_is_a_usage_error(capsys):
    predicted = mc.predict_memory(["DP=2", "DP2 x PP2"])
    assert len(predicted["DP=2"]) == 1 and len(predicted["DP2 x PP2"]) == 2
    for stages in predicted.values():
        assert all(0 < states < total for total, states in stages)
    assert mc.main(["--list"]) == 0
    assert "'ZeRO-3 dp4': 4 processes" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        mc.main(["DP=3"])
    assert exc.value.code == 2 and "unknown layout(s) 'DP=3'" in capsys.readouterr().err
