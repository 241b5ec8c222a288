"""One decision for every rank: rank 0 computes, every rank gets the result.

Searches, file-system checks and names made of random parts need not agree
across processes when each computes its own; a job must act on one answer.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, TypeVar

import torch.distributed as dist

__all__ = ["on_rank0", "on_rank0_named"]

T = TypeVar("T")


def on_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0 only; its value on every rank, or its exception raised on
    every rank (collective: one broadcast over the default process group).

    An exception that cannot be pickled arrives as a RuntimeError naming it.
    """
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            try:
                pickle.dumps(e)
            except Exception:  # noqa: BLE001 - what cannot travel is named instead
                e = RuntimeError(f"{type(e).__name__}: {e}")
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def on_rank0_named(fn: Callable[[], T], what: str, error: type[Exception], *,
                   passing: tuple[type[Exception], ...] = ()) -> T:
    """:func:`on_rank0` of ``fn``; an exception other than those in ``passing`` is raised
    on every rank as ``error`` saying that ``what`` failed on rank 0 (and why)."""

    def named() -> T:
        try:
            return fn()
        except passing:
            raise
        except Exception as e:  # noqa: BLE001 - every rank raises it, named
            raise error(f"{what} failed on rank 0: {type(e).__name__}: {e}") from None

    return on_rank0(named)
