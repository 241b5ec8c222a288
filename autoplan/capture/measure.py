"""Measurement: run a captured graph node by node under ``FakeTensorMode``.

No real storage is ever allocated, so a 400B-parameter model on the meta device costs
nothing.  :class:`_Measure` records per node (:class:`_Measured`) the forward and
backward FLOPs (``FlopCounterMode``), the bytes autograd saves for backward
(saved-tensor hooks; the share inside a tensor-parallel region and the share quadratic
in the sequence, :func:`_quadratic_shape`, apart), the counted dispatched operators
(:class:`_Dispatched`, as the runtime's selective-checkpoint policy sees them), how
many operators it dispatches in all (views included, as a Python dispatch mode sees
an eager run of it) and how many autograd nodes its backward runs
(:func:`~autoplan.opstream.autograd_nodes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter as _fc
from torch.utils._pytree import tree_flatten, tree_map

from ..opstream import COUNTED, DispatchCount, OpStream, autograd_nodes, op_name
from .export import _fix_device

aten = torch.ops.aten


# torch's FLOP registry covers the CUDA SDPA kernels but not the CPU flash
# kernel that SDPA dispatches to under a CPU FakeTensor; reuse torch's own
# formulas (sdpa_flop / sdpa_backward_flop) for it rather than writing new ones.
for _op, _formula in ((aten._scaled_dot_product_flash_attention_for_cpu, _fc.sdpa_flop),
                      (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                       _fc.sdpa_backward_flop)):
    if _op not in _fc.flop_registry:
        _fc.flop_registry[_op] = _formula  # already shape-wrapped by torch's decorator


_INDEXING = {aten.index.Tensor, aten.index_select.default, aten.gather.default}
_DROPOUTS = {aten.dropout.default, torch.nn.functional.dropout}


def _fused_dropout(x: torch.Tensor, p: float, train: bool = True, *args: Any) -> torch.Tensor:
    """Dropout as the fused kernel CUDA runs (``native_dropout``: a 1-byte mask is
    saved), not CPU's composite path, which saves a full-precision noise tensor.
    ``p == 0`` is the identity, as in ATen's ``dropout``."""
    if p == 0 or not train:
        return x
    return aten.native_dropout.default(x, p, train)[0]


@dataclass
class _Measured:
    fwd_flops: int = 0
    bwd_flops: int = 0
    saved: int = 0
    saved_sharded: int = 0
    saved_quadratic: int = 0
    params: tuple[str, ...] = ()


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Dispatched(DispatchCount):
    """Records the counted dispatched operators (:mod:`autoplan.opstream`) of what runs
    under it, as the runtime's selective-checkpoint policy will see them, and in ``total``
    how many operators reach it (:class:`~autoplan.opstream.DispatchCount`)."""

    def __init__(self, stream: OpStream) -> None:
        super().__init__()
        self.stream = stream
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        kind = self.stream.kind(func, args, kwargs)
        self.stream.produced(func, kind, args, out)
        if kind == COUNTED:
            self.names.append(op_name(func))
        return out


