"""Fuzz cases shared by ``tests/test_fuzz.py`` (a few hundred, in CI) and
``benchmarks/fuzz.py`` (thousands).  Each family is a hypothesis strategy that draws
a case and a ``check_*`` function that runs it and returns ``None`` or a
:class:`Failure`:

- command lines, corrupted profile YAML and corrupted plan JSON, through the CLI
  in-process (:func:`command_lines`, :func:`corrupted_texts`,
  :func:`corrupted_json_values`; :func:`check_case`);
- model shapes: small Hugging Face configs of six families and plain ``nn.Module``
  stacks of five styles, traced, planned on a shipped or composed cluster and
  estimated under random strategies (:func:`model_cases`; :func:`check_model_case`);
- strategies: random ``Strategy(...)`` keywords, valid and not, estimated on a tiny
  model (:func:`strategy_kwargs`; :func:`check_strategy_case`);
- clusters: composed clusters and composite YAML profiles, valid and broken
  (:func:`cluster_cases`; :func:`check_cluster_case`);
- checkpoints: a real one-process checkpoint with its files corrupted, found with
  ``latest_good`` and loaded (:func:`checkpoint_corruptions`; :class:`CheckpointBench`).

A case *passes* when it returns, or raises an :class:`~autoplan.errors.AutoplanError`
with a one-line message (the CLI: exits 0, 1 or 2, printing such a line); every plan
or estimate that says it fits has each stage's peak within ``memory_fraction`` of its
devices' memory; and a second run gives the same output.  Anything else is a failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from hypothesis import strategies as st
from torch import nn

import autoplan
from autoplan.cli import main
from autoplan.errors import AutoplanError
from autoplan.hardware.profiles import COLLECTIVE_OPS

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
COMMANDS = ["trace", "estimate", "plan", "report", "whatif", "emit", "replan", "demo", "trce", ""]


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


#: Kinds of :class:`Failure`, as the benchmark counts them.
TRACEBACK = "traceback"          # an exception other than an AutoplanError, or a bad exit
BAD_MESSAGE = "bad message"      # an AutoplanError whose message is empty or not one line
OVER_MEMORY = "over memory"      # a plan or estimate that fits by its own account, but does not
DIFFERS = "differs"              # a second run with the same inputs gave another output
WRONG = "wrong"                  # another broken promise (a corrupt checkpoint taken as good)
FAILURE_KINDS = (TRACEBACK, BAD_MESSAGE, OVER_MEMORY, DIFFERS, WRONG)


@dataclass(frozen=True)
class Failure:
    """Why one fuzz case failed: its kind (:data:`FAILURE_KINDS`), the case, the detail."""

    kind: str
    case: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.case}\n{self.detail}"

    __repr__ = __str__


#: Failures this fuzzing found in code that others are changing now (``autoplan/runtime``),
#: reported and left to them: name -> how to recognise one.  Each is reproduced by a strict
#: xfail test in ``tests/test_fuzz.py``; the CI tests let them pass, ``benchmarks/fuzz.py``
#: counts them apart.  Delete the entry (and the xfail) when the fix lands.
KNOWN_BUGS: dict[str, Callable[[Failure], bool]] = {
}


def known_bug(failure: Failure | None) -> str | None:
    """The :data:`KNOWN_BUGS` entry ``failure`` is an instance of, if any."""
    if failure is None:
        return None
    return next((name for name, match in KNOWN_BUGS.items() if match(failure)), None)


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
    return re.sub(r"\d+(\.\d+)? s\b|in \d+(\.\d+)? s", "<t>", text)


def check_case(argv: list[str]) -> "Failure | None":
    """``None`` when ``autoplan ARGV`` passes (clean exit, same output twice), else why not."""
    case = f"autoplan {' '.join(argv)}"
    first = run_cli(argv)
    if first.traceback is not None:
        return Failure(TRACEBACK, case, first.traceback)
    if first.code not in (0, 1, 2):
        return Failure(TRACEBACK, case, f"exit code {first.code!r}")
    if first.code == 2 and first.stderr.count("Traceback"):
        return Failure(TRACEBACK, case, f"traceback text in the error:\n{first.stderr}")
    second = run_cli(argv)
    if (second.code, _timing_free(second.stdout), _timing_free(second.stderr)) != \
            (first.code, _timing_free(first.stdout), _timing_free(first.stderr)):
        return Failure(DIFFERS, case, "a second run printed something else")
    return None


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------- running a case twice
class _Broken(Exception):
    """A case broke a promise (not an error a user may see): carries the :class:`Failure` kind."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def _one_line(exc: AutoplanError) -> str:
    """``Type: message``; :class:`_Broken` when the message is empty or spans lines (a
    :class:`~autoplan.errors.TraceError` may add indented ``in module:`` / ``at:`` /
    ``what to do:`` lines under its one-line summary)."""
    from autoplan.errors import TraceError
    message = str(exc)
    lines = message.strip().splitlines()
    if isinstance(exc, TraceError) and lines and all(l.startswith("  ") for l in lines[1:]):
        lines = lines[:1]
    if not message.strip() or len(lines) > 1:
        raise _Broken(BAD_MESSAGE, f"{type(exc).__name__} with a message that is not one line: "
                                   f"{message!r}")
    return f"{type(exc).__name__}: {message}"


