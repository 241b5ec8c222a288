"""Short text labels shared by the tables, figures and HTML of :mod:`autoplan.report`."""

from __future__ import annotations

from typing import Any

__all__ = ["plan_label"]


def plan_label(plan: Any) -> str:
    """A short layout label: degrees, micro-batch, ZeRO stages, recompute, schedule.

    ``tp`` lists every stage's degree (``tp4/8``) and ``z``/``rc-`` every option
    some layer uses, so a mixed plan is never shown as a uniform one.
    """
    if not (hasattr(plan, "stages") and hasattr(plan, "layers") and hasattr(plan, "mesh")):
        return type(plan).__name__
    tps = sorted({s.tp for s in plan.stages})
    parts = [f"dp{plan.dp}", "tp" + "/".join(map(str, tps)), f"pp{plan.pp}"]
    cp = plan.mesh.degree("cp")
    if cp > 1:
        parts.append(f"cp{cp}")
    parts.append(f"mb{plan.micro_batch}")
    zeros = sorted({lp.zero for lp in plan.layers})
    if zeros != [0]:
        parts.append("z" + "/".join(map(str, zeros)))
    rcs = sorted({lp.recompute.value for lp in plan.layers} - {"none"})
    if rcs:
        parts.append("rc-" + "/".join(rcs))
    if any(lp.sequence_parallel for lp in plan.layers):
        parts.append("sp")
    if plan.pp > 1:
        parts.append(plan.schedule.value + (f"x{plan.virtual_stages}"
                                            if plan.virtual_stages > 1 else ""))
    return " ".join(parts)
