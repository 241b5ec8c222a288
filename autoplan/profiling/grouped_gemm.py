"""Grouped GEMMs (MoE experts) timed over
:data:`~autoplan.hardware.grouped_gemm.GROUPED_SHAPES` and tabled per dtype; their pricing
stays in :mod:`autoplan.hardware.grouped_gemm`, which the cost model uses."""

from __future__ import annotations

from typing import Any, Callable

from ..hardware.grouped_gemm import (GROUPED_SHAPES, grouped_gemm_call, grouped_gemm_flops,
                                     grouped_gemm_table)
from ..hardware.profiles import EfficiencyTable
from .plan import MeasurementPlan
from .timing import time_local


def measure_grouped_gemms(torch, dist, device, dtypes: dict, plan: MeasurementPlan, cuda: bool,
                          sync: Callable[[], None], timed, say) -> dict[str, list]:
    """Grouped GEMMs per 16-bit or fp32 dtype the plan times matmuls in, over
    :data:`~autoplan.hardware.grouped_gemm.GROUPED_SHAPES`: ``dtype -> [(experts, rows, k,
    n, seconds)]``; a dtype the device's grouped kernel refuses is left out."""
    experts, rows_list, k, n = GROUPED_SHAPES["cuda" if cuda else "cpu"]
    out: dict[str, list] = {}
    for name in ("bf16", "fp32"):
        if name not in plan.matmul_sizes:
            continue
        points = []
        for rows in rows_list:
            try:
                call = grouped_gemm_call(torch, experts=experts, rows=rows, k=k, n=n,
                                         dtype=dtypes[name], device=device)
                call()
            except (RuntimeError, NotImplementedError) as exc:   # no kernel for this dtype
                say(f"grouped GEMM {name}: not measured ({type(exc).__name__}: {exc})"[:200])
                points = []
                break
            dist.barrier()
            sec = (time_local(call, sync, plan.matmul_target_s, plan.repeats) if cuda
                   else timed(call, plan.matmul_target_s, local=True))
            del call
            points.append((experts, rows, k, n, sec))
            flops = grouped_gemm_flops(experts=experts, rows=rows, k=k, n=n)
            say(f"grouped GEMM {name} {experts} x {rows} rows: {flops / sec / 1e9:.1f} GFLOP/s")
        if points:
            out[name] = points
    return out


def tabulate_grouped_gemms(ranks: list[dict[str, Any]], peaks: dict[str, float],
                           how: str) -> dict[str, EfficiencyTable]:
    """Per dtype, the grouped-GEMM efficiency table of the slowest rank at each point."""
    out = {}
    for dtype, points in (ranks[0].get("grouped") or {}).items():
        if dtype not in peaks or any(dtype not in (r.get("grouped") or {}) for r in ranks):
            continue
        worst = [(*p[:4], max(r["grouped"][dtype][i][4] for r in ranks))
                 for i, p in enumerate(points)]
        out[dtype] = grouped_gemm_table(
            worst, peaks[dtype],
            f"{how}: grouped GEMMs (torch grouped_mm) of {worst[0][0]} experts, "
            f"{', '.join(str(p[1]) for p in worst)} rows each, {worst[0][2]} x {worst[0][3]} "
            f"weights, over the best measured {dtype} matmul")
    return out
