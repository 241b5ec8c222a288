"""The README's quick start and CI agree; the README and docs/ read as prose a person reads
(no line over 120 characters outside code blocks), their links lead somewhere, and the
legend they show is the one the command line prints."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: The widest line of prose or table a page may hold (code blocks may be wider).
MAX_LINE = 120
#: The README is a front door: a few screens, depth in docs/.
MAX_README_LINES = 250


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in block.splitlines()
            if line.startswith("    ") and line.strip().startswith("python -m pip install")]


def test_quick_start_has_exactly_two_commands():
    cmds = _commands()
    assert len(cmds) == 2, cmds
    assert all(c.startswith("python -m pip install torch==2.13.0 && ") for c in cmds)
    assert cmds[0].endswith("autoplan demo")
    assert cmds[1].endswith('python -m pytest -q -n auto -m "not slow"')


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    sed = re.search(r"test_command=\$\((sed .*)\)", script).group(1)
    out = subprocess.run(["bash", "-c", sed], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _commands()[1]


def test_the_docs_show_the_legend_the_cli_prints():
    from autoplan.report import legend_text
    text = (ROOT / "docs" / "cli.md").read_text()
    block = text.split("<!-- legend:", 1)[1].split("```", 2)[1].strip("\n")
    assert block == legend_text()


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of what is not code: fenced blocks and indented code blocks
    (four spaces after a blank line) are left out.

    >>> prose_lines("a\\n```\\nlong code\\n```\\n\\n    indented\\nb")
    [(1, 'a'), (5, ''), (7, 'b')]
    """
    out, fenced, indented, previous = [], False, False, ""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            indented = line.startswith("    ") and (indented or not previous.strip())
            if not indented:
                out.append((number, line))
        previous = line
    return out


def test_prose_lines_leave_out_code():
    text = "a\n```\nlong code\n```\n\n    indented\nb\n- item\n    continued"
    assert prose_lines(text) == [(1, "a"), (5, ""), (7, "b"), (8, "- item"), (9, "    continued")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_line_over_120_characters_outside_code(page: Path):
    long = [f"{page.name}:{n}: {len(line)} characters" for n, line in prose_lines(page.read_text())
            if len(line) > MAX_LINE]
    assert not long, "\n".join(long)


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"{len(lines)} lines: move depth to docs/"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    heads = [line.lstrip("#").strip() for _, line in prose_lines(page.read_text())
             if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_lead_to_files_and_headings_that_exist(page: Path):
    bad = []
    for _, line in prose_lines(page.read_text()):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)
