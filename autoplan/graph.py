"""Records of a captured model: nodes, layers, tensor-parallel structure.

A :class:`ModelGraph` is what :func:`autoplan.trace` returns and what the cost
model and the search consume.  All quantities are per *micro-batch* of
``ModelGraph.micro_batch`` sequences; FLOPs and activation bytes of the layers
scale linearly with the micro-batch size (``scale_to_batch``).

Identical blocks share one *template* (the list of their nodes); each layer
names its template, so a 96-layer model stores one block's nodes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable

import networkx as nx

from .records import TRANSIENT, Record

__all__ = [
    "LayerKind",
    "LinearRole",
    "TP_SHARDED_ROLES",
    "NodeRecord",
    "LinearRecord",
    "CollectiveRecord",
    "TPStructure",
    "CoreOp",
    "AttentionCore",
    "LayerRecord",
    "ModelGraph",
]


class LayerKind(str, enum.Enum):
    PRE = "pre"          # embeddings and everything before the first block
    BLOCK = "block"      # one child of a repeated nn.ModuleList / nn.Sequential
    SEGMENT = "segment"  # glue between two stacks (e.g. T5 encoder -> decoder)
    POST = "post"        # final norm, head and loss


class LinearRole(str, enum.Enum):
    """Megatron-style tensor-parallel role of a matmul with a weight."""

    COLUMN = "column"              # output features sharded (opens a parallel region)
    ROW = "row"                    # input features sharded (closes it; output all-reduced)
    EXPERT_COLUMN = "expert_column"
    EXPERT_ROW = "expert_row"
    ROUTER = "router"              # MoE gate: replicated
    VOCAB_EMBEDDING = "vocab_embedding"  # vocab-parallel embedding
    VOCAB_HEAD = "vocab_head"      # vocab-parallel output projection (loss_parallel)
    REPLICATED = "replicated"


#: Linear roles whose weight tensor parallelism splits (Megatron pattern; DTensors under
#: :mod:`autoplan.runtime.tp`).  Expert banks are not: the runtime keeps the experts (and
#: the router) whole on every rank of the tensor-parallel group, which all run the block's
#: tokens through them; expert parallelism splits them over dp x cp instead.
TP_SHARDED_ROLES = frozenset({LinearRole.COLUMN, LinearRole.ROW, LinearRole.VOCAB_EMBEDDING,
                              LinearRole.VOCAB_HEAD})


@dataclass(frozen=True)
class NodeRecord(Record):
    """One call of an operator in the captured forward graph (per micro-batch).

    ``saved_bytes`` are the bytes autograd keeps for backward that this node
    saved first (storages counted once, parameters excluded).  Of those,
    ``saved_tp_sharded_bytes`` were produced inside a tensor-parallel region
    (they shrink by the TP degree) and ``saved_quadratic_bytes`` have two
    sequence-length dimensions (the attention core that selective recompute drops).
    """

    name: str
    target: str
    module: str
    inputs: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    out_bytes: int
    fwd_flops: int
    bwd_flops: int
    param_bytes: int
    saved_bytes: int
    saved_tp_sharded_bytes: int
    saved_quadratic_bytes: int
    tp_region: bool


@dataclass(frozen=True)
class LinearRecord(Record):
    """A weight-carrying matmul (Linear, Conv1D, embedding, expert bank) and its TP role."""

    name: str                 # parameter's module path relative to the layer
    role: LinearRole
    in_features: int
    out_features: int
    num_experts: int = 1
    bias: bool = False


@dataclass(frozen=True)
class CollectiveRecord(Record):
    """A collective that tensor (or sequence / expert) parallelism inserts per micro-batch.

    ``nbytes`` is the size of the full, unsharded tensor; the cost model applies
    the degree (e.g. ring all-reduce moves ``2 (t-1)/t * nbytes``).
    """

    op: str            # all_reduce | all_gather | reduce_scatter | all_to_all
    phase: str         # forward | backward
    nbytes: int
    where: str         # the linear it belongs to


@dataclass(frozen=True)
class TPStructure(Record):
    """How a layer splits under tensor parallelism (Megatron pattern)."""

    linears: tuple[LinearRecord, ...] = ()
    tp_collectives: tuple[CollectiveRecord, ...] = ()   # TP without sequence parallel
    sp_collectives: tuple[CollectiveRecord, ...] = ()   # TP with sequence parallel
    ep_collectives: tuple[CollectiveRecord, ...] = ()   # expert parallel (token all-to-all)
    divisors: tuple[int, ...] = ()  # a TP degree must divide every one of these (heads, features)
    # elements of each parameter tensor of the modules sequence parallelism runs on the
    # sequence shard with their parameters whole (sequence_parallel_modules: the norms);
    # their gradients are partial sums over the tp group, all-reduced once per step
    sp_replicated_params: tuple[int, ...] = ()

    def roles(self) -> dict[str, str]:
        return {lin.name: lin.role.value for lin in self.linears}

    def placed_roles(self) -> dict[str, LinearRole]:
        """The linears tensor parallelism places, by name: all but the experts and the
        router, which stay whole on every tp rank (:mod:`autoplan.runtime.tp`)."""
        return {lin.name: lin.role for lin in self.linears
                if lin.role not in (LinearRole.EXPERT_COLUMN, LinearRole.EXPERT_ROW,
                                    LinearRole.ROUTER)}

    def region_entries(self) -> list[str]:
        """The modules that open a block's tensor-parallel regions, sorted: the parents of
        its column linears (``""``: the block itself)."""
        return sorted({n.rpartition(".")[0] for n, r in self.placed_roles().items()
                       if r is LinearRole.COLUMN})

    def sequence_parallel_modules(self, kind: LayerKind, modules: Iterable[str]) -> list[str]:
        """Of ``modules`` (names relative to the layer's module; each holds parameters of
        its own), those sequence parallelism runs on the sequence shard with their
        parameters whole (torch's ``SequenceParallel``): in a block, those outside the
        linears tensor parallelism places (:meth:`placed_roles`) and outside the modules
        that open a tensor-parallel region (:meth:`region_entries`); in the last layer,
        those that are no such linear (the final norm); none in other layers.
        :func:`autoplan.runtime.tp.tp_plan` applies it, the capture counts their
        parameters (``sp_replicated_params``)."""
        placed = self.placed_roles()
        if kind is LayerKind.POST:
            return [m for m in modules if m not in placed]
        if kind is not LayerKind.BLOCK:
            return []
        entries = self.region_entries()
        inside = tuple(e + "." for e in entries if e)
        return [m for m in modules
                if m and m not in placed and m not in entries and not m.startswith(inside)]

    def max_degree(self) -> int:
        """Largest TP degree allowed by ``divisors`` (1 when nothing can shard)."""
        from math import gcd
        g = 0
        for d in self.divisors:
            g = gcd(g, d)
        return g or 1

    def valid_degrees(self) -> tuple[int, ...]:
        g = self.max_degree()
        return tuple(d for d in range(1, g + 1) if g % d == 0)


@dataclass(frozen=True)
class CoreOp(Record):
    """One dispatched operator of a block's attention core.

    ``op`` is its counted name (:func:`autoplan.opstream.op_name`, e.g. ``bmm``,
    ``_softmax``, ``sdpa``) and ``index`` its occurrence among that operator's
    counted calls in one forward of the block (0 for the first).
    """

    op: str
    index: int


@dataclass(frozen=True)
class AttentionCore(Record):
    """What selective recompute re-runs in a block, named so the runtime can find it.

    ``nodes`` are the captured fx nodes of the core (QK^T, scale, mask, softmax,
    dropout, attention x V, or a fused attention kernel: the nodes whose forward
    FLOPs make ``LayerRecord.selective_recompute_flops``); ``ops`` are the counted
    dispatched operators those nodes ran, and ``calls`` how many counted calls of
    each of those operators one forward of the whole block makes, so that the
    runtime can tell when the block it runs is not the block that was captured.
    Operators a run adds or drops (casts, dropout's noise) follow their inputs at
    run time instead (see :mod:`autoplan.opstream`).
    """

    nodes: tuple[str, ...]
    ops: tuple[CoreOp, ...]
    calls: dict[str, int]

    def __post_init__(self) -> None:
        for o in self.ops:
            if o.op not in self.calls or not 0 <= o.index < self.calls[o.op]:
                raise ValueError(f"core op {o.op}#{o.index} is outside the block's "
                                 f"{self.calls.get(o.op, 0)} counted call(s) of {o.op}")


@dataclass(frozen=True)
class LayerRecord(Record):
    """A unit the planner places: a block, or the pre/post/glue segments.

    All figures are per micro-batch of ``ModelGraph.micro_batch`` sequences.
    ``cut_bytes`` is what a pipeline boundary right after this layer must send
    forward (activations produced at or before it and used after it).
    ``attention_core`` names, for a block, the operators selective recompute
    re-runs (``None`` for other layers and in graphs captured before it was
    recorded).  ``param_tensors`` counts the parameter tensors the layer owns (a tied
    one counted in the layer that uses it first), ``tp_param_tensors`` those of them in
    the linears tensor parallelism shards (column, row, vocabulary embedding and head):
    an optimizer step pays the host's time per tensor on a CPU
    (``OpOverhead.optimizer_param_s``); both are 0 in graphs captured before they were
    recorded (their optimizer is then priced by its bytes alone).  ``dispatched_ops``
    counts the operators one eager forward of the layer dispatches below autograd at the
    captured micro-batch, where a Python dispatch mode sees them (composites such as
    ``linear`` arrive as ``t`` + ``addmm``; views, casts and allocations count, metadata
    queries do not; a reshape that needs a copy only at other sizes adds one there):
    torch's selective checkpoint runs its mode for each (``OpOverhead.selective_dispatch_s``),
    and the host pays its time per operator in the forward (``OpOverhead.forward_dispatch_s``).
    ``autograd_nodes`` counts the nodes the layer's backward runs (its parameters'
    ``AccumulateGrad`` included; a view's node counts though it runs no operator), which the
    autograd engine's host time goes by (``OpOverhead.backward_node_s``).  Both are 0 in
    graphs captured before they were recorded.
    """

    name: str
    kind: LayerKind
    stack: str
    index: int
    template: str
    modules: tuple[str, ...]
    fwd_flops: int
    bwd_flops: int
    param_count: int
    param_bytes: int
    saved_bytes: int
    saved_tp_sharded_bytes: int
    saved_quadratic_bytes: int
    selective_recompute_flops: int
    input_bytes: int
    output_bytes: int
    cut_bytes: int
    tp: TPStructure
    tied_params: tuple[str, ...] = ()
    attention_core: AttentionCore | None = None
    param_tensors: int = 0
    tp_param_tensors: int = 0
    dispatched_ops: int = 0
    autograd_nodes: int = 0

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    def __repr__(self) -> str:
        return (f"<LayerRecord {self.name} ({self.kind.value}, template {self.template}): "
                f"{self.param_count:,} params, {self.flops:,} FLOPs, "
                f"{self.saved_bytes:,} saved bytes per micro-batch>")

    @property
    def num_experts(self) -> int:
        """The experts of this layer's expert bank (1 for a dense layer)."""
        return max((lin.num_experts for lin in self.tp.linears
                    if lin.role in (LinearRole.EXPERT_COLUMN, LinearRole.EXPERT_ROW)), default=1)


@dataclass(frozen=True)
class ModelGraph(Record):
    """A captured model: its layers in execution order and their node templates."""

    model: str
    capture: str                    # "torch.export" or "torch.fx.symbolic_trace"
    objective: str
    micro_batch: int
    seq_len: int | None
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    param_dtype: str
    num_params: int
    param_bytes: int
    attributes: dict[str, int]      # hidden_size, num_heads, vocab_size, ... when known
    layers: tuple[LayerRecord, ...]
    templates: dict[str, tuple[NodeRecord, ...]] = field(default_factory=dict)
    #: The model's name for people (``GPT-3 175B``, ``llama 8.03B``); ``model`` is the
    #: class the runtime checks against.
    title: str = ""
    #: The torch.fx GraphModule captured (``None`` after loading from JSON: not stored).
    fx_graph: Any = field(default=None, compare=False, repr=False, metadata=TRANSIENT)

    def __post_init__(self) -> None:
        missing = sorted({l.template for l in self.layers} - set(self.templates))
        if missing:
            raise ValueError(f"layers name templates that are not stored: {missing}")

    def __repr__(self) -> str:
        blocks = sum(1 for l in self.layers if l.kind is LayerKind.BLOCK)
        return (f"<ModelGraph {self.title or self.model}: {len(self.layers)} layers ({blocks} blocks), "
                f"{self.num_params:,} params ({self.param_dtype}), seq_len {self.seq_len}, "
                f"micro-batch {self.micro_batch}, {self.capture}>")

    # ------------------------------------------------------------------ views
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def blocks(self) -> tuple[LayerRecord, ...]:
        return tuple(l for l in self.layers if l.kind is LayerKind.BLOCK)

    @property
    def fwd_flops(self) -> int:
        return sum(l.fwd_flops for l in self.layers)

    @property
    def bwd_flops(self) -> int:
        return sum(l.bwd_flops for l in self.layers)

    @property
    def saved_bytes(self) -> int:
        return sum(l.saved_bytes for l in self.layers)

    def layer(self, name: str) -> LayerRecord:
        for l in self.layers:
            if l.name == name:
                return l
        raise KeyError(f"no layer named {name!r}; layers are {[l.name for l in self.layers][:8]}...")

    def nodes(self, layer: str | LayerRecord) -> tuple[NodeRecord, ...]:
        rec = self.layer(layer) if isinstance(layer, str) else layer
        return self.templates[rec.template]

    def layer_table(self):
        """One row per layer (pandas DataFrame)."""
        import pandas as pd
        rows = [{
            "layer": l.name, "kind": l.kind.value, "template": l.template,
            "params": l.param_count, "fwd_GFLOP": l.fwd_flops / 1e9, "bwd_GFLOP": l.bwd_flops / 1e9,
            "saved_MiB": l.saved_bytes / 2**20, "cut_MiB": l.cut_bytes / 2**20,
            "tp_max": l.tp.max_degree(),
        } for l in self.layers]
        return pd.DataFrame(rows)

    def to_networkx(self, level: str = "layer") -> nx.DiGraph:
        """The graph as a networkx DiGraph.

        ``level="layer"``: one node per layer with its record's figures as
        attributes, an edge between consecutive layers weighted by ``cut_bytes``.
        ``level="node"``: every operator of every layer (``layer/node`` names),
        edges from the recorded inputs; a block's external inputs link to the
        previous layer's last node.
        """
        g = nx.DiGraph(model=self.model, capture=self.capture)
        if level == "layer":
            prev = None
            for l in self.layers:
                g.add_node(l.name, kind=l.kind.value, fwd_flops=l.fwd_flops, bwd_flops=l.bwd_flops,
                           param_bytes=l.param_bytes, saved_bytes=l.saved_bytes, template=l.template)
                if prev is not None:
                    g.add_edge(prev.name, l.name, nbytes=prev.cut_bytes)
                prev = l
            return g
        if level != "node":
            raise ValueError(f"level must be 'layer' or 'node', got {level!r}")
        last: str | None = None
        for l in self.layers:
            nodes = self.templates[l.template]
            local = {n.name for n in nodes}
            for n in nodes:
                key = f"{l.name}/{n.name}"
                g.add_node(key, layer=l.name, target=n.target, shape=n.shape, dtype=n.dtype,
                           fwd_flops=n.fwd_flops, bwd_flops=n.bwd_flops, saved_bytes=n.saved_bytes)
                for i in n.inputs:
                    if i in local:
                        g.add_edge(f"{l.name}/{i}", key)
                    elif last is not None:
                        g.add_edge(last, key)
            if nodes:
                last = f"{l.name}/{nodes[-1].name}"
        return g
