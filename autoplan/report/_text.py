"""Short text labels shared by the tables, figures and HTML of :mod:`autoplan.report`."""

from __future__ import annotations

from typing import Any

__all__ = ["plan_label"]


def plan_label(plan: Any) -> str:
    """A short layout label: degrees, micro-batch, ZeRO stages, recompute, schedule.

    ``tp`` lists every stage's degree (``tp4/8``) and ``z``/``rc-`` every option
    some layer uses, so a mixed plan is never shown as a uniform one.
    """
    if not hasattr(plan, "label"):
        return type(plan).__name__
    return plan.label(compact=True)
