"""What a real step moves and computes, recorded operator by operator.

:func:`record_step` runs one :meth:`ParallelModel.step <autoplan.runtime.ParallelModel.step>`
under a ``TorchDispatchMode`` that sees every operator this process dispatches, the
collectives included (``c10d`` ops and the functional collectives DTensor issues), and
records per collective kind, group and dtype the bytes moved and the calls, and per
dtype the FLOPs of the matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, fused
attention, ``_grouped_mm``, ``_scaled_mm``), with the definitions of :mod:`autoplan.cost.ledger`, so
the result compares with the estimate's ledger (:meth:`autoplan.cost.engine.CostEngine.ledger`)
term by term.  Groups are named by the mesh dimension whose ranks they are
(:func:`group_names`).

FP8 (torchao's float8 linears, :mod:`.fp8`): a tensor of torchao's ``Float8TrainingTensor``
counts as its FP8 data (dtype ``fp8``, one byte an element), in collectives (the FP8
all-gathers of sequence parallelism) and in matmuls: the ``mm`` of two of them is one
FP8 GEMM, counted at its FLOPs in ``fp8``, which is what the program computes on a GPU
(``torch._scaled_mm`` on the FP8 data).  Emulated (``fp8_emulate``), torchao runs that
GEMM as an fp32 ``mm`` of the dequantized values, inside the subclass where this mode
does not see it: the FLOPs are the same, counted once, as FP8.  FSDP2's all-gather of
a unit mixing FP8 weights with bf16 ones (norms, biases) moves one byte buffer
(``uint8``), counted as such.

Operators on DTensors are left to DTensor (the mode returns ``NotImplemented`` for
them), which runs them as local operators and collectives the mode then sees; the
fake tensors DTensor propagates shapes with are not counted.

Examples
--------
>>> # in every process, after parallelize():
>>> # measured = record_step(pm, batch)
>>> # measured.transfers[("all_reduce", "dp", "fp32")]   # (bytes, calls) of the step
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..cost.engine import CAUSAL_BLOCK_FRACTION

__all__ = ["MeasuredStep", "record_step", "group_names", "group_ranks", "canonical_group",
           "StepRecorder", "LiveBytes"]

#: dtype names as the cost ledger writes them
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.float64: "float64", torch.int64: "int64", torch.int32: "int32",
                torch.uint8: "uint8", torch.bool: "bool", torch.float8_e4m3fn: "fp8",
                torch.float8_e5m2: "fp8"}


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
               torch.float8_e5m2fnuz)


def _payload(t: torch.Tensor) -> torch.Tensor:
    """What a tensor holds: torchao's ``Float8TrainingTensor`` (whose dtype is the one it
    stands for, bf16) holds its FP8 data; every other tensor itself."""
    data = getattr(t, "_data", None)
    return data if isinstance(data, torch.Tensor) and data.dtype in _FP8_DTYPES else t


def _bytes(tensors) -> int:
    return sum(_payload(t).numel() * _payload(t).element_size() for t in tensors)


def _dtype(tensors) -> str:
    if not tensors:
        return "none"
    dtype = _payload(tensors[0]).dtype
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _c10d(kind: str, sent: Callable[[tuple], list], group_arg: int):
    """A c10d op's kind, the tensors whose bytes count, and where its process group is."""
    return kind, sent, group_arg


def _list(x) -> list:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


#: Per collective operator: (kind, the tensors whose bytes count, the group argument's
#: position); bytes as autoplan.cost.ledger defines them
_COLLECTIVES: dict[str, tuple[str, Callable[[tuple], list], int]] = {
    "c10d::allreduce_": _c10d("all_reduce", lambda a: _list(a[0]), 1),
    "c10d::allreduce_coalesced_": _c10d("all_reduce", lambda a: _list(a[0]), 1),
    "c10d::allgather_": _c10d("all_gather", lambda a: _list(a[0]), 2),
    "c10d::_allgather_base_": _c10d("all_gather", lambda a: [a[0]], 2),
    "c10d::allgather_into_tensor_coalesced_": _c10d("all_gather", lambda a: _list(a[0]), 2),
    "c10d::reduce_scatter_": _c10d("reduce_scatter", lambda a: _list(a[1]), 2),
    "c10d::_reduce_scatter_base_": _c10d("reduce_scatter", lambda a: [a[1]], 2),
    "c10d::reduce_scatter_tensor_coalesced_": _c10d("reduce_scatter", lambda a: _list(a[1]), 2),
    "c10d::alltoall_base_": _c10d("all_to_all", lambda a: [a[1]], 2),
    "c10d::alltoall_": _c10d("all_to_all", lambda a: _list(a[1]), 2),
    "c10d::send": _c10d("send", lambda a: _list(a[0]), 1),
    "c10d::broadcast_": _c10d("broadcast", lambda a: _list(a[0]), 1),
}
#: functional collectives (DTensor's): the group by name, the last argument
_FUNCTIONAL = {
    "_c10d_functional::all_reduce": ("all_reduce", lambda a: [a[0]], 1),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", lambda a: _list(a[0]), 1),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", lambda a: [a[0]], None),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", lambda a: _list(a[0]),
                                                           None),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", lambda a: [a[0]], 1),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter",
                                                          lambda a: _list(a[0]), 1),
    "_c10d_functional::all_to_all_single": ("all_to_all", lambda a: [a[0]], 1),
    "_c10d_functional::broadcast": ("broadcast", lambda a: [a[0]], 1),
}


