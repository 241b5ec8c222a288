"""Tensor and sequence parallelism with ``torch.distributed.tensor.parallel``.

The ``parallelize_module`` plan of every layer is built from the roles the
capture found (:class:`~autoplan.graph.LinearRole`), not from module names:

- ``column`` -> :class:`ColwiseParallel`, ``row`` -> :class:`RowwiseParallel`
  (Megatron-LM, Shoeybi et al. 2019, Sec. 3);
- ``vocab_embedding`` -> a row-sharded embedding table (vocab-parallel),
  ``vocab_head`` -> a column-sharded head whose logits stay sharded over the
  vocabulary for the built-in loss, computed under torch's ``loss_parallel``
  (three all-reduces of one number per token; Megatron-LM's vocab-parallel
  cross-entropy), and are all-gathered for a loss of the user's;
- sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2): the residual
  stream between blocks is sharded on the sequence dimension; every
  parameterised module outside the tensor-parallel regions (the norms) runs
  :class:`SequenceParallel`; the module that opens a region all-gathers its
  input (:class:`PrepareModuleInput`), the row linear that closes it
  reduce-scatters (``output_layouts=Shard(1)``).  The first block of the
  model turns the replicated embedding output into sequence shards.

FP8 linears (:mod:`.fp8`) under the tensorwise recipe take torchao's float8 styles
(``float8``): a column or row linear that is a ``Float8Linear`` its float8 style, and
a region entry whose column linears all are ``PrepareFloat8ModuleInput``, which casts
the region's input to FP8 before its sequence all-gather (torchtitan's float8 TP plan).

Expert roles (MoE) are not applied here: in a block with an expert bank the
experts and the router stay whole on every rank of the tensor-parallel group
(they see the same tokens: the attention output is all-reduced before them),
while attention and shared experts split as in a dense block.  A linear the
capture marked ``replicated`` (a one-feature gate such as Qwen2-MoE's
``shared_expert_gate``, scaling the shared expert's all-reduced output) is in no
plan either: it too stays whole on every rank.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..graph import LayerKind, LayerRecord, LinearRole

__all__ = ["tp_plan", "apply_tp"]


def _has_module(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
        return True
    except AttributeError:
        return False


def _own_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=False))


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def tp_plan(layer: LayerRecord, module: nn.Module, *, sequence_parallel: bool,
            first_block: bool = False, region_kwargs: dict[str, str] | None = None,
            vocab_parallel_loss: bool = False, float8=None) -> dict[str, object]:
    """The ``parallelize_module`` plan of one layer, relative to ``module``.

    ``module`` is the block itself for a block layer, the model (or pipeline
    stage) root for the pre and post layers.  ``vocab_parallel_loss``: the head's
    logits stay sharded over the vocabulary (a DTensor ``Shard(-1)``) for a loss
    computed under torch's ``loss_parallel`` (no rank holds the whole logits);
    otherwise they are all-gathered.  ``float8``: torchao's float8 styles
    (:class:`autoplan.runtime.fp8.Float8Styles`) for the FP8 linears, or None.
    """
    region_kwargs = region_kwargs or {}

    def fp8(name: str) -> bool:
        return float8 is not None and float8.converted(module.get_submodule(name))
    # MoE: the experts and the router stay whole on every tp rank (each runs the block's
    # tokens through them; expert parallelism splits the experts over dp x cp instead);
    # attention and shared experts split as in a dense block; replicated linears (a
    # one-feature gate) get no entry below and stay whole too
    roles = {n: r for n, r in layer.tp.placed_roles().items() if _has_module(module, n)}
    plan: dict[str, object] = {}
    sp = sequence_parallel
    if layer.kind is LayerKind.BLOCK:
        # a block's module holds all its linears: the modules that open its regions
        entries = layer.tp.region_entries()
        for name, role in roles.items():
            if role is LinearRole.COLUMN:
                # without an enclosing module to gather once, each column linear gathers
                gather_here = sp and _parent(name) == ""
                style = float8.colwise if fp8(name) else ColwiseParallel
                plan[name] = style(input_layouts=Shard(1)) if gather_here else style()
            elif role is LinearRole.ROW:
                style = float8.rowwise if fp8(name) else RowwiseParallel
                plan[name] = style(output_layouts=Shard(1)) if sp else style()
        if sp:
            owners = [name for name, sub in module.named_modules() if name and _own_params(sub)]
            for name in layer.tp.sequence_parallel_modules(layer.kind, owners):
                plan[name] = SequenceParallel()
        # the module that opens a region takes its input as one DTensor (gathered from the
        # sequence shards under sp): the region's column linears share it, their input
        # gradients add up as partial sums and are reduced once, by one all-reduce (one
        # reduce-scatter under sp) where the region's input leaves it -- Megatron-LM's
        # one backward collective per region, which the cost model prices.  Without it
        # each column linear wraps its own input and reduces its own input gradient:
        # q, k and v apart, gate and up apart (a Llama block: 5 all-reduces in the
        # backward, not 2)
        arriving = Shard(1) if sp else Replicate()
        for e in entries:
            if not e:
                continue
            kw = region_kwargs.get(e.rpartition(".")[2]) or region_kwargs.get(e)
            # FP8 into the region when every column linear it feeds multiplies FP8
            columns = [n for n, r in roles.items() if r is LinearRole.COLUMN
                       and n.startswith(e + ".")]
            prepare = (float8.prepare_input if columns and all(fp8(n) for n in columns)
                       else PrepareModuleInput)
            if kw:
                plan[e] = prepare(input_kwarg_layouts={kw: arriving},
                                  desired_input_kwarg_layouts={kw: Replicate()})
            else:
                plan[e] = prepare(input_layouts=(arriving,), desired_input_layouts=(Replicate(),))
        if sp and first_block:
            # the embedding output arrives replicated; from here on the residual
            # stream is sharded on the sequence dimension
            plan[""] = PrepareModuleInput(input_layouts=(Replicate(),),
                                          desired_input_layouts=(Shard(1),),
                                          use_local_output=True)
        return plan
    for name, role in roles.items():
        if role is LinearRole.VOCAB_EMBEDDING and isinstance(module.get_submodule(name), nn.Embedding):
            # vocab-parallel embedding: each rank holds a slice of the table, the
            # partial lookups are all-reduced
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif role is LinearRole.VOCAB_HEAD and isinstance(module.get_submodule(name), nn.Linear):
            if vocab_parallel_loss:
                plan[name] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                             output_layouts=Shard(-1), use_local_output=False)
            else:
                plan[name] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                             output_layouts=Replicate())
    if sp and layer.kind is LayerKind.POST:
        leaves = [path for path in layer.modules if _has_module(module, path)
                  and _own_params(module.get_submodule(path))
                  and not list(module.get_submodule(path).children())]
        for path in layer.tp.sequence_parallel_modules(layer.kind, leaves):
            plan[path] = SequenceParallel(use_local_output=True)
    return plan


def apply_tp(root: nn.Module, layers: Iterable[tuple[LayerRecord, str]], tp_mesh: DeviceMesh, *,
             sequence_parallel: bool, first_block: str | None = None,
             region_kwargs: dict[str, str] | None = None,
             vocab_parallel_loss: bool = False, float8=None) -> None:
    """Shard the linears of ``layers`` (``(record, module path)`` pairs present in ``root``)
    over ``tp_mesh``; tied parameters are re-tied after sharding.  ``vocab_parallel_loss``,
    ``float8``: see :func:`tp_plan`."""
    ties = _tied_groups(root)
    for layer, path in layers:
        if layer.kind is LayerKind.BLOCK:
            if not _has_module(root, path):
                continue
            module = root.get_submodule(path)
            plan = tp_plan(layer, module, sequence_parallel=sequence_parallel,
                           first_block=path == first_block, region_kwargs=region_kwargs,
                           float8=float8)
        else:
            module = root
            plan = tp_plan(layer, root, sequence_parallel=sequence_parallel,
                           region_kwargs=region_kwargs, vocab_parallel_loss=vocab_parallel_loss,
                           float8=float8)
        own = plan.pop("", None)
        if plan:
            parallelize_module(module, tp_mesh, plan)
        if own is not None:
            parallelize_module(module, tp_mesh, own)
    _retie(root, ties)


def _tied_groups(root: nn.Module) -> list[list[tuple[str, str]]]:
    where: dict[int, list[tuple[str, str]]] = {}
    for mname, m in root.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            where.setdefault(id(p), [])
            if (mname, pname) not in where[id(p)]:
                where[id(p)].append((mname, pname))
    return [g for g in where.values() if len(g) > 1]


def _retie(root: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    for group in groups:
        mods = [(root.get_submodule(m), p) for m, p in group]
        first = getattr(mods[0][0], mods[0][1])
        for m, p in mods[1:]:
            other = getattr(m, p)
            if other is first:
                continue
            if (type(other) is not type(first) or other.shape != first.shape or
                    getattr(other, "placements", None) != getattr(first, "placements", None)):
                raise ValueError(
                    f"tied parameters {group} were sharded differently by tensor parallelism "
                    f"({getattr(first, 'placements', None)} vs {getattr(other, 'placements', None)})")
            m.register_parameter(p, first)


def reduce_partial_grads(modules: Iterable[nn.Module]) -> int:
    """All-reduce the gradients left as partial sums over a tensor-parallel group, all of
    them in one collective per group; returns how many gradients were reduced.

    Under sequence parallelism the parameters of the modules that run on the sharded
    sequence with their parameters whole (:class:`SequenceParallel`: the norms) see only
    their rank's share of the tokens, so their gradients are ``Partial`` DTensors.  Left
    so, the optimizer reduces each of them at every operator that reads it (AdamW: three
    small collectives per tensor per step, at ``lerp_`` and at both operands of
    ``addcmul_``); Megatron-LM reduces them together once per step
    (``_allreduce_layernorm_grads``), as this does.  Gradients FSDP2 manages arrive
    reduced already (its post-backward redistributes them) and are left alone.
    """
    groups: dict[tuple, list[nn.Parameter]] = {}
    seen: set[int] = set()   # a parameter two stages of this rank share is reduced once
    for module in modules:
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                groups.setdefault((id(g.device_mesh), g.placements, g.dtype), []).append(p)
    for params in groups.values():
        mesh, placements = params[0].grad.device_mesh, params[0].grad.placements
        if any(pl.is_partial() and pl.reduce_op != "sum" for pl in placements):
            for p in params:   # not a plain sum: let DTensor reduce each
                p.grad = p.grad.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                         for pl in placements])
            continue
        local = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in local])
        for dim, pl in enumerate(placements):
            if pl.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        whole = [Replicate() if pl.is_partial() else pl for pl in placements]
        for p, t, part in zip(params, local, flat.split([t.numel() for t in local])):
            p.grad = DTensor.from_local(part.view_as(t), mesh, whole, run_check=False,
                                        shape=p.grad.shape, stride=p.grad.stride())
    return sum(len(params) for params in groups.values())
