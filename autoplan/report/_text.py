"""Text shared by the command line, tables, figures and HTML of :mod:`autoplan.report`:
layout labels, their legend, and how two plans differ."""

from __future__ import annotations

import textwrap
from collections import Counter
from typing import Any

from ..plan_facts import PLAN_FACTS

__all__ = ["plan_label", "model_name", "LEGEND", "legend_text", "plan_differences"]


def model_name(obj: Any) -> str:
    """The one name a model goes by in every report: the title the capture or the zoo
    gave it (``GPT-3 175B``, ``llama 8.03B``), else its class (``LlamaForCausalLM``).

    Works on a :class:`~autoplan.Plan` or a :class:`~autoplan.ModelGraph`."""
    return getattr(obj, "title", "") or getattr(obj, "model", "") or type(obj).__name__


def plan_label(plan: Any) -> str:
    """A short layout label: degrees, micro-batch, ZeRO stages, recompute, schedule.

    ``tp`` lists every stage's degree (``tp4/8``) and ``z``/``rc-`` every option
    some layer uses, so a mixed plan is never shown as a uniform one.
    """
    if not hasattr(plan, "label"):
        return type(plan).__name__
    return plan.label(compact=True)


#: What each term of a plan label means (``autoplan plan --explain``, the HTML report).
LEGEND: tuple[tuple[str, str], ...] = (
    ("dpN", "data parallel: N replicas of the model, each on its own share of the batch; "
            "gradients averaged over them"),
    ("tpN", "tensor parallel: each layer's matmuls split over N devices of one node "
            "(Megatron-LM column/row split); tp4/8 means stages use 4 and 8"),
    ("ppN", "pipeline parallel: the layers cut into N stages on N groups of devices"),
    ("cpN", "context parallel: each sequence split over N devices; attention exchanges keys "
            "and values"),
    ("epN", "expert parallel: each MoE layer's experts split over N of the data/context "
            "parallel devices; tokens travel to their experts by all-to-all"),
    ("mbBxM", "micro-batches: B sequences each, M of them per replica per step "
              "(gradient accumulation); mbB in tables"),
    ("zeroK / zK", "ZeRO stage K over the data parallel devices: 1 shards optimizer state, "
                   "2 also gradients, 3 also parameters (FSDP)"),
    ("rc-selective", "recompute the attention core in backward instead of keeping it "
                     "(Korthikanti et al. 2022)"),
    ("rc-full", "keep only each block's input and recompute the whole block in backward"),
    ("sp", "sequence parallel: with tp, the activations outside the split matmuls are "
           "sharded over the tp group too"),
    ("1f1b / gpipe", "pipeline schedules: one forward one backward (Narayanan et al. 2021), "
                     "or all forwards then all backwards"),
    ("interleavedxV", "interleaved 1F1B: V chunks of layers per pipeline rank, a smaller bubble "
                      "for more pipeline messages"),
    ("zero_bubblexV", "zero-bubble ZBV (Qi et al. 2024): two chunks per rank in a V, weight "
                      "gradients deferred into the bubble"),
    ("z1/3, rc-full/selective", "a mixed plan: some layers use one option, some the other "
                                "(per-layer choices)"),
)


def legend_text() -> str:
    """:data:`LEGEND` as aligned lines of text."""
    width = max(len(term) for term, _ in LEGEND)
    lines = ["legend:"]
    for term, text in LEGEND:
        lines += textwrap.wrap(text, 100, initial_indent=f"  {term:<{width}}  ",
                               subsequent_indent=" " * (width + 4))
    return "\n".join(lines)


def _facts(p: Any) -> dict[str, str]:
    """The plan's facts in words, by label (:data:`~autoplan.plan_facts.PLAN_FACTS`)."""
    return {f.label: f.in_words(p) for f in PLAN_FACTS if f.label is not None}


def _layer_changes(a: Any, b: Any) -> list[str]:
    """Per-layer choices that differ between two plans with the same layers."""
    pa = {lp.name: lp for lp in a.layers}
    counts: Counter[tuple[str, str, str]] = Counter()
    for lb in b.layers:
        la = pa.get(lb.name)
        if la is None:
            continue
        for what, x, y in (("recompute", la.recompute.value, lb.recompute.value),
                           ("zero", la.zero, lb.zero), ("tp", la.tp, lb.tp)):
            if x != y:
                counts[(what, str(x), str(y))] += 1
    return [f"{what} of {n} layer{'s' if n > 1 else ''}: {x} -> {y}"
            for (what, x, y), n in sorted(counts.items())]


def plan_differences(winner: Any, other: Any) -> list[str]:
    """How ``other`` differs from ``winner``: each degree, option, per-layer choice or
    stage boundary that changed (``"zero: 1 -> 2"``), and then what that did to the
    predicted step time and peak memory (when both plans are priced).  Empty when the
    layouts are the same."""
    fa, fb = _facts(winner), _facts(other)
    per_layer = _layer_changes(winner, other)
    # per-layer lines say it better than the sets of options ("none -> full/none")
    detailed = {c.split(" of ")[0] for c in per_layer} - {"tp"}
    lines = [f"{k}: {fa[k]} -> {fb[k]}" for k in fa if fa[k] != fb[k] and k not in detailed]
    lines += [c for c in per_layer if not c.startswith("tp ") or fa["tp"] == fb["tp"]]
    sa = [len(s.layers) for s in winner.stages]
    sb = [len(s.layers) for s in other.stages]
    if len(sa) == len(sb) and sa != sb:
        lines.append(f"layers per stage: {sa} -> {sb}")
    ea, eb = getattr(winner, "estimate", None), getattr(other, "estimate", None)
    if lines and ea is not None and eb is not None:
        dt = eb.step_time_s - ea.step_time_s
        dm = (eb.peak_memory_bytes - ea.peak_memory_bytes) / 2**30
        lines.append(f"=> step {dt * 1e3:+.1f} ms ({(eb.step_time_s / ea.step_time_s - 1) * 100:+.1f}%), "
                     f"peak memory {dm:+.1f} GiB")
    return lines
