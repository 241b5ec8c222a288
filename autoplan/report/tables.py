"""Tables of a plan (pandas): one row per virtual stage, with where it runs.

:func:`plan_stage_table` answers "where does the planner cut": per stage its
pipeline rank and chunk, device type, how many layers and blocks, the first
and last layer, its devices, and, given the cluster, the nodes and sites the
stage spans and whether the edge into it crosses a site boundary.
"""

from __future__ import annotations

from typing import Any

from ..graph import LayerKind

__all__ = ["plan_stage_table", "device_span"]


def device_span(devices: tuple[int, ...] | list[int]) -> str:
    """``0-31`` for a contiguous range, the list when short, else first, second, ..., last (count).

    Examples
    --------
    >>> device_span((0, 1, 2, 3)), device_span((4, 9)), device_span(tuple(range(0, 64, 8)))
    ('0-3', '4,9', '0,8,...,56 (8)')
    """
    devices = tuple(devices)
    if not devices:
        return "-"
    if len(devices) > 1 and devices == tuple(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    if len(devices) <= 4:
        return ",".join(map(str, devices))
    return f"{devices[0]},{devices[1]},...,{devices[-1]} ({len(devices)})"


def plan_stage_table(plan, cluster: Any = None, graph: Any = None):
    """One row per virtual stage of ``plan`` (pandas DataFrame).

    Parameters
    ----------
    plan : Plan
    cluster : Cluster, optional
        Adds ``nodes`` (how many the stage spans), ``sites`` and
        ``crosses_site`` (some data-parallel replica sends the activation
        into this stage from a device at another site).
    graph : ModelGraph, optional
        Counts ``blocks`` (repeated layers) apart from the other layers.

    Columns: ``stage, rank, chunk, device_type, layers, [blocks,] first, last,
    devices, dp, cp, tp, zero, recompute`` (``recompute`` as ``option: count``
    pairs), and with a cluster ``nodes, sites, crosses_site``.
    """
    import pandas as pd

    kinds = {l.name: l.kind for l in graph.layers} if graph is not None else None
    by_stage: dict[int, list] = {}
    for lp in plan.layers:
        by_stage.setdefault(lp.stage, []).append(lp)
    rows = []
    for st in plan.stages:
        lps = by_stage.get(st.index, [])
        counts: dict[str, int] = {}
        for lp in lps:
            counts[lp.recompute.value] = counts.get(lp.recompute.value, 0) + 1
        row: dict[str, Any] = {
            "stage": st.index, "rank": st.rank, "chunk": st.chunk, "device_type": st.device_type,
            "layers": len(st.layers)}
        if kinds is not None:
            row["blocks"] = sum(1 for n in st.layers if kinds.get(n) is LayerKind.BLOCK)
        row.update({
            "first": st.layers[0] if st.layers else "-", "last": st.layers[-1] if st.layers else "-",
            "devices": device_span(st.devices), "dp": st.dp, "cp": st.cp, "tp": st.tp,
            "zero": "/".join(map(str, sorted({lp.zero for lp in lps}))) or "-",
            "recompute": ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "-"})
        if cluster is not None:
            site = [cluster.devices[d].site for d in range(cluster.num_devices)]
            row["nodes"] = len({cluster.devices[d].node for d in st.devices})
            row["sites"] = "+".join(dict.fromkeys(site[d] for d in st.devices))
            prev = plan.stages[st.index - 1] if st.index > 0 else None
            # some replica's activation travels from one site to another into this stage
            row["crosses_site"] = prev is not None and any(
                site[prev.replica_devices(r)[0]] != site[st.replica_devices(r)[0]]
                for r in range(st.dp))
        rows.append(row)
    return pd.DataFrame(rows)
