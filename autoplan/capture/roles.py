"""Tensor-parallel roles, inferred from the data flow of the captured graph.

:func:`_weight_uses` finds where each weight is used (linear, GPT-2 Conv1D, embedding,
expert bank); :func:`_tp_structure` gives each use of a layer its role in the Megatron
pattern (column, row, expert column/row, router, vocabulary embedding/head, replicated:
:func:`_is_row`, :func:`_is_router`, :func:`_is_gate`), the head counts the degree must
divide (:func:`_heads_of`), the tensor-parallel region, and the collectives of the tensor-,
sequence- and expert-parallel variants of the layer.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from ..graph import CollectiveRecord, LayerKind, LinearRecord, LinearRole, TPStructure
from .assemble import _RepLayer
from .export import _strip
from .measure import _fetch_attr, _val_bytes

aten = torch.ops.aten


_MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default,
            aten.bmm.default, aten.baddbmm.default, aten.einsum.default}
_PASSTHROUGH = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
    aten.contiguous.default, aten.dropout.default, aten.native_dropout.default,
    aten.alias.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
    aten.type_as.default, aten.feature_dropout.default, aten.flatten.using_ints,
    operator.getitem, aten.add.Tensor, aten.mul.Tensor, aten.squeeze.dim, aten.unsqueeze.default,
}


_RESIDUAL_ADDS = {aten.add.Tensor, aten.add_.Tensor, operator.add, torch.add}
_ROUTING = {aten.topk.default, aten.softmax.int, aten._softmax.default, aten.sigmoid.default}


@dataclass
class _WeightUse:
    node: fx.Node
    param: str          # qualified parameter name (full path)
    module: str         # module path owning the parameter
    shape: tuple[int, ...]
    kind: str           # linear | conv1d | embedding | experts | conv


def _param_shapes(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj = _fetch_attr(gm, node.target)
            if isinstance(obj, nn.Parameter):
                out[node.name] = tuple(obj.shape)
    return out


def _aliases(wrapper: nn.Module) -> dict[str, list[tuple[str, bool]]]:
    """Every name of each parameter (tied weights have several), with whether its
    owning module is an ``nn.Embedding``."""
    by_id: dict[int, list[tuple[str, bool]]] = defaultdict(list)
    for mod_name, mod in wrapper.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            by_id[id(p)].append((full, isinstance(mod, nn.Embedding)))
    out = {}
    for names in by_id.values():
        for n, _ in names:
            out[n] = names
    return out


_WEIGHT_VIEWS = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default, aten.view.default,
                 aten.reshape.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
                 aten.expand.default, aten.unsqueeze.default, aten.contiguous.default}


def _param_source(node: fx.Node, param_of_node: dict[str, str]) -> fx.Node | None:
    """The parameter a matmul operand is a transposed / reshaped / cast view of (``x @ w.T``)."""
    for _ in range(4):
        if node.name in param_of_node:
            return node
        if node.op != "call_function" or node.target not in _WEIGHT_VIEWS or not node.args \
                or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
    return node if node.name in param_of_node else None


def _weight_uses(gm: fx.GraphModule, param_of_node: dict[str, str],
                 aliases: dict[str, list[tuple[str, bool]]]) -> list[_WeightUse]:
    shapes = _param_shapes(gm)
    uses = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_module") or node.target in _WEIGHT_VIEWS:
            continue
        params = [a for a in node.all_input_nodes if a.name in param_of_node and a.name in shapes]
        if not params and node.target in _MATMULS:
            params = [src for a in node.all_input_nodes
                      if (src := _param_source(a, param_of_node)) is not None and src.name in shapes]
        weights = [p for p in params if len(shapes[p.name]) >= 2]
        if not weights:
            continue
        w = weights[0]
        shape = shapes[w.name]
        tgt = node.target
        is_embedding = tgt in (aten.embedding.default, torch.nn.functional.embedding)
        names = aliases.get(param_of_node[w.name], [(param_of_node[w.name], is_embedding)])
        # a tied weight is named after the module that uses it this way
        chosen = next((n for n, emb in names if emb == is_embedding), names[0][0])
        full = _strip(chosen)
        module = full.rsplit(".", 1)[0] if "." in full else ""
        if is_embedding:
            kind = "embedding"
        elif len(shape) == 3:
            kind = "experts"
        elif tgt is aten.addmm.default:
            kind = "conv1d"          # GPT-2 Conv1D: addmm(bias, x, weight[in, out])
        elif tgt in _MATMULS or tgt in (torch._C._nn.linear, torch.matmul, torch.addmm):
            kind = "linear"
        else:
            kind = "conv"
        uses.append(_WeightUse(node, full, module, shape, kind))
    return uses


_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default}


def _uncast(x: Any) -> Any:
    """The activation a dtype cast reads (a router may score in fp32: DeepSeek-V3)."""
    while isinstance(x, fx.Node) and x.target in _CASTS and x.args and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x


def _expert_matmul(u: _WeightUse) -> tuple[fx.Node | None, fx.Node | None, fx.Node | None]:
    """An expert bank's matmul, the weight operand it takes and the token operand.

    Hugging Face's ``batched_mm`` experts gather the bank per routed token
    (``w[expert_ids]``, the weight use) and multiply the gathered copies with the
    routed tokens, one row per (token, chosen expert): ``bmm(w_sel, x[..., None])``,
    or ``bmm(x[:, None], w_sel)`` for banks stored ``[experts, in, out]`` (gpt-oss).
    """
    chain, frontier = {u.node}, [u.node]
    if u.node.target in _MATMULS:
        mm = u.node
    else:
        mm = None
        for _ in range(4):
            nxt = []
            for n in frontier:
                for user in n.users:
                    if user.target in _MATMULS and mm is None:
                        mm = user
                    elif user.target in _WEIGHT_VIEWS:
                        chain.add(user)
                        nxt.append(user)
            frontier = nxt
    if mm is None:
        return None, None, None
    operands = [a for a in mm.args if isinstance(a, fx.Node)]
    weight = next((a for a in operands if a in chain or _param_source(a, {u.node.name: u.param})
                   is not None), None)
    tokens = next((a for a in operands if a is not weight), None)
    return mm, weight, tokens


def _expert_in_out(u: _WeightUse) -> tuple[int, int]:
    """(in, out) features of an expert bank: ``[experts, out, in]`` unless its matmul
    takes it as the right operand (``x @ w``, a bank stored ``[experts, in, out]``)."""
    fin, fout = int(u.shape[2]), int(u.shape[1])
    mm, weight, _ = _expert_matmul(u)
    val = weight.meta.get("val") if weight is not None else None
    if mm is None or not isinstance(val, torch.Tensor) or val.dim() < 2 or \
            mm.target not in (aten.bmm.default, aten.baddbmm.default, aten.matmul.default):
        return fin, fout
    right = mm.args.index(weight) == (2 if mm.target is aten.baddbmm.default else 1)
    k, n = (int(val.shape[-2]), int(val.shape[-1])) if right else (int(val.shape[-1]), int(val.shape[-2]))
    return (k, n) if {k, n} == {fin, fout} else (fin, fout)


def _users_through(node: fx.Node, passthrough: set, limit: int = 8,
                   through: Callable[[fx.Node], bool] | None = None) -> list[fx.Node]:
    """Nodes reached from ``node`` through pass-through ops (breadth first, bounded);
    ``through(user)``: a user to pass through besides the ops of ``passthrough``."""
    frontier, seen, out = [node], {node}, []
    for _ in range(limit):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                out.append(u)
                if u.target in passthrough or (through is not None and through(u)):
                    nxt.append(u)
        frontier = nxt
    return out


def _is_token_scale(node: fx.Node) -> bool:
    """A product of a tensor and a per-token scale: one factor's last dimension is 1 and
    the other's is not (Qwen2-MoE's ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``).
    The scaled tensor keeps its features, so a row matmul's output passes through it."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2:
        return False
    widths = []
    for a in node.args:
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() < 1:
            return False
        widths.append(int(val.shape[-1]))
    return min(widths) == 1 < max(widths)


