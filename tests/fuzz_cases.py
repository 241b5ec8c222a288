"""Fuzz cases shared by ``tests/test_fuzz.py`` (a few hundred, in CI) and
``benchmarks/fuzz.py`` (thousands): command lines, corrupted profile YAML and
corrupted plan JSON, each run through the CLI in-process.

A case *passes* when the command ends cleanly (exit code 0, 1 or 2, with any error
an :class:`~autoplan.errors.AutoplanError` turned into one line) and a second run
prints the same.  Anything else is a traceback a user would see.
"""

from __future__ import annotations

import contextlib
import io
import json
import traceback
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from autoplan.cli import main

#: A model small enough to capture in well under a second.
TINY_GPT = ["gpt", "--seq-len", "16", "--model-arg", "vocab_size=64", "--model-arg", "seq_len=16",
            "--model-arg", "hidden=32", "--model-arg", "heads=4", "--model-arg", "layers=2"]

_MODELS = ["gpt", "zoo:llama9", "hf:lama", "nope.py:make", "zoo:", "hf:", ":", ""]
_CLUSTERS = ["a100-sxm4-80gb", "h100-sxm5-80gb", "two-sites", "a100-sxm4-8gb", "", "x.yaml",
             "/nonexistent/p.yaml"]
_NUMBERS = ["0", "1", "2", "3", "8", "16", "-1", "1.5", "abc", "1e9", "nan", "inf", ""]
_FLAGS = ["--cluster", "--nodes", "--global-batch", "--dp", "--tp", "--pp", "--cp", "--micro-batch",
          "--seq-len", "--top-k", "--memory-fraction", "--time-limit", "--zero", "--recompute",
          "--schedule", "--virtual-stages", "--precision", "--price", "--model-arg", "--json",
          "--plan", "--sequence-parallel", "--debug-not-a-flag"]
_MODEL_ARGS = ["layers=abc", "hiden=4", "heads=3", "hidden=0", "layers=2", "vocab_size=-1",
               "attention=sdpa", "bias=1", "noequals", "=", "ffn=None"]
COMMANDS = ["trace", "estimate", "plan", "report", "whatif", "emit", "demo", "trce", ""]


@st.composite
def command_lines(draw) -> list[str]:
    """A command line: a command, a model (mostly the tiny GPT, so a run stays fast), then
    a random mix of flags and values, valid and not."""
    command = draw(st.sampled_from(COMMANDS))
    argv = [command] if command else []
    if command in ("trace", "estimate", "plan", "report", "whatif"):
        argv += TINY_GPT if draw(st.booleans()) else [draw(st.sampled_from(_MODELS))]
    if command in ("estimate", "plan", "report", "whatif") and draw(st.booleans()):
        argv += ["--cluster", draw(st.sampled_from(_CLUSTERS[:3])), "--global-batch",
                 draw(st.sampled_from(["8", "16"]))]
    for _ in range(draw(st.integers(0, 4))):
        flag = draw(st.sampled_from(_FLAGS))
        argv.append(flag)
        if flag == "--cluster":
            argv.append(draw(st.sampled_from(_CLUSTERS)))
        elif flag == "--model-arg":
            argv.append(draw(st.sampled_from(_MODEL_ARGS)))
        elif flag in ("--recompute", "--schedule", "--precision"):
            argv.append(draw(st.sampled_from(["none", "full", "1f1b", "interleaved", "bf16", "fp8"])))
        elif flag not in ("--json", "--sequence-parallel"):
            argv.append(draw(st.sampled_from(_NUMBERS)))
    return argv


_YAML_NOISE = ["", ":", "- ", "null", "[]", "{}", "-1", "0", "1e400", "nan", "'x'", "\t", "!!python/object:os.system",
               "&a", "*a", "\x00", "é", "[[[[", "name: other"]


@st.composite
def corrupted_texts(draw, text: str, noise: list[str]) -> bytes:
    """``text`` with a few random edits: lines dropped, duplicated or replaced with noise,
    a value replaced, bytes flipped, or the file cut short."""
    lines = text.splitlines()
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["drop", "dup", "noise", "value", "cut", "bytes"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if not lines:
            break
        if kind == "drop":
            del lines[i]
        elif kind == "dup":
            lines.insert(i, lines[i])
        elif kind == "noise":
            lines[i] = draw(st.sampled_from(noise))
        elif kind == "value" and ":" in lines[i]:
            key = lines[i].split(":", 1)[0]
            lines[i] = f"{key}: {draw(st.sampled_from(noise + _NUMBERS))}"
        elif kind == "cut":
            lines = lines[:i]
    data = "\n".join(lines).encode("utf-8")
    if draw(st.booleans()) and data:
        pos = draw(st.integers(0, len(data) - 1))
        data = data[:pos] + bytes([draw(st.integers(0, 255))]) + data[pos + 1:]
    return data


_JSON_NOISE = ['"x"', "null", "-1", "0", "1e400", "[]", "{}", "true", '"bf16"', "[1, 2]", "1.5"]


@st.composite
def corrupted_json_values(draw, data: dict) -> bytes:
    """A plan's JSON with one to three values (anywhere in the tree) replaced, or cut short."""
    doc = json.loads(json.dumps(data))
    paths: list[tuple] = []

    def walk(node, path):
        paths.append(path)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in list(items)[:8]:
            walk(v, (*path, k))

    walk(doc, ())
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths[1:]))
        node = doc
        for k in path[:-1]:
            try:
                node = node[k]
            except (KeyError, IndexError, TypeError):
                break
        else:
            try:
                node[path[-1]] = json.loads(draw(st.sampled_from(_JSON_NOISE)))
            except (KeyError, IndexError, TypeError):
                pass
    text = json.dumps(doc).encode("utf-8")
    if draw(st.integers(0, 4)) == 0:
        text = text[:draw(st.integers(0, len(text)))]
    return text


@dataclass(frozen=True)
class Outcome:
    """What one CLI run did: exit code, output, and the traceback if one escaped."""

    code: int | None
    stdout: str
    stderr: str
    traceback: str | None


def run_cli(argv: list[str]) -> Outcome:
    """Run ``autoplan ARGV`` in-process; an exception other than a clean exit is a traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: int | None = main(list(argv))
        except SystemExit as exc:          # argparse: --help or a usage error, already printed
            code = exc.code if isinstance(exc.code, int) else 2
        except Exception:                  # noqa: BLE001 - what the fuzzing looks for
            return Outcome(None, out.getvalue(), err.getvalue(), traceback.format_exc())
    return Outcome(code, out.getvalue(), err.getvalue(), None)


def _timing_free(text: str) -> str:
    """Output with the seconds a step took removed (they differ run to run)."""
    import re
    return re.sub(r"\d+(\.\d+)? s\b|in \d+(\.\d+)? s", "<t>", text)


def check_case(argv: list[str]) -> str | None:
    """``None`` when ``autoplan ARGV`` passes (clean exit, same output twice), else why not."""
    first = run_cli(argv)
    if first.traceback is not None:
        return f"autoplan {' '.join(argv)}\n{first.traceback}"
    if first.code not in (0, 1, 2):
        return f"autoplan {' '.join(argv)}: exit code {first.code!r}"
    if first.code == 2 and first.stderr.count("Traceback"):
        return f"autoplan {' '.join(argv)}: traceback text in the error"
    second = run_cli(argv)
    if (second.code, _timing_free(second.stdout), _timing_free(second.stderr)) != \
            (first.code, _timing_free(first.stdout), _timing_free(first.stderr)):
        return f"autoplan {' '.join(argv)}: a second run printed something else"
    return None


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
