"""What the cost model returns: :class:`Estimate`, per stage :class:`StageEstimate`
and the :class:`MemoryBreakdown` of one device.

All times are seconds per training step, memory in bytes, FLOP counts per step.
Every record round-trips through JSON exactly (:class:`~autoplan.records.Record`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..records import TRANSIENT, Record

__all__ = ["MemoryBreakdown", "StageEstimate", "Estimate", "BREAKDOWN_KEYS", "COMM_KINDS"]

#: Keys of :attr:`Estimate.breakdown`: they partition the step time (exposed time).
BREAKDOWN_KEYS: tuple[str, ...] = (
    "compute_s", "recompute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "dp_comm_s", "pp_comm_s",
    "bubble_s", "optimizer_s")

#: Kinds of communication in :attr:`Estimate.comm_total`.
COMM_KINDS: tuple[str, ...] = ("tp_comm_s", "cp_comm_s", "ep_comm_s", "dp_comm_s", "pp_comm_s")


@dataclass(frozen=True)
class MemoryBreakdown(Record):
    """Peak memory of one device, by kind (bytes).

    ``params``/``grads``/``optimizer`` are the model states after ZeRO
    partitioning; ``activations`` the saved activations of the micro-batches in
    flight plus the working set of one layer; ``buffers`` communication buffers
    (gathered ZeRO-3 parameters, gradient buckets, pipeline send/receive);
    ``reserve`` the runtime's reservation and allocator fragmentation.
    """

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float
    reserve_bytes: float

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activations_bytes + self.buffers_bytes + self.reserve_bytes)


@dataclass(frozen=True)
class StageEstimate(Record):
    """One pipeline rank (all its virtual chunks), on its slowest/fullest replica.

    Times are per micro-batch (``forward_s``, ``backward_s``: compute plus
    exposed communication) and per step (``busy_s``: the rank's work in one
    step without waiting).
    """

    rank: int
    device_type: str
    layers: int
    micro_batches_in_flight: float
    forward_s: float
    backward_s: float
    busy_s: float
    dp_comm_exposed_s: float
    memory: MemoryBreakdown
    memory_capacity_bytes: float
    fits: bool
    #: the deferred weight-gradient share of ``backward_s`` (seconds per micro-batch), what
    #: the zero-bubble schedule moves into the bubbles
    weight_grad_s: float = 0.0

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total_bytes


@dataclass(frozen=True)
class Estimate(Record):
    """Predicted step time, throughput and memory of one layout.

    ``breakdown`` partitions ``step_time_s`` into exposed time per kind
    (:data:`BREAKDOWN_KEYS`): compute, recompute, communication per kind,
    pipeline bubble and optimizer.  ``comm_total`` is each communication kind's
    total time on the critical device, hidden or not.

    ``mfu`` (``hfu``) divides the model's (hardware's) FLOP/s by the devices' peak as
    their profile states it: the datasheet peak for the shipped GPU profiles, the best
    measured matmul rate for a profile ``autoplan profile`` wrote (CPU included), so
    there it reads as a fraction of what the machine was seen to do.
    """

    step_time_s: float
    breakdown: dict[str, float]
    comm_total: dict[str, float]
    tokens_per_step: int
    tokens_per_s: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    model_tflops_per_gpu: float
    mfu: float
    hfu: float
    num_devices: int
    stages: tuple[StageEstimate, ...]
    peak_memory_bytes: float
    fits: bool
    memory_fraction: float
    notes: tuple[str, ...] = ()
    #: What every device moves over each group and computes in the step, as priced
    #: (:class:`autoplan.cost.ledger.Ledger`); carried in memory, not in JSON (a plan's
    #: file stays as it was; ``CostEngine.ledger`` rebuilds it)
    ledger: Any = field(default=None, compare=False, repr=False, metadata=TRANSIENT)

    def stage_table(self):
        """One row per pipeline rank (pandas DataFrame): time, memory by kind, fit."""
        import pandas as pd
        rows = []
        for s in self.stages:
            m = s.memory
            rows.append({
                "rank": s.rank, "device_type": s.device_type, "layers": s.layers,
                "in_flight": s.micro_batches_in_flight,
                "fwd_ms": s.forward_s * 1e3, "bwd_ms": s.backward_s * 1e3, "busy_s": s.busy_s,
                "dp_exposed_s": s.dp_comm_exposed_s,
                "params_GiB": m.params_bytes / 2**30, "grads_GiB": m.grads_bytes / 2**30,
                "optim_GiB": m.optimizer_bytes / 2**30, "act_GiB": m.activations_bytes / 2**30,
                "buffers_GiB": m.buffers_bytes / 2**30, "reserve_GiB": m.reserve_bytes / 2**30,
                "peak_GiB": m.total_bytes / 2**30, "capacity_GiB": s.memory_capacity_bytes / 2**30,
                "fits": s.fits,
            })
        return pd.DataFrame(rows)

    def summary(self) -> str:
        """One line: step time, throughput, MFU, peak memory and whether it fits: the
        planning limit (``memory_fraction`` of a device) or the device itself."""
        fit = "fits" if self.fits else self._misfit()
        # a CPU "device" runs at GFLOP/s: print what it does, not "0 TFLOP/s"
        rate = (f"{self.model_tflops_per_gpu:.0f} TFLOP/s/GPU" if self.model_tflops_per_gpu >= 1
                else f"{self.model_tflops_per_gpu * 1e3:.3g} GFLOP/s/device")
        return (f"step {self.step_time_s:.3f} s, {self.tokens_per_s:,.0f} tok/s, "
                f"{rate}, MFU {self.mfu:.1%}, "
                f"peak {self.peak_memory_bytes / 2**30:.1f} GiB ({fit})")

    def _misfit(self) -> str:
        """What a layout that does not fit exceeds: the device, or only the planning limit
        (75.4 GiB on an 80 GiB A100 is over 90% of it, not over the card)."""
        if not self.stages:
            return "DOES NOT FIT"
        worst = max(self.stages, key=lambda s: s.peak_memory_bytes / s.memory_capacity_bytes)
        cap = worst.memory_capacity_bytes / 2**30
        if worst.peak_memory_bytes > worst.memory_capacity_bytes:
            return f"DOES NOT FIT the {cap:.3g} GiB device"
        limit = cap * self.memory_fraction
        if worst.peak_memory_bytes / 2**30 > limit:
            return (f"over the planning limit, {self.memory_fraction:.0%} of {cap:.3g} GiB = "
                    f"{limit:.1f} GiB; the {cap:.3g} GiB device holds it")
        return "DOES NOT FIT"

    def report(self) -> str:
        """Several lines: the summary, the breakdown and the per-stage table."""
        lines = [self.summary(), "breakdown (exposed):"]
        for k in BREAKDOWN_KEYS:
            v = self.breakdown.get(k, 0.0)
            share = v / self.step_time_s if self.step_time_s else 0.0
            lines.append(f"  {k[:-2]:<10} {v:10.4f} s  {share:6.1%}")
        lines.append("communication (total, hidden or not): " + ", ".join(
            f"{k[:-2]} {v:.4f} s" for k, v in self.comm_total.items()))
        lines.append(self.stage_table().to_string(index=False, float_format=lambda x: f"{x:.3g}"))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)