def attempt(record: list, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``None`` after noting its AutoplanError in ``record``; any other
    exception becomes a :class:`_Broken` traceback naming ``what``."""
    try:
        return fn()
    except AutoplanError as exc:
        record.append((what, _one_line(exc)))
        return None
    except (_Broken, KeyboardInterrupt):
        raise
    except BaseException:  # noqa: BLE001 - what the fuzzing looks for (DCP raises BaseExceptions)
        raise _Broken(TRACEBACK, f"{what} raised:\n{traceback.format_exc()}") from None


def twice(case: str, run: Callable[[], list]) -> Failure | None:
    """Run a case twice: a :class:`Failure` if either run breaks a promise, or if the
    second run records something else than the first."""
    records = []
    for _ in range(2):
        try:
            records.append(run())
        except _Broken as broken:
            return Failure(broken.kind, case, str(broken))
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - raised outside attempt(): by a result's methods
            return Failure(TRACEBACK, case, traceback.format_exc())
    if records[0] != records[1]:
        diff = next((f"{a!r:.300}\n  then\n{b!r:.300}" for a, b in zip(*records) if a != b),
                    f"{len(records[0])} records, then {len(records[1])}")
        return Failure(DIFFERS, case, diff)
    return None


def memory_problem(plan, cluster) -> str | None:
    """Why ``plan`` (with its estimate) fits by its own account but not by its devices'
    memory, or ``None``: every pipeline rank's peak must be within ``memory_fraction`` of
    the smallest memory among that rank's devices."""
    est = plan.estimate
    if est is None or not est.fits:
        return None
    cap_of = {}
    for stage in plan.stages:
        for d in stage.devices:
            cap = cluster.device_type_of(d).memory_bytes * est.memory_fraction
            cap_of[stage.rank] = min(cap_of.get(stage.rank, math.inf), cap)
    for stage in est.stages:
        cap = cap_of.get(stage.rank)
        if cap is None:
            return f"estimate stage rank {stage.rank} has no devices in the plan"
        if not stage.peak_memory_bytes <= cap:
            return (f"pipeline rank {stage.rank}: predicted peak {stage.peak_memory_bytes / 2**30:.3f} "
                    f"GiB > memory_fraction {est.memory_fraction} x its devices' memory = "
                    f"{cap / 2**30:.3f} GiB, yet the estimate says it fits")
    if not est.peak_memory_bytes <= max(cap_of.values()):
        return (f"predicted peak {est.peak_memory_bytes / 2**30:.3f} GiB exceeds every device's "
                f"share of memory ({max(cap_of.values()) / 2**30:.3f} GiB), yet it fits")
    return None


_SPLIT = re.compile(r"global_batch=(\d+) cannot be split over any data-parallel degree this "
                    r"model and cluster allow \(\[([\d, ]*)\]")


def _check_advice(record: list) -> None:
    """Refuse an error (the last in ``record``) whose advice cannot be followed."""
    what, message = record[-1]
    split = _SPLIT.search(message)
    if split and any(int(split.group(1)) % int(d) == 0 for d in split.group(2).split(",")
                     if d.strip()):
        raise _Broken(WRONG, f"{what} blames the global batch, which a degree it lists "
                             f"divides: {message}")
    if "fewer than the 1 pipeline" in message:
        raise _Broken(WRONG, f"{what} asks for fewer than one pipeline stage: {message}")


def _check_memory(plan, cluster) -> None:
    problem = memory_problem(plan, cluster)
    if problem:
        raise _Broken(OVER_MEMORY, f"{plan.summary()}\n{problem}")


# ---------------------------------------------------------------------- clusters to plan on
NODE_PROFILES = ("a100-sxm4-80gb", "a100-sxm4-40gb", "h100-sxm5-80gb", "h200-sxm-141gb",
                 "v100-sxm2-32gb")
COMPOSITE_PROFILES = ("mixed-a100-v100", "two-sites")


def site_link(a: str, b: str, bw_gbps: float = 100.0, latency_ms: float = 10.0,
              efficiency: float = 0.8):
    """A link between sites ``a`` and ``b`` (figures in the YAML's units)."""
    from autoplan.hardware import SiteLink
    from autoplan.hardware.profiles import CollectiveEfficiency

    def si(value: Any, scale: float) -> Any:       # a figure that is no number stays as it is
        return value * scale if isinstance(value, (int, float)) else value

    eff = CollectiveEfficiency(**dict.fromkeys(COLLECTIVE_OPS, efficiency), source="fuzz")
    return SiteLink(sites=(a, b), bw_bytes_per_s=si(bw_gbps, 1e9 / 8), latency_s=si(latency_ms, 1e-3),
                    collective_efficiency=eff, source="fuzz")


@st.composite
def cluster_choices(draw) -> tuple:
    """A valid cluster to plan on: a shipped node profile on 1-2 nodes, the first k devices
    of one node (any device count), a shipped composite, or node groups composed at one
    or two sites."""
    kind = draw(st.sampled_from(["node", "subset", "composite", "composed"]))
    if kind == "node":
        return ("node", draw(st.sampled_from(NODE_PROFILES)), draw(st.integers(1, 2)))
    if kind == "subset":
        return ("subset", draw(st.sampled_from(NODE_PROFILES)), draw(st.integers(1, 8)))
    if kind == "composite":
        return ("composite", draw(st.sampled_from(COMPOSITE_PROFILES)))
    groups = tuple((draw(st.sampled_from(NODE_PROFILES)), draw(st.integers(1, 2)),
                    draw(st.sampled_from(["east", "west"]))) for _ in range(draw(st.integers(1, 3))))
    return ("composed", groups)


def make_cluster(spec: tuple):
    """The cluster :func:`cluster_choices` describes."""
    from autoplan.hardware import NodeGroup
    kind = spec[0]
    if kind == "node":
        return autoplan.load_cluster(spec[1], nodes=spec[2])
    if kind == "subset":
        return autoplan.load_cluster(spec[1]).subset(range(spec[2]))
    if kind == "composite":
        return autoplan.load_cluster(spec[1])
    groups = [NodeGroup(p, n, site=s) for p, n, s in spec[1]]
    sites = sorted({s for _, _, s in spec[1]})
    links = [site_link(a, b) for i, a in enumerate(sites) for b in sites[i + 1:]]
    return autoplan.compose_cluster(groups, links, name="fuzz-composed")


# ---------------------------------------------------------------------- strategies
_DEGREE_NOISE = (0, -1, 9, 2.0, "2", None, True)
_ZERO = (0, 1, 2, 3)
_ZERO_NOISE = (-1, 4, True, "2", 1.5)
_RECOMPUTE = ("none", "selective", "full")
_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
_ENUM_NOISE = ("", "FULL", "zbv", None, 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def strategy_kwargs(draw, num_devices: int) -> tuple[tuple[str, Any], ...]:
    """``Strategy(**kwargs)`` keywords, as sorted pairs.  Three times in five a layout
    meant to work: degrees whose product is ``num_devices``, a global batch they divide,
    options that go together, and now and then one value broken (out of range or of the
    wrong type); otherwise any degrees in 0..9 and options drawn independently."""
    kw: dict[str, Any] = {}
    if draw(st.integers(0, 4)) >= 2:
        rest = num_devices
        for name in ("dp", "tp", "pp"):
            kw[name] = draw(st.sampled_from(_divisors(rest)))
            rest //= kw[name]
        kw["cp"] = rest
        kw["micro_batch"] = draw(st.integers(1, 4))
        kw["global_batch"] = kw["dp"] * kw["micro_batch"] * draw(st.integers(1, 8))
        kw["schedule"] = draw(st.sampled_from(_SCHEDULES))
        kw["virtual_stages"] = {"interleaved": draw(st.integers(2, 3)), "zero_bubble": 2}.get(
            kw["schedule"], 1)
        kw["zero"] = draw(st.sampled_from(_ZERO))
        kw["recompute"] = draw(st.sampled_from(_RECOMPUTE))
        kw["precision"] = draw(st.sampled_from(("bf16", "fp16", "fp32")))
        kw["sequence_parallel"] = kw["tp"] > 1 and draw(st.booleans())
        if draw(st.booleans()):
            kw["ep"] = draw(st.sampled_from(_divisors(kw["dp"] * kw["cp"])))
        if _rarely(draw, 5):
            name = draw(st.sampled_from(sorted(kw)))
            kw[name] = draw(st.sampled_from({"zero": _ZERO_NOISE, "recompute": _ENUM_NOISE,
                                             "schedule": _ENUM_NOISE, "precision": ("fp8", ""),
                                             "sequence_parallel": (True, 1)}.get(name, _DEGREE_NOISE)))
        return tuple(sorted(kw.items()))
    for name in ("dp", "tp", "pp", "cp", "micro_batch", "global_batch", "ep", "virtual_stages"):
        if draw(st.booleans()):
            kw[name] = draw(st.integers(0, 9)) if name != "global_batch" else draw(st.integers(0, 64))
    for name, valid, noise in (("zero", _ZERO, _ZERO_NOISE), ("recompute", _RECOMPUTE, _ENUM_NOISE),
                               ("schedule", _SCHEDULES, _ENUM_NOISE),
                               ("precision", ("bf16", "fp16", "fp32"), ("fp8", ""))):
        if draw(st.booleans()):
            kw[name] = _mostly(draw, valid, noise, 4)
    if draw(st.booleans()):
        kw["sequence_parallel"] = draw(st.booleans())
    if _rarely(draw, 10):                     # one value of the wrong type
        kw[draw(st.sampled_from(["dp", "tp", "pp", "micro_batch", "global_batch"]))] = \
            draw(st.sampled_from(_DEGREE_NOISE))
    return tuple(sorted(kw.items()))


def _estimate_record(record: list, graph, cluster, kwargs: tuple,
                     memory_fraction: float | None = None) -> None:
    """Build ``Strategy(**kwargs)`` and estimate it; note the outcome and check its memory."""
    from autoplan.plan import Plan
    strategy = attempt(record, "Strategy", lambda: autoplan.Strategy(**dict(kwargs)))
    if strategy is None:
        return
    est = attempt(record, "estimate", lambda: autoplan.estimate(
        graph, cluster, strategy, memory_fraction=memory_fraction))
    if est is None:
        _check_advice(record)
        return
    if est.fits:
        plan = attempt(record, "Plan.from_strategy",
                       lambda: Plan.from_strategy(graph, cluster, strategy))
        if plan is None:
            raise _Broken(WRONG, f"{strategy.describe()} was estimated but Plan.from_strategy "
                                 f"refuses it: {record[-1][1]}")
        from dataclasses import replace
        _check_memory(replace(plan, estimate=est), cluster)
    record.append(("estimate", est.to_json()))


#: Models the strategy, cluster and memory-bound cases run on, built on the meta device and
#: traced once per process: ``name -> (spec, config overrides, seq_len)``.  The tiny ones
#: trace in a second or two; the mid-size ones (0.1-0.3 B parameters) hold gigabytes of
#: state, so a small ``memory_fraction`` makes memory bind.
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt": ("gpt", dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4), 16),
    "mixtral": ("hf:mixtral", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   num_local_experts=4, num_experts_per_tok=2), 16),
    "gpt2-mid": ("hf:gpt2", dict(n_embd=2048, n_layer=3, n_head=16, vocab_size=32000,
                                 n_positions=512, bos_token_id=0, eos_token_id=0), 512),
    "llama-mid": ("hf:llama", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2,
                                   vocab_size=32000), 1024),
    "mixtral-mid": ("hf:mixtral", dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2,
                                       vocab_size=32000, num_local_experts=8,
                                       num_experts_per_tok=2), 512),
}
TINY_MODELS = ("gpt", "mixtral")
MID_MODELS = ("gpt2-mid", "llama-mid", "mixtral-mid")
_GRAPHS: dict[str, Any] = {}


