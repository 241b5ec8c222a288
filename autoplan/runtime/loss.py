"""The training loss: token cross-entropy, as Hugging Face computes it.

:func:`token_cross_entropy` is the loss a causal token model trains with (next-token,
``shift=True``) and a Hugging Face seq2seq or masked model with labels = input ids
(``shift=False``); :func:`_primary_output` picks the tensor of a model's output it is
computed on.  The runtime (:mod:`autoplan.runtime.parallelize`) trains with it and the
capture (:mod:`autoplan.capture.objective`) prices it, so the loss priced is the loss
run.  It imports nothing else of the runtime: ``import autoplan.capture`` loads it
without torch.distributed's tensor, FSDP and pipelining stacks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..errors import TraceError

__all__ = ["token_cross_entropy"]


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
