"""The README's quick start and CI agree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in block.splitlines()
            if line.startswith("    ") and line.strip().startswith("python -m pip install")]


def test_quick_start_has_exactly_two_commands():
    cmds = _commands()
    assert len(cmds) == 2, cmds
    assert all(c.startswith("python -m pip install torch==2.13.0 && ") for c in cmds)
    assert cmds[1].endswith("python -m pytest -q")


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    sed = re.search(r"test_command=\$\((sed .*)\)", script).group(1)
    out = subprocess.run(["bash", "-c", sed], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _commands()[1]


def test_readme_shows_the_legend_the_cli_prints():
    from autoplan.report import legend_text
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- legend:", 1)[1].split("```", 2)[1].strip("\n")
    assert block == legend_text()