# ---------------------------------------------------------------------- FLOPs
def _mm(a, b, *_, **__) -> int:
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _addmm(bias, a, b, *_, **__) -> int:
    return _mm(a, b)


def _bmm(a, b, *_, **__) -> int:
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _baddbmm(bias, a, b, *_, **__) -> int:
    return _bmm(a, b)


def _attention(q, k, v, *_, **__) -> int:
    """Scores and values of a fused attention's forward: ``2 q k^T + 2 p v`` per head."""
    lead = q.numel() // (q.shape[-2] * q.shape[-1])
    return 2 * lead * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _attention_backward(grad_out, q, k, v, *_, **__) -> int:
    """The four matmuls of its backward (the gradients of scores, values, queries and
    keys): twice the forward's, as the capture counts the backward of its math."""
    return 2 * _attention(q, k, v)


def _grouped_mm(a, b, *_, **__) -> int:
    """``torch._grouped_mm``: every row of the stacked operand meets one group's matrix."""
    if a.dim() == 2 and b.dim() == 3:           # (M, K) x (E, K, N)
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:           # (K, M) x (M, N), grouped over M
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 2:           # (E, M, K) x (K, N)... grouped over N
        return 2 * a.shape[1] * a.shape[2] * b.shape[1]
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[-1]


_MATMULS: dict[str, Callable[..., int]] = {
    "aten::mm": _mm, "aten::addmm": _addmm, "aten::bmm": _bmm, "aten::baddbmm": _baddbmm,
    "aten::_grouped_mm": _grouped_mm,
    # FP8 GEMMs called directly (torchao calls them inside its tensor subclass, where the
    # mm the subclass receives is counted: see the module docstring)
    "aten::_scaled_mm": _mm, "aten::_scaled_grouped_mm": _grouped_mm,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _attention,
    "aten::_scaled_dot_product_flash_attention": _attention,
    "aten::_scaled_dot_product_efficient_attention": _attention,
    "aten::_scaled_dot_product_cudnn_attention": _attention,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _attention_backward,
    "aten::_scaled_dot_product_flash_attention_backward": _attention_backward,
    "aten::_scaled_dot_product_efficient_attention_backward": _attention_backward,
    "aten::_scaled_dot_product_cudnn_attention_backward": _attention_backward,
}


#: The fused attention kernels (forward and backward), called with ``is_causal`` or a mask
_ATTENTION = frozenset(name for name, count in _MATMULS.items()
                       if count in (_attention, _attention_backward))


