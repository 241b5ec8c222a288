"""Activation checkpointing: full and selective, with torch's checkpoint wrapper.

``full`` keeps only a block's input and re-runs the whole block in backward.
``selective`` re-runs only the block's attention core (Korthikanti et al. 2022,
Sec. 4.2: the activations that grow with s^2 but cost few FLOPs), through
torch's selective checkpoint contexts: every other operator's output is saved.

The core is not guessed from shapes at run time (a tensor of shape
``(b, s, h)`` looks quadratic when ``s == h``: Llama-3-8B at 4096 tokens).  It
is the set of operators the capture identified
(:class:`~autoplan.graph.AttentionCore`, recorded per block by
:func:`autoplan.trace`), whose FLOPs the cost model charges as
``selective_recompute_flops``.  Each is named by its dispatched operator and its
occurrence among that operator's counted calls in the block's forward
(:mod:`autoplan.opstream`); a fresh policy per checkpointed call counts the
calls as they come and checks, after the forward, that the block made exactly
the calls the capture recorded, so a block that does not match its capture
raises :class:`~autoplan.errors.PlanMismatchError` instead of recomputing
something else.  Random operators are always saved, so a recompute never
replays one.

torch's selective checkpointing caches the output of every saved operator for
the recompute, which re-runs the block's whole forward and takes each saved
operator's result from the cache.  Most of those outputs are read by nobody in
the backward: a linear's output that only feeds an addition, a row-parallel
projection's partial sum and its all-reduce (autograd saves the *inputs* of a
matmul, an addition saves nothing).  Kept, they made selective recompute hold
more than no recompute at all (measured on the small GPT at tp=2: +6 MB, 2.9 vs
4.5 MB a block).  So at the end of each checkpointed forward the cache keeps
only the outputs the backward needs, those autograd saved (seen through the
checkpoint's own saved-tensor hooks) and those a recomputed operator reads; the
others are replaced by :class:`_Unread`, which gives the recompute an
uninitialised tensor of the same shape, strides and dtype that it only passes
to saved operators (whose cached results ignore their inputs) and to views.
The activations held are then those of no recompute less the core's, as
:func:`autoplan.cost.memory.activation_bytes` counts them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..errors import ConfigError, PlanMismatchError
from ..graph import AttentionCore, LayerRecord
from ..opstream import ALLOC, FOLLOW, FREE, RANDOM, OpStream, StorageSet, op_name, plain_tensors
from ..strategy import Recompute

__all__ = ["apply_ac", "CorePolicy"]


class CorePolicy:
    """The selective-checkpoint policy of one checkpointed call of a block.

    Recomputes the captured attention core's operators and what follows from
    them (casts, layout copies, dropout applied to them), saves every other
    operator, and lets views be redone.  ``context_fn`` runs once per forward, so each call
    gets a fresh policy; operators are counted apart for the forward and for a
    recompute (``ctx.is_recompute``), both of which run the same sequence.

    Parameters
    ----------
    core : AttentionCore
        The block's core as the capture recorded it.
    where : str
        The block's name, for error messages.

    Examples
    --------
    >>> from autoplan.graph import AttentionCore, CoreOp
    >>> core = AttentionCore(nodes=("matmul",), ops=(CoreOp("bmm", 1),), calls={"bmm": 2})
    >>> policy = CorePolicy(core, "layers.0")
    >>> x = torch.ones(1, 2, 2, requires_grad=True)
    >>> [policy(None, torch.ops.aten.bmm.default, x, x).name for _ in range(2)]
    ['MUST_SAVE', 'PREFER_RECOMPUTE']
    >>> policy.check()
    """

    def __init__(self, core: AttentionCore, where: str) -> None:
        self.core = core
        self.where = where
        self._targets = {(o.op, o.index) for o in core.ops}
        self._streams = {False: OpStream(), True: OpStream()}
        self._made = {False: StorageSet(), True: StorageSet()}
        #: storages the forward's recomputed (not merely viewed) operators read: their
        #: cached producers must stay real for the recompute
        self.read = StorageSet()

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        recompute = bool(getattr(ctx, "is_recompute", False))
        stream, made = self._streams[recompute], self._made[recompute]
        kind = stream.kind(func, args, kwargs)
        out = getattr(ctx, "op_output", None)
        stream.produced(func, kind, args, out)
        if kind == FREE:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if kind in (RANDOM, ALLOC):
            return CheckpointPolicy.MUST_SAVE
        if kind == FOLLOW:
            redo = made.any_of(plain_tensors((args, kwargs)))
        else:
            name = op_name(func)
            redo = (name, stream.number(name)) in self._targets
        if redo:
            made.add(plain_tensors(out))
            if not recompute:
                self.read.add(storage_tensors((args, kwargs)))
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    def check(self) -> None:
        """Raise :class:`PlanMismatchError` unless the forward made the captured counts
        of the core's operators."""
        calls = self._streams[False].calls
        seen = {op: calls.get(op, 0) for op in self.core.calls}
        if seen != dict(self.core.calls):
            diff = ", ".join(f"{op}: captured {n}, ran {seen[op]}"
                             for op, n in sorted(self.core.calls.items()) if seen[op] != n)
            raise PlanMismatchError(
                f"selective recompute of {self.where}: the block's forward did not run the "
                f"operators its capture recorded ({diff}), so the captured attention core "
                f"({', '.join(self.core.nodes)}) cannot be found in it. The model (or its "
                "attention implementation, or the device's kernel choice) differs from the "
                "one captured: re-capture with autoplan.trace on this model and setup, or use "
                "recompute='full'")