def tiny_graph(name: str):
    """The traced graph of :data:`MODELS` ``[name]`` (cached)."""
    if name not in _GRAPHS:
        from autoplan.zoo import build_model
        spec, args, seq = MODELS[name]
        model, _ = build_model(spec, dict(args))
        _GRAPHS[name] = autoplan.trace(model, seq_len=seq)
    return _GRAPHS[name]


#: Clusters the strategy cases run on (small, so the degrees often match the world).
STRATEGY_CLUSTERS = (("subset", "a100-sxm4-80gb", 1), ("subset", "a100-sxm4-80gb", 4),
                     ("node", "a100-sxm4-80gb", 1), ("node", "h100-sxm5-80gb", 2),
                     ("subset", "v100-sxm2-32gb", 6), ("composite", "mixed-a100-v100"))


@st.composite
def strategy_cases(draw) -> tuple[str, tuple, tuple]:
    """``(tiny model, cluster spec, Strategy keywords)``."""
    model = draw(st.sampled_from(TINY_MODELS))
    spec = draw(st.sampled_from(STRATEGY_CLUSTERS))
    return model, spec, draw(strategy_kwargs(make_cluster(spec).num_devices))


def check_strategy_case(case: tuple[str, tuple, tuple]) -> Failure | None:
    """``Strategy(**kwargs)`` estimated on a tiny model: a StrategyError (or another
    AutoplanError) with a one-line message, or an estimate whose memory holds if it
    fits; the same twice."""
    model, spec, kwargs = case

    def run() -> list:
        record: list = []
        _estimate_record(record, tiny_graph(model), make_cluster(spec), kwargs)
        return record

    return twice(f"Strategy(**{dict(kwargs)}) on {model} / {spec}", run)


