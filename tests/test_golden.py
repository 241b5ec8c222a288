"""Golden plans: today's plan for a fixed set of (model, cluster, batch) cases against the
plan recorded in ``tests/golden/<case>.json``.

A difference fails with a readable diff (degrees, stage boundaries, layers per stage,
predicted numbers with their relative change).  When the change is intended (a new
cost-model fit, a better search), rewrite the files with::

    python -m pytest tests/test_golden.py --update-golden

and review the diff of ``tests/golden`` before committing it.  The predicted numbers
live only in the golden files; this file holds none.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import autoplan
from autoplan.errors import AutoplanError, InfeasiblePlan
from autoplan.records import atomic_write_text
from autoplan.report import device_span, plan_label

GOLDEN = Path(__file__).resolve().parent / "golden"

#: Relative change of a predicted number that counts as a change (float noise is far below).
REL_TOL = 1e-6


@dataclass(frozen=True)
class Case:
    name: str
    model: str                 # zoo:<name>, or "gpt-small" (autoplan.models.GPT)
    seq_len: int
    cluster: str
    nodes: int | None
    global_batch: int
    covers: str                # what the case is there for

    @property
    def inputs(self) -> dict[str, Any]:
        return {"model": self.model, "seq_len": self.seq_len, "cluster": self.cluster,
                "nodes": self.nodes, "global_batch": self.global_batch, "covers": self.covers}


CASES = [
    Case("gpt-small-a100x8", "gpt-small", 256, "a100-sxm4-80gb", 1, 32,
         "a small GPT on one node"),
    Case("gpt3-1.3b-a100-40gb-x8", "zoo:gpt3-1.3b", 2048, "a100-sxm4-40gb", 1, 64,
         "a zoo model on one node of 40 GB GPUs"),
    Case("gpt3-1.3b-v100-x32", "zoo:gpt3-1.3b", 2048, "v100-sxm2-32gb", 4, 256,
         "the same model on four V100 nodes"),
    Case("llama3-70b-h100-x16", "zoo:llama3-70b", 4096, "h100-sxm5-80gb", 2, 64,
         "H100 nodes; a 70B model on 16 GPUs needs model (and pipeline) parallelism"),
    Case("llama3-70b-mixed-a100-v100", "zoo:llama3-70b", 4096, "mixed-a100-v100", None, 256,
         "heterogeneous cluster: blocks split by device type"),
    Case("llama3-70b-two-sites", "zoo:llama3-70b", 4096, "two-sites", None, 256,
         "two sites joined by a slow link"),
    Case("llama3-70b-a100-40gb-x64", "zoo:llama3-70b", 4096, "a100-sxm4-40gb", 8, 64,
         "memory-bound: recompute and sharding forced by 40 GB GPUs"),
    Case("mixtral-8x7b-a100-x32", "zoo:mixtral-8x7b", 4096, "a100-sxm4-80gb", 4, 128,
         "mixture of experts"),
    Case("qwen3-235b-a22b-h100-x128", "zoo:qwen3-235b-a22b", 4096, "h100-sxm5-80gb", 16, 512,
         "a 128-expert top-8 MoE across 16 nodes: expert parallelism inside and across nodes"),
    Case("deepseek-v3-gb200-nvl72-x144", "zoo:deepseek-v3", 4096, "gb200-nvl72", 2, 1152,
         "DeepSeek-V3 671B (MLA, 256 experts, shared expert, dense first layers) on two "
         "72-GPU NVLink domains"),
    Case("gpt3-175b-a100-x128", "zoo:gpt3-175b", 2048, "a100-sxm4-80gb", 16, 512,
         "GPT-3 175B on 128 GPUs"),
    Case("gpt3-175b-a100-x1024", "zoo:gpt3-175b", 2048, "a100-sxm4-80gb", 128, 1536,
         "GPT-3 175B on 1024 GPUs at the published batch"),
    Case("gpt3-175b-a100-x16-infeasible", "zoo:gpt3-175b", 2048, "a100-sxm4-80gb", 2, 64,
         "infeasible: the planner's reason is recorded"),
]


# ------------------------------------------------------------------ plans
@functools.lru_cache(maxsize=None)
def _graph(model: str, seq_len: int):
    """Each (model, seq_len) is captured once for all the cases that use it."""
    if model == "gpt-small":
        from autoplan.models import GPT, GPTConfig
        module = GPT(GPTConfig(vocab_size=1024, seq_len=seq_len, hidden=256, heads=8, layers=8))
    else:
        from autoplan.zoo import build_model
        module, _ = build_model(model)
    return autoplan.trace(module, seq_len=seq_len)


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items()))


def plan_digest(plan) -> dict[str, Any]:
    """What a golden file records of a plan: layout, stage boundaries, predictions."""
    est = plan.estimate
    by_stage: dict[int, list] = {}
    for lp in plan.layers:
        by_stage.setdefault(lp.stage, []).append(lp)
    stages = []
    for st in plan.stages:
        lps = by_stage.get(st.index, [])
        stages.append({
            "stage": st.index, "rank": st.rank, "chunk": st.chunk, "device_type": st.device_type,
            "devices": device_span(st.devices), "dp": st.dp, "cp": st.cp, "tp": st.tp,
            "layers": len(st.layers), "first": st.layers[0], "last": st.layers[-1],
            "recompute": _counts(lp.recompute.value for lp in lps),
            "zero": _counts(lp.zero for lp in lps)})
    return {
        "layout": plan_label(plan),
        "degrees": {
            "dp": plan.dp, "tp": sorted({s.tp for s in plan.stages}), "pp": plan.pp,
            "cp": plan.mesh.degree("cp"), "ep": plan.ep, "micro_batch": plan.micro_batch,
            "num_micro_batches": plan.num_micro_batches, "schedule": plan.schedule.value,
            "virtual_stages": plan.virtual_stages, "precision": plan.precision.value,
            "sequence_parallel": any(lp.sequence_parallel for lp in plan.layers)},
        "replica_batch": _counts(plan.replica_batch),
        "stages": stages,
        "prediction": {
            "step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu,
            "peak_memory_GiB": est.peak_memory_bytes / 2**30, "fits": est.fits},
    }


def case_digest(case: Case) -> dict[str, Any]:
    graph = _graph(case.model, case.seq_len)
    cluster = autoplan.load_cluster(case.cluster, nodes=case.nodes)
    out: dict[str, Any] = {"case": case.inputs}
    try:
        # the defaults: the search's budget counts steps, not seconds, so a loaded
        # machine finds the same plan
        plan = autoplan.plan(graph, cluster, global_batch=case.global_batch)
    except InfeasiblePlan as exc:
        out["infeasible"] = {"error": type(exc).__name__, "binding": exc.binding,
                             "required_GiB": exc.required_bytes / 2**30,
                             "available_GiB": exc.available_bytes / 2**30}
    except AutoplanError as exc:
        out["infeasible"] = {"error": type(exc).__name__, "message": str(exc)}
    else:
        out["plan"] = plan_digest(plan)
    return out


# ------------------------------------------------------------------ diff
_NUMERIC = {"step_time_s", "tokens_per_s", "mfu", "peak_memory_GiB", "required_GiB",
            "available_GiB"}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def _walk(old: Any, new: Any, path: str, out: list[str]) -> None:
    key = path.rsplit(".", 1)[-1]
    if key in _NUMERIC and isinstance(old, (int, float)) and isinstance(new, (int, float)) \
            and not isinstance(old, bool) and not isinstance(new, bool):
        if not math.isclose(old, new, rel_tol=REL_TOL, abs_tol=0.0):
            rel = (new - old) / old if old else math.inf
            out.append(f"{path}: {_fmt(old)} -> {_fmt(new)} ({rel:+.2%})")
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for k in list(old) + [k for k in new if k not in old]:
            sub = f"{path}.{k}" if path else k
            if k not in new:
                out.append(f"{sub}: removed (was {_fmt(old[k])})")
            elif k not in old:
                out.append(f"{sub}: added ({_fmt(new[k])})")
            else:
                _walk(old[k], new[k], sub, out)
        return
    if isinstance(old, list) and isinstance(new, list) and key == "stages":
        if len(old) != len(new):
            out.append(f"{path}: {len(old)} stages -> {len(new)} stages; layers per stage "
                       f"{[s.get('layers') for s in old]} -> {[s.get('layers') for s in new]}")
            return
        for i, (a, b) in enumerate(zip(old, new)):
            _walk(a, b, f"{path}[{i}]", out)
        return
    if old != new:
        out.append(f"{path}: {_fmt(old)} -> {_fmt(new)}")


def golden_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Readable differences between two case digests, most important first."""
    out: list[str] = []
    _walk(old, new, "", out)
    order = ("case", "infeasible", "plan.layout", "plan.degrees", "plan.replica_batch",
             "plan.stages", "plan.prediction", "plan")
    return sorted(out, key=lambda line: next((i for i, p in enumerate(order)
                                              if line.startswith(p)), len(order)))


