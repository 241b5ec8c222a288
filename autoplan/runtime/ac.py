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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
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


class _Checked:
    """``context_fn`` of one checkpointed block: a fresh :class:`CorePolicy` per call,
    the latest kept so a forward hook can check it."""

    def __init__(self, core: AttentionCore, where: str) -> None:
        self.core = core
        self.where = where
        self.policy: CorePolicy | None = None

    def __call__(self):
        self.policy = CorePolicy(self.core, self.where)
        # CPU's composite dropout allocates its noise (empty_like), draws it in place
        # (bernoulli_) and scales it in place (div_): all three are saved, so the cached
        # allocation has been mutated by the time a recompute asks for it, and its final
        # value is the one the recomputed `x * noise` needs.  Any other in-place change to
        # a saved tensor that a recomputed core op reads would also break autograd's own
        # saved-tensor version check without AC.
        return create_selective_checkpoint_contexts(self.policy, allow_cache_entry_mutation=True)

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
    return wrapped
