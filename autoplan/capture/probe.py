"""The quadratic-attention probe and the attention core.

The attention core (:func:`_attention_core`: the operators whose output has two
sequence-length dimensions and the matmuls that read one) is what selective recompute
re-runs; :func:`_core_ops` records it as the runtime's operator stream sees it.  When
``seq_len`` equals a model dimension shapes cannot tell the quadratic tensors apart, so
:func:`_quadratic_probe` captures again at a length that collides with nothing
(:func:`_probe_length`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
from torch import nn

from ..graph import AttentionCore, CoreOp, NodeRecord
from .assemble import _node_record, _RepLayer
from .export import _capture_fx
from .measure import _Measure, _quadratic_shape
from .objective import _max_positions, _Objective


def _model_dims(model: nn.Module) -> set[int]:
    dims = {int(d) for p in model.parameters() for d in p.shape}
    cfg = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "n_head", "heads", "head_dim"):
        v = getattr(cfg, key, None)
        if isinstance(v, int):
            dims.add(v)
    return dims


def _probe_length(model: nn.Module, seq_len: int | None, args: tuple, kwargs: dict) -> int | None:
    """A sequence length for the quadratic-term probe, or None when none is needed/possible."""
    if not seq_len or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) \
            or args[0].dim() != 2 or args[0].is_floating_point():
        return None
    dims = _model_dims(model) | {int(args[0].shape[0])}
    if seq_len not in dims:
        return None
    limit = _max_positions(model) or 2 * seq_len
    for delta in range(1, seq_len):
        for cand in (seq_len - delta, seq_len + delta):
            if 2 < cand <= limit and cand not in dims and cand * cand not in dims:
                return cand
    return None


def _quadratic_probe(wrapper: _Objective, args: tuple, method: str,
                     probe_len: int) -> tuple[dict[str, int], set[str]]:
    """Quadratic saved bytes per node and the attention-core node names at ``probe_len``."""
    ids = torch.zeros(args[0].shape[0], probe_len, dtype=args[0].dtype, device=args[0].device)
    gm, _ = _capture_fx(wrapper, (ids,), {}, method)
    measured, values, _ = _Measure(gm, (ids,), {}, probe_len, set()).run()
    records = [_node_record(n, measured[n.name], values, "", set(), 0)
               for n in gm.graph.nodes if n.name in measured]
    core = {r.name for r in _attention_core(records, probe_len)}
    return {k: m.saved_quadratic for k, m in measured.items()}, core


def _attention_core(nodes: Sequence[NodeRecord], seq_len: int | None) -> list[NodeRecord]:
    """The nodes selective recompute re-runs (Korthikanti et al. 2022, Sec. 4.2).

    Those are the operators whose output has two sequence-length dimensions
    (QK^T, scaling, masking, softmax, dropout) and the matmuls that consume such a
    tensor (attention x V): the part whose saved activations grow with s^2 while
    its FLOPs are small.  Found from the captured shapes, not from names.
    """
    if not seq_len:
        return []

    def quadratic(shape: Sequence[int]) -> bool:
        return _quadratic_shape(shape, seq_len)

    shapes = {n.name: n.shape for n in nodes}
    core = []
    for n in nodes:
        if n.dtype == "bool" and not n.fwd_flops:
            continue  # masks are built once, not recomputed work
        if quadratic(n.shape) or (n.fwd_flops and any(quadratic(shapes.get(i, ())) for i in n.inputs)):
            core.append(n)
    return core


def _core_ops(layer: _RepLayer, core: set[str],
              dispatched: dict[str, tuple[str, ...]]) -> AttentionCore:
    """The attention core of a block as the runtime will see it: the counted dispatched
    operators of the core's nodes, each numbered by its occurrence among the block's
    calls of that operator (see :mod:`autoplan.opstream`)."""
    calls: dict[str, int] = defaultdict(int)
    ops, nodes = [], []
    for n in layer.nodes:
        if n.name in core:
            nodes.append(n.name)
        for name in dispatched.get(n.name, ()):
            if n.name in core:
                ops.append(CoreOp(op=name, index=calls[name]))
            calls[name] += 1
    return AttentionCore(nodes=tuple(nodes), ops=tuple(ops),
                         calls={name: calls[name] for name in sorted({o.op for o in ops})})
