"""What ``autoplan profile`` measures and for how long (:class:`MeasurementPlan`)."""

from __future__ import annotations

from dataclasses import dataclass

from .attention import ATTENTION_HEADS, ATTENTION_TOKENS


@dataclass(frozen=True)
class MeasurementPlan:
    """What to measure and for how long (seconds are targets per point, not limits)."""
    matmul_sizes: dict[str, tuple[int, ...]]
    matmul_target_s: float
    copy_bytes: int
    copy_target_s: float
    comm_sizes_bytes: tuple[int, ...]
    comm_target_s: float
    repeats: int
    overhead_target_s: float = 0.1
    #: fused attention (CUDA only): (batch, heads, sequence, head dim) per timed call
    attention_shapes: tuple[tuple[int, int, int, int], ...] = ()

    @classmethod
    def for_machine(cls, cuda: bool, quick: bool) -> "MeasurementPlan":
        """The default (or ``quick``) plan for a CPU or a CUDA machine."""
        kib, mib = 2**10, 2**20
        if cuda:
            sizes = (512, 1024, 2048, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
            seqs = (1024, 4096) if quick else (512, 1024, 2048, 4096, 8192)
            attention = tuple((ATTENTION_TOKENS // s, heads, s, d) for s in seqs
                              for heads, d in ATTENTION_HEADS)
            return cls({d: sizes for d in ("fp32", "tf32", "bf16", "fp16")},
                       0.05 if quick else 0.2, (256 if quick else 1024) * mib, 0.05 if quick else 0.2,
                       tuple(4**i * kib for i in range(0, 9 if quick else 10, 2 if quick else 1)),
                       0.05 if quick else 0.2, 3 if quick else 5,
                       attention_shapes=attention)
        if quick:
            # collectives up to 16 MiB, where a CPU collective is bandwidth-bound: up to 2 MiB
            # the fit's slope was noise under latency on 4 ranks of 2 cores (1000 GB/s)
            return cls({"fp32": (128, 256, 512, 768), "bf16": (128, 256, 512)}, 0.06,
                       64 * mib, 0.1, (1 * kib, 16 * kib, 256 * kib, 16 * mib), 0.2, 3, 0.1)
        return cls({"fp32": (64, 128, 256, 512, 1024, 1536), "bf16": (64, 128, 256, 512, 1024)},
                   0.4, 256 * mib, 0.5, tuple(4**i * kib for i in range(0, 8)), 0.35, 5, 0.4)
