"""Per-layer and per-template aggregates of a captured graph, computed once.

The cost model is called ~10^4-10^5 times per search, so everything that
depends only on the model is taken out of the :class:`~autoplan.graph.ModelGraph`
once, here: per layer the FLOPs, parameters, saved bytes and collectives *per
sequence* (the graph records them per micro-batch of ``graph.micro_batch``
sequences, linear in the batch), and per template the list of FLOP-carrying
nodes that the compute time is priced from.  Identical blocks share one
template, so a 96-layer model prices one block.

Prefix sums over the layers make any contiguous range's totals O(1).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from itertools import accumulate

from ..capture.probe import _attention_core
from ..graph import TP_SHARDED_ROLES as _SHARDED_ROLES
from ..graph import LayerKind, LayerRecord, LinearRole, ModelGraph, NodeRecord
from ..hardware.profile_records import elementwise_kind

__all__ = ["MatmulNode", "LayerCost", "GraphSummary", "summarize", "ACTIVATION_UNIT_BYTES"]

# Fused attention operators: the whole attention core in one node.
_FUSED_ATTENTION_TARGETS = ("scaled_dot_product", "flash_attention", "efficient_attention",
                            "cudnn_attention")
# Operators that only re-label memory (no kernel, no traffic).
_FREE_OPS = ("view", "_unsafe_view", "alias", "transpose", "permute", "expand", "aten.t.",
             "getitem", "unbind", "split", "chunk", "select", "slice", "squeeze", "unsqueeze",
             "detach", "unflatten", "lift_fresh", "as_strided", "_reshape_alias")
# Operators that are free on a contiguous input and a copy on a transposed one.
_MAYBE_COPY_OPS = ("reshape", "flatten")
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1}
#: Bytes per element at which the summary counts every floating tensor of a graph (bf16's):
#: the figures do not depend on the dtype the model was built or captured in.  Integer and
#: boolean tensors (token ids, masks) keep their own bytes, exact under a 2-byte recipe.
ACTIVATION_UNIT_BYTES = 2
# Floating dtypes a model computes in: under a mixed-precision recipe every one of them is
# the recipe's activation dtype, whatever dtype the model was built in.
_COMPUTE_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16"})


# Operators whose backward keeps only their integer or boolean arguments (indices, masks,
# targets): what they save is not in their output's dtype.
_SAVE_INDEX_OPS = ("embedding", "masked_fill", "where", "nll_loss", "gather", "index",
                   "scatter")


def _saved_scale(n: NodeRecord, activation_bytes: int) -> float:
    """:func:`_unit_scale` of what node ``n`` saves."""
    if any(op in n.target for op in _SAVE_INDEX_OPS):
        return 1.0
    return _unit_scale(n.dtype, activation_bytes)


def _unit_scale(dtype: str, activation_bytes: int) -> float:
    """What a node's bytes are multiplied by to count them in the graph's activation dtype.

    A floating tensor is counted by its elements at ``activation_bytes`` each, so a model
    built in fp32 and the same one built in bf16 (whose norms and softmax may upcast to
    fp32 inside) give the same figures, which the engine then prices at the recipe's
    activation dtype (:class:`~autoplan.strategy.Precision`).  Integer and boolean
    tensors keep their bytes.
    """
    if dtype in _COMPUTE_DTYPES:
        return activation_bytes / _DTYPE_BYTES[dtype]
    return 1.0


@dataclass(frozen=True)
class MatmulNode:
    """A FLOP-carrying node of a template, per sequence.

    ``sharded``: its work splits over the tensor-parallel group; ``core``: it is
    part of the attention core (what selective recompute re-runs and a fused
    attention kernel computes: the matmuls without weights that produce or
    consume an ``s x s`` tensor);
    ``weight``: it multiplies a parameter (half its backward is the weight
    gradient, which zero-bubble schedules defer);
    ``expert``: it is a GEMM of an expert bank (its size under expert parallelism
    is that of one expert's tokens, :meth:`CostEngine.template_time`);
    ``fused``: it is a fused attention kernel's call (torch's
    ``scaled_dot_product_attention``), the whole core in one node, its backward's
    FLOPs counted with the scores the kernel recomputes (torch's FLOP formula);
    ``module``: the module that runs it, relative to the layer as the capture names it
    (a linear's name in ``LayerRecord.tp.linears``: what FP8 recipes convert).
    """

    fwd_flops: float
    bwd_flops: float
    sharded: bool
    core: bool
    weight: bool
    expert: bool = False
    fused: bool = False
    module: str = ""


@dataclass(frozen=True)
class LayerCost:
    """One layer's figures per sequence (bytes in the captured activation dtype).

    ``stream_bytes`` is the layer's input from the layer before it (the output
    of that layer's last node: the residual stream); ``shared_input_bytes`` the
    rest of its inputs, produced before the stack and shared by every layer
    (masks, position biases), which a stage holds once; ``send_bytes`` what a
    pipeline boundary after the layer sends: ``cut_bytes`` less the next layer's
    shared inputs (a stage rebuilds those; Megatron-LM sends the hidden state only).

    Mixture-of-experts layers: ``expert_params`` are the parameters of the expert
    banks (part of ``params`` and ``sharded_params``; expert parallelism divides
    them by ``ep``); ``expert_tokens`` the token-to-expert assignments per sequence
    (tokens x top-k, derived from the expert GEMMs' FLOPs: each assignment runs
    every expert matrix once, ``2 x in x out`` FLOPs); ``expert_hidden`` the
    features of one dispatched token (the expert bank's input width).
    ``param_tensors`` and ``tp_param_tensors``: the layer's parameter tensors and those
    of them tensor parallelism shards, ``dispatched_ops`` the operators one eager forward
    dispatches and ``autograd_nodes`` the nodes its backward runs
    (:class:`~autoplan.graph.LayerRecord`).
    ``sp_params``: the elements of each parameter tensor whose gradient sequence
    parallelism leaves partial over the tp group (the norms',
    :attr:`~autoplan.graph.TPStructure.sp_replicated_params`).
    """

    index: int
    name: str
    kind: LayerKind
    template: str
    fwd_flops: float
    bwd_flops: float
    selective_flops: float
    params: int
    sharded_params: int
    tied_params: int
    saved_replicated_bytes: float
    saved_sharded_bytes: float
    saved_quadratic_bytes: float
    input_bytes: float
    cut_bytes: float
    stream_bytes: float
    shared_input_bytes: float
    send_bytes: float
    tp_collectives: tuple[tuple[str, str, float], ...]
    sp_collectives: tuple[tuple[str, str, float], ...]
    max_tp: int
    largest_module_params: int = 0
    largest_module_sharded: bool = False
    num_experts: int = 1
    expert_params: int = 0
    expert_tokens: float = 0.0
    expert_hidden: int = 0
    largest_module_expert: bool = False
    param_tensors: int = 0
    tp_param_tensors: int = 0
    sp_params: tuple[int, ...] = ()
    dispatched_ops: int = 0
    autograd_nodes: int = 0
    #: the linear each of ``sp_collectives`` belongs to (the row linear closing its region)
    sp_collective_linears: tuple[str, ...] = ()

    @property
    def is_block(self) -> bool:
        return self.kind is LayerKind.BLOCK


def _vocab_width(rec) -> int:
    """Output features of the layer's vocabulary head (0 without one)."""
    return sum(l.out_features for l in rec.tp.linears if l.role is LinearRole.VOCAB_HEAD)


class GraphSummary:
    """What the cost model needs of a :class:`ModelGraph` (see the module docstring).

    Build it with :func:`summarize` (cached per graph object).  Attributes:

    ``layers``
        :class:`LayerCost` per layer, in execution order.
    ``templates``
        ``{template: tuple of MatmulNode}``.
    ``elementwise``
        ``{template: (replicated, tp_sharded, quadratic)}`` bytes per sequence that the
        template's memory-bound operators (no FLOPs counted: norms, activations,
        softmax, residual adds, copies) read and write in the forward pass;
        ``quadratic`` is the attention core's ``s x s`` part.
    ``elementwise_kinds``
        ``{template: {kind: (replicated, tp_sharded, quadratic)}}``: the part of
        ``elementwise`` that operators of each kind a profile may time apart move
        (:data:`~autoplan.hardware.profile_records.RATE_KINDS`: GELU, SiLU, softmax,
        layer norm, masked_fill by operator, then broadcasts and layout copies by their
        operands, :func:`rate_kind`); kinds the template lacks are absent.
    ``elementwise_backward``
        ``{template: (replicated, tp_sharded, quadratic)}``: the bytes the same operators'
        backward moves, each as its derivative does (:func:`backward_traffic`: nothing
        for an add or a concatenation, whose gradient passes through; twice the forward
        for a product of two tensors), plus the stacks an ``unbind`` or ``split`` gathers
        its pieces' gradients in; a kind of ``elementwise_kinds`` at
        :data:`BACKWARD_TRAFFIC_DEFAULT`, which a profile's measured backward replaces.
        Where the host is the device (CPUs) the cost model prices these instead of twice
        the forward's.
    ``elementwise_returned``
        ``{template: (replicated, tp_sharded, quadratic)}``: the part of ``elementwise``
        that dropouts of probability 0 count (they save no mask; torch returns their
        input): free where the cost model prices ``elementwise_backward``.
    ``activation_bytes``
        Bytes per element every floating captured tensor is counted at
        (:data:`ACTIVATION_UNIT_BYTES`, whatever dtype the model was built in); the
        engine scales them to the recipe's activation dtype (``Strategy.precision``).
    ``causal``
        The objective is next-token prediction (a causal attention mask).
    ``kv_bytes_per_token``
        Bytes of one token's keys and values per layer in the captured dtype
        (context parallelism exchanges them); ``None`` when the graph does not
        state hidden size and heads.
    ``loss_logits``
        Logits per token the loss reads (the vocabulary head's width) when the objective
        is a token cross-entropy, else 0; ``loss_shifts``: the next-token shift slices
        them first (:func:`~autoplan.runtime.loss.token_cross_entropy`).
    ``op_counts``
        ``{template: (operators, tensor-parallel linears, shared column linears)}``: the
        captured operators a forward pass dispatches (nodes less ``getitem`` and export's
        guards), the linears tensor parallelism shards (column, row, vocabulary) and, of
        them, the column linears that share their region's input with another (q, k, v:
        two; gate, up: one), which a device with a host overhead per operator pays
        (:class:`~autoplan.hardware.OpOverhead`).
    """

    def __init__(self, graph: ModelGraph) -> None:
        self.model = graph.model
        self.title = graph.title
        self.seq_len = graph.seq_len
        self.num_params = graph.num_params
        self.activation_bytes = ACTIVATION_UNIT_BYTES
        self.causal = graph.objective.startswith("next-token")
        mb = graph.micro_batch
        self.templates: dict[str, tuple[MatmulNode, ...]] = {}
        self.elementwise: dict[str, tuple[float, float, float]] = {}
        self.elementwise_kinds: dict[str, dict[str, tuple[float, float, float]]] = {}
        self.elementwise_backward: dict[str, tuple[float, float, float]] = {}
        self.elementwise_returned: dict[str, tuple[float, float, float]] = {}
        self.op_counts: dict[str, tuple[int, int, int]] = {}
        #: ``{template: (linears, region entries)}``: the layer's weight-carrying matmuls
        #: and the modules that open its tensor-parallel regions (FP8 recipes, .fp8)
        self.linears: dict[str, tuple[tuple, tuple[str, ...]]] = {}
        layers = []
        owners = _param_owners(graph)
        # a layer's input and output (the residual stream) are in the dtype it was built in
        boundary = ACTIVATION_UNIT_BYTES / _DTYPE_BYTES.get(graph.param_dtype, 4)
        streams = _stream_bytes(graph)
        for i, rec in enumerate(graph.layers):
            if rec.template not in self.templates:
                self.templates[rec.template] = _matmuls(rec, graph.templates[rec.template],
                                                        graph.seq_len, mb)
                (self.elementwise[rec.template], self.elementwise_kinds[rec.template],
                 self.elementwise_backward[rec.template],
                 self.elementwise_returned[rec.template]) = _elementwise(
                    graph.templates[rec.template], graph.seq_len, mb, _in_bank(rec),
                    self.activation_bytes)
                self.op_counts[rec.template] = _op_counts(rec, graph.templates[rec.template])
                self.linears[rec.template] = (rec.tp.linears, tuple(rec.tp.region_entries()))
            core_flops = sum(n.fwd_flops for n in self.templates[rec.template] if n.core)
            nxt = graph.layers[i + 1] if i + 1 < len(graph.layers) else None
            shared_next = max(0, nxt.input_bytes - streams[i + 1]) if nxt is not None else 0
            layers.append(_layer_cost(i, rec, mb, owners, core_flops, streams[i], shared_next,
                                      self.templates[rec.template],
                                      graph.templates[rec.template], self.activation_bytes,
                                      boundary))
        self.layers: tuple[LayerCost, ...] = tuple(layers)
        self.index = {l.name: l.index for l in self.layers}
        attrs = graph.attributes
        h, a = attrs.get("hidden_size"), attrs.get("num_attention_heads")
        kv = attrs.get("num_key_value_heads", a)
        self.kv_bytes_per_token = (2 * h * kv // a * self.activation_bytes
                                   if h and a and kv else None)
        self.tied_owner = {l.index: owners.get(l.index) for l in self.layers}
        # the token cross-entropy (autoplan.runtime.loss.token_cross_entropy) over the vocab
        # head's logits: their width, and whether the next-token shift slices them
        self.loss_logits = (_vocab_width(graph.layers[-1]) if graph.layers
                            and "cross-entropy" in graph.objective else 0)
        self.loss_shifts = graph.objective.startswith("next-token")
        # prefix sums of the additive per-layer figures: totals of [lo, hi) in O(1)
        self._prefix = {
            key: [0.0, *accumulate(float(getattr(l, key)) for l in self.layers)]
            for key in ("fwd_flops", "bwd_flops", "selective_flops", "params", "sharded_params",
                        "saved_replicated_bytes", "saved_sharded_bytes", "saved_quadratic_bytes",
                        "input_bytes", "autograd_nodes")
        }

    def total(self, key: str, lo: int, hi: int) -> float:
        """Sum of ``key`` over layers ``lo .. hi-1``."""
        p = self._prefix[key]
        return p[hi] - p[lo]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def block_indices(self) -> tuple[int, ...]:
        return tuple(l.index for l in self.layers if l.is_block)


_CACHE: dict[int, tuple[weakref.ref, GraphSummary]] = {}


def summarize(graph: ModelGraph | GraphSummary) -> GraphSummary:
    """The :class:`GraphSummary` of ``graph`` (computed once per graph object)."""
    if isinstance(graph, GraphSummary):
        return graph
    hit = _CACHE.get(id(graph))
    if hit is not None and hit[0]() is graph:
        return hit[1]
    summary = GraphSummary(graph)
    key = id(graph)
    _CACHE[key] = (weakref.ref(graph, lambda _ref, k=key: _CACHE.pop(k, None)), summary)
    return summary


def _param_owners(graph: ModelGraph) -> dict[int, int]:
    """For layers that use a parameter owned by another layer (tied embeddings): the owner."""
    owner_of: dict[str, int] = {}
    for i, l in enumerate(graph.layers):
        for lin in l.tp.linears:
            owner_of.setdefault(lin.name, i)
    out = {}
    for i, l in enumerate(graph.layers):
        if l.tied_params:
            # a tied parameter lives in the layer that saw it first (the embedding)
            for j, other in enumerate(graph.layers[:i]):
                if other.param_count and any(
                        lin.role is LinearRole.VOCAB_EMBEDDING for lin in other.tp.linears):
                    out[i] = j
                    break
    return out


def _tied_count(rec: LayerRecord) -> int:
    """Parameters this layer uses but does not own (e.g. a head tied to the embedding)."""
    tied = {t.rsplit(".", 1)[0] for t in rec.tied_params}
    return sum(lin.in_features * lin.out_features * lin.num_experts
               for lin in rec.tp.linears if lin.name in tied)


def _sharded_count(rec: LayerRecord) -> int:
    n = 0
    tied = {t.rsplit(".", 1)[0] for t in rec.tied_params}
    for lin in rec.tp.linears:
        if lin.role in _SHARDED_ROLES and lin.name not in tied:
            n += lin.in_features * lin.out_features * lin.num_experts
            if lin.bias and lin.role in (LinearRole.COLUMN, LinearRole.EXPERT_COLUMN):
                n += lin.out_features * lin.num_experts
    return min(n, rec.param_count)


def _stream_bytes(graph: ModelGraph) -> list[int]:
    """Per layer: bytes of the previous layer's last node output (its own input for layer 0)."""
    out = []
    prev = None
    for rec in graph.layers:
        if prev is None:
            out.append(rec.input_bytes)
        else:
            nodes = graph.templates[prev.template]
            last = nodes[-1].out_bytes if nodes else prev.cut_bytes
            out.append(min(last, rec.input_bytes) if rec.input_bytes else last)
        prev = rec
    out.append(0)
    return out


def _layer_cost(i: int, rec: LayerRecord, mb: int, owners: dict[int, int],
                core_flops: float, stream: int, shared_next: int,
                matmuls: tuple[MatmulNode, ...] = (),
                nodes: tuple[NodeRecord, ...] = (), activation_bytes: int = 0,
                boundary: float = 1.0) -> LayerCost:
    quad, sharded, saved = (rec.saved_quadratic_bytes, rec.saved_tp_sharded_bytes,
                            rec.saved_bytes)
    if nodes and activation_bytes:
        # the layer's saved bytes are its nodes' (capture), counted in the activation dtype
        unit = [_saved_scale(n, activation_bytes) for n in nodes]
        quad = sum(u * n.saved_quadratic_bytes for u, n in zip(unit, nodes))
        sharded = sum(u * n.saved_tp_sharded_bytes for u, n in zip(unit, nodes))
        saved = sum(u * n.saved_bytes for u, n in zip(unit, nodes))
    shd = max(sharded - quad, 0)
    rep = max(saved - sharded, 0)
    in_bank = _in_bank(rec)
    tp_colls, sp_colls = rec.tp.tp_collectives, rec.tp.sp_collectives
    if in_bank is not None:
        # the expert region is whole on every tp rank: what it saves does not shrink with
        # tp, and it all-reduces nothing over tp
        moved = sum((n.saved_tp_sharded_bytes - n.saved_quadratic_bytes)
                    * (_saved_scale(n, activation_bytes) if activation_bytes else 1.0)
                    for n in nodes if in_bank(n.module))
        moved = min(max(moved, 0), shd)
        shd, rep = shd - moved, rep + moved
        tp_colls = tuple(c for c in tp_colls if not in_bank(c.where))
        sp_colls = tuple(c for c in sp_colls if not in_bank(c.where))
    return LayerCost(
        index=i, name=rec.name, kind=rec.kind, template=rec.template,
        fwd_flops=rec.fwd_flops / mb, bwd_flops=rec.bwd_flops / mb,
        selective_flops=core_flops,
        params=rec.param_count, sharded_params=_sharded_count(rec),
        tied_params=_tied_count(rec) if i in owners else 0,
        saved_replicated_bytes=rep / mb, saved_sharded_bytes=shd / mb,
        saved_quadratic_bytes=quad / mb, input_bytes=rec.input_bytes * boundary / mb,
        cut_bytes=rec.cut_bytes * boundary / mb,
        stream_bytes=stream * boundary / mb,
        shared_input_bytes=max(0, rec.input_bytes - stream) * boundary / mb,
        send_bytes=max(0, rec.cut_bytes - shared_next) * boundary / mb,
        tp_collectives=tuple((c.op, c.phase, c.nbytes * boundary / mb) for c in tp_colls),
        sp_collectives=tuple((c.op, c.phase, c.nbytes * boundary / mb) for c in sp_colls),
        sp_collective_linears=tuple(c.where for c in sp_colls),
        max_tp=rec.tp.max_degree() if rec.tp.divisors else 0,
        num_experts=rec.num_experts,
        param_tensors=rec.param_tensors, tp_param_tensors=rec.tp_param_tensors,
        dispatched_ops=rec.dispatched_ops, autograd_nodes=rec.autograd_nodes,
        sp_params=rec.tp.sp_replicated_params,
        **_experts(rec, matmuls),
        **_largest_module(rec),
    )


def _expert_linears(rec: LayerRecord) -> list:
    return [lin for lin in rec.tp.linears
            if lin.role in (LinearRole.EXPERT_COLUMN, LinearRole.EXPERT_ROW) and lin.num_experts > 1]


def _in_bank(rec: LayerRecord):
    """A test of whether a module path (relative to the layer) is in one of ``rec``'s expert
    banks, or None for a dense layer.  A bank is a module (``experts.w1``) or a 3-D
    parameter of one (``experts.gate_up_proj`` of module ``experts``): its GEMMs and
    element-wise operators run in either."""
    banks = {lin.name for lin in _expert_linears(rec)}
    if not banks:
        return None
    owners = banks | {b.rsplit(".", 1)[0] for b in banks if "." in b}
    return lambda module: module in owners or any(module.startswith(b + ".") for b in banks)


def _experts(rec: LayerRecord, matmuls: tuple[MatmulNode, ...]) -> dict:
    """``expert_params``, ``expert_tokens`` and ``expert_hidden`` of a layer (see
    :class:`LayerCost`); zeros for a dense layer."""
    linears = _expert_linears(rec)
    if not linears:
        return {}
    params = sum(lin.in_features * lin.out_features * lin.num_experts
                 + (lin.out_features * lin.num_experts
                    if lin.bias and lin.role is LinearRole.EXPERT_COLUMN else 0)
                 for lin in linears)
    # each token-to-expert assignment multiplies every matrix of its expert once
    per_assignment = 2 * sum(lin.in_features * lin.out_features for lin in linears)
    flops = sum(n.fwd_flops for n in matmuls if n.expert)
    first = next((lin for lin in linears if lin.role is LinearRole.EXPERT_COLUMN), linears[0])
    return {"expert_params": min(params, rec.param_count),
            "expert_tokens": flops / per_assignment,
            "expert_hidden": first.in_features}


def _largest_module(rec: LayerRecord) -> dict:
    """The largest weight-carrying submodule (what a per-module ZeRO-3 gather holds)."""
    best, sharded, expert = 0, False, False
    tied = {t.rsplit(".", 1)[0] for t in rec.tied_params}
    for lin in rec.tp.linears:
        if lin.name in tied:
            continue
        n = lin.in_features * lin.out_features * lin.num_experts + (lin.out_features if lin.bias else 0)
        if n > best:
            best, sharded = n, lin.role in _SHARDED_ROLES
            expert = lin.role in (LinearRole.EXPERT_COLUMN, LinearRole.EXPERT_ROW) and lin.num_experts > 1
    return {"largest_module_params": min(best, rec.param_count) if rec.param_count else best,
            "largest_module_sharded": sharded, "largest_module_expert": expert}


def _matmuls(rec: LayerRecord, nodes: tuple[NodeRecord, ...], seq_len: int | None,
             mb: int) -> tuple[MatmulNode, ...]:
    sharded_modules = {lin.name for lin in rec.tp.linears if lin.role in _SHARDED_ROLES}
    in_bank = _in_bank(rec)
    core = {n.name for n in _attention_core(nodes, seq_len)}
    out = []
    for n in nodes:
        if not (n.fwd_flops or n.bwd_flops):
            continue
        expert = in_bank is not None and in_bank(n.module)
        weight = n.param_bytes > 0 or n.module in sharded_modules or expert
        fused = any(t in n.target for t in _FUSED_ATTENTION_TARGETS)
        # the shape test alone also matches (b, s, h) activations when h == s: a node
        # that multiplies a weight is never part of the attention core
        is_core = not weight and (n.name in core or fused)
        # expert GEMMs run whole on every tensor-parallel rank (see _SHARDED_ROLES)
        sharded = not expert and (n.tp_region or n.module in sharded_modules or is_core)
        out.append(MatmulNode(n.fwd_flops / mb, n.bwd_flops / mb, sharded, is_core, weight, expert,
                              fused and is_core, n.module))
    return tuple(out)


#: Captured nodes that dispatch no operator: tuple indexing and torch.export's guards.
_NOT_OPERATORS = ("getitem", "_guards")


def _op_counts(rec: LayerRecord, nodes: tuple[NodeRecord, ...]) -> tuple[int, int, int]:
    """``(operators, tensor-parallel linears, shared column linears)`` of one layer's
    forward (``op_counts``).  A block's region (:meth:`~autoplan.graph.LayerTP.region_entries`,
    a module other than the block itself) takes its input once for all its column linears
    (:mod:`autoplan.runtime.tp`): every one past the first shares it."""
    ops = sum(1 for n in nodes if not any(n.target.startswith(t) for t in _NOT_OPERATORS))
    linears = sum(1 for lin in rec.tp.linears if lin.role in _SHARDED_ROLES)
    shared = 0
    if rec.kind is LayerKind.BLOCK:
        # column linears inside a region's module, less one per region (its first)
        inside = sum(1 for n, r in rec.tp.placed_roles().items()
                     if r is LinearRole.COLUMN and n.rpartition(".")[0])
        shared = inside - sum(1 for e in rec.tp.region_entries() if e)
    return ops, linears, shared


def _elementwise(nodes: tuple[NodeRecord, ...], seq_len: int | None,
                 mb: int, in_bank=None, activation_bytes: int = 0
                 ) -> tuple[tuple[float, float, float], dict[str, tuple[float, float, float]],
                            tuple[float, float, float], tuple[float, float, float]]:
    """Forward bytes moved by the memory-bound nodes, ``(replicated, sharded, quadratic)``,
    the part of them each kind a profile may time apart moves (:func:`rate_kind`;
    kinds without a node are absent) and the backward's bytes.

    Each node that carries no FLOPs and is not a pure re-labelling of memory
    (views, transposes, getitem...) reads its inputs and writes its output:
    ``out_bytes`` plus the ``out_bytes`` of its inputs inside the template (an
    input from outside the template is counted at the node's own output size).
    Third, the bytes their backward moves (``GraphSummary.elementwise_backward``); fourth,
    the part of the forward's bytes that dropouts saving no mask (probability 0: torch
    returns their input, no backward) count (``GraphSummary.elementwise_returned``).
    Nodes of an expert bank (``in_bank``) are replicated over tensor parallelism.
    With ``activation_bytes``, floating tensors are counted in that dtype (:func:`_unit_scale`).
    """
    def nbytes(n: NodeRecord) -> float:
        return n.out_bytes * (_unit_scale(n.dtype, activation_bytes) if activation_bytes else 1.0)

    size = {n.name: nbytes(n) for n in nodes}
    by_name = {n.name: n for n in nodes}
    total = [0.0, 0.0, 0.0]
    backward = [0.0, 0.0, 0.0]
    returned = [0.0, 0.0, 0.0]
    kinds: dict[str, list[float]] = {}
    for n in nodes:
        if n.fwd_flops or n.bwd_flops or not n.out_bytes:
            continue
        t = n.target
        if _is_scores(n.shape, seq_len, mb):
            part = 2
        elif n.tp_region and not (in_bank is not None and in_bank(n.module)):
            part = 1
        else:
            part = 0
        if any(op in t for op in _GATHER_BACKWARD_OPS):
            # views forward; the backward stacks the pieces' gradients into a new tensor
            # (reads them, writes their input's size)
            if n.dtype in _COMPUTE_DTYPES:
                backward[part] += 2 * sum(size.get(i, 0.0) for i in n.inputs)
            continue
        if any(op in t for op in _FREE_OPS) and not any(op in t for op in _MAYBE_COPY_OPS):
            continue
        if any(op in t for op in _MAYBE_COPY_OPS):
            src = by_name[n.inputs[0]].target if n.inputs and n.inputs[0] in by_name else ""
            if "transpose" not in src and "permute" not in src:
                continue
        moved = size[n.name] + sum(size.get(i, size[n.name]) for i in n.inputs)
        total[part] += moved
        if "dropout" in t and not n.saved_bytes:
            # saves no mask: probability 0, and torch returns its input (no backward)
            returned[part] += moved
            continue
        kind = rate_kind(n, by_name)
        # a kind a profile may time is counted at the default, which its measured
        # backward rate replaces (CostEngine.template_time)
        backward[part] += moved * (BACKWARD_TRAFFIC_DEFAULT if kind is not None
                                   else backward_traffic(n))
        if kind is not None:
            kinds.setdefault(kind, [0.0, 0.0, 0.0])[part] += moved

    def per_sequence(v: list[float]) -> tuple[float, float, float]:
        return v[0] / mb, v[1] / mb, v[2] / mb
    return (per_sequence(total), {k: per_sequence(v) for k, v in kinds.items()},
            per_sequence(backward), per_sequence(returned))


#: Bytes a memory-bound operator's backward moves per byte its forward moves (output plus
#: inputs) where :func:`backward_traffic` does not know its derivative (torch's
#: ``derivatives.yaml``): it reads the output gradient and what it saved and writes the
#: input gradient.
BACKWARD_TRAFFIC_DEFAULT = 2.0
#: Free in the forward (views of one tensor), a copy in the backward: the gradients of
#: the pieces stacked (unbind, split, chunk).
_GATHER_BACKWARD_OPS = ("unbind", "split", "chunk")
_PASS_THROUGH = ("aten.add.", "aten.add_.", "aten.sub.", "aten.cat.", "aten.stack.",
                 "aten.clone.", "aten.contiguous.", "aten.reshape.", "aten.flatten.")
_UNARY = ("aten.neg.", "aten.pow.", "aten.rsqrt.", "aten.sqrt.", "aten.exp.", "aten.log.",
          "aten.tanh.", "aten.sigmoid.", "aten.relu.", "aten.abs.", "aten.reciprocal.",
          "aten.sin.", "aten.cos.", "aten.erf.")
_REDUCTIONS = ("aten.mean.", "aten.sum.", "aten.amax.", "aten.to.", "aten._to_copy.",
               "aten.type_as.", "aten.where.", "aten.masked_fill.", "aten.div.Scalar",
               "aten.mul.Scalar")


def backward_traffic(n: NodeRecord) -> float:
    """Bytes ``n``'s backward moves per byte its forward moves (:data:`BACKWARD_TRAFFIC_DEFAULT`
    where its derivative is not known here): 0 for a node without gradient (an integer or
    boolean output) and for one whose gradient passes through unchanged (an add, a
    concatenation's slices, a copy's view); 1 for one product per input (a cast, a
    reduction's expand, a scalar multiply, one masked fill); 1.5 for a unary function
    (its gradient reads the output gradient and its input or output); 2 for a product of
    two tensors (each operand's gradient, the output gradient times the other)."""
    t = n.target
    if n.dtype not in _COMPUTE_DTYPES:
        return 0.0
    if any(t.startswith(p) for p in _PASS_THROUGH):
        return 0.0
    if any(t.startswith(p) for p in _REDUCTIONS):
        return 1.0
    if any(t.startswith(p) for p in _UNARY):
        return 1.5
    if t.startswith(("aten.mul.", "aten.div.")):
        return 2.0 if len(n.inputs) >= 2 else 1.0
    return BACKWARD_TRAFFIC_DEFAULT


def rate_kind(n: NodeRecord, nodes: dict[str, NodeRecord]) -> str | None:
    """The kind of memory-bound node ``n`` a profile may price at its own speed
    (:data:`~autoplan.hardware.profile_records.RATE_KINDS`), or ``None``.

    Its operator's kind first (:func:`~autoplan.hardware.profile_records.elementwise_kind`:
    GELU, SiLU, softmax, layer norm, masked_fill), else by its operands (``nodes``: the
    template's nodes by name; an input from outside the template is of unknown shape and
    decides nothing):

    * ``layout_copy``: a reshape, flatten, contiguous or clone of a transposed or permuted
      view, which copies it into a new layout;
    * ``broadcast``: an operand smaller than the output, an input of the template or a
      parameter (``param_bytes``: a norm's weight), or an expanded view (not a
      concatenation, whose inputs are each smaller than its output).
    """
    own = elementwise_kind(n.target)
    if own is not None:
        return own
    srcs = [nodes[i] for i in n.inputs if i in nodes]
    if any(op in n.target for op in (*_MAYBE_COPY_OPS, "contiguous", "clone")):
        if srcs and any(op in srcs[0].target for op in ("transpose", "permute")):
            return "layout_copy"
        return None
    if any(op in n.target for op in (*_FREE_OPS, "aten.cat", "aten.stack")):
        return None     # a concatenation's inputs are smaller than its output, not broadcast
    numel = math.prod(n.shape)
    if 0 < n.param_bytes < n.out_bytes:
        return "broadcast"
    if len(n.inputs) >= 2 and any(math.prod(m.shape) < numel or "expand" in m.target
                                  for m in srcs):
        return "broadcast"
    return None


def _is_scores(shape: tuple[int, ...], seq_len: int | None, mb: int) -> bool:
    """An ``s x s`` attention-score tensor: ``(b, heads, s, s)`` or ``(b * heads, s, s)``,
    or ``s x (s + 1)`` when a learned attention-sink column is appended to the scores
    (gpt-oss), as the capture's saved-bytes rule (``capture.measure._quadratic_shape``).

    A ``(b, s, h)`` activation with ``h == s`` has the micro-batch as its first
    dimension and is not one.
    """
    if not seq_len or len(shape) < 3 or shape[-2] != seq_len or \
            shape[-1] not in (seq_len, seq_len + 1):
        return False
    return len(shape) >= 4 or shape[0] != mb
