"""The facts two plans are compared on, in one table.

:func:`autoplan.plan_diff` (what a replan changed, one ``field: old -> new`` line each)
and :func:`autoplan.report.plan_differences` (why the winner won, in words) both walk
:data:`PLAN_FACTS`: which facts of a :class:`~autoplan.Plan` there are, in which order,
how each reads as a field name and as words, and how its value is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["PlanFact", "PLAN_FACTS"]


@dataclass(frozen=True)
class PlanFact:
    """One fact of a plan.

    Attributes
    ----------
    field : str
        Its name in :func:`autoplan.plan_diff` (``micro_batch``).
    label : str or None
        Its name in the why-it-won lines (``micro-batch``); None: not shown there.
    text : callable
        ``text(plan) -> str``: the value, as :func:`autoplan.plan_diff` writes it.
    words : callable, optional
        ``words(plan) -> str``: the value in the why-it-won lines, where it reads
        otherwise than ``text`` (``yes``/``no`` for a flag).
    """

    field: str
    label: str | None
    text: Callable[[Any], str]
    words: Callable[[Any], str] | None = None

    def in_words(self, plan: Any) -> str:
        """The value as the why-it-won lines write it."""
        return (self.words or self.text)(plan)


def _joined(values: Any) -> str:
    """The distinct values, sorted, ``/``-joined: ``4/8`` (a mixed plan shows every one)."""
    return "/".join(map(str, sorted(set(values))))


def _replica_batch_range(p: Any) -> str:
    rb = p.replica_batch
    return f"{min(rb)}..{max(rb)}" if len(set(rb)) > 1 else str(rb[0])


def _replica_batch_list(p: Any) -> str:
    rb = p.replica_batch
    return ",".join(map(str, rb)) if len(set(rb)) > 1 else str(rb[0])


#: Every fact, in the order both comparisons list their lines.
PLAN_FACTS: tuple[PlanFact, ...] = (
    PlanFact("devices", None, lambda p: str(p.num_devices)),
    PlanFact("dp", "dp", lambda p: str(p.dp)),
    PlanFact("tp", "tp", lambda p: _joined(s.tp for s in p.stages)),
    PlanFact("pp", "pp", lambda p: str(p.pp)),
    PlanFact("cp", "cp", lambda p: str(p.cp)),
    PlanFact("ep", "ep", lambda p: str(p.ep)),
    PlanFact("micro_batch", "micro-batch", lambda p: str(p.micro_batch)),
    PlanFact("micro_batches", "micro-batches per replica", lambda p: str(p.num_micro_batches)),
    PlanFact("schedule", "schedule", lambda p: p.schedule.value,
             lambda p: p.schedule.value if p.pp > 1 else "none"),
    PlanFact("virtual_stages", "chunks per rank", lambda p: str(p.virtual_stages)),
    PlanFact("zero", "zero", lambda p: _joined(lp.zero for lp in p.layers)),
    PlanFact("recompute", "recompute", lambda p: _joined(lp.recompute.value for lp in p.layers)),
    PlanFact("sequence_parallel", "sequence parallel",
             lambda p: str(any(lp.sequence_parallel for lp in p.layers)),
             lambda p: "yes" if any(lp.sequence_parallel for lp in p.layers) else "no"),
    PlanFact("replica_batch", "replica batches", _replica_batch_range, _replica_batch_list),
)
