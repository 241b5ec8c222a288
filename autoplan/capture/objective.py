"""The capture-time objective and the example inputs.

:class:`_Objective` wraps the model with its training objective, so the captured graph
ends in the scalar loss a training step differentiates: next-token cross-entropy for
causal token models, token cross-entropy against the input ids for Hugging Face seq2seq
and masked models (both :func:`~autoplan.runtime.loss.token_cross_entropy`, the loss the
runtime trains with), the user's ``loss_fn`` otherwise.  :func:`_example_inputs` builds
one micro-batch of token ids from ``seq_len`` or takes the inputs given, which
:func:`_check_input_shapes` checks against the model's first layer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import InputError
from ..runtime.loss import _primary_output, token_cross_entropy


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
    # a model on the meta device is captured on meta copies of the inputs (only shapes count)
    def place(t: Any) -> Any:
        return t.to(device) if device.type == "meta" and isinstance(t, torch.Tensor) else t

    if isinstance(example_inputs, torch.Tensor):
        return (place(example_inputs),), {}
    if isinstance(example_inputs, dict):
        return (), {k: place(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(place(t) for t in example_inputs), {}
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
