"""A GPT-2/GPT-3 shaped decoder: learned position embeddings, pre-LayerNorm,
GeLU MLP, optional dropout, eager or fused (SDPA) attention.

It is written so that torch's tensor parallelism applies to it without changes:
attention reshapes with ``-1`` heads, so a column-sharded ``qkv`` projection
yields the local heads.  The block matches Megatron-LM's GPT layer, which is what
Korthikanti et al. (2022) count in their activation-memory formulas.

Examples
--------
>>> import torch
>>> model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2))
>>> model(torch.zeros(2, 16, dtype=torch.long)).shape
torch.Size([2, 16, 64])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "Block"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    seq_len: int = 1024
    hidden: int = 768
    heads: int = 12
    layers: int = 12
    ffn: int | None = None          # default 4 * hidden
    dropout: float = 0.0
    attention: str = "eager"         # "eager" (explicit softmax) or "sdpa" (fused)
    bias: bool = True
    tie_embeddings: bool = False

    @property
    def ffn_hidden(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.attention not in ("eager", "sdpa"):
            raise ValueError(f"attention must be 'eager' or 'sdpa', got {self.attention!r}")


#: An attention core that replaces the causal one: ``core(attention, q, k, v) -> y`` with
#: ``q, k, v`` and ``y`` of shape ``(batch, heads, seq, head_dim)`` (context parallelism
#: installs one that attends to keys and values gathered from other ranks).
AttentionCore = Callable[["Attention", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    """Causal multi-head self-attention; ``core``, when set, replaces the causal core."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout_p = cfg.dropout
        self.fused = cfg.attention == "sdpa"
        self.core: AttentionCore | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # rows laid out per head, (heads, 3, d), as Megatron-LM does: a contiguous column
        # shard of qkv then holds the q, k and v of whole heads, and -1 gives the local heads
        qkv = self.qkv(x).view(b, s, -1, 3, self.head_dim)
        q, k, v = qkv.unbind(dim=3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))          # (b, heads, s, d)
        if self.core is not None:
            y = self.core(self, q, k, v)
        elif self.fused:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout_p if self.training else 0.0)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = self.attn_dropout(torch.softmax(scores, dim=-1))
            y = probs @ v
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids ``(batch, seq)`` in, logits ``(batch, seq, vocab)`` out.

    ``position_ids`` (``(seq,)`` or ``(batch, seq)``), when given, are the positions of
    the tokens in their sequence (default ``0 .. seq-1``): a context-parallel rank holds
    tokens from several places of the sequence.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 initialisation (Radford et al. 2019): N(0, 0.02) weights, zero biases
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        s = idx.shape[1]
        pos = torch.arange(s, device=idx.device) if position_ids is None else position_ids
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