# ------------------------------------------------------------------ tests
def test_diff_reads_like_a_changelog():
    stage = {"stage": 0, "rank": 0, "layers": 12, "first": "h.0", "last": "h.11"}
    old = {"case": {"model": "m"},
           "plan": {"layout": "dp8 tp1 pp2", "degrees": {"tp": [1], "pp": 2},
                    "stages": [stage, dict(stage, stage=1, rank=1, first="h.12", last="post")],
                    "prediction": {"step_time_s": 10.0, "fits": True}}}
    new = json.loads(json.dumps(old))
    new["plan"]["prediction"]["step_time_s"] = 11.0
    new["plan"]["stages"][1]["layers"] = 13
    new["plan"]["stages"][1]["first"] = "h.11"
    assert golden_diff(old, new) == [
        "plan.stages[1].layers: 12 -> 13",
        "plan.stages[1].first: h.12 -> h.11",
        "plan.prediction.step_time_s: 10 -> 11 (+10.00%)",
    ]
    new["plan"]["stages"] = new["plan"]["stages"][:1]
    new["plan"]["degrees"]["tp"] = [2]
    new["plan"]["layout"] = "dp8 tp2 pp1"
    assert golden_diff(old, new) == [
        "plan.layout: dp8 tp1 pp2 -> dp8 tp2 pp1",
        "plan.degrees.tp: [1] -> [2]",
        "plan.stages: 2 stages -> 1 stages; layers per stage [12, 12] -> [12]",
        "plan.prediction.step_time_s: 10 -> 11 (+10.00%)",
    ]
    # float noise far below REL_TOL is no change
    noise = json.loads(json.dumps(old))
    noise["plan"]["prediction"]["step_time_s"] = 10.0 * (1 + 1e-12)
    assert golden_diff(old, noise) == []


def test_every_golden_file_has_a_case():
    names = {c.name for c in CASES}
    assert len(names) == len(CASES)
    stale = sorted(p.stem for p in GOLDEN.glob("*.json") if p.stem not in names)
    assert not stale, f"golden files without a case (delete them): {stale}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_plan(case, update_golden):
    pytest.importorskip("transformers")
    path = GOLDEN / f"{case.name}.json"
    new = case_digest(case)
    if update_golden:
        atomic_write_text(path, json.dumps(new, indent=1) + "\n")
        return
    if not path.exists():
        pytest.fail(f"no golden file {path.name}; create it with "
                    "`python -m pytest tests/test_golden.py --update-golden`")
    old = json.loads(path.read_text())
    changes = golden_diff(old, new)
    if changes:
        pytest.fail(f"the plan for {case.name} ({case.covers}) changed:\n  "
                    + "\n  ".join(changes)
                    + "\nIf intended, run `python -m pytest tests/test_golden.py --update-golden` "
                      "and review `git diff tests/golden`.", pytrace=False)