def _is_gate(u: _WeightUse) -> bool:
    """A linear with one output feature: a per-token gate (Qwen2-MoE's
    ``shared_expert_gate``, ``nn.Linear(hidden, 1)``) that scales another branch.  It has
    nothing to split, so it stays whole on every tensor-parallel rank, as a router does,
    and constrains no tensor-parallel degree."""
    if u.kind not in ("linear", "conv1d") or len(u.shape) != 2:
        return False
    out_features = u.shape[1] if u.kind == "conv1d" else u.shape[0]
    return out_features == 1


def _is_activation(a: Any, param_nodes: set[str]) -> bool:
    return isinstance(a, fx.Node) and a.name not in param_nodes and a.op != "get_attr"


def _descendants(node: fx.Node, within: set[str]) -> set[fx.Node]:
    out, frontier = set(), [node]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u not in out and u.name in within:
                out.add(u)
                frontier.append(u)
    return out


def _is_row(node: fx.Node, param_nodes: set[str], within: set[str]) -> bool:
    """Does the matmul's output reach a residual add unchanged?

    Unchanged: through views, casts, dropout and per-token scales (a gated shared
    expert's output, :func:`_is_token_scale`), not through other products.  A residual
    add sums the (passed-through) matmul output with an activation of the same shape
    that does *not* derive from that matmul (the residual stream);
    ``x + 0.044715 * x**3`` inside a GeLU is therefore no residual add.
    """
    chain = {node}
    derived = _descendants(node, within) | {node}
    for u in _users_through(node, _PASSTHROUGH - _RESIDUAL_ADDS - {aten.mul.Tensor},
                            through=_is_token_scale):
        if u.target in _RESIDUAL_ADDS:
            a, b = u.args[0], u.args[1]
            other = b if a in chain else a
            if isinstance(other, fx.Node) and other in derived:
                chain.add(u)
                continue
            if _is_activation(a, param_nodes) and _is_activation(b, param_nodes):
                va, vb = a.meta.get("val"), b.meta.get("val")
                same = (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
                        and tuple(va.shape) == tuple(vb.shape))
                if same or not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
                    return True
        chain.add(u)
    return False


