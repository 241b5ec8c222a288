"""FP8 GEMM rates for ``autoplan profile``: tensorwise and rowwise ``torch._scaled_mm``.

On a CUDA device with FP8 matmuls (compute capability 8.9 or later), the profile times
square FP8 GEMMs of the sizes it times its other matmuls at, as torchao's float8 linears
call them (:mod:`autoplan.runtime.fp8`): e4m3 operands, the second column-major, a bf16
output, and

- **tensorwise**: one fp32 scale per operand (the ``fp8`` and ``fp8-blockwise`` recipes'
  kernel class; also what torchao's rowwise backward GEMMs run): the profile's ``fp8``
  peak (the best throughput measured) and efficiency table;
- **rowwise**: one scale per row of the first operand and per column of the second, with
  fast accumulation (torchao's rowwise forward GEMM): the ``fp8_rowwise`` table, against
  the ``fp8`` peak (:data:`autoplan.hardware.profile_records.VARIANT_TABLES`).

Each call takes the next of a rotation of operand sets spanning the profile's cold bytes,
so no call finds its operands in cache, as the 16-bit matmuls are timed.  A device whose
torch rejects a kind (``torch._scaled_mm`` raises) gets no table for it, and says so.
The functions take the timer as an argument: :func:`measure_fp8_gemms` runs on CPU too
(torch's CPU ``_scaled_mm``), which the tests use as a rehearsal of the GPU path.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["FP8_KINDS", "fp8_capable", "cold_scaled_mm", "measure_fp8_gemms", "fp8_tables"]

#: What is timed, by the profile key of its table
FP8_KINDS = ("fp8", "fp8_rowwise")
#: CUDA compute capability of the first GPUs with FP8 tensor cores (Ada 8.9, Hopper 9.0)
FP8_MIN_CAPABILITY = (8, 9)


def fp8_capable(torch, device) -> bool:
    """Whether ``device`` has FP8 matmuls (a CUDA device of capability 8.9 or later)."""
    if getattr(device, "type", str(device)) != "cuda":
        return False
    return tuple(torch.cuda.get_device_capability(device)) >= FP8_MIN_CAPABILITY


def cold_scaled_mm(torch, n: int, device, cold_bytes: int, *, rowwise: bool) -> Callable[[], Any]:
    """A call that multiplies two ``n x n`` FP8 matrices into a bf16 third with
    ``torch._scaled_mm``, each call the next of as many operand sets as span
    ``cold_bytes`` (see the module docstring)."""
    fp8 = torch.float8_e4m3fn
    per_set = 2 * n * n + 2 * n * n       # two FP8 operands, one bf16 output
    sets = max(2, -(-cold_bytes // per_set))
    a_all = torch.randn(sets, n, n, device=device).to(fp8)
    # the second operand column-major, as _scaled_mm wants it
    b_all = torch.randn(sets, n, n, device=device).to(fp8).transpose(1, 2)
    out_all = torch.zeros(sets, n, n, device=device, dtype=torch.bfloat16)
    if rowwise:
        scale_a = torch.ones(n, 1, device=device)
        scale_b = torch.ones(1, n, device=device)
    else:
        scale_a = scale_b = torch.ones((), device=device)
    state = [0]

    def call() -> None:
        i = state[0]
        state[0] = (i + 1) % sets
        out_all[i] = torch._scaled_mm(a_all[i], b_all[i], scale_a=scale_a, scale_b=scale_b,
                                      out_dtype=torch.bfloat16, use_fast_accum=rowwise)

    return call


def measure_fp8_gemms(torch, device, sizes: Sequence[int], cold_bytes: int,
                      time_call: Callable[[Callable[[], Any]], float],
                      say: Callable[[str], None] = lambda _: None
                      ) -> dict[str, list[tuple[int, float]]]:
    """Seconds per call of each FP8 GEMM kind (:data:`FP8_KINDS`) at each size, by
    ``time_call(call)``; a kind torch rejects on this device is left out (and said)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for kind in FP8_KINDS:
        rows: list[tuple[int, float]] = []
        for n in sizes:
            try:
                call = cold_scaled_mm(torch, n, device, cold_bytes, rowwise=kind == "fp8_rowwise")
                call()
            except RuntimeError as exc:     # this torch or device lacks the kernel
                say(f"matmul {kind}: not measured ({str(exc).splitlines()[0][:120]})")
                rows = []
                break
            sec = time_call(call)
            del call
            rows.append((n, sec))
            say(f"matmul {kind} {n}^3: {2 * n**3 / sec / 1e9:.1f} GFLOP/s")
        if rows:
            out[kind] = rows
    return out


def fp8_tables(ranks: list[dict[str, Any]], source: str):
    """``(fp8 peak, {kind: EfficiencyTable}, {kind: [(FLOPs, FLOP/s)]})`` from every rank's
    measured FP8 GEMMs (its ``"fp8_matmul"``: kind -> [(n, seconds)]), the slowest rank at
    each size as for the other matmuls; ``(None, {}, {})`` when none was measured."""
    from .profile_records import EfficiencyTable

    measured = [r.get("fp8_matmul") or {} for r in ranks]
    if not all("fp8" in m for m in measured):
        return None, {}, {}
    points: dict[str, list[tuple[float, float]]] = {}
    for kind in FP8_KINDS:
        if not all(kind in m for m in measured):
            continue
        points[kind] = [(2.0 * n**3, 2.0 * n**3 / max(m[kind][i][1] for m in measured))
                        for i, (n, _) in enumerate(measured[0][kind])]
    peak = max(p for _, p in points["fp8"])
    tables = {kind: EfficiencyTable(
        tuple((f, min(1.0, p / peak)) for f, p in pts),
        source=(f"{source}: square torch._scaled_mm, e4m3 operands, bf16 output, "
                + ("one scale a row and column, fast accumulation (torchao's rowwise forward)"
                   if kind == "fp8_rowwise" else "one scale per operand (tensorwise)")
                + ", timed cold; throughput over the best tensorwise one (the fp8 peak)"))
        for kind, pts in points.items()}
    return peak, tables, points
