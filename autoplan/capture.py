"""Capture: an unmodified ``nn.Module`` becomes a costed layer graph.

The flow, and why (measured with torch 2.13):

1. Wrap the model with its training objective (next-token cross-entropy for
   causal token models, the user's ``loss_fn`` otherwise).
2. Find the repeated blocks (children of an ``nn.ModuleList``/``nn.Sequential``
   with identical structure) and keep only a few representatives of each stack,
   so capture time does not grow with depth.
3. Capture the forward graph with ``torch.export`` (non-strict; HF causal LMs
   with ``use_cache=False``) or, where export fails on a plain module,
   ``torch.fx.symbolic_trace``.  Both give a ``torch.fx`` graph.
   ``symbolic_trace`` alone fails on every Hugging Face model tried (GPT-2,
   Llama, BERT, Mixtral) and on ``nn.TransformerEncoder``; non-strict export
   traces them all.  MoE experts are captured with HF's ``batched_mm`` experts
   implementation: ``grouped_mm`` has no FlopCounterMode rule (and fails in
   fp32 under FakeTensor), ``eager`` calls ``nonzero``, which FakeTensor cannot size.
4. Run that graph node by node under ``FakeTensorMode`` (no real storage is
   ever allocated, so a 400B-parameter model on the meta device costs nothing):
   each node's forward and backward FLOPs come from ``FlopCounterMode`` and the
   bytes autograd saves for backward from saved-tensor hooks.
5. Group nodes into layers, derive the tensor-parallel structure from the data
   flow (column/row roles in the Megatron pattern), and expand the
   representatives back to the full depth.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import operator
import os
import traceback
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter as _fc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .errors import InputError, TraceError
from .graph import (
    AttentionCore,
    CollectiveRecord,
    CoreOp,
    LayerKind,
    LayerRecord,
    LinearRecord,
    LinearRole,
    ModelGraph,
    NodeRecord,
    TPStructure,
)
from .opstream import COUNTED, OpStream, op_name

__all__ = ["trace", "find_stacks", "Stack"]

aten = torch.ops.aten

# torch's FLOP registry covers the CUDA SDPA kernels but not the CPU flash
# kernel that SDPA dispatches to under a CPU FakeTensor; reuse torch's own
# formulas (sdpa_flop / sdpa_backward_flop) for it rather than writing new ones.
for _op, _formula in ((aten._scaled_dot_product_flash_attention_for_cpu, _fc.sdpa_flop),
                      (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                       _fc.sdpa_backward_flop)):
    if _op not in _fc.flop_registry:
        _fc.flop_registry[_op] = _formula  # already shape-wrapped by torch's decorator

_MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default,
            aten.bmm.default, aten.baddbmm.default, aten.einsum.default}
_PASSTHROUGH = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
    aten.contiguous.default, aten.dropout.default, aten.native_dropout.default,
    aten.alias.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
    aten.type_as.default, aten.feature_dropout.default, aten.flatten.using_ints,
    operator.getitem, aten.add.Tensor, aten.mul.Tensor, aten.squeeze.dim, aten.unsqueeze.default,
}
_INDEXING = {aten.index.Tensor, aten.index_select.default, aten.gather.default}
_DROPOUTS = {aten.dropout.default, torch.nn.functional.dropout}


def _fused_dropout(x: torch.Tensor, p: float, train: bool = True, *args: Any) -> torch.Tensor:
    """Dropout as the fused kernel CUDA runs (``native_dropout``: a 1-byte mask is
    saved), not CPU's composite path, which saves a full-precision noise tensor.
    ``p == 0`` is the identity, as in ATen's ``dropout``."""
    if p == 0 or not train:
        return x
    return aten.native_dropout.default(x, p, train)[0]


_RESIDUAL_ADDS = {aten.add.Tensor, aten.add_.Tensor, operator.add, torch.add}
_ROUTING = {aten.topk.default, aten.softmax.int, aten._softmax.default, aten.sigmoid.default}


# ---------------------------------------------------------------------- stacks
@dataclass(frozen=True)
class Stack:
    """A container (``nn.ModuleList``/``nn.Sequential``) whose children are layers."""

    path: str
    names: tuple[str, ...]        # child names in order
    signatures: tuple[str, ...]   # structural signature of each child


