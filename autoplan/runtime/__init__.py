"""The runtime: apply a layout to a model with torch.distributed and train it.

Mechanism only: each parallelism is one small module (:mod:`.tp`, :mod:`.fsdp`,
:mod:`.ac`, :mod:`.pipeline`); :func:`parallelize` applies a resolved
:class:`Layout` through them.  Policy (which degrees, where to cut) comes from
a :class:`~autoplan.Strategy`, a searched plan, or a hand-written ``Layout``.
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .layout import LayerLayout, Layout, check_layout, layout_from_strategy
from .parallelize import ParallelModel, parallelize, resolve_layout

__all__ = [
    "parallelize",
    "ParallelModel",
    "Layout",
    "LayerLayout",
    "layout_from_strategy",
    "check_layout",
    "resolve_layout",
    "save_checkpoint",
    "load_checkpoint",
]
