"""How a block's dispatched operators are named and counted, for capture and runtime alike.

Selective recompute must re-run exactly the operators the capture put in a
block's attention core (:func:`autoplan.capture.probe._attention_core`), whose FLOPs
the cost model charges.  The capture knows them as ``torch.fx`` nodes; the
runtime sees the block run eagerly, one dispatched ATen operator at a time
(torch's selective-checkpoint mode sits below autograd, so composite operators
such as ``linear`` or ``matmul`` arrive decomposed: ``t`` + ``mm``, ``expand``
+ ``bmm``).  Both sides therefore name the core in the dispatched vocabulary:
the capture runs each fx node of a block under an :class:`OpStream` and the
runtime feeds the eager block's operators through another one.

An :class:`OpStream` sorts each dispatched operator into one of five kinds:

``free``
    views and aliases: no work and no new data, always cheap to redo; also the
    metadata queries torch's selective checkpointing never shows its policy.
    Not counted.
``alloc``
    uninitialised allocations (``empty_like``).  Not counted; the runtime saves
    them, because code that fills one in place keeps using the allocation, not
    the in-place operator's result (CPU dropout: ``noise = empty_like(x);
    noise.bernoulli_(1 - p)``), so a recompute that re-allocated it would read
    garbage where the saved random draw was.
``random``
    operators tagged ``nondeterministic_seeded`` (a fused attention kernel only
    when its ``dropout_p`` is not 0).  Not counted; a recompute must never
    replay them, so the runtime always saves them.
``follow``
    operators whose presence depends on the run rather than on the model:
    dtype casts (bf16 autocast adds ``_to_copy`` around matmuls), layout copies
    (``clone``: whether ``matmul`` or ``reshape`` must copy depends on the
    strides it is given, which a cast or a tensor-parallel shard changes), the pieces of
    CPU's composite dropout that act on its random noise (``div_`` of the
    noise, ``input * noise``; CUDA runs one ``native_dropout`` instead), and
    operators on constants, none of whose inputs requires grad (a captured
    graph materialises the causal mask that an eager run may skip).  Not
    counted; the runtime recomputes one exactly when one of its inputs is data
    that a recomputed operator made.
``counted``
    everything else: the operators whose sequence is a property of the model.
    Each is numbered by its occurrence among the same operator's calls in the
    block's forward, which names it across the two runs.  Fused attention
    kernels share one name (``sdpa``) because the kernel chosen depends on the
    device and dtype, not on the model.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["OpStream", "StorageSet", "DispatchCount", "autograd_nodes", "enters_dispatch_mode",
           "op_name", "plain_tensors", "FREE", "ALLOC", "RANDOM", "FOLLOW", "COUNTED"]

FREE, ALLOC, RANDOM, FOLLOW, COUNTED = "free", "alloc", "random", "follow", "counted"

aten = torch.ops.aten

#: Fused scaled-dot-product-attention kernels: which one runs depends on the device,
#: dtype and mask, so they are counted under one name.
_SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward",
}
#: Operators that make no new data although torch does not mark them as views.
_FREE = {"_unsafe_view", "alias", "lift_fresh", "detach"}
#: Allocations whose contents are written later, in place.
_ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
#: dtype (and device) casts and layout copies: autocast adds casts, and whether a
#: copy is needed depends on strides, so their number is not the model's.
_COPIES = {"_to_copy", "to", "type_as", "clone", "contiguous"}
#: random operators whose output is data (the dropped-out input), not noise
_RANDOM_DATA = {"native_dropout", "sdpa"}


def op_name(func: Any) -> str:
    """The counted name of a dispatched operator: its overload packet, ``aten.`` dropped
    for ATen, fused attention kernels as ``sdpa``.

    Examples
    --------
    >>> op_name(torch.ops.aten.bmm.default)
    'bmm'
    >>> op_name(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    'sdpa'
    """
    packet = getattr(func, "overloadpacket", func)
    name = getattr(packet, "__name__", str(packet))
    ns = getattr(func, "namespace", "aten")
    if name in _SDPA_KERNELS:
        return "sdpa"
    return name if ns == "aten" else f"{ns}.{name}"


def enters_dispatch_mode(func: Any) -> bool:
    """Whether a dispatched ``func`` is one that torch's selective checkpoint runs its
    Python mode's work for: every operator (views, casts and allocations too) but the
    metadata queries it passes straight through (``SAC_IGNORED_OPS``; on fake tensors
    ``prim.device`` dispatches at every call, where a real tensor answers without
    dispatching).  What :attr:`~autoplan.graph.LayerRecord.dispatched_ops` counts."""
    return func not in SAC_IGNORED_OPS


class DispatchCount(TorchDispatchMode):
    """Counts, in ``total``, the operators run under it that :func:`enters_dispatch_mode`."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += enters_dispatch_mode(func)
        return func(*args, **(kwargs or {}))


def autograd_nodes(outputs: list[torch.Tensor], counts_leaf: Callable[[torch.Tensor], bool]) -> int:
    """How many nodes a backward from ``outputs`` runs: every ``grad_fn`` reachable from
    theirs, each once, and of the leaves' ``AccumulateGrad`` nodes those whose tensor
    ``counts_leaf`` (a block's parameters, not the fresh leaves standing in for its
    inputs).  The autograd engine's host time goes per node, whether the node runs one
    operator (``AddmmBackward0``) or none (a view's).  What
    :attr:`~autoplan.graph.LayerRecord.autograd_nodes` counts."""
    seen: set[Any] = set()
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    count = 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is None:
            count += 1
            todo.extend(fn for fn, _ in node.next_functions)
        elif counts_leaf(leaf):
            count += 1
    return count


def _is_random(func: Any, args: tuple, kwargs: dict) -> bool:
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    if op_name(func) != "sdpa":
        return True
    # fused attention kernels carry the tag for their dropout, which may be off
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            p = args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value)
            return bool(p)
    return True


