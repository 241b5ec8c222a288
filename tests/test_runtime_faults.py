"""Bad layouts fail fast and alike on every rank; a crashed or hung rank becomes an error.

``parallelize`` validates a layout against the world and the model before its
first collective: each rank below asks for a bad layout *alone*, so any
collective would hang (and then time out with a RuntimeError, not the expected
error).  A crashed peer surfaces at once (gloo sees the connection close); a
hung one after the process group's timeout, set at ``init_process_group``.
"""

from __future__ import annotations


import pytest

import runtime_cases as rc
from autoplan.plan import Plan
from dist_harness import run, run_outcomes

pytestmark = pytest.mark.distributed

#: the process-group timeout the hang test runs under, seconds
PG_TIMEOUT_S = 5.0


def test_bad_layouts_are_rejected_before_any_collective():
    out = run(rc.bad_plans_issue_no_collective, 2, pg_timeout=30)
    for rank, result in enumerate(out):
        errors = result["errors"]
        assert set(errors) == {"unknown layer", "degrees vs world", "tp vs heads"}, rank
        kind, message, seconds = errors["unknown layer"]
        assert kind == "PlanMismatchError" and "blocks.7" in message
        kind, message, seconds = errors["degrees vs world"]
        assert kind == "StrategyError" and "dp=2 x tp=2 x pp=1 x cp=1 = 4" in message
        assert "world has 2" in message
        kind, message, seconds = errors["tp vs heads"]
        assert kind == "StrategyError" and "tp=2 does not divide" in message
        assert result["loss_after"] > 0


def test_crashed_rank_surfaces_as_an_error_at_once():
    outcomes = run_outcomes(rc.crashed_peer, 2, "crash", pg_timeout=60, timeout=120, grace=30)
    assert outcomes[1].exitcode == 17
    survivor = outcomes[0].value
    assert survivor is not None, outcomes[0].error
    assert survivor["raised"] == "RuntimeError"
    assert survivor["seconds"] < 10, survivor   # far below the 60 s collective timeout


def test_hung_rank_surfaces_after_the_collective_timeout():
    outcomes = run_outcomes(rc.crashed_peer, 2, "hang", pg_timeout=PG_TIMEOUT_S, timeout=120,
                            grace=1)
    survivor = outcomes[0].value
    assert survivor is not None, outcomes[0].error
    assert survivor["raised"] == "RuntimeError" and "Timed out" in survivor["message"]
    assert PG_TIMEOUT_S - 1 < survivor["seconds"] < PG_TIMEOUT_S + 10, survivor
    assert outcomes[1].killed   # the hung rank was killed by the harness, not waited for


def test_cluster_target_plans_once_and_every_rank_applies_the_same_plan():
    out = run(rc.cluster_target, 2)
    assert out[0]["plan"] == out[1]["plan"]
    assert out[0]["loss"] == out[1]["loss"] > 0
    assert Plan.from_json(out[0]["plan"]).num_devices == 2