def _signature(module: nn.Module) -> str:
    parts = [type(module).__qualname__]
    for name, sub in module.named_modules():
        parts.append(f"m:{name}:{type(sub).__qualname__}")
    for name, p in module.named_parameters(remove_duplicate=False):
        parts.append(f"p:{name}:{tuple(p.shape)}:{p.dtype}")
    for name, b in module.named_buffers(remove_duplicate=False):
        parts.append(f"b:{name}:{tuple(b.shape)}:{b.dtype}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def find_stacks(model: nn.Module) -> list[Stack]:
    """The outermost containers with at least two structurally identical children.

    Examples
    --------
    >>> from autoplan.models import GPT, GPTConfig
    >>> [s.path for s in find_stacks(GPT(GPTConfig(vocab_size=8, seq_len=4, hidden=8, heads=2, layers=3)))]
    ['blocks']
    """
    stacks: list[Stack] = []
    taken: list[str] = []
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
            continue
        if any(path == t or path.startswith(t + ".") for t in taken):
            continue
        names = tuple(mod._modules)
        sigs = tuple(_signature(mod._modules[n]) for n in names)
        counts: dict[str, int] = defaultdict(int)
        for s in sigs:
            counts[s] += 1
        if max(counts.values()) < 2:
            continue
        # a repeated child must carry parameters (ReLUs repeating is no stack)
        if not any(counts[s] >= 2 and any(True for _ in mod._modules[n].parameters())
                   for n, s in zip(names, sigs)):
            continue
        stacks.append(Stack(path, names, sigs))
        taken.append(path)
    return stacks


def _representatives(stack: Stack) -> int:
    """How many leading children to keep: all distinct kinds, a middle one, and a last one."""
    seen: set[str] = set()
    prefix = 0
    for i, s in enumerate(stack.signatures):
        if s not in seen:
            seen.add(s)
            prefix = i + 1
    return min(len(stack.names), max(3, prefix + 2))


def _map_full_to_rep(stack: Stack, keep: int) -> list[int]:
    """For each child of the full stack, the kept child whose measurements it reuses.

    The first child maps to the first kept one (it may save tensors shared with
    later blocks), the last to the last kept one (its cut is followed by the
    post segment), and every other child to a kept middle child of the same
    structure (its cut is followed by another block).
    """
    n = len(stack.names)
    if keep >= n:
        return list(range(n))
    sigs = stack.signatures
    out = []
    for i in range(n):
        if i == 0:
            out.append(0)
            continue
        if i == n - 1 and sigs[keep - 1] == sigs[i]:
            out.append(keep - 1)
            continue
        middle = [j for j in range(1, keep - 1) if sigs[j] == sigs[i]]
        if not middle:
            middle = [j for j in range(keep) if sigs[j] == sigs[i]]
        out.append(middle[-1])
    return out


@contextlib.contextmanager
def _truncated(model: nn.Module, stacks: Sequence[Stack], keep: Sequence[int]):
    """Temporarily keep only the first ``keep[i]`` children of each stack."""
    saved = []
    try:
        for st, k in zip(stacks, keep):
            cont = model.get_submodule(st.path) if st.path else model
            saved.append((cont, cont._modules))
            cont._modules = OrderedDict(list(cont._modules.items())[:k])
        yield
    finally:
        for cont, mods in saved:
            cont._modules = mods


# ------------------------------------------------------------------ objective
def _is_hf(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return cfg is not None and hasattr(cfg, "to_dict") and hasattr(model, "can_generate")


def _hf_kind(model: nn.Module) -> str:
    """'causal', 'seq2seq', 'masked' or 'base' for Hugging Face models, from what the
    model can do rather than its class name: an encoder-decoder config is seq2seq; a
    model with an output projection over the vocabulary is causal when it can generate
    (HF's GenerationMixin) and masked otherwise; without one it is a base model."""
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        return "seq2seq"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return "base"
    can_generate = getattr(model, "can_generate", None)
    return "causal" if callable(can_generate) and can_generate() else "masked"


def _vocab_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for key in ("vocab_size", "n_vocab"):
        v = getattr(cfg, key, None)
        if isinstance(v, int):
            return v
    return None


def _is_token_model(model: nn.Module) -> bool:
    if _vocab_size(model) is not None:
        return True
    first = next((m for m in model.modules() if not list(m.children())), None)
    return isinstance(first, nn.Embedding)


class _Objective(nn.Module):
    """The model plus its training objective, returning a scalar loss."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, token_model: bool) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.hf = _is_hf(model)
        self.kind = _hf_kind(model) if self.hf else ("causal" if token_model else "base")
        self.vocab = _vocab_size(model)
        if loss_fn is not None:
            self.description = f"user loss_fn {getattr(loss_fn, '__name__', type(loss_fn).__name__)}"
        elif self.kind == "causal":
            self.description = "next-token cross-entropy"
        elif self.kind in ("seq2seq", "masked"):
            self.description = "token cross-entropy (labels = input ids)"
        else:
            self.description = "sum of outputs (no loss_fn given)"

    def _call_model(self, *args: Any, **kwargs: Any) -> Any:
        if self.hf and args and not kwargs:
            kwargs = {"input_ids": args[0]}
            if self.kind == "seq2seq":
                kwargs["decoder_input_ids"] = args[0]
            elif self.kind == "causal":
                kwargs["use_cache"] = False
            args = ()
        return self.model(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self._call_model(*args, **kwargs)
        if self.loss_fn is not None:
            return self.loss_fn(out, *args)
        logits = _primary_output(out)
        if self.kind == "causal" and logits.dim() == 3:
            return token_cross_entropy(logits, args[0], shift=True)
        if self.kind in ("seq2seq", "masked") and logits.dim() == 3 and logits.shape[-1] == self.vocab:
            return token_cross_entropy(logits, args[0], shift=False)
        return logits.float().sum()


def token_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, *, shift: bool) -> torch.Tensor:
    """Cross-entropy as Hugging Face computes it with ``labels=input_ids`` (fp32 upcast)."""
    if shift:
        logits, ids = logits[:, :-1, :], ids[:, 1:]
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids.reshape(-1))


def _primary_output(out: Any) -> torch.Tensor:
    if isinstance(out, (torch.Tensor, fx.Proxy)):
        return out
    for key in ("logits", "last_hidden_state", "prediction_logits"):
        v = getattr(out, key, None)
        if isinstance(v, torch.Tensor):
            return v
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TraceError(f"cannot find a tensor in the model output of type {type(out).__name__}; "
                     "pass loss_fn=lambda out, *inputs: <scalar> to say what to train")


# ---------------------------------------------------------------------- inputs
def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _example_inputs(model: nn.Module, seq_len: int | None, example_inputs: Any,
                    micro_batch: int) -> tuple[tuple, dict]:
    device = _model_device(model)
    if example_inputs is None:
        if seq_len is None:
            hint = ("pass seq_len=<tokens per sequence>" if _is_token_model(model)
                    else "pass example_inputs=(tensor, ...) with the shapes of one micro-batch")
            raise InputError(f"trace() needs inputs for {type(model).__name__}: {hint}")
        if not _is_token_model(model):
            raise InputError(
                f"seq_len was given but {type(model).__name__} does not take token ids (no "
                "vocabulary/embedding found); pass example_inputs=(tensor, ...) instead")
        if not isinstance(seq_len, int) or seq_len < 2:
            raise InputError(f"seq_len must be an integer >= 2, got {seq_len!r}")
        limit = _max_positions(model)
        if limit is not None and seq_len > limit:
            raise InputError(f"seq_len={seq_len} exceeds the model's maximum of {limit} positions "
                             "(config max_position_embeddings / seq_len); use a shorter seq_len "
                             "or build the model with more positions")
        if not isinstance(micro_batch, int) or micro_batch < 1:
            raise InputError(f"micro_batch must be a positive integer, got {micro_batch!r}")
        return (torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device),), {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError(f"example_inputs must be a tensor, a tuple of tensors or a dict of "
                     f"keyword tensors, got {type(example_inputs).__name__}")


def _max_positions(model: nn.Module) -> int | None:
    """The longest sequence a learned position-embedding table allows (None: no such table;
    rotary and relative positions have no hard limit)."""
    cfg = getattr(model, "config", None)
    tables = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    for key in ("max_position_embeddings", "n_positions", "seq_len"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0 and v in tables:
            return v
    return None


def _check_input_shapes(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Fail early, naming the argument and expected shape, on obviously wrong inputs."""
    tensors = [(f"example_inputs[{i}]", a) for i, a in enumerate(args)] + \
              [(f"example_inputs[{k!r}]", v) for k, v in kwargs.items()]
    if not tensors:
        raise InputError("example_inputs is empty; pass at least one tensor")
    first_leaf = next((m for m in model.modules() if not list(m.children())
                       and any(True for _ in m.parameters(recurse=False))), None)
    name, t = tensors[0]
    if not isinstance(t, torch.Tensor):
        return
    if isinstance(first_leaf, nn.Linear) and t.dim() >= 1 and t.shape[-1] != first_leaf.in_features:
        raise InputError(f"{name} has shape {tuple(t.shape)} but the first Linear expects "
                         f"(..., {first_leaf.in_features}); pass a tensor of shape "
                         f"(batch, {first_leaf.in_features})")
    if isinstance(first_leaf, nn.Conv2d) and (t.dim() != 4 or t.shape[1] != first_leaf.in_channels):
        raise InputError(f"{name} has shape {tuple(t.shape)} but the first Conv2d expects "
                         f"(batch, {first_leaf.in_channels}, height, width)")
    if isinstance(first_leaf, nn.Embedding) and t.is_floating_point():
        raise InputError(f"{name} is {t.dtype} but the model starts with an Embedding: pass "
                         "integer token ids of shape (batch, seq_len)")


# ------------------------------------------------------------------ capture fx
def _module_tracker(model: nn.Module):
    """Forward hooks that keep the path of the module being run (for error messages)."""
    stack: list[str] = []
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def pre(mod, *_):
        stack.append(names.get(mod, "?"))

    def post(mod, *_):
        if stack:
            stack.pop()

    for m in names:
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    return stack, handles


def _user_frame(tb) -> str | None:
    """The innermost traceback frame outside torch and autoplan, as 'file:line: code'."""
    frames = traceback.extract_tb(tb)
    torch_dir = os.path.dirname(torch.__file__)
    own_dir = os.path.dirname(__file__)
    for fr in reversed(frames):
        if fr.filename.startswith(torch_dir) or fr.filename.startswith(own_dir):
            continue
        return f"{fr.filename}:{fr.lineno}: {(fr.line or '').strip()}"
    return None


def _strip(path: str) -> str:
    """Module path relative to the user's model (drop the objective wrapper's 'model.')."""
    if path == "model":
        return ""
    return path[len("model."):] if path.startswith("model.") else path


def _to_cpu_graph(gm: fx.GraphModule) -> None:
    """Make a captured graph runnable on CPU FakeTensors: drop metadata asserts and
    turn ``device='meta'`` arguments (from a meta-device model) into CPU, in every
    nested graph too (higher-order ops such as ``wrap_with_set_grad_enabled``)."""
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        changed = False
        for node in list(sub.graph.nodes):
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                    and node.target.name().startswith("aten::_assert") and not node.users:
                sub.graph.erase_node(node)
                changed = True
                continue
            new_args = tree_map(_fix_device, node.args)
            new_kwargs = tree_map(_fix_device, dict(node.kwargs))
            if new_args != node.args or new_kwargs != dict(node.kwargs):
                node.args, node.kwargs = new_args, new_kwargs
                changed = True
        if changed:
            sub.recompile()


def _export(wrapper: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    ep = torch.export.export(wrapper, args, kwargs, strict=False)
    gm = ep.module()
    _to_cpu_graph(gm)
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else "model"
        node.meta["autoplan_module"] = _strip(path)
    return gm


class _PathTracer(fx.Tracer):
    """symbolic_trace that records the module path of every node.

    No module is a leaf, so parameters appear as ``get_attr`` nodes and every
    operator as a ``call_function`` node, like an exported graph.
    """

    def __init__(self) -> None:
        super().__init__()
        self._paths = ["model"]

    def is_leaf_module(self, m, qualname):
        return False

    def call_module(self, m, forward, args, kwargs):
        path = self.path_of_module(m)
        self._paths.append(path)
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._paths.pop()

    def create_node(self, *a, **k):
        node = super().create_node(*a, **k)
        node.meta["autoplan_module"] = _strip(self._paths[-1])
        return node


class _FixedArity(nn.Module):
    """symbolic_trace cannot trace ``*args``: the objective behind named positional inputs."""

    def __init__(self, objective: _Objective) -> None:
        super().__init__()
        self.model = objective.model
        self._objective = objective.forward

    def forward(self, input0, input1=None, input2=None, input3=None):
        args = [a for a in (input0, input1, input2, input3) if a is not None]
        return self._objective(*args)


def _symbolic(wrapper: _Objective, n_args: int) -> fx.GraphModule:
    if not 1 <= n_args <= 4:
        raise TraceError(f"symbolic_trace takes 1 to 4 positional inputs, got {n_args}")
    root = _FixedArity(wrapper)
    unused = {f"input{i}": None for i in range(n_args, 4)}
    graph = _PathTracer().trace(root, concrete_args=unused)
    return fx.GraphModule(root, graph)


def _capture_fx(wrapper: nn.Module, args: tuple, kwargs: dict, method: str) -> tuple[fx.GraphModule, str]:
    if method not in ("auto", "export", "symbolic_trace"):
        raise InputError(f"method must be 'auto', 'export' or 'symbolic_trace', got {method!r}")
    errors: list[tuple[str, BaseException, str | None, str | None]] = []
    if method in ("auto", "export"):
        stack, handles = _module_tracker(wrapper)
        try:
            with _quiet_fake_tensor_log():
                return _export(wrapper, args, kwargs), "torch.export"
        except Exception as exc:  # noqa: BLE001 - turned into a TraceError below
            where = _strip(stack[-1]) if stack else None
            errors.append(("torch.export", exc, where, _user_frame(exc.__traceback__)))
        finally:
            for h in handles:
                h.remove()
    # a shape error: the model does not run on these inputs, traced or not (symbolic_trace
    # checks no shapes, so it would pass and the measurement fail with a raw torch error)
    shape_error = bool(errors) and _is_shape_error(errors[0][1])
    if method in ("auto", "symbolic_trace") and not kwargs and not shape_error:
        try:
            return _symbolic(wrapper, len(args)), "torch.fx.symbolic_trace"
        except Exception as exc:  # noqa: BLE001
            errors.append(("torch.fx.symbolic_trace", exc, None, _user_frame(exc.__traceback__)))
    path, exc, where, line = errors[0]
    summary = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    msg = [f"could not capture {type(wrapper.model).__name__} with {path}: "
           f"{type(exc).__name__}: {summary[:300]}"]
    if where:
        msg.append(f"  in module: {where or '<root>'} ({type(wrapper.model.get_submodule(where)).__name__ if where else ''})")
    if line:
        msg.append(f"  at: {line}")
    if _is_shape_error(exc):
        msg.append("  what to do: the model does not run on these inputs: two shapes there do not "
                   "fit together; check its configuration (a hidden size that the heads, or heads "
                   "that the key/value heads, do not divide; an odd head size) and the inputs' shape")
    else:
        msg.append("  what to do: make that code traceable (no data-dependent Python control flow, "
                   "no .item()/.tolist() on tensors), or move it into a function wrapped with "
                   "torch.fx.wrap / a custom op so tracing treats it as one leaf operation")
    raise TraceError("\n".join(msg), module_path=where, source_line=line) from None


#: Words of torch's errors for operands whose shapes do not fit (a model that would fail
#: the same way run eagerly), as opposed to code that cannot be traced.
_SHAPE_WORDS = ("shapes cannot be multiplied", "same reduction dim", "attempting to broadcast",
                "must match the size of tensor", "size mismatch", "invalid for input of size",
                "expected input with shape", "expected size", "is invalid for input",
                "channels, but got")


def _is_shape_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "data-dependent" not in text and any(w in text for w in _SHAPE_WORDS)


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """torch logs a traceback at ERROR level when an operator fails on fake tensors during
    export; that failure becomes a TraceError here, so the log line is only noise."""
    import logging
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------- measurement
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


def _fix_device(x: Any) -> Any:
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


class _Dispatched(TorchDispatchMode):
    """Records the counted dispatched operators (:mod:`autoplan.opstream`) of what runs
    under it, as the runtime's selective-checkpoint policy will see them."""

    def __init__(self, stream: OpStream) -> None:
        super().__init__()
        self.stream = stream
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = self.stream.kind(func, args, kwargs)
        self.stream.produced(func, kind, args, out)
        if kind == COUNTED:
            self.names.append(op_name(func))
        return out


class _Measure:
    """Run a captured graph node by node under FakeTensorMode, measuring each node.

    ``dispatched`` gets, per node, the counted operators it dispatched (in order).
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

    def run(self) -> tuple[dict[str, _Measured], dict[str, Any], dict[str, str]]:
        from torch._subclasses.fake_tensor import FakeTensorMode

        measured: dict[str, _Measured] = {}
        values: dict[str, Any] = {}
        requires: dict[str, Any] = {}
        producer: dict[StorageWeakRef, str] = {}
        saved_seen: set[StorageWeakRef] = set()
        param_storages: set[StorageWeakRef] = set()
        param_of_node: dict[str, str] = {}
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
                    if self.seq_len and sum(1 for d in t.shape if d == self.seq_len) >= 2:
                        rec.saved_quadratic += nbytes
                    return t

                with _fc.FlopCounterMode(display=False) as fwd, \
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                        torch.enable_grad(), _Dispatched(stream) as dispatched:
                    out = target(*call_args, **call_kwargs)
                rec.fwd_flops = int(fwd.get_total_flops())
                self.dispatched[node.name] = tuple(dispatched.names)
                outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
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


# --------------------------------------------------------- tensor parallelism
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


def _users_through(node: fx.Node, passthrough: set, limit: int = 8) -> list[fx.Node]:
    """Nodes reached from ``node`` through pass-through ops (breadth first, bounded)."""
    frontier, seen, out = [node], {node}, []
    for _ in range(limit):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                out.append(u)
                if u.target in passthrough:
                    nxt.append(u)
        frontier = nxt
    return out


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

    A residual add sums the (passed-through) matmul output with an activation of
    the same shape that does *not* derive from that matmul (the residual stream);
    ``x + 0.044715 * x**3`` inside a GeLU is therefore no residual add.
    """
    chain = {node}
    derived = _descendants(node, within) | {node}
    for u in _users_through(node, _PASSTHROUGH - _RESIDUAL_ADDS - {aten.mul.Tensor}):
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


def _val_bytes(node: fx.Node, values: dict[str, Any]) -> int:
    return sum(_nbytes(t) for t in _tensors(values.get(node.name)))


# ------------------------------------------------------------------- assembly
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
        rows = [u for u in mine if u.kind in ("linear", "conv1d") and _is_row(u.node, param_nodes, own)]
        routers = [u for u in mine if u.kind in ("linear", "conv1d") and u not in rows and _is_router(u.node)]
        experts = [u for u in mine if u.kind == "experts"]
        for u in mine:
            if u in rows:
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
            fin, fout = shape[2], shape[1]
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
    for u in mine:
        if roles[u.param] in (LinearRole.COLUMN, LinearRole.EXPERT_COLUMN):
            x = u.node.args[1] if u.kind == "conv1d" else u.node.args[0]
            if isinstance(x, fx.Node) and x.name not in region:
                region_inputs[x.name] = _val_bytes(x, values)
    in_bytes = sum(region_inputs.values())
    row_uses = [node_by_param[p] for p, r in roles.items() if r in (LinearRole.ROW, LinearRole.EXPERT_ROW)]
    n_regions = max(1, len(row_uses))
    for u in row_uses:
        out_b = _val_bytes(u.node, values)
        inp = in_bytes // n_regions
        where = rel(u.module)
        tp_coll += [CollectiveRecord("all_reduce", "forward", out_b, where),
                    CollectiveRecord("all_reduce", "backward", inp, where)]
        sp_coll += [CollectiveRecord("all_gather", "forward", inp, where),
                    CollectiveRecord("reduce_scatter", "forward", out_b, where),
                    CollectiveRecord("all_gather", "backward", out_b, where),
                    CollectiveRecord("reduce_scatter", "backward", inp, where)]
    exp_rows = [u for u in mine if roles[u.param] is LinearRole.EXPERT_ROW]
    for u in exp_rows:
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


def _attributes(model: nn.Module, graph_vocab: int | None) -> dict[str, int]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    keys = {
        "hidden_size": ("hidden_size", "hidden", "n_embd", "d_model"),
        "num_attention_heads": ("num_attention_heads", "heads", "n_head", "num_heads"),
        "num_key_value_heads": ("num_key_value_heads",),
        "ffn_hidden_size": ("intermediate_size", "ffn_hidden", "n_inner", "d_ff"),
        "vocab_size": ("vocab_size",),
        "num_layers": ("num_hidden_layers", "layers", "n_layer", "num_layers"),
        "num_experts": ("num_local_experts", "num_experts"),
    }
    out = {}
    for name, cands in keys.items():
        for c in cands:
            v = getattr(cfg, c, None)
            if isinstance(v, int) and not isinstance(v, bool):
                out[name] = v
                break
    return out


@contextlib.contextmanager
def _capture_mode(model: nn.Module):
    """Training mode (dropout is part of what a step saves) and, for MoE models,
    the ``batched_mm`` experts implementation, which FlopCounterMode can count."""
    was_training = model.training
    cfg = getattr(model, "config", None)
    restore = []
    for key in ("_experts_implementation", "experts_implementation"):
        if cfg is not None and getattr(cfg, key, None) not in (None, "batched_mm") and \
                _has_experts(model):
            restore.append((key, getattr(cfg, key)))
            setattr(cfg, key, "batched_mm")
    model.train()
    try:
        yield
    finally:
        model.train(was_training)
        for key, val in restore:
            setattr(cfg, key, val)


def _has_experts(model: nn.Module) -> bool:
    return any(p.dim() == 3 for p in model.parameters())


def trace(model: nn.Module, *, seq_len: int | None = None, example_inputs: Any = None,
          micro_batch: int = 1, loss_fn: Callable | None = None, method: str = "auto") -> ModelGraph:
    """Capture ``model`` as a costed layer graph.

    Parameters
    ----------
    model : nn.Module
        Any module; may live on the meta device (nothing is allocated).
    seq_len : int, optional
        Tokens per sequence, for token models (inputs are ``(micro_batch, seq_len)`` ids).
    example_inputs : tensor, tuple or dict, optional
        One micro-batch of inputs for other models.
    micro_batch : int
        Sequences per micro-batch for token models (FLOPs and activations scale linearly).
    loss_fn : callable, optional
        ``loss_fn(output, *inputs) -> scalar``; default next-token cross-entropy for
        causal token models.
    method : {"auto", "export", "symbolic_trace"}
        Capture front end; ``auto`` tries ``torch.export`` then ``symbolic_trace``.

    Returns
    -------
    ModelGraph

    Examples
    --------
    >>> from autoplan.models import GPT, GPTConfig
    >>> g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)), seq_len=16)
    >>> [l.kind.value for l in g.layers]
    ['pre', 'block', 'block', 'block', 'block', 'post']
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"trace() takes an nn.Module, got {type(model).__name__}")
    args, kwargs = _example_inputs(model, seq_len, example_inputs, micro_batch)
    if example_inputs is not None:
        _check_input_shapes(model, args, kwargs)
        micro_batch = int(args[0].shape[0]) if args and isinstance(args[0], torch.Tensor) and \
            args[0].dim() > 0 else micro_batch
        if seq_len is None and args and isinstance(args[0], torch.Tensor) and \
                not args[0].is_floating_point() and args[0].dim() == 2:
            seq_len = int(args[0].shape[1])
    wrapper = _Objective(model, loss_fn, _is_token_model(model))
    stacks = find_stacks(model)
    keep = [_representatives(st) for st in stacks]
    # A tensor is quadratic in the sequence when two of its dims equal seq_len; if seq_len
    # equals a model dimension (hidden 4096 at seq 4096), shapes cannot tell, so the
    # classification comes from a second capture at a length that collides with nothing.
    probe_len = _probe_length(model, seq_len, args, kwargs)
    quad_seq = None if probe_len else seq_len
    with _capture_mode(model), _truncated(model, stacks, keep):
        gm, path = _capture_fx(wrapper, args, kwargs, method)
        rep_layers = _assign_layers(gm, stacks, keep)
        probe = _quadratic_probe(wrapper, args, method, probe_len) if probe_len else None
        # measure once with no TP region known, derive TP regions, then attribute sharding
        first = _Measure(gm, args, kwargs, quad_seq, set())
        measured, values, param_of_node = first.run()
        dispatched = first.dispatched
        for node in gm.graph.nodes:
            if node.name in values and node.op != "output":
                v = values[node.name]
                if isinstance(v, torch.Tensor):
                    node.meta.setdefault("val", v)
        param_nodes = set(param_of_node)
        uses_placeholder = _weight_uses(gm, param_of_node, _aliases(wrapper))
        vocab = _vocab_size(model)
        if vocab is None:
            emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
            vocab = emb.num_embeddings if emb is not None else None
        tps, regions = [], set()
        for l in rep_layers:
            tp, region = _tp_structure(l, uses_placeholder, param_nodes, values, vocab,
                                       l.name if l.kind is LayerKind.BLOCK else "")
            tps.append(tp)
            regions |= region
        gathered = frozenset(first.gathered)
        if regions:
            measured, values, param_of_node = _Measure(gm, args, kwargs, quad_seq, regions).run()
        derived = _param_derived(gm, param_nodes)
        cuts = _cut_bytes(rep_layers, values, param_nodes, derived)

    shapes = _param_shapes(gm)
    param_sizes = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.name in param_of_node:
            obj = _fetch_attr(gm, node.target)
            param_sizes[node.name] = (obj.numel(), obj.numel() * obj.element_size())
    owner_of_param: dict[str, str] = {}
    rep_records: list[tuple[_RepLayer, dict]] = []
    templates: dict[str, tuple[NodeRecord, ...]] = {}
    for li, (l, tp) in enumerate(zip(rep_layers, tps)):
        prefix = l.name if l.kind is LayerKind.BLOCK else ""
        nodes, params, tied = [], 0, []
        pcount = 0
        for n in l.nodes:
            if n.op == "get_attr":
                continue
            m = measured.get(n.name, _Measured())
            if probe is not None:
                scale = (seq_len / probe_len) ** 2
                m.saved_quadratic = min(m.saved, round(probe[0].get(n.name, 0) * scale))
            pb = 0
            for a in n.all_input_nodes:
                if a.name in param_sizes:
                    pname = param_of_node[a.name]
                    if pname in owner_of_param and owner_of_param[pname] != l.name:
                        if pname not in tied:
                            tied.append(_strip(pname))
                        continue
                    if pname not in owner_of_param:
                        owner_of_param[pname] = l.name
                        pcount += param_sizes[a.name][0]
                        params += param_sizes[a.name][1]
                        pb += param_sizes[a.name][1]
            nodes.append(_node_record(n, m, values, prefix, regions, pb, gathered))
        tid = l.name if l.kind is LayerKind.BLOCK else l.name
        templates[tid] = tuple(nodes)
        core = ([n for n in nodes if n.name in probe[1]] if probe is not None
                else _attention_core(nodes, seq_len))
        sel_flops = sum(n.fwd_flops for n in core)
        core_ops = (_core_ops(l, {n.name for n in core}, dispatched)
                    if l.kind is LayerKind.BLOCK else None)
        modules = _top_modules({n.module for n in nodes}) if l.kind is not LayerKind.BLOCK else (l.name,)
        rep_records.append((l, dict(
            template=tid, modules=modules,
            fwd_flops=sum(n.fwd_flops for n in nodes), bwd_flops=sum(n.bwd_flops for n in nodes),
            param_count=pcount, param_bytes=params,
            saved_bytes=sum(n.saved_bytes for n in nodes),
            saved_tp_sharded_bytes=sum(n.saved_tp_sharded_bytes for n in nodes),
            saved_quadratic_bytes=sum(n.saved_quadratic_bytes for n in nodes),
            selective_recompute_flops=sel_flops,
            input_bytes=_input_bytes(l, values, param_nodes, derived),
            output_bytes=cuts[li], cut_bytes=cuts[li], tp=tp, tied_params=tuple(tied),
            attention_core=core_ops)))

    layers = _expand(rep_records, stacks, keep)
    all_params = {id(p): p for p in model.parameters()}
    num_params = sum(p.numel() for p in all_params.values())
    param_bytes = sum(p.numel() * p.element_size() for p in all_params.values())
    pdtype = next(iter(all_params.values())).dtype if all_params else torch.float32
    inputs = tuple((f"input{i}", tuple(int(d) for d in t.shape), str(t.dtype).replace("torch.", ""))
                   for i, t in enumerate(_tensors(list(args) + list(kwargs.values()))))
    graph = ModelGraph(
        model=type(model).__name__, capture=path, objective=wrapper.description,
        micro_batch=int(micro_batch), seq_len=seq_len, inputs=inputs,
        param_dtype=str(pdtype).replace("torch.", ""), num_params=int(num_params),
        param_bytes=int(param_bytes), attributes=_attributes(model, vocab), layers=tuple(layers),
        templates={k: templates[k] for k in sorted({l.template for l in layers})})
    graph.__dict__["fx_graph"] = gm
    return graph


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
        return sum(1 for d in shape if d == seq_len) >= 2

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