class _Measure:
    """Run a captured graph node by node under FakeTensorMode, measuring each node.

    ``dispatched`` gets, per node, the counted operators it dispatched (in order),
    ``dispatch_counts`` how many operators it dispatched in all, and ``autograd_counts``
    how many autograd nodes its backward runs (:func:`~autoplan.opstream.autograd_nodes`;
    its parameters' ``AccumulateGrad`` included, the leaves standing in for its inputs not).
    """

    def __init__(self, gm: fx.GraphModule, args: tuple, kwargs: dict, seq_len: int | None,
                 region: set[str]) -> None:
        self.gm = gm
        self.args = args
        self.kwargs = kwargs
        self.seq_len = seq_len
        self.region = region
        # per-token gathers of expert weight banks (HF's batched_mm experts path):
        # grouped-GEMM kernels never materialise them
        self.gathered: set[str] = set()
        self.dispatched: dict[str, tuple[str, ...]] = {}
        self.dispatch_counts: dict[str, int] = {}
        self.autograd_counts: dict[str, int] = {}

    def run(self) -> tuple[dict[str, _Measured], dict[str, Any], dict[str, str]]:
        from torch._subclasses.fake_tensor import FakeTensorMode

        measured: dict[str, _Measured] = {}
        values: dict[str, Any] = {}
        requires: dict[str, Any] = {}
        producer: dict[StorageWeakRef, str] = {}
        saved_seen: set[StorageWeakRef] = set()
        param_storages: set[StorageWeakRef] = set()
        param_of_node: dict[str, str] = {}
        param_ids: set[int] = set()     # the parameters' fakes (leaves autograd accumulates into)
        gathered = self.gathered
        stream = OpStream()
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        flat_inputs = list(self.args) + list(self.kwargs.values())
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        with mode:
            fake_inputs = [self._fake(t) for t in _tensors(flat_inputs)]
            for i, node in enumerate(placeholders):
                # placeholders past the inputs are symbolic_trace's concrete (None) arguments
                values[node.name] = fake_inputs[i] if i < len(fake_inputs) else None
                requires[node.name] = False
            for node in self.gm.graph.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "get_attr":
                    obj = _fetch_attr(self.gm, node.target)
                    if isinstance(obj, torch.Tensor):
                        is_param = isinstance(obj, nn.Parameter) and obj.is_floating_point()
                        fake = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
                        if is_param:
                            fake.requires_grad_(True)
                            param_of_node[node.name] = node.target
                            param_ids.add(id(fake))
                        param_storages.add(StorageWeakRef(fake.untyped_storage()))
                        values[node.name] = fake
                        requires[node.name] = is_param
                    else:
                        values[node.name] = obj
                        requires[node.name] = False
                    continue
                if node.op == "output":
                    break
                if node.op == "call_module":
                    target: Callable = self.gm.get_submodule(node.target)
                elif node.op == "call_method":
                    target = _method_caller(node.target)
                else:
                    target = node.target
                if target in _DROPOUTS and len(node.args) >= 3 and node.args[2]:
                    target = _fused_dropout
                if isinstance(target, torch._ops.OpOverload) and target.name().startswith("aten::_assert"):
                    values[node.name] = None
                    requires[node.name] = False
                    continue
                rec = _Measured()
                leaves: list[torch.Tensor] = []

                def load(x: Any) -> Any:
                    if isinstance(x, fx.Node):
                        v, rg = values[x.name], requires[x.name]
                        return _leafify(v, rg, leaves, x.name in param_of_node)
                    return _fix_device(x)

                call_args = tree_map(load, tuple(node.args))
                call_kwargs = tree_map(load, dict(node.kwargs))
                if _mutates(target) and call_args and isinstance(call_args[0], torch.Tensor) \
                        and call_args[0].requires_grad and call_args[0].is_leaf:
                    # an in-place op cannot write into an autograd leaf; in the real
                    # graph its operand was an intermediate, so give it one
                    call_args = (call_args[0].clone(),) + tuple(call_args[1:])
                call_kwargs = {k: _fix_device(v) for k, v in call_kwargs.items()}

                if target in _INDEXING and node.args and isinstance(node.args[0], fx.Node) \
                        and node.args[0].name in param_of_node and values[node.args[0].name].dim() >= 3:
                    gathered.add(node.name)

                def pack(t: torch.Tensor) -> torch.Tensor:
                    ref = StorageWeakRef(t.untyped_storage())
                    if producer.get(ref) in gathered:
                        # per-token copies of expert weights (HF's batched_mm experts path):
                        # grouped-GEMM kernels read the weights in place, so these are
                        # parameters, not activations
                        return t
                    if ref in param_storages or ref in saved_seen:
                        return t
                    saved_seen.add(ref)
                    nbytes = t.untyped_storage().nbytes()
                    rec.saved += nbytes
                    # a storage no earlier node produced was made inside this node
                    if producer.get(ref, node.name) in self.region:
                        rec.saved_sharded += nbytes
                    if self.seq_len and _quadratic_shape(t.shape, self.seq_len):
                        rec.saved_quadratic += nbytes
                    return t

                with _fc.FlopCounterMode(display=False) as fwd, \
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                        torch.enable_grad(), _Dispatched(stream) as dispatched:
                    out = target(*call_args, **call_kwargs)
                rec.fwd_flops = int(fwd.get_total_flops())
                self.dispatched[node.name] = tuple(dispatched.names)
                self.dispatch_counts[node.name] = dispatched.total
                outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
                self.autograd_counts[node.name] = autograd_nodes(
                    outs, lambda t: id(t) in param_ids)
                grad_leaves = [l for l in leaves if l.requires_grad]
                if outs and grad_leaves:
                    with _fc.FlopCounterMode(display=False) as bwd:
                        torch.autograd.grad(outs, grad_leaves, [torch.empty_like(o) for o in outs],
                                            allow_unused=True)
                    rec.bwd_flops = int(bwd.get_total_flops())
                rec.params = tuple(sorted({param_of_node[a.name] for a in _input_nodes(node)
                                           if a.name in param_of_node}))
                for t in _tensors(out):
                    producer.setdefault(StorageWeakRef(t.untyped_storage()), node.name)
                values[node.name] = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
                requires[node.name] = tree_map(
                    lambda t: bool(t.requires_grad) if isinstance(t, torch.Tensor) else False, out)
                measured[node.name] = rec
        return measured, values, param_of_node

    @staticmethod
    def _fake(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return torch.zeros(t.shape, dtype=t.dtype, device="cpu")


def _fetch_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _method_caller(name: str) -> Callable:
    def call(self_, *args, **kwargs):
        return getattr(self_, name)(*args, **kwargs)
    return call


def _mutates(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def _leafify(v: Any, rg: Any, leaves: list[torch.Tensor], is_param: bool) -> Any:
    """Fresh autograd leaves for this node's float inputs that require grad upstream."""
    if isinstance(v, torch.Tensor):
        if is_param:
            leaves.append(v)
            return v
        if rg is True and v.is_floating_point():
            leaf = v.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf
        return v
    if isinstance(v, (tuple, list)) and isinstance(rg, (tuple, list)) and len(v) == len(rg):
        return type(v)(_leafify(a, b, leaves, False) for a, b in zip(v, rg))
    return v


def _val_bytes(node: fx.Node, values: dict[str, Any]) -> int:
    return sum(_nbytes(t) for t in _tensors(values.get(node.name)))


def _quadratic_shape(shape: Sequence[int], seq_len: int) -> bool:
    """Two sequence-length dimensions: ``s x s`` attention scores, or ``s x (s + 1)`` when
    each head appends a learned sink logit before its softmax (gpt-oss)."""
    return sum(1 for d in shape if d == seq_len) >= 2 or \
        (len(shape) >= 4 and shape[-2] == seq_len and shape[-1] == seq_len + 1)
