"""The example notebooks run from top to bottom, and are committed without outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["gpt3_175b_scaling", "heterogeneous", "moe_expert_parallel", "recompute_zero_tradeoff",
         "sparse_parameter_server"]
# Each notebook runs in 15-35 s on two idle cores; the bound only catches a notebook
# that has grown pathological, with room for a loaded CI machine.
BUDGET_S = 300


def test_the_expected_notebooks_exist():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}.ipynb cell {i} has outputs: clear them before committing"
            assert cell.execution_count is None, f"{name}.ipynb cell {i} has an execution count"
    assert "widgets" not in nb.metadata


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=BUDGET_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    # the cell timeout guards against a hang; run time is not asserted (a loaded machine)
    client.execute()          # raises CellExecutionError, naming the cell, on any error
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})]
    assert images, f"{name}.ipynb drew no figure"