def _is_router(node: fx.Node) -> bool:
    return any(u.target in (aten.topk.default,) for u in _users_through(
        node, _PASSTHROUGH | _ROUTING, limit=4))


def _heads_of(node: fx.Node, out_features: int) -> int | None:
    """Number of heads when the matmul output is reshaped into (..., heads, head_dim).

    The reshape splits the feature dimension into factors; the last is the head
    dimension.  A factor that a user immediately unbinds, splits or selects along is a
    fused q/k/v (or gate/up) axis, not heads, whichever order the model lays them out in:
    ``(heads, 3, d)`` (Megatron) and ``(3, heads, d)`` both give ``heads``.
    """
    for u in _users_through(node, {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                                   operator.getitem, aten.split.Tensor, aten.split_with_sizes.default,
                                   aten.chunk.default, aten.unbind.int, aten.slice.Tensor}, limit=4):
        val = u.meta.get("val")
        src = u.args[0].meta.get("val") if isinstance(u.args[0], fx.Node) else None
        if u.target not in (aten.view.default, aten.reshape.default) or not isinstance(val, torch.Tensor) \
                or not isinstance(src, torch.Tensor) or src.dim() < 1:
            continue
        # the factors the feature dimension was split into: the shortest trailing run of
        # the new shape whose product is the viewed tensor's last dimension
        features, k = int(src.shape[-1]), 1
        while k <= val.dim() and math.prod(int(d) for d in val.shape[-k:]) < features:
            k += 1
        if k < 2 or k > val.dim() or math.prod(int(d) for d in val.shape[-k:]) != features:
            continue
        lead = val.dim() - k
        factors = [int(d) for d in val.shape[lead:]]
        head_dim = factors[-1]
        if head_dim <= 1 or out_features % features:
            continue
        fused = set()
        for w in u.users:
            if w.target in (aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default,
                            aten.chunk.default, aten.select.int):
                dim = w.args[1] if len(w.args) > 1 else w.kwargs.get("dim", 0)
                dim = dim if isinstance(dim, int) and dim >= 0 else (dim or 0) + val.dim()
                if lead <= dim < val.dim() - 1:
                    fused.add(dim - lead)
        heads = math.prod(f for i, f in enumerate(factors[:-1]) if i not in fused)
        if heads >= 1:
            return heads
    return None


