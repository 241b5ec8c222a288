"""The optimizer :func:`~autoplan.parallelize` builds when the caller names none.

``torch.optim.AdamW`` with ``fused=True``: one kernel per parameter tensor reads the
gradient and reads and writes the parameter and both moments, the traffic the cost
model prices (``optimizer`` in ``profiles/cost/cost-model.yaml``).  torch's own default
is not that: on CPU it runs a loop of about ten operators per tensor (lerp, mul,
addcmul, sqrt, div, addcdiv...), each a pass over the tensor; on CUDA the same
operators over lists of tensors (``foreach``).  Measured on this kind of 2-core VM,
4 processes at once, the small GPT of ``benchmarks/pick_rank.py`` (3.7 M parameters
in 53 tensors): 12.9 ms a step by default, 6.1 ms fused.

A fused (or foreach) kernel takes lists of tensors of one kind: ``DTensor`` operators
refuse a list that mixes plain tensors and DTensors, or DTensors of different meshes
(tensor parallelism shards the linears and leaves the norms whole), so the parameters
are split into one parameter group per kind; each group gets the same hyper-parameters.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

__all__ = ["default_optimizer", "param_kinds"]


def param_kinds(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` split by kind, in first-seen order: plain tensors, and DTensors by
    device mesh (each kind a list in the order given)."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        key = ("dtensor", p.device_mesh) if isinstance(p, DTensor) else ("tensor",)
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def default_optimizer(params: Iterable[nn.Parameter], **hyper) -> torch.optim.Optimizer:
    """``torch.optim.AdamW(**hyper)`` (torch's defaults where ``hyper`` is silent) with
    ``fused=True``, one parameter group per kind of tensor (:func:`param_kinds`);
    without ``fused`` where torch has no fused kernel for the parameters' device, or
    where ``hyper`` says ``fused=False``.  Other hyper-parameters:
    ``functools.partial(default_optimizer, lr=3e-4)``."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    params = list(params)
    groups = [{"params": kind} for kind in param_kinds(params)]
    if not groups:
        # no parameters (a stage with none): let torch say so as it always has
        return torch.optim.AdamW(params, **hyper)
    fused = hyper.pop("fused", None) is not False and all(
        p.device.type in _get_fused_kernels_supported_devices() and p.is_floating_point()
        for p in params)
    return torch.optim.AdamW(groups, fused=fused or None, **hyper)
