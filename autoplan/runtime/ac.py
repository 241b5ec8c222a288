"""Activation checkpointing: full and selective, with torch's checkpoint wrapper.

``full`` keeps only a block's input and re-runs the whole block in backward.
``selective`` re-runs only the attention core, the operators whose tensors
have two sequence-length dimensions (Korthikanti et al. 2022, Sec. 4.2: the
activations that grow with s^2 but cost few FLOPs), through torch's selective
checkpoint contexts: every other operator's output is saved.  The same
criterion picks the attention core in :func:`autoplan.capture._attention_core`,
so the runtime recomputes what the cost model charges for.  Random operators
are always saved, so a recomputed region never replays a random op.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..strategy import Recompute

__all__ = ["apply_ac", "attention_core_policy"]

_MATMULS = {torch.ops.aten.bmm.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default,
            torch.ops.aten.baddbmm.default}


def _quadratic(shape, seq_len: int) -> bool:
    return sum(1 for d in shape if d == seq_len) >= 2


def attention_core_policy(seq_len: int):
    """A selective-checkpoint policy: recompute ops that read or (for matmuls) produce a
    tensor with two sequence-length dimensions; save everything else."""

    def policy(ctx, op, *args, **kwargs):
        if getattr(op, "is_view", False):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            return CheckpointPolicy.MUST_SAVE
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(_quadratic(t.shape, seq_len) for t in tensors):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in _MATMULS and len(tensors) >= 2 and tensors[0].dim() >= 2 and tensors[1].dim() >= 2:
            out_shape = tuple(tensors[0].shape[:-1]) + (tensors[1].shape[-1],)
            if _quadratic(out_shape, seq_len):
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def apply_ac(block: nn.Module, mode: Recompute, *, seq_len: int | None = None) -> nn.Module:
    """Wrap ``block`` for activation checkpointing; returns the module to put in its place."""
    mode = Recompute(mode)
    if mode is Recompute.NONE:
        return block
    if mode is Recompute.FULL:
        return checkpoint_wrapper(block, preserve_rng_state=True)
    if not seq_len:
        raise ValueError("selective recompute needs the sequence length (seq_len)")
    context_fn = functools.partial(create_selective_checkpoint_contexts,
                                   attention_core_policy(seq_len))
    return checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=True)