def storage_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in a nested structure that own storage: a wrapper subclass (DTensor)
    by its inner tensors."""
    out = []
    for t in tree_flatten(x)[0]:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            out.extend(storage_tensors([getattr(t, n) for n in names]))
        else:
            out.append(t)
    return out


class _Unread:
    """A cache entry of selective checkpointing whose value the backward never reads: at
    the recompute, a fresh uninitialised tensor of the same metadata (a wrapper subclass
    rebuilt around fresh inner tensors), so nothing is held from forward to backward."""

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride = tuple(t.shape), tuple(t.stride())
        self.dtype, self.device = t.dtype, t.device
        self.inner = None
        if is_traceable_wrapper_subclass(t):
            names, ctx = t.__tensor_flatten__()
            # inner "tensors" may be other objects (a DTensor's device mesh): kept as they are
            self.inner = (type(t), ctx, {n: _Unread(v) if isinstance(v, torch.Tensor) else v
                                         for n in names for v in (getattr(t, n),)})

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        if self.inner is None:
            return torch.empty_strided(self.size, self.stride, dtype=self.dtype,
                                       device=self.device)
        cls, ctx, inner = self.inner
        return cls.__tensor_unflatten__(
            {n: u.get_val(allow_cache_entry_mutation) if isinstance(u, _Unread) else u
             for n, u in inner.items()}, ctx, self.size, self.stride)


class _Checked:
    """``context_fn`` of one checkpointed block: a fresh :class:`CorePolicy` per call,
    the latest kept so a forward hook can check it; and, around the wrapped block's
    forward (:meth:`track`, :meth:`prune`), what autograd saves, so that the cache keeps
    only what the backward reads."""

    def __init__(self, core: AttentionCore, where: str) -> None:
        self.core = core
        self.where = where
        self.policy: CorePolicy | None = None
        self._cache: dict | None = None       # this forward's selective-checkpoint cache
        self._saved: StorageSet | None = None
        self._hooks: Any = None

    def __call__(self):
        self.policy = CorePolicy(self.core, self.where)
        # CPU's composite dropout allocates its noise (empty_like), draws it in place
        # (bernoulli_) and scales it in place (div_): all three are saved, so the cached
        # allocation has been mutated by the time a recompute asks for it, and its final
        # value is the one the recomputed `x * noise` needs.  Any other in-place change to
        # a saved tensor that a recomputed core op reads would also break autograd's own
        # saved-tensor version check without AC.
        contexts = create_selective_checkpoint_contexts(self.policy,
                                                        allow_cache_entry_mutation=True)
        self._cache, self._saved = contexts[0].storage, StorageSet()
        return contexts

    def track(self, module, args) -> None:
        """Before the checkpointed forward of the block (not its recompute): wrap the
        checkpoint's saved-tensor hooks to see what autograd saves."""
        if self._cache is None or self._hooks is not None:
            return
        # the innermost saved-tensor hooks: those of the checkpoint that runs this block
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is None:
            return
        pack_outer, unpack_outer = hooks
        saved = self._saved

        def pack(t: torch.Tensor) -> Any:
            saved.add(storage_tensors(t))
            return pack_outer(t)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack_outer)
        self._hooks.__enter__()

    def prune(self, module, args, output) -> None:
        """After the checkpointed forward: replace the cached outputs that neither autograd
        saved nor a recomputed operator reads by :class:`_Unread`."""
        if self._hooks is None:
            return
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        keep, read = self._saved, self.policy.read if self.policy is not None else StorageSet()

        def unread(w: Any) -> Any:
            val = getattr(w, "val", None)
            if not isinstance(val, torch.Tensor):
                return w
            tensors = storage_tensors(val)
            if not tensors or keep.any_of(tensors) or read.any_of(tensors):
                return w
            return _Unread(val)

        for entries in self._cache.values():
            # torch 2.13 keys an operator's cached outputs by call index; torch 2.11 lists them
            items = entries.items() if isinstance(entries, dict) else enumerate(entries)
            for idx, entry in list(items):
                leaves, spec = tree_flatten(entry)
                entries[idx] = spec.unflatten([unread(w) for w in leaves]) if leaves else entry
        self._cache = self._saved = None

    def reset(self, module, args) -> None:
        self.policy = None

    def check(self, module, args, output) -> None:
        if self.policy is not None and torch.is_grad_enabled():
            self.policy.check()
        self.policy = None