@st.composite
def memory_bound_cases(draw, models: tuple[str, ...] = MID_MODELS) -> tuple:
    """``(model, cluster spec, global batch, memory_fraction, Strategy keywords)`` where the
    memory fraction (1-30 % of each device) makes a mid-size model's memory bind."""
    model = draw(st.sampled_from(models))
    spec = draw(cluster_choices())
    return (model, spec, draw(st.sampled_from((1, 4, 8, 16, 32, 64, 128))),
            draw(st.sampled_from((0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2, 0.3))),
            draw(strategy_kwargs(make_cluster(spec).num_devices)))


def check_memory_bound_case(case: tuple) -> Failure | None:
    """Plan a mid-size model where memory binds, and estimate a strategy for it: every
    plan, runner-up and estimate that fits stays within ``memory_fraction`` of its devices'
    memory, and re-estimating the plan gives its estimate; the same twice."""
    from autoplan.cost import estimate_plan
    model, spec, global_batch, fraction, kwargs = case

    def run() -> list:
        record: list = []
        graph, cluster = tiny_graph(model), make_cluster(spec)
        plan = attempt(record, "plan", lambda: autoplan.plan(
            graph, cluster, global_batch=global_batch, memory_fraction=fraction))
        if plan is None:
            _check_advice(record)
        else:
            for p in (plan, *getattr(plan, "runners_up", ())):
                _check_memory(p, cluster)
            again = estimate_plan(graph, cluster, plan, memory_fraction=fraction)
            if (again.fits, again.peak_memory_bytes) != (plan.estimate.fits,
                                                         plan.estimate.peak_memory_bytes):
                raise _Broken(WRONG, f"{plan.summary()}\nre-estimated: {again.summary()}")
            record.append(("plan", plan.to_json()))
        _estimate_record(record, graph, cluster, kwargs, fraction)
        return record

    return twice(f"{model} on {spec}, global batch {global_batch}, memory_fraction {fraction}, "
                 f"Strategy(**{dict(kwargs)})", run)


# ---------------------------------------------------------------------- model shapes
HF_FAMILIES = ("llama", "gpt2", "mixtral", "qwen3_moe", "bert", "t5")
MODULE_STYLES = ("sequential", "list", "residual", "tuple", "cnn")
#: hidden sizes, some of which no head count divides
_WIDTHS = (4, 6, 8, 12, 16, 20, 24, 32, 48, 50, 64)