def _is_causal(func, args: tuple, kwargs: dict) -> bool:
    """Whether a fused attention call asks its kernel for the causal mask (``is_causal``,
    by the operator's schema), which it computes by skipping the blocks above the
    diagonal, rather than handing it a mask tensor, whose every block it computes."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return (bool(bound.get("is_causal", False)) and bound.get("attn_mask") is None
            and bound.get("attn_bias") is None)


# ---------------------------------------------------------------------- groups
#: The ledger's group names, in the order that names a group two dimensions share
GROUPS = ("tp", "cp", "ep", "dp", "edp", "pp", "tied", "world")


def group_ranks(plan, rank: int | None = None) -> dict[str, frozenset[int]]:
    """The ranks of each of this rank's groups, by the ledger's names (:data:`GROUPS`):
    ``dp`` is ``dp x cp`` (what data parallelism reduces over), ``ep``/``edp`` carved out
    of it (:func:`autoplan.runtime.mesh.expert_meshes`), ``tied`` the first and last
    pipeline stages' ranks at this rank's other coordinates; no collective."""
    import itertools

    from .mesh import mesh_coordinates, rank_at

    rank = dist.get_rank() if rank is None else rank
    c = mesh_coordinates(plan, rank)
    dims = dict(zip(plan.mesh.dims, plan.mesh.degrees))

    def along(*names: str) -> list[int]:
        out = []
        for idx in itertools.product(*(range(dims.get(n, 1)) for n in names)):
            out.append(rank_at(plan, **{**c, **dict(zip(names, idx))}))
        return out

    dp_cp = along("dp", "cp")            # in the flattened dp x cp order
    ranks = {"tp": along("tp"), "cp": along("cp"), "dp": dp_cp, "pp": along("pp"),
             "world": list(range(dist.get_world_size()))}
    if plan.ep > 1:
        i = dp_cp.index(rank)
        first = i - i % plan.ep
        ranks["ep"] = dp_cp[first:first + plan.ep]
        ranks["edp"] = dp_cp[i % plan.ep::plan.ep]
    if plan.pp > 1:
        ranks["tied"] = [ranks["pp"][0], ranks["pp"][-1]]
    return {name: frozenset(r) for name, r in ranks.items()}


def group_names(plan, rank: int | None = None) -> dict[frozenset[int], str]:
    """This rank's groups of more than one rank by their ranks, named as the ledger
    names them (:func:`group_ranks`); a group two names share takes the first in
    :data:`GROUPS` (dp = 2, cp = 1: ``dp``; ep = dp: ``ep``)."""
    out: dict[frozenset[int], str] = {}
    found = group_ranks(plan, rank)
    for name in GROUPS:
        if name in found and len(found[name]) > 1:
            out.setdefault(found[name], name)
    return out


def canonical_group(plan, name: str, rank: int | None = None) -> str:
    """The name :func:`group_names` gives the ranks of the ledger's group ``name`` (the
    estimate calls the expert all-to-all's group ``ep`` even where it is the whole
    ``dp`` group; both sides compare under one name)."""
    ranks = group_ranks(plan, rank).get(name)
    if ranks is None:
        return name
    return group_names(plan, rank).get(ranks, name)


# ---------------------------------------------------------------------- memory
class LiveBytes:
    """Peak bytes of live tensor storages on this process (CPU has no allocator statistics).

    At entry every tensor the garbage collector can reach is counted (parameters,
    gradients, optimizer states, runtime buffers; a DTensor by its local shard); then a
    ``TorchDispatchMode`` counts the storage of every operator output, and a weak
    reference to each storage subtracts it when it is freed.  A storage is counted at its
    current size: FSDP2 frees and re-allocates the unsharded parameters and all-gather
    buffers of a layer by resizing their storages (``UntypedStorage.resize_(0)`` and back,
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``free_storage``/``alloc_storage``),
    which no operator dispatch shows, so ``resize_`` is wrapped while the count runs.
    Temporaries an operator allocates and frees inside itself are not seen (nor are those
    inside a DTensor's dispatch): the peak is of what operators hand to each other.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._refs: dict[int, object] = {}
        self._sizes: dict[int, int] = {}     # bytes each live storage is counted at

    def _add(self, t) -> None:
        import torch
        from torch.distributed.tensor import DTensor
        from torch._subclasses.fake_tensor import is_fake
        if isinstance(t, DTensor):
            t = t._local_tensor
        if not isinstance(t, torch.Tensor) or is_fake(t) or t.is_meta:
            return   # fake and meta tensors (left from capturing the model) hold no memory
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        self._track(st)

    def _track(self, st) -> None:
        import weakref
        if st.device.type == "meta":
            return
        key = st._cdata
        if key in self._refs:
            return
        n = st.nbytes()

        def freed(_ref, key=key) -> None:
            if self._refs.pop(key, None) is not None:
                self.current -= self._sizes.pop(key)

        self._refs[key] = weakref.ref(st, freed)
        self._sizes[key] = 0
        self._set(key, n)

    def _set(self, key: int, n: int) -> None:
        self.current += n - self._sizes[key]
        self._sizes[key] = n
        self.peak = max(self.peak, self.current)

    def __enter__(self) -> "LiveBytes":
        import gc

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        gc.collect()   # garbage is not memory in use
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # isinstance on some tracked objects warns
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    self._add(obj)
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    tracker._add(t)
                return out

        resize = torch.UntypedStorage.resize_

        def counted_resize(st, size):
            out = resize(st, size)
            if st._cdata in tracker._refs:
                tracker._set(st._cdata, st.nbytes())
            else:
                tracker._track(st)
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = counted_resize
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        import torch
        self._mode.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize


# ---------------------------------------------------------------------- the recorder
@dataclass
class MeasuredStep:
    """What one process moved and computed in a step.

    ``transfers``: ``(kind, group, dtype) -> [bytes, calls]``; a group no mesh dimension
    names is ``"ranks a,b,..."``.  ``flops``: matmul FLOPs by dtype.  ``matmuls``:
    ``(op, dtype, FLOPs)`` of each matmul, in order (for a report of what ran in which
    dtype).  ``loss``: the step's return value.
    """

    transfers: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)
    matmuls: list[tuple[str, str, int]] = field(default_factory=list)
    loss: float | None = None
    #: peak and start-of-step bytes of live tensor storages (``record_step(memory=True)``)
    peak_bytes: int | None = None
    start_bytes: int | None = None


