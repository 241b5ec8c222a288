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
zero-bubble (Qi et al. 2024).  Each micro-batch loss is a mean over its tokens,
divided by the replica's micro-batches and weighted by its share of the global
batch before backward (``scale_grads=False``), so the data-parallel mean of the
accumulated gradients is that of the mean loss over the global batch.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from torch.distributed.tensor import DTensor

from ..strategy import Schedule
from .adapters import Adapter
from .mesh import shared_group

__all__ = ["StageModule", "build_stage_module", "build_schedule", "CrossStageTie",
           "cross_stage_ties", "TiedGrads"]


class StageModule(nn.Module):
    """One pipeline stage: embedding (first stage), some blocks, head (last stage).

    Its children are the model's top-level children, pruned to this stage, so
    parameter names are the model's own.
    """

    def __init__(self, adapter: Adapter, *, is_first: bool, is_last: bool, seq_len: int) -> None:
        super().__init__()
        self._adapter = adapter
        self.is_first = is_first
        self.is_last = is_last
        self.seq_len = seq_len
        self.has_blocks = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
                       copy_params: Sequence[str] = ()) -> StageModule:
    """A :class:`StageModule` holding ``block_names`` (full layer names such as
    ``"model.layers.3"``), plus the embedding if first and the head if last.
    Parameters and buffers are shared with ``model``, not copied, except
    ``copy_params`` (tied parameters that other stages hold too: each stage
    gets its own copy, kept equal by :class:`TiedGrads`)."""
    private = {id(model.get_parameter(n)) for n in copy_params}
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())
            if id(t) not in private}
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
    stage = StageModule(adapter, is_first=is_first, is_last=is_last, seq_len=seq_len)
    stage.has_blocks = len(keep) > 0
    for name, child in root.named_children():
        stage.add_module(name, child)
    for name, p in root.named_parameters(recurse=False):
        stage.register_parameter(name, p)
    for name, b in root.named_buffers(recurse=False):
        stage.register_buffer(name, b)
    return stage


# ---------------------------------------------------------------------- tied weights
@dataclass(frozen=True)
class CrossStageTie:
    """Parameter names that are one tied parameter in the model but fall into different
    pipeline stages (an input embedding tied to the output head).  ``canonical`` is the
    name state dicts use (the model's first name for it); ``stages[i]`` holds ``names[i]``."""

    names: tuple[str, ...]
    stages: tuple[int, ...]

    @property
    def canonical(self) -> str:
        return self.names[0]