@st.composite
def hf_configs(draw) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """``(model_type, config overrides)``: tiny sizes, heads / kv-heads / hidden in every
    combination (not only those that divide), experts and experts per token at random."""
    family = draw(st.sampled_from(HF_FAMILIES))
    hidden, heads = draw(st.sampled_from(_WIDTHS)), draw(st.integers(1, 8))
    layers, vocab = draw(st.integers(1, 4)), draw(st.sampled_from((16, 50, 64, 128)))
    ffn = draw(st.sampled_from((8, 16, 24, 64, 96)))
    if family in ("llama", "mixtral", "qwen3_moe"):
        cfg: dict[str, Any] = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=draw(st.integers(1, 8)),
                                   vocab_size=vocab, tie_word_embeddings=draw(st.booleans()))
        if family != "llama":
            cfg.update(num_local_experts=draw(st.integers(1, 8)),
                       num_experts_per_tok=draw(st.integers(1, 3)))
        if family == "qwen3_moe":
            cfg.update(moe_intermediate_size=draw(st.sampled_from((8, 16, 24))),
                       decoder_sparse_step=draw(st.integers(1, 2)))
    elif family == "gpt2":
        cfg = dict(n_embd=hidden, n_head=heads, n_layer=layers, n_inner=ffn, vocab_size=vocab,
                   n_positions=draw(st.sampled_from((8, 16, 64))))
    elif family == "bert":
        cfg = dict(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers,
                   intermediate_size=ffn, vocab_size=vocab,
                   max_position_embeddings=draw(st.sampled_from((8, 16, 64))))
    else:
        cfg = dict(d_model=hidden, d_kv=draw(st.sampled_from((4, 8, 16))), num_heads=heads, d_ff=ffn,
                   num_layers=layers, num_decoder_layers=draw(st.integers(1, 4)), vocab_size=vocab)
    return family, tuple(sorted(cfg.items()))


class MLPBlock(nn.Module):
    """``Linear -> GELU -> Linear``; returns ``(y, x)`` when ``returns_tuple``."""

    def __init__(self, width: int, ffn: int, returns_tuple: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, ffn), nn.Linear(ffn, width)
        self.returns_tuple = returns_tuple

    def forward(self, x: torch.Tensor):
        y = self.down(nn.functional.gelu(self.up(x)))
        return (y, x) if self.returns_tuple else y


class BlockStack(nn.Module):
    """An input projection, an ``nn.ModuleList`` of blocks called in one of three styles
    (``h = block(h)``, ``h = h + block(h)``, ``h, _ = block(h)``), and a head."""

    def __init__(self, style: str, features: int, width: int, ffn: int, depth: int, out: int,
                 misfit: bool = False) -> None:
        super().__init__()
        self.style = style
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MLPBlock(width, ffn, style == "tuple") for _ in range(depth))
        if misfit:       # the last block expects another width: the model cannot run
            self.blocks[-1].up = nn.Linear(width + 1, ffn)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.style == "list":
                h = block(h)
            elif self.style == "residual":
                h = h + block(h)
            else:
                h, _ = block(h)
        return self.head(self.norm(h))


class SmallCNN(nn.Module):
    """A stem convolution, ``depth`` conv-BN-ReLU blocks in an ``nn.Sequential``, global
    average pooling and a linear classifier."""

    def __init__(self, in_channels: int, channels: int, depth: int, classes: int,
                 misfit: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, channels + int(misfit), 3, padding=1)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1),
                                                    nn.BatchNorm2d(channels), nn.ReLU())
                                      for _ in range(depth)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


@st.composite
def module_configs(draw) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """``(style, sizes)`` of a plain module (see :func:`build_module`)."""
    style = draw(st.sampled_from(MODULE_STYLES))
    cfg = dict(width=draw(st.sampled_from(_WIDTHS)), depth=draw(st.integers(1, 5)),
               features=draw(st.integers(1, 16)), out=draw(st.integers(1, 8)),
               ffn=draw(st.sampled_from((4, 8, 32))), batch=draw(st.integers(1, 4)),
               image=draw(st.integers(1, 12)),
               # example inputs of the wrong width: an InputError, not a torch traceback
               bad_input=_rarely(draw, 10),
               # a layer inside that expects another width: a TraceError saying so
               misfit=_rarely(draw, 10))
    return style, tuple(sorted(cfg.items()))


