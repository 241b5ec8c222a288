"""Square matmuls per dtype and size, timed cold as a training step runs them
(:func:`measure_matmuls`, :func:`cold_matmul`)."""

from __future__ import annotations

from typing import Any, Callable

from ..hardware.profiles import EfficiencyTable
from .plan import MeasurementPlan
from .timing import fmt_bytes, time_local


#: Matmuls are timed cold, as a training step runs them (other layers' weights and
#: activations have evicted the caches since the last use): each call takes the next of
#: several input/output sets that together span at least this many bytes, twice this
#: machine's 32 MiB last-level CPU cache (on CUDA, twice the device's L2 where larger;
#: Triton's ``do_bench`` clears the L2 before each call likewise).  Warm, back to back, the
#: step's matmul sizes on this CPU run 7-22% faster (median ~15%).
COLD_BYTES = 64 * 2**20


def cold_matmul(torch, n: int, dtype, device, cold_bytes: int) -> Callable[[], Any]:
    """A call that multiplies two ``n x n`` matrices into a third, each call the next of
    as many distinct sets (views into three flat buffers) as span ``cold_bytes``, so no
    call finds its operands in cache (:data:`COLD_BYTES`)."""
    per_set = 3 * n * n * torch.empty((), dtype=dtype).element_size()
    sets = max(2, -(-cold_bytes // per_set))
    a_all = torch.randn(sets * n * n, device=device).to(dtype)
    b_all = torch.randn(sets * n * n, device=device).to(dtype)
    # written once here: a step's outputs land in memory its allocator has used before,
    # while a fresh page faults on its first write (~0.5-1.7 ms per MiB on this kind of VM);
    # a quick profile's few calls of a size would otherwise all pay it
    out_all = torch.zeros(sets * n * n, device=device, dtype=dtype)
    views = [(a_all[i * n * n:(i + 1) * n * n].view(n, n),
              b_all[i * n * n:(i + 1) * n * n].view(n, n),
              out_all[i * n * n:(i + 1) * n * n].view(n, n)) for i in range(sets)]
    state = [0]

    def call() -> None:
        a, b, out = views[state[0]]
        state[0] = (state[0] + 1) % sets
        torch.matmul(a, b, out=out)

    call.sets = views  # type: ignore[attr-defined]
    return call


def measure_matmuls(torch, dist, device, dtypes: dict, plan: MeasurementPlan, cuda: bool,
                    cold_bytes: int, sync: Callable[[], None], timed: Callable[..., float],
                    say: Callable[[str], None]) -> dict[str, list[tuple[int, float]]]:
    """Seconds per cold square matmul (:func:`cold_matmul`) of each size the plan times, per
    dtype: ``dtype -> [(n, seconds)]``, every rank at once (on CUDA each GPU's own best batch,
    :func:`~.timing.time_local`; on CPU ``timed(call, target_s, local=True)``).  On CUDA an
    fp32 matmul runs on TF32 tensor cores only as ``tf32``."""
    matmul: dict[str, list[tuple[int, float]]] = {}
    for name, sizes in plan.matmul_sizes.items():
        if cuda:  # fp32 matmuls run on TF32 tensor cores only when allowed
            torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
        matmul[name] = []
        for n in sizes:
            call = cold_matmul(torch, n, dtypes[name], device, cold_bytes)
            dist.barrier()
            sec = (time_local(call, sync, plan.matmul_target_s, plan.repeats) if cuda
                   else timed(call, plan.matmul_target_s, local=True))
            del call
            matmul[name].append((n, sec))
            say(f"matmul {name} {n}^3: {2 * n**3 / sec / 1e9:.1f} GFLOP/s")
    if cuda:
        torch.set_float32_matmul_precision("highest")
    return matmul


def tabulate_matmuls(ranks: list[dict[str, Any]], how: str, shares_cores: bool
                     ) -> tuple[dict[str, float], dict[str, EfficiencyTable],
                                dict[str, list[tuple[float, float]]]]:
    """``(peaks, efficiency tables, throughput points)`` per dtype from the ranks' matmul
    timings (:func:`measure_matmuls`): at each size the slowest rank's time, the peak the best
    of those, each table the throughput over the peak (``how``: the sources' opening)."""
    peaks: dict[str, float] = {}
    tables: dict[str, EfficiencyTable] = {}
    throughput: dict[str, list[tuple[float, float]]] = {}
    for dtype in ranks[0]["matmul"]:
        points = []
        for i, (n, _) in enumerate(ranks[0]["matmul"][dtype]):
            sec = max(r["matmul"][dtype][i][1] for r in ranks)
            points.append((2.0 * n**3, 2.0 * n**3 / sec))
        peak = max(p[1] for p in points)
        peaks[dtype] = peak
        throughput[dtype] = points
        tables[dtype] = EfficiencyTable(
            tuple((flops, min(1.0, achieved / peak)) for flops, achieved in points),
            source=(f"{how}: square matmuls timed cold (each call's operands from a rotation "
                    f"of sets spanning {fmt_bytes(ranks[0].get('cold_bytes', COLD_BYTES))}), "
                    f"throughput over the best measured ({dtype})"
                    + ("; the ranks share cores: each rank free-running, every rank busy, "
                       "the fastest of a few windows of the ranks' mean"
                       if shares_cores else "")))
    return peaks, tables, throughput