def apply_ac(block: nn.Module, mode: Recompute, *, layer: LayerRecord | None = None,
             core: AttentionCore | None = None) -> nn.Module:
    """Wrap ``block`` for activation checkpointing.

    Parameters
    ----------
    block : nn.Module
        One block of the model (after tensor parallelism, before FSDP).
    mode : Recompute
        ``none`` returns ``block``; ``full`` re-runs the whole block in backward;
        ``selective`` re-runs only its captured attention core.
    layer : LayerRecord, optional
        The block's captured record; selective recompute uses its ``attention_core``.
    core : AttentionCore, optional
        The core itself, instead of ``layer``.

    Returns
    -------
    nn.Module
        The module to put in the block's place.

    Raises
    ------
    ConfigError
        Selective recompute without a recorded attention core.
    """
    mode = Recompute(mode)
    if mode is Recompute.NONE:
        return block
    if mode is Recompute.FULL:
        return checkpoint_wrapper(block, preserve_rng_state=True)
    where = layer.name if layer is not None else type(block).__name__
    if core is None and layer is not None:
        core = layer.attention_core
    if core is None:
        raise ConfigError(f"selective recompute of {where} needs the attention core the capture "
                          "records for each block; this graph has none (captured by an older "
                          "autoplan?): re-capture it with autoplan.trace, or use recompute='full'")
    checked = _Checked(core, where)
    wrapped = checkpoint_wrapper(block, context_fn=checked, preserve_rng_state=True)
    wrapped.register_forward_pre_hook(checked.reset)
    wrapped.register_forward_hook(checked.check)
    block.register_forward_pre_hook(checked.track)     # inside the checkpoint
    block.register_forward_hook(checked.prune, always_call=True)   # pops the hooks on error too
    return wrapped