def cross_stage_ties(model: nn.Module, adapter: Adapter, stages: Sequence[Sequence[str]],
                     kinds: dict) -> list[CrossStageTie]:
    """The tied parameters of ``model`` that the pipeline split separates."""
    from ..graph import LayerKind

    owners: dict[int, list[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if full not in owners.setdefault(id(p), []):
                owners[id(p)].append(full)
    first_name = {id(p): n for n, p in model.named_parameters()}
    stage_of_layer = {name: s for s, layer_names in enumerate(stages) for name in layer_names}
    pre = [n for n in stage_of_layer if kinds[n] is LayerKind.PRE]
    post = [n for n in stage_of_layer if kinds[n] is LayerKind.POST]

    def stage_of(fqn: str) -> int:
        if fqn.startswith(adapter.blocks + "."):
            idx = fqn[len(adapter.blocks) + 1:].split(".")[0]
            return stage_of_layer[f"{adapter.blocks}.{idx}"]
        if any(fqn.startswith(m + ".") for m in adapter.pre):
            return stage_of_layer[pre[0]] if pre else 0
        if any(fqn.startswith(m + ".") for m in adapter.post):
            return stage_of_layer[post[0]] if post else len(stages) - 1
        raise ValueError(f"cannot place parameter {fqn!r} in a pipeline stage")

    ties = []
    for pid, names in owners.items():
        if len(names) < 2:
            continue
        names = sorted(names, key=lambda n: n != first_name[pid])   # canonical first
        where = tuple(stage_of(n) for n in names)
        if len(set(where)) > 1:
            ties.append(CrossStageTie(tuple(names), where))
    return ties


class TiedGrads:
    """Keeps the stage copies of cross-stage tied parameters equal (Megatron-LM's
    embedding group, Shoeybi et al. 2019): after backward, each copy's gradient is
    replaced by the sum over the copies, so every copy takes the same optimizer step.
    Copies on one rank (the V-shaped zero-bubble schedule puts the first and the last
    stage together) are summed locally; copies on two ranks by an all-reduce over a
    two-rank group of the same data- and tensor-parallel coordinates."""

    def __init__(self, ties: Sequence[CrossStageTie], local: dict[int, nn.Module],
                 stage_rank: Sequence[int], rank_of: Callable[[int], int],
                 all_pairs: Callable[[tuple[int, ...]], list[tuple[int, ...]]]) -> None:
        """``local``: stage index -> wrapped stage module on this rank; ``stage_rank``: pipeline
        rank of each stage; ``rank_of(pp_rank)``: this rank's peer on that pipeline rank;
        ``all_pairs(pp_ranks)``: every global rank group to create for those pipeline ranks,
        in the same order on every rank (``new_group`` is collective; one group per members
        in a process, :func:`~autoplan.runtime.mesh.shared_group`)."""
        self.items: list[tuple[list[tuple[nn.Module, str]], Any]] = []
        for tie in ties:
            pp_ranks = tuple(sorted({stage_rank[s] for s in tie.stages}))
            group = None
            if len(pp_ranks) > 1:
                mine = tuple(sorted(rank_of(r) for r in pp_ranks))
                for members in all_pairs(pp_ranks):
                    g = shared_group(members)
                    if members == mine:
                        group = g
            holders = [(local[s], n) for s, n in zip(tie.stages, tie.names) if s in local]
            if holders:
                self.items.append((holders, group))

    @torch.no_grad()
    def __call__(self) -> None:
        import torch.distributed as dist

        for holders, group in self.items:
            params = [m.get_parameter(n) for m, n in holders]
            locals_ = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    # e.g. a vocab-parallel embedding's gradient comes out replicated
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                g = p.grad
                locals_.append(g.to_local() if isinstance(g, DTensor) else g)
            total = locals_[0].clone()
            for g in locals_[1:]:
                total += g
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in locals_:
                g.copy_(total)


def build_schedule(schedule: Schedule, stages: list[PipelineStage], num_micro_batches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """torch's schedule object for ``schedule`` over this rank's ``stages``.

    ``loss_fn`` must already divide by the micro-batches (and weight the replica's share):
    torch's ``scale_grads`` would divide each rank's gradients by its own micro-batch count
    *after* the data-parallel reduction, wrong when replicas run different counts."""
    kw = dict(loss_fn=loss_fn, scale_grads=False)
    if schedule is Schedule.GPIPE:
        return ScheduleGPipe(stages[0], num_micro_batches, **kw)
    if schedule is Schedule.ONE_F_ONE_B:
        return Schedule1F1B(stages[0], num_micro_batches, **kw)
    if schedule is Schedule.INTERLEAVED:
        return ScheduleInterleaved1F1B(stages, num_micro_batches, **kw)
    if schedule is Schedule.ZERO_BUBBLE:
        return ScheduleZBVZeroBubble(stages, num_micro_batches, **kw)
    raise ValueError(f"unknown schedule {schedule!r}")


class _ZeroStage(PipelineStage):
    """torch's pipeline stage with two changes, both what the cost model prices.

    **ZeRO per micro-batch.**  Its FSDP2 units reduce and reshard after each
    micro-batch's backward as their ZeRO stage asks
    (:func:`autoplan.runtime.fsdp.set_micro_batch_sync`: ZeRO-2 and ZeRO-3 reduce-scatter
    every micro-batch, ZeRO-3 reshards).  torch's stage runs every backward without
    reduction or resharding and reduces once at the step's end (``REDUCE_GRAD``), which
    keeps every unit's gathered weights and whole gradients until then: ZeRO-2 and ZeRO-3
    would save no memory under a pipeline.  The step's ``REDUCE_GRAD`` then reduces what
    is left (the ZeRO-0/1 units; a unit already reduced has nothing pending).  Split
    backwards (zero-bubble schedules' input and weight passes) keep torch's handling.

    **Receive buffers while in use.**  torch allocates a receive buffer for every
    micro-batch's input activation and output gradient when the step starts and keeps
    them all (Llama-3-70B tp8 pp4 interleaved x5 on 64 A100: 164 GiB a device).  Here a
    buffer is allocated when its receive is posted and released once its micro-batch's
    backward is done, so a stage holds those of the micro-batches in flight, as
    Megatron-LM does (``CostOptions.pp_buffers_per_micro_batch=False``).
    """

    #: (recv infos kind, chunk, position) -> (shape, stride, dtype) of a released buffer
    _released: dict

    def _fresh_buffers(self, infos) -> None:
        """Allocate the released receive buffers among ``infos`` again (empty)."""
        released = self.__dict__.setdefault("_released", {})
        for info in infos:
            layout = released.pop(id(info), None)
            if layout is not None:
                shape, stride, dtype = layout
                info.buffer = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)

    def _release_buffers(self, infos) -> None:
        """Drop this stage's references to the receive buffers among ``infos`` (autograd
        keeps what the backward still needs)."""
        released = self.__dict__.setdefault("_released", {})
        for info in infos:
            buf = getattr(info, "buffer", None)
            if getattr(info, "is_root_arg", True) or buf is None or not buf.numel():
                continue
            released[id(info)] = (tuple(buf.shape), tuple(buf.stride()), buf.dtype)
            info.buffer = buf.new_empty(0)

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._fresh_buffers(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        self._fresh_buffers(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self._release_buffers(self.args_recv_info.get(bwd_chunk_id, ()))
        self._release_buffers(self.grad_recv_info.get(bwd_chunk_id, ()))
        return out

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict,
                                   last_backward: bool = False):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.pipelining.stage import stage_backward

        from .fsdp import set_micro_batch_sync

        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)
        set_micro_batch_sync(self.submod, last=False)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                               bwd_kwargs["input_values"])
        return grads, None


def make_stage(module: nn.Module, stage_index: int, num_stages: int, device: torch.device,
               group) -> PipelineStage:
    return _ZeroStage(module, stage_index, num_stages, device, group=group)