class StepRecorder(TorchDispatchMode):
    """Records the collectives and matmuls dispatched while it is active (see the module)."""

    def __init__(self, names: dict[frozenset[int], str]) -> None:
        super().__init__()
        self.names = names
        self.step = MeasuredStep()
        self._ranks: dict[Any, str] = {}

    def _group(self, group: Any) -> str:
        name = self._ranks.get(id(group))
        if name is None:
            if isinstance(group, str):
                from torch.distributed.distributed_c10d import _resolve_process_group
                group = _resolve_process_group(group)
            elif isinstance(group, torch.ScriptObject):   # a c10d op's boxed group
                group = dist.ProcessGroup.unbox(group)
            ranks = frozenset(dist.get_process_group_ranks(group))
            if len(ranks) == 1:
                name = ""   # this rank alone: nothing crosses a link (FSDP2 over one rank)
            else:
                name = self.names.get(ranks) or "ranks " + ",".join(map(str, sorted(ranks)))
            self._ranks[id(group)] = name
        return name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(a, DTensor) for a in leaves):
            return NotImplemented
        out = func(*args, **kwargs)
        if any(isinstance(a, FakeTensor) for a in leaves):
            return out
        name = func._schema.name
        if name in _COLLECTIVES:
            kind, sent, at = _COLLECTIVES[name]
            tensors = sent(args)
            self._add(kind, self._group(args[at]), tensors)
        elif name in _FUNCTIONAL:
            kind, sent, _ = _FUNCTIONAL[name]
            tensors = sent(args)
            group = args[-1]
            if kind == "all_gather":     # the gathered bytes: the input times the group
                n = args[1]
                self._add(kind, self._group(group), tensors, factor=n)
            else:
                self._add(kind, self._group(group), tensors)
        elif name in _MATMULS:
            flops = _MATMULS[name](*args, **kwargs)
            if name in _ATTENTION and _is_causal(func, args, kwargs):
                # the kernel skips the score blocks above the diagonal
                flops *= CAUSAL_BLOCK_FRACTION
            # the first matmul operand (after addmm's and baddbmm's bias)
            dtype = _dtype([args[1] if name in ("aten::addmm", "aten::baddbmm") else args[0]])
            self.step.flops[dtype] = self.step.flops.get(dtype, 0.0) + flops
            self.step.matmuls.append((name.split("::")[1], dtype, flops))
        return out

    def _add(self, kind: str, group: str, tensors: list, factor: int = 1) -> None:
        if not tensors or not group:
            return
        acc = self.step.transfers.setdefault((kind, group, _dtype(tensors)), [0.0, 0.0])
        acc[0] += factor * _bytes(tensors)
        acc[1] += 1


def record_step(pm, batch: Any, *, memory: bool = False) -> MeasuredStep:
    """Run ``pm.step(batch)`` and return what this process moved and computed in it;
    ``memory``: also the peak bytes of live tensor storages (:class:`LiveBytes`; CPU
    tensors have no allocator statistics), in a step of its own after the recorded one.
    Record a step after the first two: they also run one-time work (pipeline shape
    inference, the optimizer's states, DDP's bucket rebuild) that is not part of a
    training step."""
    recorder = StepRecorder(group_names(pm.plan))
    with recorder:
        loss = pm.step(batch)
    recorder.step.loss = loss
    if memory:
        dist.barrier()
        with LiveBytes() as live:
            recorder.step.start_bytes = live.current
            pm.step(batch)
        recorder.step.peak_bytes = live.peak
    return recorder.step
