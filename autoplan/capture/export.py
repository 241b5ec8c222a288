"""Front ends: the objective as a ``torch.fx`` graph, with each node's module path.

:func:`_capture_fx` tries ``torch.export`` (non-strict) and, where that fails on a plain
module, ``torch.fx.symbolic_trace`` (:class:`_PathTracer`, through
:class:`_FixedArity`).  Every node gets the path of the module that ran it
(``node.meta["autoplan_module"]``, relative to the user's model: :func:`_strip`); an
exported graph is made runnable on CPU FakeTensors (:func:`_to_cpu_graph`).  When both
fail, the :class:`~autoplan.errors.TraceError` names the module being run
(:func:`_module_tracker`) and the user's source line (:func:`_user_frame`).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import InputError, TraceError
from .objective import _Objective


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
    own_dir = os.path.dirname(os.path.dirname(__file__))  # the autoplan package
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


def _fix_device(x: Any) -> Any:
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x