def plain_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in a nested structure, less wrapper subclasses (DTensor), which have no
    storage of their own to follow."""
    return [t for t in tree_flatten(x)[0]
            if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t)]


def _ref(t: torch.Tensor) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class StorageSet:
    """Storages seen so far, by weak reference: a freed storage whose address is reused
    does not count as seen."""

    def __init__(self) -> None:
        self._refs: dict[StorageWeakRef, StorageWeakRef] = {}

    def add(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            ref = _ref(t)
            if ref is not None:
                self._refs[ref] = ref

    def any_of(self, tensors: list[torch.Tensor]) -> bool:
        for t in tensors:
            ref = _ref(t)
            if ref is not None:
                held = self._refs.get(ref)
                if held is not None and not held.expired():
                    return True
        return False


class OpStream:
    """Sorts and numbers the dispatched operators of one run of a block.

    :meth:`kind` and :meth:`number` are called once per operator, in order; the
    caller reports what each one produced with :meth:`produced` so that later
    operators acting on random noise can be recognised.

    Examples
    --------
    >>> s = OpStream()
    >>> x = torch.ones(2, 2, requires_grad=True)
    >>> s.kind(torch.ops.aten.bmm.default, (x, x)), s.number("bmm"), s.number("bmm")
    ('counted', 0, 1)
    >>> s.kind(torch.ops.aten.t.default, (x,)), s.kind(torch.ops.aten._to_copy.default, (x,))
    ('free', 'follow')
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._noise = StorageSet()

    def kind(self, func: Any, args: tuple, kwargs: dict | None = None) -> str:
        """``free``, ``alloc``, ``random``, ``follow`` or ``counted`` (see the module docstring)."""
        name = op_name(func)
        if func in SAC_IGNORED_OPS or getattr(func, "is_view", False) or name in _FREE:
            return FREE
        if name in _ALLOC:
            return ALLOC
        kwargs = kwargs or {}
        if _is_random(func, args, kwargs):
            return RANDOM
        if name in _COPIES or self._noise.any_of(plain_tensors((args, kwargs))):
            return FOLLOW
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not any(t.requires_grad for t in tensors):
            return FOLLOW   # constants (masks), and everything when grad is off
        return COUNTED

    def number(self, name: str) -> int:
        """Occurrence index of a counted operator named ``name`` (0 for its first call)."""
        index = self.calls[name]
        self.calls[name] += 1
        return index

    def produced(self, func: Any, kind: str, args: tuple, out: Any) -> None:
        """Record what operator ``func`` of kind ``kind`` returned.

        Random noise (a ``bernoulli_`` draw, not ``native_dropout``'s dropped-out
        data) and what is computed in place on it stay noise.
        """
        if kind == RANDOM and op_name(func) not in _RANDOM_DATA:
            self._noise.add(plain_tensors(out))
        elif kind == FOLLOW and self._noise.any_of(plain_tensors(args)) \
                and getattr(getattr(func, "_schema", None), "is_mutable", False):
            self._noise.add(plain_tensors(out))
