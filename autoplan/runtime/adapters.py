"""Per-family knowledge the generic runtime cannot read from the captured graph.

Everything here is small on purpose: where the modules of the embedding, the
block stack and the head live, how a pipeline stage runs its slice of the
model, and how a block hands its hidden state to the attention module (which
sequence parallelism must redistribute).  Tensor-parallel roles come from the
capture, not from here.

Two families are known: the package's :class:`~autoplan.models.GPT` and Hugging
Face Llama-style decoders (``LlamaForCausalLM`` and relatives: ``model.embed_tokens``,
``model.rotary_emb``, ``model.layers``, ``model.norm``, ``lm_head``).  Models of
other families run every parallelism but pipelining.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .cp import cp_context

__all__ = ["Adapter", "adapter_for", "model_output", "is_hf"]


def is_hf(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return cfg is not None and hasattr(cfg, "to_dict") and hasattr(model, "can_generate")


def model_output(out: Any) -> torch.Tensor:
    """The tensor a loss is computed from: the output itself, ``.logits`` or the first item."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        v = getattr(out, key, None)
        if isinstance(v, torch.Tensor):
            return v
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find a tensor in the model output of type {type(out).__name__}")


@dataclass(frozen=True)
class Adapter:
    """Where a family keeps its parts and how a pipeline stage runs them.

    ``pre`` / ``post``: module paths of the layers before and after the block
    stack; ``shared``: parameter-free modules every stage keeps (rotary
    tables); ``blocks``: path of the ``nn.ModuleList`` of blocks.
    ``region_kwargs`` maps a module that opens a tensor-parallel region (the
    parent of its column linears, relative to the block) to the keyword its
    hidden state arrives by, when it is not the first positional argument.
    """

    family: str
    blocks: str
    pre: tuple[str, ...]
    post: tuple[str, ...]
    embed: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    run_blocks: Callable[[nn.Module, torch.Tensor, int], torch.Tensor]
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    shared: tuple[str, ...] = ()
    region_kwargs: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------ the package GPT
def _positions(root: nn.Module, length: int, device: torch.device) -> torch.Tensor:
    """Global positions of the tokens a stage runs: ``0 .. length-1``, or under context
    parallelism those of this rank's tokens (:func:`autoplan.runtime.cp.apply_cp`)."""
    ctx = cp_context(root)
    if ctx is None:
        return torch.arange(length, device=device)
    return ctx.positions.to(device)


def _gpt_embed(root: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    pos = _positions(root, ids.shape[1], ids.device)
    return root.drop(root.tok_emb(ids) + root.pos_emb(pos))


def _gpt_blocks(root: nn.Module, x: torch.Tensor, seq_len: int) -> torch.Tensor:
    for block in root.blocks.values():
        x = block(x)
    return x


def _gpt_head(root: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return root.head(root.ln_f(x))


GPT_ADAPTER = Adapter(family="gpt", blocks="blocks", pre=("tok_emb", "pos_emb", "drop"),
                      post=("ln_f", "head"), embed=_gpt_embed, run_blocks=_gpt_blocks,
                      head=_gpt_head)


# ------------------------------------------------------------------ HF Llama-style decoders
def _llama_embed(root: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return root.model.embed_tokens(ids)


def _llama_blocks(root: nn.Module, x: torch.Tensor, seq_len: int) -> torch.Tensor:
    # The same mask and rotary tables LlamaModel.forward builds, for the full
    # sequence: under sequence parallelism ``x`` holds only this rank's slice.
    # Under context parallelism the "full sequence" is this rank's tokens, at their
    # global positions; the CP attention builds its own mask (create_causal_mask
    # returns None for an implementation without a mask function).
    from transformers.masking_utils import create_causal_mask

    inner = root.model
    b = x.shape[0]
    ctx = cp_context(root)
    length = seq_len if ctx is None else ctx.local_len
    position_ids = _positions(root, length, x.device).unsqueeze(0)
    shape_only = x.new_empty((b, length, 0))
    mask = create_causal_mask(**_mask_arguments(create_causal_mask, inner.config, shape_only,
                                                position_ids))
    rope = inner.rotary_emb(shape_only, position_ids=position_ids)
    for layer in inner.layers.values():   # no cache: every version's default
        x = layer(x, attention_mask=mask, position_embeddings=rope, position_ids=position_ids,
                  use_cache=False)
    return x


def _mask_arguments(create_causal_mask: Callable, config: Any, shape_only: torch.Tensor,
                    position_ids: torch.Tensor) -> dict[str, Any]:
    """``create_causal_mask``'s arguments for a step without a cache."""
    return {"config": config, "inputs_embeds": shape_only, "attention_mask": None,
            "position_ids": position_ids, _cache_keyword(create_causal_mask): None}


@functools.cache
def _cache_keyword(create_causal_mask: Callable) -> str:
    """The name the installed transformers gives ``create_causal_mask``'s cache:
    ``past_key_values`` until 5.23, ``cache`` from 5.24 (which warns on the old name and
    says it will drop it); read once, not on every step."""
    import inspect
    params = inspect.signature(create_causal_mask).parameters
    return "cache" if "cache" in params else "past_key_values"


def _llama_head(root: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return root.lm_head(root.model.norm(x))


LLAMA_ADAPTER = Adapter(family="llama", blocks="model.layers", pre=("model.embed_tokens",),
                        post=("model.norm", "lm_head"), shared=("model.rotary_emb",),
                        embed=_llama_embed, run_blocks=_llama_blocks, head=_llama_head,
                        region_kwargs={"self_attn": "hidden_states"})


def adapter_for(model: nn.Module) -> Adapter | None:
    """The adapter of ``model``'s family, or None when the runtime does not know it."""
    from ..models.gpt import GPT

    if isinstance(model, GPT):
        return GPT_ADAPTER
    if is_hf(model):
        inner = getattr(model, "model", None)
        if (inner is not None and hasattr(model, "lm_head") and
                all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
                and isinstance(inner.layers, nn.ModuleList)):
            return LLAMA_ADAPTER
    return None
