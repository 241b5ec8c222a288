"""The runtime: apply a plan to a model with torch.distributed and train it.

Mechanism only: each parallelism is one small module (:mod:`.tp`, :mod:`.cp`,
:mod:`.ep`, :mod:`.fsdp`, :mod:`.ac`, :mod:`.pipeline`); :func:`parallelize` applies a
:class:`~autoplan.Plan`, the record the search makes and the cost model prices,
through them.  Policy (which degrees, where to cut) comes from a
:class:`~autoplan.Strategy` (laid out by :meth:`Plan.from_strategy`), a
searched plan, or a plan built by hand (``blocks_per_stage`` for an uneven split).

The names below load on first use: :mod:`.parallelize` and :mod:`.checkpoint` pull in
torch.distributed's tensor, FSDP, pipelining and checkpoint stacks, and the capture
imports :mod:`.loss` (the training loss) from this package without them.
"""

from __future__ import annotations

import sys
import types

from .._lazy import lazy_names as _lazy_names

__all__ = [
    "parallelize",
    "ParallelModel",
    "plan_of",
    "check_plan",
    "resolve_plan",
    "save_checkpoint",
    "load_checkpoint",
]

_LAZY = {
    "parallelize": ".parallelize",
    "ParallelModel": ".parallelize",
    "resolve_plan": ".parallelize",
    "plan_of": ".layout",
    "check_plan": ".layout",
    "save_checkpoint": ".checkpoint",
    "load_checkpoint": ".checkpoint",
}

__getattr__, __dir__ = _lazy_names(__name__, _LAZY, __all__)


class _Package(types.ModuleType):
    """Keeps ``autoplan.runtime.parallelize`` the function: importing the submodule of
    the same name (``from autoplan.runtime.parallelize import ...``) sets the package's
    attribute to the submodule, which would hide the function."""

    def __setattr__(self, name: str, value) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType) and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
