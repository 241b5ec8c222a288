"""Pipeline schedules: step time from per-rank times, and micro-batches in flight.

Each pipeline rank ``p`` needs ``t_p = F_p + B_p`` seconds per micro-batch
(forward and backward of all its chunks, with their exposed communication).
With ``m`` micro-batches per step and ``pp`` ranks:

* **GPipe** (Huang et al. 2019) and **1F1B** (PipeDream-Flush; Narayanan et
  al. 2021, Sec. 2.2.1): ``T = (m - 1) max_p t_p + sum_p t_p``.  For equal
  ranks this is ``(m + pp - 1) t``: the bubble is ``(pp - 1) / m`` of the
  ideal time.
* **Interleaved 1F1B** with ``v`` chunks per rank (Narayanan et al. 2021,
  Sec. 2.2.2): the bubble shrinks by ``v``:
  ``T = m max_p t_p + (sum_p t_p - max_p t_p) / v``.
* **Zero bubble, ZB-V** (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
  Sec. 3 and 5): backward splits into the input gradient ``B`` and the weight
  gradient ``W``, which fills the bubble; with two chunks per rank in a V the
  remaining bubble is ``(pp - 1) max(0, F_c + B_c - 2 W_c)`` for per-chunk
  times (half a rank's), so ``T = m max_p t_p + (pp - 1) max(0, F + B - 2W) / 2``.

Activations in flight on rank ``p`` (0 = first):

* GPipe: all ``m`` micro-batches.
* 1F1B: ``min(pp - p, m)`` (rank ``p`` runs ``pp - p - 1`` warm-up forwards).
* Interleaved: Megatron-LM runs ``(pp - p - 1) * 2 + (v - 1) * pp`` warm-up
  chunk forwards, so ``min(that + 1, m v)`` chunk micro-batches are in flight,
  each holding ``1/v`` of the rank's activations; for the first rank this is
  ``pp (1 + (pp - 1)/(pp v))`` micro-batches, Korthikanti et al. 2022, Sec. 4.2.3.
* ZB-V: ``min(pp, m)`` on every rank (Qi et al. 2024, Sec. 5: the V shape
  gives every rank the first rank's 1F1B activation memory).

Examples
--------
>>> pipeline_time(Schedule.ONE_F_ONE_B, [1.0, 1.0], m=4)   # (4 + 2 - 1) * 1
5.0
>>> bubble_fraction(Schedule.ONE_F_ONE_B, pp=2, m=4)
0.25
>>> in_flight(Schedule.ONE_F_ONE_B, rank=0, pp=4, m=8), in_flight(Schedule.ONE_F_ONE_B, rank=3, pp=4, m=8)
(4.0, 1.0)
"""

from __future__ import annotations

from typing import Sequence

from ..strategy import Schedule

__all__ = ["pipeline_time", "bubble_fraction", "in_flight"]


def pipeline_time(schedule: Schedule, rank_times_s: Sequence[float], m: int, *,
                  virtual_stages: int = 1, zb_excess_s: float = 0.0) -> float:
    """Seconds for ``m`` micro-batches through ranks needing ``rank_times_s`` each.

    ``zb_excess_s`` is ``max(0, F + B - 2W)`` of the slowest rank (zero bubble only).
    """
    pp = len(rank_times_s)
    t_max = max(rank_times_s)
    total = sum(rank_times_s)
    if pp == 1:
        return m * t_max
    if schedule is Schedule.INTERLEAVED:
        return m * t_max + (total - t_max) / virtual_stages
    if schedule is Schedule.ZERO_BUBBLE:
        return m * t_max + (pp - 1) * zb_excess_s / 2
    return (m - 1) * t_max + total


def bubble_fraction(schedule: Schedule, pp: int, m: int, virtual_stages: int = 1) -> float:
    """Bubble time over ideal time for equal ranks: ``(pp - 1) / (v m)`` (0 for ZB-V with F=B=W)."""
    if pp == 1 or schedule is Schedule.ZERO_BUBBLE:
        return 0.0
    v = virtual_stages if schedule is Schedule.INTERLEAVED else 1
    return (pp - 1) / (v * m)


def in_flight(schedule: Schedule, rank: int, pp: int, m: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations rank ``rank`` holds at its peak (see the module docstring)."""
    if pp == 1:
        return 1.0
    if schedule is Schedule.GPIPE:
        return float(m)
    if schedule is Schedule.INTERLEAVED:
        v = virtual_stages
        warmup = (pp - rank - 1) * 2 + (v - 1) * pp
        return min(warmup + 1, m * v) / v
    if schedule is Schedule.ZERO_BUBBLE:
        return float(min(pp, m))
    return float(min(pp - rank, m))
