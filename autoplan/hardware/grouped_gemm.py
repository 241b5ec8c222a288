"""Grouped GEMMs (MoE expert banks) as ``autoplan profile`` times them.

A mixture-of-experts layer runs its local experts' projections as one grouped GEMM
(``torch._grouped_mm``: the Hugging Face families' default ``grouped_mm`` experts, and
:mod:`autoplan.runtime.ep` on the local banks): rows sorted by expert, each group of rows
multiplied by its expert's matrix.  Its speed depends on the rows each expert gets,
which a square-matmul table does not tell: few tokens per expert leave the kernel short
of work.  The profile times it over a range of rows per expert and keeps, per dtype, an
:class:`~autoplan.hardware.profile_records.EfficiencyTable` keyed by the FLOPs of one
expert's GEMM (``2 x rows x k x n``), the fraction of the dtype's peak at which the whole
grouped GEMM runs; the cost model prices expert GEMMs from it
(:meth:`autoplan.cost.engine.CostEngine.template_time`).

Examples
--------
>>> import torch
>>> call = grouped_gemm_call(torch, experts=4, rows=8, k=16, n=16, dtype=torch.float32,
...                          device="cpu")
>>> call().shape
torch.Size([32, 16])
>>> grouped_gemm_flops(experts=4, rows=8, k=16, n=16)
16384
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .profile_records import EfficiencyTable

__all__ = ["GROUPED_SHAPES", "grouped_gemm_call", "grouped_gemm_flops", "grouped_gemm_table"]

#: What ``autoplan profile`` times, per device kind: (experts, (rows per expert, ...), k, n).
#: Rows from a few (fine-grained MoE at a small micro-batch) to thousands; k and n those
#: of a mid-size expert projection (CUDA) or a small one (CPU, where a call must take
#: milliseconds, not seconds).
GROUPED_SHAPES = {"cuda": (8, (4, 16, 64, 256, 1024, 4096), 2048, 1408),
                  "cpu": (8, (4, 16, 64, 256), 256, 256)}


def grouped_gemm_flops(*, experts: int, rows: int, k: int, n: int) -> int:
    """FLOPs of one grouped GEMM: ``experts`` groups of ``rows x k`` by ``k x n``."""
    return 2 * experts * rows * k * n


def grouped_gemm_call(torch, *, experts: int, rows: int, k: int, n: int, dtype,
                      device) -> Callable[[], Any]:
    """One forward grouped GEMM as the experts run it (``torch.nn.functional.grouped_mm``
    where torch has it, else ``torch._grouped_mm``), on operands made once."""
    a = torch.randn(experts * rows, k, dtype=dtype, device=device)
    b = torch.randn(experts, k, n, dtype=dtype, device=device)
    offs = torch.arange(rows, experts * rows + 1, rows, dtype=torch.int32, device=device)
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return lambda: fn(a, b, offs=offs)


def grouped_gemm_table(timings: Sequence[tuple[int, int, int, int, float]], peak: float,
                       source: str) -> EfficiencyTable:
    """The efficiency table of ``(experts, rows, k, n, seconds)`` timings against ``peak``
    FLOP/s: per point the FLOPs of one expert's GEMM and the fraction of the peak the
    grouped GEMM ran at (capped at 1).

    >>> t = grouped_gemm_table([(8, 4, 16, 16, 1e-3), (8, 64, 16, 16, 2e-3)], 1e9, "example")
    >>> [round(e, 4) for _, e in t.points]
    [0.0164, 0.1311]
    """
    points: dict[float, float] = {}
    for experts, rows, k, n, sec in timings:
        per_expert = 2.0 * rows * k * n
        eff = grouped_gemm_flops(experts=experts, rows=rows, k=k, n=n) / sec / peak
        points[per_expert] = max(points.get(per_expert, 0.0), min(1.0, eff))
    return EfficiencyTable(tuple(sorted(points.items())), source=source)
