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

One module per step: :mod:`.objective` (1; the loss itself is the runtime's,
:mod:`autoplan.runtime.loss`), :mod:`.stacks` (2), :mod:`.export` (3),
:mod:`.measure` (4), :mod:`.assemble` and :mod:`.roles` (5), and :mod:`.probe` for the
attention core selective recompute re-runs.  This module runs them: :func:`trace`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from ..errors import InputError
from ..graph import TP_SHARDED_ROLES, LayerKind, ModelGraph, NodeRecord
from ..runtime.loss import token_cross_entropy
from .assemble import (
    _assign_layers,
    _cut_bytes,
    _expand,
    _input_bytes,
    _node_record,
    _param_derived,
    _RepLayer,
    _top_modules,
)
from .export import _capture_fx, _strip
from .measure import _fetch_attr, _Measure, _Measured, _tensors
from .objective import _check_input_shapes, _example_inputs, _is_token_model, _Objective, _vocab_size
from .probe import _attention_core, _core_ops, _probe_length, _quadratic_probe
from .roles import _aliases, _sp_replicated, _tp_structure, _weight_uses
from .stacks import Stack, _representatives, _truncated, find_stacks

__all__ = ["trace", "find_stacks", "Stack", "token_cross_entropy"]


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
          micro_batch: int = 1, loss_fn: Callable | None = None, method: str = "auto",
          title: str | None = None) -> ModelGraph:
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
    title : str, optional
        The model's name for people (plans and reports print it); default: a Hugging
        Face model's type and size (``llama 8.03B``), else the class name.

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
        dispatched, dispatch_counts = first.dispatched, first.dispatch_counts
        autograd_counts = first.autograd_counts
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
        pcount = ptensors = tp_tensors = 0
        owned: list[tuple[str, int]] = []      # (parameter, elements) this layer owns
        sharded = {(prefix + "." + lin.name if prefix else lin.name) for lin in tp.linears
                   if lin.role in TP_SHARDED_ROLES}
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
                        owned.append((_strip(pname), param_sizes[a.name][0]))
                        ptensors += 1
                        tp_tensors += _strip(pname).rpartition(".")[0] in sharded
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
        tp = dataclasses.replace(tp, sp_replicated_params=_sp_replicated(l.kind, tp, owned,
                                                                         prefix, modules))
        rep_records.append((l, dict(
            template=tid, modules=modules,
            fwd_flops=sum(n.fwd_flops for n in nodes), bwd_flops=sum(n.bwd_flops for n in nodes),
            param_count=pcount, param_bytes=params,
            param_tensors=ptensors, tp_param_tensors=tp_tensors,
            dispatched_ops=sum(dispatch_counts.get(n.name, 0) for n in l.nodes),
            autograd_nodes=sum(autograd_counts.get(n.name, 0) for n in l.nodes),
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
        templates={k: templates[k] for k in sorted({l.template for l in layers})}, fx_graph=gm,
        title=title or _default_title(model, int(num_params)))
    return graph


def _default_title(model: nn.Module, num_params: int) -> str:
    """``llama 8.03B`` for a Hugging Face model (its config's model type and size), the
    class name for any other module."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model_type, str) or not model_type:
        return type(model).__name__
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num_params >= scale:
            return f"{model_type} {num_params / scale:.3g}{unit}"
    return f"{model_type} {num_params}"
