"""Issue 68's table and node sweeps, as ``benchmarks/search_coverage.py`` prints them.

Each row of the issue's table plans (or replans) a setup the search once returned a
clearly slower plan for; the plan must be within 2% of the better plan the same cost
model prices.  The sweeps plan GPT-3 175B and Llama-3-70B on every count of 120..128
A100 nodes: within 2% of the best plan using every device of any count up to it, and a
replan from 128 nodes within 3%.  The table is printed (``pytest -s`` shows it); the
planning times are the benchmark's figures, not asserted here; the searches run with
the library's defaults, whose budget counts steps, not seconds (a loaded machine finds
the same plans).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import search_coverage as sc  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("row", sc.ROWS, ids=[r.model + "-" + str(r.nodes) + "-" + r.stack
                                              + ("-replan" if r.replan_from else "")
                                              + (f"-b{r.batch}" if r.other_batch else "")
                                              for r in sc.ROWS])
def test_issue_table_row_is_within_2_percent_of_the_better_plan(row):
    result = sc.run_row(row)
    sc.print_table([result])
    assert result.plan.estimate.fits
    assert result.ratio <= sc.PLAN_TARGET + 1e-9, (row.name, result.plan.summary(),
                                                   result.better_what, result.better)


@pytest.mark.parametrize("model", list(sc.SWEEP_MODELS))
def test_node_sweep_plan_and_replan_are_near_the_best(model):
    rows = sc.sweep_rows(model)
    sc.print_sweep(model, rows)
    for r in rows:
        assert r.plan_ratio <= sc.PLAN_TARGET + 1e-9, r
        assert r.replan_ratio <= sc.REPLAN_TARGET + 1e-9, r