def _tp_structure(layer: _RepLayer, uses: list[_WeightUse], param_nodes: set[str],
                  values: dict[str, Any], vocab: int | None, prefix: str) -> tuple[TPStructure, set[str]]:
    own = {n.name for n in layer.nodes}
    mine = [u for u in uses if u.node.name in own]

    def rel(path: str) -> str:
        if prefix and (path == prefix or path.startswith(prefix + ".")):
            return path[len(prefix):].lstrip(".")
        return path

    roles: dict[str, LinearRole] = {}
    if layer.kind is LayerKind.BLOCK:
        gates = [u for u in mine if _is_gate(u)]
        rows = [u for u in mine if u.kind in ("linear", "conv1d") and u not in gates
                and _is_row(u.node, param_nodes, own)]
        routers = [u for u in mine if u.kind in ("linear", "conv1d") and u not in rows and _is_router(u.node)]
        experts = [u for u in mine if u.kind == "experts"]
        for u in mine:
            if u in gates:
                roles[u.param] = LinearRole.REPLICATED
            elif u in rows:
                roles[u.param] = LinearRole.ROW
            elif u in routers:
                roles[u.param] = LinearRole.ROUTER
            elif u.kind in ("linear", "conv1d"):
                roles[u.param] = LinearRole.COLUMN
            elif u.kind == "experts":
                roles[u.param] = LinearRole.EXPERT_ROW if u is experts[-1] else LinearRole.EXPERT_COLUMN
            else:
                roles[u.param] = LinearRole.REPLICATED
        has_row = any(r in (LinearRole.ROW, LinearRole.EXPERT_ROW) for r in roles.values())
        if not has_row:   # no Megatron pair: nothing to shard without an extra all-gather
            roles = {k: LinearRole.REPLICATED for k in roles}
    else:
        for u in mine:
            if u.kind == "embedding" and vocab is not None and u.shape[0] == vocab:
                roles[u.param] = LinearRole.VOCAB_EMBEDDING
            elif u.kind in ("linear", "conv1d") and vocab is not None and vocab in u.shape \
                    and layer.kind is not LayerKind.PRE:
                roles[u.param] = LinearRole.VOCAB_HEAD
            else:
                roles[u.param] = LinearRole.REPLICATED

    # the tensor-parallel region: from the column matmuls up to (not including) the row ones
    starts = [u.node for u in mine if roles.get(u.param) in (LinearRole.COLUMN, LinearRole.EXPERT_COLUMN)]
    stops = {u.node for u in mine if roles.get(u.param) in (LinearRole.ROW, LinearRole.EXPERT_ROW)}
    region: set[str] = set()
    frontier = list(starts)
    while frontier:
        n = frontier.pop()
        if n.name in region or n in stops or n.name not in own:
            continue
        region.add(n.name)
        frontier.extend(n.users)

    linears, divisors, tp_coll, sp_coll, ep_coll = [], set(), [], [], []
    seen_params: set[str] = set()
    for u in mine:
        if u.param in seen_params:
            continue
        seen_params.add(u.param)
        role = roles[u.param]
        shape = u.shape
        n_exp = shape[0] if u.kind == "experts" else 1
        if u.kind == "conv1d":
            fin, fout = shape[0], shape[1]
        elif u.kind == "experts":
            fin, fout = _expert_in_out(u)
        elif u.kind == "embedding":
            fin, fout = shape[0], shape[1]
        else:
            fin, fout = shape[1], shape[0]
        bias = any(a.op == "get_attr" and a.name in param_nodes and a is not u.node.args[0]
                   and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim() == 1
                   for a in u.node.all_input_nodes) or any(
                       a.op == "get_attr" and "bias" in str(a.target) for a in u.node.all_input_nodes)
        pname = rel(u.param)
        name = pname[: -len(".weight")] if pname.endswith(".weight") else pname
        linears.append(LinearRecord(name, role, int(fin), int(fout), int(n_exp), bool(bias)))
        if role is LinearRole.COLUMN:
            divisors.add(int(fout))
            heads = _heads_of(u.node, int(fout))
            if heads:
                divisors.add(heads)
        elif role is LinearRole.ROW:
            divisors.add(int(fin))
        elif role in (LinearRole.EXPERT_COLUMN, LinearRole.EXPERT_ROW):
            divisors.add(int(min(shape[1], shape[2])))

    # collectives: one parallel region per row matmul (Megatron: f / g operators)
    node_by_param = {u.param: u for u in mine}
    region_inputs: dict[str, int] = {}
    # an expert bank's use is a gather of the bank (its args are the weights): the MoE
    # region's input is what the router reads, the tokens before they are routed
    router_in = {u.module.rsplit(".", 1)[0]: _uncast(u.node.args[0]) for u in mine
                 if roles.get(u.param) is LinearRole.ROUTER}
    for u in mine:
        if roles[u.param] in (LinearRole.COLUMN, LinearRole.EXPERT_COLUMN):
            x = u.node.args[1] if u.kind == "conv1d" else u.node.args[0]
            if u.kind == "experts":
                parent = u.module.rsplit(".", 1)[0]
                x = router_in.get(parent, next(iter(router_in.values()), None))
                if x is None:
                    x = _expert_matmul(u)[2]
            if isinstance(x, fx.Node) and x.name not in region:
                region_inputs[x.name] = _val_bytes(x, values)
    in_bytes = sum(region_inputs.values())
    row_uses = [node_by_param[p] for p, r in roles.items() if r in (LinearRole.ROW, LinearRole.EXPERT_ROW)]
    n_regions = max(1, len(row_uses))
    for u in row_uses:
        out_b = _val_bytes(u.node, values)
        if u.kind == "experts":   # its use is the gathered bank: the block's tokens come out
            x = router_in.get(u.module.rsplit(".", 1)[0], next(iter(router_in.values()), None))
            out_b = _val_bytes(x, values) if x is not None else out_b
        inp = in_bytes // n_regions
        where = rel(u.module)
        tp_coll += [CollectiveRecord("all_reduce", "forward", out_b, where),
                    CollectiveRecord("all_reduce", "backward", inp, where)]
        sp_coll += [CollectiveRecord("all_gather", "forward", inp, where),
                    CollectiveRecord("reduce_scatter", "forward", out_b, where),
                    CollectiveRecord("all_gather", "backward", out_b, where),
                    CollectiveRecord("reduce_scatter", "backward", inp, where)]
    exp_rows = [u for u in mine if roles[u.param] is LinearRole.EXPERT_ROW]
    exp_cols = [u for u in mine if roles[u.param] is LinearRole.EXPERT_COLUMN]
    for u in exp_rows:
        # dispatch and combine move the routed tokens: one row per (token, chosen expert),
        # what the bank's first matmul multiplies
        col = next((c for c in exp_cols if c.module == u.module), exp_cols[0] if exp_cols else u)
        x = _expert_matmul(col)[2]
        tokens = _val_bytes(x, values) if x is not None else 0
        if not tokens:
            tokens = sum(region_inputs.values()) or _val_bytes(u.node, values)
        ep_coll += [CollectiveRecord("all_to_all", "forward", tokens, rel(u.module)),
                    CollectiveRecord("all_to_all", "forward", tokens, rel(u.module)),
                    CollectiveRecord("all_to_all", "backward", tokens, rel(u.module)),
                    CollectiveRecord("all_to_all", "backward", tokens, rel(u.module))]
    for u in mine:  # vocab-parallel embedding and head (Megatron / torch loss_parallel)
        if roles[u.param] is LinearRole.VOCAB_EMBEDDING:
            b = _val_bytes(u.node, values)
            tp_coll.append(CollectiveRecord("all_reduce", "forward", b, rel(u.module)))
            sp_coll.append(CollectiveRecord("reduce_scatter", "forward", b, rel(u.module)))
            sp_coll.append(CollectiveRecord("all_gather", "backward", b, rel(u.module)))
        elif roles[u.param] is LinearRole.VOCAB_HEAD:
            x = u.node.args[1] if u.kind == "conv1d" else u.node.args[0]
            b = _val_bytes(x, values) if isinstance(x, fx.Node) else 0
            tp_coll.append(CollectiveRecord("all_reduce", "backward", b, rel(u.module)))
            sp_coll.append(CollectiveRecord("all_gather", "forward", b, rel(u.module)))
            sp_coll.append(CollectiveRecord("reduce_scatter", "backward", b, rel(u.module)))
    tp = TPStructure(tuple(linears), tuple(tp_coll), tuple(sp_coll), tuple(ep_coll),
                     tuple(sorted(divisors)))
    return tp, region


def _sp_replicated(kind: LayerKind, tp: TPStructure, owned: list[tuple[str, int]], prefix: str,
                   top: tuple[str, ...]) -> tuple[int, ...]:
    """Elements of each parameter (``(name, elements)`` pairs the layer owns, full names)
    of the modules sequence parallelism keeps whole on the sequence shard
    (:meth:`TPStructure.sequence_parallel_modules`; in the last layer, among its ``top``
    modules)."""
    def module_of(name: str) -> str:
        m = name.rpartition(".")[0]
        return m[len(prefix) + 1:] if prefix and m.startswith(prefix + ".") else m
    owners = list(dict.fromkeys(module_of(n) for n, _ in owned))
    if kind is LayerKind.POST:
        owners = [m for m in owners if m in top]
    sp = set(tp.sequence_parallel_modules(kind, owners))
    return tuple(n for name, n in owned if module_of(name) in sp)