def build_module(style: str, cfg: dict) -> tuple[nn.Module, torch.Tensor]:
    """A plain module of ``style`` and one batch of example inputs (seeded: the same twice)."""
    torch.manual_seed(0)
    width, depth, batch, bad = cfg["width"], cfg["depth"], cfg["batch"], int(cfg["bad_input"])
    misfit = cfg.get("misfit", False)
    if style == "cnn":
        model: nn.Module = SmallCNN(3, width, depth, cfg["out"], misfit)
        return model, torch.randn(batch, 3 + bad, cfg["image"], cfg["image"])
    if style == "sequential":
        layers: list[nn.Module] = [nn.Linear(cfg["features"], width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        if misfit:
            layers[-2] = nn.Linear(width + 1, width)
        model = nn.Sequential(*layers, nn.Linear(width, cfg["out"]))
    else:
        model = BlockStack(style, cfg["features"], width, cfg["ffn"], depth, cfg["out"], misfit)
    return model, torch.randn(batch, cfg["features"] + bad)


@dataclass(frozen=True)
class ModelCase:
    """A model (a Hugging Face ``model_type`` or a plain module style, with its sizes),
    how it is captured, and the cluster, batch and strategies it is planned with."""

    family: str
    config: tuple[tuple[str, Any], ...]
    seq_len: int | None
    cluster: tuple
    global_batch: int
    memory_fraction: float
    strategies: tuple[tuple[tuple[str, Any], ...], ...]


@st.composite
def model_cases(draw, families: str = "all") -> ModelCase:
    """A :class:`ModelCase`; ``families`` is ``"hf"``, ``"module"`` or ``"all"``."""
    hf = {"hf": True, "module": False}.get(families, None)
    if hf is None:
        hf = draw(st.booleans())
    family, cfg = draw(hf_configs() if hf else module_configs())
    spec = draw(cluster_choices())
    n = make_cluster(spec).num_devices
    return ModelCase(family, cfg, draw(st.sampled_from((1, 2, 7, 8, 16, 33, 64))) if hf else None,
                     spec, draw(st.sampled_from((1, 2, 3, 6, 8, 12, 16, 24, 32, 64, 96))),
                     draw(st.sampled_from((0.9, 0.9, 0.5, 1.0, 0.05))),
                     tuple(draw(strategy_kwargs(n)) for _ in range(draw(st.integers(1, 2)))))


def _run_model_case(case: ModelCase) -> list:
    from autoplan.zoo import build_model
    record: list = []
    cfg = dict(case.config)
    if case.family in HF_FAMILIES:
        built = attempt(record, "build", lambda: build_model(f"hf:{case.family}", cfg))
        if built is None:
            return record
        graph = attempt(record, "trace", lambda: autoplan.trace(built[0], seq_len=case.seq_len))
    else:
        model, inputs = build_module(case.family, cfg)
        graph = attempt(record, "trace", lambda: autoplan.trace(model, example_inputs=inputs))
    if graph is None:
        return record
    record.append(("graph", graph.to_json()))
    cluster = make_cluster(case.cluster)
    plan = attempt(record, "plan", lambda: autoplan.plan(
        graph, cluster, global_batch=case.global_batch, memory_fraction=case.memory_fraction))
    if plan is None:
        _check_advice(record)
    else:
        _check_memory(plan, cluster)
        for alt in getattr(plan, "runners_up", ()):
            _check_memory(alt, cluster)
        # (the search's budget counts steps, not seconds: a plan it cuts repeats exactly)
        record.append(("plan", plan.to_json()))
    for kwargs in case.strategies:
        _estimate_record(record, graph, cluster, kwargs, case.memory_fraction)
    return record


def check_model_case(case: ModelCase) -> Failure | None:
    """Trace, plan and estimate ``case``: AutoplanErrors with one-line messages or results;
    no plan or estimate that fits on paper but not in memory; the same twice."""
    return twice(f"{case}", lambda: _run_model_case(case))


# ---------------------------------------------------------------------- composed clusters
_SITES = ("east", "west", "north")
_SITE_NOISE = ("", "  ", None, 3)
_NODES_NOISE = (0, -1, True, "2", 1.5, None)
_PROFILE_NOISE = ("nope", "two-sites", "", "a100", "/nonexistent/x.yaml", 3, None)


def _rarely(draw, one_in: int) -> bool:
    """True about one time in ``one_in`` (a middle value: hypothesis favours the bounds)."""
    return draw(st.integers(0, one_in - 1)) == one_in // 2


def _mostly(draw, valid, noise, one_in: int = 8):
    """A valid value, or (about one time in ``one_in``) a broken one."""
    return draw(st.sampled_from(noise)) if _rarely(draw, one_in) else draw(st.sampled_from(valid))


@dataclass(frozen=True)
class ClusterCase:
    """Node groups ``(profile, nodes, site)`` and site links ``(site, site, bw_Gbps,
    latency_ms, efficiency)``, built with :func:`autoplan.compose_cluster` (``form``
    ``"compose"``) or written as a composite YAML profile and loaded (``"yaml"``, with
    ``edits`` to the document and ``nodes`` passed to :func:`autoplan.load_cluster`)."""

    form: str
    name: Any
    groups: tuple[tuple[Any, Any, Any], ...]
    links: tuple[tuple[Any, ...], ...]
    nodes: Any = None
    edits: tuple[tuple[str, Any], ...] = ()


@st.composite
def cluster_cases(draw) -> ClusterCase:
    """A :class:`ClusterCase`, valid most of the time: 1-3 groups at 1-3 sites with a link
    for every pair of sites; sometimes a bad profile, node count, site, link or figure, a
    missing or extra link, or (YAML) a key dropped, added or given a noise value."""
    groups = tuple((_mostly(draw, NODE_PROFILES, _PROFILE_NOISE, 12),
                    _mostly(draw, (1, 1, 2, 3), _NODES_NOISE, 12),
                    _mostly(draw, _SITES, _SITE_NOISE, 12))
                   for _ in range(0 if _rarely(draw, 30) else draw(st.integers(1, 3))))
    sites = sorted({s for _, _, s in groups if isinstance(s, str)})
    links = []
    for i, a in enumerate(sites):
        for b in sites[i + 1:]:
            if not _rarely(draw, 12):          # now and then a pair without a link
                links.append((a, b, _mostly(draw, (100, 400, 12.5), (0, -5, math.nan, math.inf, "x"), 12),
                              _mostly(draw, (10, 0.5, 0), (-1, math.nan), 12),
                              _mostly(draw, (0.8, 1.0), (0, 1.5), 12)))
    if _rarely(draw, 10):                     # an extra link: a duplicate, to itself, or nowhere
        a = draw(st.sampled_from(sites or ["east"]))
        links.append((a, draw(st.sampled_from([a, "mars", *sites])), 100, 10, 0.8))
    form = draw(st.sampled_from(["compose", "yaml"]))
    name = _mostly(draw, ("fuzz-cluster", "c.1_x"), ("", "Bad Name", 7), 12)
    if form == "compose":
        return ClusterCase(form, name, groups, tuple(links))
    edits = tuple((draw(st.sampled_from(["drop", "add", "noise"])), draw(st.integers(0, 1000)))
                  for _ in range(draw(st.integers(1, 2)) if _rarely(draw, 3) else 0))
    total = sum(n for _, n, _ in groups if isinstance(n, int))
    nodes = draw(st.sampled_from([None, total, total + 1, 0])) if _rarely(draw, 4) else None
    return ClusterCase(form, name, groups, tuple(links), nodes, edits)


def cluster_yaml(case: ClusterCase) -> str:
    """The composite profile YAML of a :class:`ClusterCase`, with its edits applied."""
    import yaml
    doc: dict[str, Any] = {
        "kind": "composite", "name": case.name, "description": "a fuzz case",
        "groups": [{"profile": p, "nodes": n, "site": s} for p, n, s in case.groups],
        "site_links": [{"sites": [a, b], "bw_Gbps": bw, "latency_ms": lat, "source": "fuzz",
                        "collective_efficiency": {**dict.fromkeys(COLLECTIVE_OPS, eff),
                                                  "source": "fuzz"}}
                       for a, b, bw, lat, eff in case.links]}
    for kind, seed in case.edits:
        parents: list[Any] = []

        def walk(node):
            if isinstance(node, (dict, list)) and node:
                parents.append(node)
                for v in (node.values() if isinstance(node, dict) else node):
                    walk(v)

        walk(doc)
        node = parents[seed % len(parents)]
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = keys[seed % len(keys)]
        if kind == "drop":
            del node[key]
        elif kind == "add" and isinstance(node, dict):
            node["bogus_key"] = 1
        elif kind == "noise":
            node[key] = [None, -1, "x", [], {}, 1e400][seed % 6]
    return yaml.safe_dump(doc, sort_keys=False)


def _build_case_cluster(record: list, case: ClusterCase, workdir: Path):
    from autoplan.hardware import NodeGroup
    if case.form == "yaml":
        # one file per text: profiles are cached by path, mtime and size, and two texts of
        # one size written within a clock tick would share an entry
        text = cluster_yaml(case)
        path = workdir / f"composite-{hashlib.sha1(text.encode()).hexdigest()[:12]}.yaml"
        path.write_text(text)
        cluster = attempt(record, "load_cluster", lambda: autoplan.load_cluster(path, nodes=case.nodes))
        if cluster is None and record[-1][1].startswith("ProfileError") and str(path) not in record[-1][1]:
            raise _Broken(BAD_MESSAGE, f"the error does not name the file {path}: {record[-1][1]}")
        return cluster
    groups = attempt(record, "NodeGroup", lambda: [NodeGroup(p, n, site=s) for p, n, s in case.groups])
    links = attempt(record, "SiteLink", lambda: [site_link(*link) for link in case.links])
    if groups is None or links is None:
        return None
    return attempt(record, "compose_cluster", lambda: autoplan.compose_cluster(groups, links,
                                                                                name=case.name))


def check_cluster_case(case: ClusterCase, workdir: Path) -> Failure | None:
    """Compose or load the cluster of ``case``: an AutoplanError with a one-line message
    (naming the file, for YAML), or a cluster that round-trips through JSON, prices a path
    and an all-reduce over all its devices, and estimates a tiny GPT under pure data
    parallelism within its memory; the same twice."""

    def run() -> list:
        from autoplan.hardware import Cluster
        record: list = []
        cluster = _build_case_cluster(record, case, workdir)
        if cluster is None:
            return record
        n = cluster.num_devices
        if Cluster.from_json(cluster.to_json()) != cluster:
            raise _Broken(WRONG, "the cluster does not round-trip through JSON")
        link = cluster.path(0, n - 1)
        t = cluster.collective_time("all_reduce", range(n), 1e6)
        if not (math.isfinite(t) and t >= 0 and link.bw_bytes_per_s > 0):
            raise _Broken(WRONG, f"all-reduce over {n} devices: {t} s; path 0-{n - 1}: {link}")
        record.append(("cluster", cluster.to_json(), repr(link), t))
        _estimate_record(record, tiny_graph("gpt"), cluster,
                         (("dp", n), ("global_batch", n), ("micro_batch", 1)))
        return record

    return twice(f"{case}", run)


# ---------------------------------------------------------------------- corrupted checkpoints
class CheckpointBench:
    """Two real checkpoints (``step-1``, ``step-2``) of a tiny fp32 GPT trained on one
    process (gloo, world size 1), written by
    :func:`autoplan.runtime.checkpoint.save_verified` into ``work/pristine``; each case
    corrupts a copy and reads it back through :func:`~autoplan.runtime.checkpoint.latest_good`,
    :func:`~autoplan.runtime.checkpoint.verify` and the program's :meth:`load`.  Call :meth:`close` at the end (it leaves the process group
    it made)."""

    GPT = dict(vocab_size=64, seq_len=8, hidden=16, heads=2, layers=2)

    def __init__(self, work: Path) -> None:
        import torch.distributed as dist

        from autoplan.elastic import batch_for_step
        from autoplan.runtime.checkpoint import save_verified
        from autoplan.zoo import build_model
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.own_group = not dist.is_initialized()
        if self.own_group:
            dist.init_process_group("gloo", store=dist.FileStore(str(self.work / "store"), 1),
                                    rank=0, world_size=1)
        torch.manual_seed(0)
        model, seq = build_model("gpt", dict(self.GPT), dtype=torch.float32, device="cpu")
        graph = autoplan.trace(model, seq_len=seq)
        plan = autoplan.plan(graph, autoplan.load_cluster("a100-sxm4-80gb").subset([0]),
                             global_batch=2, precision="fp32")
        self.program = autoplan.parallelize(model, plan, graph=graph)
        self.pristine = self.work / "pristine"
        for step in (1, 2):
            self.program.step(batch_for_step(0, step, global_batch=2, seq_len=seq,
                                             vocab_size=self.GPT["vocab_size"]))
            save_verified(self.program, self.pristine, step)
        #: every file of the two checkpoints, relative to the root (``step-2/manifest.json``)
        self.files = sorted(str(p.relative_to(self.pristine)) for p in self.pristine.rglob("*")
                            if p.is_file())
        self.json_docs = {f: json.loads((self.pristine / f).read_text()) for f in self.files
                          if f.endswith(".json")}

    def close(self) -> None:
        import torch.distributed as dist
        if self.own_group and dist.is_initialized():
            dist.destroy_process_group()


_GARBAGE = (b"", b"{", b"[]", b"null", b"\x00" * 64, b"\x80\x04K\x01.", b"PK\x03\x04", "é".encode())
CORRUPTIONS = ("truncate", "flip", "delete", "garbage", "json", "dir", "extra", "rename")


@st.composite
def checkpoint_corruptions(draw, files: list[str], json_docs: dict[str, dict]) -> tuple:
    """One to three ``(kind, file, arguments)`` edits of the checkpoint files: cut short,
    bytes flipped, deleted, replaced by garbage or by a directory, a JSON value replaced
    (manifest and metadata), an extra file, or the step directory renamed.  ``step-2`` is
    hit three times as often as ``step-1``."""
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        step = "step-1" if draw(st.integers(0, 3)) == 0 else "step-2"
        target = draw(st.sampled_from([f for f in files if f.startswith(step + "/")]))
        kind = draw(st.sampled_from(CORRUPTIONS))
        if kind == "truncate":
            ops.append((kind, target, draw(st.integers(0, 99))))          # percent kept
        elif kind == "flip":
            ops.append((kind, target, draw(st.integers(0, 10**6)), draw(st.integers(1, 255))))
        elif kind == "garbage":
            ops.append((kind, target, draw(st.sampled_from(_GARBAGE))))
        elif kind == "json":
            name = draw(st.sampled_from(sorted(f for f in json_docs if f.startswith(step + "/"))))
            ops.append((kind, name, draw(corrupted_json_values(json_docs[name]))))
        elif kind == "rename":
            ops.append((kind, step, draw(st.sampled_from(["step-3", "step-x", "step-02", "step-1"]))))
        else:
            ops.append((kind, target))
    return tuple(ops)


def corrupt(root: Path, op: tuple) -> None:
    """Apply one :func:`checkpoint_corruptions` edit under ``root``."""
    kind, target = op[0], root / op[1]
    if not target.exists() and kind != "rename":
        return                                  # an earlier edit removed it
    if kind == "truncate" and target.is_file():
        data = target.read_bytes()
        target.write_bytes(data[:len(data) * op[2] // 100])
    elif kind == "flip" and target.is_file():
        data = bytearray(target.read_bytes())
        if data:
            data[op[2] % len(data)] ^= op[3]
            target.write_bytes(bytes(data))
    elif kind in ("garbage", "json") and target.is_file():
        target.write_bytes(op[2])
    elif kind == "delete":
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    elif kind == "dir" and target.is_file():
        target.unlink()
        target.mkdir()
    elif kind == "extra":
        (target.parent / "stray.bin").write_bytes(b"not part of the checkpoint")
    elif kind == "rename" and target.is_dir() and op[2] != op[1]:
        dest = root / op[2]
        if dest.exists():
            shutil.rmtree(dest)
        target.rename(dest)


def _differing_files(good: Path, other: Path) -> list[str]:
    """Files of the pristine checkpoint ``good`` that ``other`` lacks or holds otherwise
    (the manifest excepted)."""
    bad = []
    for f in sorted(good.rglob("*")):
        rel = f.relative_to(good)
        if f.is_file() and rel.name != "manifest.json":
            g = other / rel
            if not g.is_file() or g.read_bytes() != f.read_bytes():
                bad.append(str(rel))
    return bad


def check_checkpoint_case(bench: CheckpointBench, ops: tuple) -> Failure | None:
    """A copy of the bench's checkpoints with ``ops`` applied: ``latest_good`` returns a
    checkpoint whose files are intact (or none), warning about each newer one it skips,
    and that checkpoint loads; ``verify`` and ``load`` of each step directory either pass
    or raise an AutoplanError naming the checkpoint; the same twice."""
    from autoplan.runtime.checkpoint import latest_good, verify
    root = bench.work / "case"

    def run() -> list:
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(bench.pristine, root)
        for op in ops:
            corrupt(root, op)
        record: list = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = attempt(record, "latest_good", lambda: latest_good(root))
        record.append(("warnings", sorted(str(w.message) for w in caught)))
        if found is not None:
            path, step = found
            name = os.path.basename(path)
            # a directory renamed to another name of its own step (step-02) is still good
            original = bench.pristine / f"step-{step}" if step in (1, 2) else None
            if original is None or _differing_files(original, Path(path)):
                raise _Broken(WRONG, f"latest_good returned {name} (step {step}), whose files "
                                     "are not the ones saved")
            record.append(("latest_good", name, step))
            loaded = attempt(record, "load the good checkpoint", lambda: bench.program.load(path))
            if loaded is None and record[-1][0] == "load the good checkpoint":
                raise _Broken(WRONG, f"latest_good returned {name}, which does not load: {record[-1][1]}")
        dirs = sorted(p.name for p in root.iterdir())
        for what, fn in (("verify", verify), ("load", bench.program.load)):
            for d in dirs:
                before = len(record)
                attempt(record, f"{what} {d}", lambda: fn(str(root / d)))
                if len(record) > before and str(root / d) not in record[-1][1]:
                    raise _Broken(BAD_MESSAGE, f"{what} {d}: the error does not name the "
                                               f"checkpoint: {record[-1][1]}")
        return record

    return twice(f"checkpoint edits {ops!r:.600}", run)
