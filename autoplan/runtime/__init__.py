"""The runtime: apply a plan to a model with torch.distributed and train it.

Mechanism only: each parallelism is one small module (:mod:`.tp`, :mod:`.cp`,
:mod:`.ep`, :mod:`.fsdp`, :mod:`.ac`, :mod:`.pipeline`); :func:`parallelize` applies a
:class:`~autoplan.Plan`, the record the search makes and the cost model prices,
through them.  Policy (which degrees, where to cut) comes from a
:class:`~autoplan.Strategy` (laid out by :meth:`Plan.from_strategy`), a
searched plan, or a plan built by hand (``blocks_per_stage`` for an uneven split).
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .layout import check_plan, plan_of
from .parallelize import ParallelModel, parallelize, resolve_plan

__all__ = [
    "parallelize",
    "ParallelModel",
    "plan_of",
    "check_plan",
    "resolve_plan",
    "save_checkpoint",
    "load_checkpoint",
]
