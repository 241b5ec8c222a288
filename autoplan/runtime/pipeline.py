"""Pipeline stages built by hand and run by torch's pipeline schedules.

A stage is a copy of the model's module tree (sharing its parameters) that
keeps only the layers of that stage, under their original names: a block
``blocks.5`` is ``blocks.5`` in every layout, so state dicts and checkpoints
do not depend on the pipeline split.  The family adapter
(:mod:`autoplan.runtime.adapters`) says how a stage runs its slice.  Stages are
built by hand rather than with the tracer front end (``pipeline()``), which
cannot split Hugging Face Llama, unties tied embeddings and fails for V-shaped
schedules.

torch's schedules are the pipeline runtime: GPipe (Huang et al. 2019), 1F1B
(Narayanan et al. 2019), interleaved 1F1B (Narayanan et al. 2021) and ZBV
zero-bubble (Qi et al. 2024).  Each micro-batch loss is a mean over its tokens
and ``scale_grads=True`` divides the accumulated gradients by the number of
micro-batches, so the gradient is that of the mean over the local batch.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from ..strategy import Schedule
from .adapters import Adapter

__all__ = ["StageModule", "build_stage_module", "build_schedule"]


class StageModule(nn.Module):
    """One pipeline stage: embedding (first stage), some blocks, head (last stage).

    Its children are the model's top-level children, pruned to this stage, so
    parameter names are the model's own.
    """

    def __init__(self, adapter: Adapter, *, is_first: bool, is_last: bool, seq_len: int,
                 autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._adapter = adapter
        self.is_first = is_first
        self.is_last = is_last
        self.seq_len = seq_len
        self.autocast_dtype = autocast_dtype
        self.has_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = (torch.autocast(x.device.type, dtype=self.autocast_dtype)
               if self.autocast_dtype is not None else contextlib.nullcontext())
        with ctx:
            if self.is_first:
                x = self._adapter.embed(self, x)
            if self.has_blocks:
                x = self._adapter.run_blocks(self, x, self.seq_len)
            if self.is_last:
                x = self._adapter.head(self, x)
        return x


def _set(root: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, value)


def build_stage_module(model: nn.Module, adapter: Adapter, block_names: Sequence[str], *,
                       is_first: bool, is_last: bool, seq_len: int,
                       autocast_dtype: torch.dtype | None = None) -> StageModule:
    """A :class:`StageModule` holding ``block_names`` (full layer names such as
    ``"model.layers.3"``), plus the embedding if first and the head if last.
    Parameters and buffers are shared with ``model``, not copied."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    root = copy.deepcopy(model, memo)
    stack = root.get_submodule(adapter.blocks)
    keep = nn.ModuleDict()
    for name in block_names:
        idx = name[len(adapter.blocks) + 1:]
        keep[idx] = stack[int(idx)]
    _set(root, adapter.blocks, keep)
    for path in () if is_first else adapter.pre:
        _set(root, path, None)
    for path in () if is_last else adapter.post:
        _set(root, path, None)
    stage = StageModule(adapter, is_first=is_first, is_last=is_last, seq_len=seq_len,
                        autocast_dtype=autocast_dtype)
    stage.has_blocks = len(keep) > 0
    for name, child in root.named_children():
        stage.add_module(name, child)
    for name, p in root.named_parameters(recurse=False):
        stage.register_parameter(name, p)
    for name, b in root.named_buffers(recurse=False):
        stage.register_buffer(name, b)
    return stage


def build_schedule(schedule: Schedule, stages: list[PipelineStage], num_micro_batches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """torch's schedule object for ``schedule`` over this rank's ``stages``."""
    if schedule is Schedule.GPIPE:
        return ScheduleGPipe(stages[0], num_micro_batches, loss_fn=loss_fn, scale_grads=True)
    if schedule is Schedule.ONE_F_ONE_B:
        return Schedule1F1B(stages[0], num_micro_batches, loss_fn=loss_fn, scale_grads=True)
    if schedule is Schedule.INTERLEAVED:
        return ScheduleInterleaved1F1B(stages, num_micro_batches, loss_fn=loss_fn, scale_grads=True)
    if schedule is Schedule.ZERO_BUBBLE:
        return ScheduleZBVZeroBubble(stages, num_micro_batches, loss_fn=loss_fn, scale_grads=True)
    raise ValueError(f"unknown schedule {schedule!r}")


def make_stage(module: nn.Module, stage_index: int, num_stages: int, device: torch.device,
               group) -> PipelineStage:
    return PipelineStage(module, stage_index, num_stages, device, group=group)
