"""Assembly: layers from graph nodes, and the representatives expanded to full depth.

:func:`_assign_layers` groups the nodes into the pre segment, one layer per kept block
and the segments between and after them, folding the residual glue a caller runs
between blocks into the block before it (:func:`_fold_residual_glue`).
:func:`_cut_bytes` and :func:`_input_bytes` give what a pipeline boundary sends and a
layer receives, :func:`_node_record` turns a measured node into a
:class:`~autoplan.graph.NodeRecord`, and :func:`_expand` replaces each stack's
representatives with the full-depth list of :class:`~autoplan.graph.LayerRecord`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

from ..errors import TraceError
from ..graph import LayerKind, LayerRecord, NodeRecord
from .measure import _Measured, _nbytes, _tensors, _val_bytes
from .stacks import Stack, _map_full_to_rep


@dataclass
class _RepLayer:
    name: str
    kind: LayerKind
    stack: str
    index: int
    nodes: list[fx.Node]


def _assign_layers(gm: fx.GraphModule, stacks: Sequence[Stack], keep: Sequence[int]) -> list[_RepLayer]:
    prefixes = []
    for st, k in zip(stacks, keep):
        for i, name in enumerate(st.names[:k]):
            path = f"{st.path}.{name}" if st.path else name
            prefixes.append((path, st.path, i))

    def block_of(node: fx.Node):
        mod = node.meta.get("autoplan_module", "")
        for path, stack, i in prefixes:
            if mod == path or mod.startswith(path + "."):
                return path, stack, i
        return None

    layers: list[_RepLayer] = []
    current: _RepLayer | None = None
    pending_attrs: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            pending_attrs.append(node)
            continue
        owner = block_of(node)
        if owner is None:
            if current is None or current.kind is LayerKind.BLOCK:
                kind = LayerKind.PRE if not layers else LayerKind.SEGMENT
                current = _RepLayer("pre" if kind is LayerKind.PRE else f"segment{len(layers)}",
                                    kind, "", -1, [])
                layers.append(current)
        else:
            path, stack, i = owner
            if current is None or current.name != path:
                current = _RepLayer(path, LayerKind.BLOCK, stack, i, [])
                layers.append(current)
        current.nodes.extend(pending_attrs)
        pending_attrs = []
        current.nodes.append(node)
    if layers and layers[-1].kind is LayerKind.SEGMENT:
        layers[-1].kind = LayerKind.POST
        layers[-1].name = "post"
    if pending_attrs and layers:
        layers[-1].nodes.extend(pending_attrs)
    layers = _fold_residual_glue(layers)
    # a block that runs in several pieces (rare) is merged into its first occurrence
    merged: dict[str, _RepLayer] = {}
    out = []
    for l in layers:
        if l.kind is LayerKind.BLOCK and l.name in merged:
            merged[l.name].nodes.extend(l.nodes)
            continue
        merged[l.name] = l
        out.append(l)
    return out


def _fold_residual_glue(layers: list[_RepLayer]) -> list[_RepLayer]:
    """Fold the glue a caller runs around each block into the block before it.

    A model that loops ``h = h + block(h)`` over an ``nn.ModuleList`` runs the
    residual add outside the blocks, so the graph reads block 0, add, block 1,
    add, ...; each add belongs to the block it follows (its output is the residual
    stream the next block reads).  Glue between consecutive blocks of one stack is
    folded into the earlier block, and the same number of nodes at the start of
    what follows the last block, when they read that block, into the last block,
    so every block holds the same operators."""
    out: list[_RepLayer] = []
    glue = None
    i = 0
    while i < len(layers):
        l = layers[i]
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        prev = out[-1] if out else None
        if (l.kind is LayerKind.SEGMENT and prev is not None and nxt is not None
                and prev.kind is LayerKind.BLOCK and nxt.kind is LayerKind.BLOCK
                and prev.stack == nxt.stack and nxt.index == prev.index + 1):
            prev.nodes.extend(l.nodes)
            glue = len([n for n in l.nodes if n.op != "get_attr"])
            i += 1
            continue
        if (glue and prev is not None and prev.kind is LayerKind.BLOCK
                and l.kind in (LayerKind.SEGMENT, LayerKind.POST)):
            ops = [n for n in l.nodes if n.op != "get_attr"][:glue]
            mine = {n for n in prev.nodes}
            if len(ops) == glue and any(a in mine for a in ops[0].all_input_nodes):
                prev.nodes.extend(ops)
                l.nodes = [n for n in l.nodes if n not in set(ops)]
            glue = None
        out.append(l)
        i += 1
    return out


def _param_derived(gm: fx.GraphModule, param_nodes: set[str]) -> set[str]:
    """Nodes whose value depends on a parameter.  The others (attention masks, rotary
    tables, position ids) derive from the inputs alone, which every pipeline stage has:
    a stage rebuilds them rather than receiving them."""
    derived: set[str] = set()
    for node in gm.graph.nodes:
        if any(a.name in param_nodes or a.name in derived for a in node.all_input_nodes):
            derived.add(node.name)
    return derived


def _cut_bytes(layers: list[_RepLayer], values: dict[str, Any], param_nodes: set[str],
               derived: set[str]) -> list[int]:
    """Bytes of activations produced at or before layer i and used after it (values that
    depend on parameters only: what a pipeline boundary after layer i must send)."""
    index = {}
    for i, l in enumerate(layers):
        for n in l.nodes:
            index[n.name] = i
    last_use: dict[str, int] = {}
    producer_node: dict[str, fx.Node] = {}
    for i, l in enumerate(layers):
        for n in l.nodes:
            for a in n.all_input_nodes:
                if a.name in index and a.name in derived and a.name not in param_nodes \
                        and a.op != "get_attr":
                    last_use[a.name] = max(last_use.get(a.name, -1), i)
                    producer_node[a.name] = a
    cuts = [0] * len(layers)
    for name, last in last_use.items():
        first = index[name]
        b = _val_bytes(producer_node[name], values)
        for i in range(first, last):
            cuts[i] += b
    return cuts


def _input_bytes(layer: _RepLayer, values: dict[str, Any], param_nodes: set[str],
                 derived: set[str]) -> int:
    """Bytes of the parameter-dependent activations a layer receives from earlier layers."""
    own = {n.name for n in layer.nodes}
    seen, total = set(), 0
    for n in layer.nodes:
        for a in n.all_input_nodes:
            if a.name not in own and a.name not in seen and a.name in derived \
                    and a.name not in param_nodes and a.op != "get_attr":
                seen.add(a.name)
                total += _val_bytes(a, values)
    return total


def _node_record(node: fx.Node, m: _Measured, values: dict[str, Any], prefix: str,
                 region: set[str], param_bytes: int, gathered: frozenset[str] = frozenset()) -> NodeRecord:
    outs = _tensors(values.get(node.name))
    # a per-token copy of expert weights is not memory traffic of the real kernel
    out_bytes = 0 if node.name in gathered else sum(_nbytes(t) for t in outs)
    first = outs[0] if outs else None
    mod = node.meta.get("autoplan_module", "")
    if prefix and (mod == prefix or mod.startswith(prefix + ".")):
        mod = mod[len(prefix):].lstrip(".")
    target = node.target
    tname = (str(target) if isinstance(target, (str, torch._ops.OpOverload))
             else getattr(target, "__name__", str(target)))
    return NodeRecord(
        name=node.name, target=tname, module=mod,
        inputs=tuple(a.name for a in node.all_input_nodes if a.op != "get_attr"),
        shape=tuple(int(d) for d in first.shape) if first is not None else (),
        dtype=str(first.dtype).replace("torch.", "") if first is not None else "none",
        out_bytes=out_bytes, fwd_flops=m.fwd_flops, bwd_flops=m.bwd_flops,
        param_bytes=param_bytes, saved_bytes=m.saved, saved_tp_sharded_bytes=m.saved_sharded,
        saved_quadratic_bytes=m.saved_quadratic, tp_region=node.name in region)


def _top_modules(paths: Iterable[str]) -> tuple[str, ...]:
    ps = sorted(p for p in set(paths))
    out = []
    for p in ps:
        if any(p == q or p.startswith(q + ".") for q in out if q):
            continue
        if p == "":
            continue
        out.append(p)
    return tuple(out)


def _expand(rep_records: list[tuple[_RepLayer, dict]], stacks: Sequence[Stack],
            keep: Sequence[int]) -> list[LayerRecord]:
    """Replace each stack's kept representatives with the full-depth list of layers."""
    by_stack = {st.path: (st, k) for st, k in zip(stacks, keep)}
    out: list[LayerRecord] = []
    i = 0
    while i < len(rep_records):
        l, rec = rep_records[i]
        if l.kind is not LayerKind.BLOCK:
            out.append(LayerRecord(name=l.name, kind=l.kind, stack="", index=-1, **rec))
            i += 1
            continue
        st, k = by_stack[l.stack]
        reps = {}
        while i < len(rep_records) and rep_records[i][0].kind is LayerKind.BLOCK and \
                rep_records[i][0].stack == l.stack:
            reps[rep_records[i][0].index] = rep_records[i][1]
            i += 1
        mapping = _map_full_to_rep(st, k)
        for full, rep in enumerate(mapping):
            if rep not in reps:
                seen = [r[0].name for r in rep_records]
                raise TraceError(
                    f"block {st.path}.{st.names[rep]} did not run where autoplan expected it: it "
                    f"expects the children of {st.path or 'the stack'} to be called one after "
                    f"another (with at most some glue between them), and saw the layers run in "
                    f"this order: {', '.join(seen[:12])}{' ...' if len(seen) > 12 else ''}")
            name = f"{st.path}.{st.names[full]}" if st.path else st.names[full]
            data = dict(reps[rep])
            data["modules"] = (name,)
            out.append(LayerRecord(name=name, kind=LayerKind.BLOCK, stack=st.path, index=full, **data))
    return out
