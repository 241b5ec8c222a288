"""Context parallelism: every sequence split over ranks, attention across the split.

Context parallelism (CP) shards each sequence of a micro-batch along its length
over the ``cp`` ranks of a group.  Everything but attention works token by
token, so it runs on the local tokens unchanged (with their *global* positions
for position embeddings and rotary tables); attention needs the keys and values
of the whole sequence.

**Load balancing.**  Under a causal mask the work of a query grows with its
position, so a contiguous split would give the last rank most of it.  As in
Megatron-LM's context parallelism and torch's ``context_parallel`` ("head-tail"
load balancer), the sequence is cut into ``2 * cp`` chunks and rank ``i`` holds
chunks ``i`` and ``2*cp - 1 - i``: chunk ``j`` attends to about ``j + 1/2``
chunks, so every rank attends to ``2*cp`` chunk pairs, the same work
(Liu et al. 2023, "Ring Attention with Blockwise Transformers", and Brandon et
al. 2023, "Striped Attention", discuss the imbalance).

**Attention** (all-gather context parallelism, Dubey et al. 2024, "The Llama 3
Herd of Models", Sec. 3.3.2): each rank computes the queries, keys and values of
its local tokens, all-gathers the keys and values over the CP group (one
collective per layer, of the ``kv_heads`` heads only, which grouped-query
attention keeps small), and attends with its local queries to all keys under a
causal mask built from global positions.  The all-gather is an autograd
function whose backward reduce-scatters the key/value gradients back to the
ranks that own the tokens.  The collective is on the critical path (not
overlapped); it is what :mod:`autoplan.cost.engine` prices.

**Loss.**  Next-token targets are shifted over the *whole* sequence before it is
sharded (the token after a rank's last local token usually lives on another
rank; the last position of the sequence has none).  Each rank's loss is its
sum of token losses over the global number of predicted tokens, times ``cp``:
the mean of the ``cp`` ranks' losses is the single-process mean loss, and the
mean of their gradients, which DDP or FSDP take over a data-parallel group that
includes the CP ranks (``dp x cp``), is its gradient.

Examples
--------
>>> cp_positions(8, 2, 0).tolist()
[0, 1, 6, 7]
>>> cp_positions(8, 2, 1).tolist()
[2, 3, 4, 5]
>>> import torch
>>> b = shard_batch(torch.arange(8).unsqueeze(0), cp=2, rank=0)
>>> b.ids.tolist(), b.targets.tolist()
([[0, 1, 6, 7]], [[1, 2, 7, -100]])
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, StrategyError

__all__ = [
    "CPContext",
    "CPBatch",
    "NextTokenLoss",
    "apply_cp",
    "check_cp",
    "cp_context",
    "cp_positions",
    "shard_sequence",
    "shard_batch",
    "next_token_targets",
    "gather_sequence",
    "IGNORE_INDEX",
    "HF_ATTENTION",
]

#: Target value that the loss skips: the last position of a sequence predicts nothing
#: (``torch.nn.functional.cross_entropy``'s and Hugging Face's default ``ignore_index``).
IGNORE_INDEX = -100

#: The name under which the CP attention is registered in Hugging Face's ``AttentionInterface``.
HF_ATTENTION = "autoplan_cp"

#: Attention implementations of Hugging Face models that CP can wrap (it calls them
#: with the gathered keys/values and its own mask).
_HF_CORES = ("eager", "sdpa")


# ---------------------------------------------------------------------- load balancing
def _check(seq_len: int, cp: int, rank: int | None = None) -> None:
    if not isinstance(cp, int) or cp < 1:
        raise StrategyError(f"the context-parallel degree must be an integer >= 1, got cp={cp!r}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise StrategyError(f"seq_len must be a positive integer, got {seq_len!r}")
    if seq_len % (2 * cp):
        ok = [c for c in range(1, seq_len // 2 + 1) if seq_len % (2 * c) == 0]
        raise StrategyError(
            f"seq_len={seq_len} is not divisible by 2 * cp = {2 * cp}: context parallelism cuts "
            f"each sequence into 2 * cp equal chunks (load balancing); with seq_len={seq_len} "
            f"use cp in {ok}, or a seq_len that is a multiple of {2 * cp}")
    if rank is not None and not 0 <= rank < cp:
        raise StrategyError(f"context-parallel rank {rank} is outside 0..{cp - 1} (cp={cp})")


def cp_positions(seq_len: int, cp: int, rank: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the tokens that context-parallel ``rank`` holds, in local order.

    The sequence is cut into ``2 * cp`` chunks of ``seq_len / (2 * cp)`` tokens;
    rank ``i`` holds chunk ``i`` followed by chunk ``2*cp - 1 - i`` (Megatron-LM's
    and torch ``context_parallel``'s load balancing for causal attention).

    Parameters
    ----------
    seq_len : int
        Tokens per sequence; a multiple of ``2 * cp``.
    cp : int
        Context-parallel degree.
    rank : int
        Rank within the context-parallel group, ``0 <= rank < cp``.

    Returns
    -------
    torch.LongTensor of shape ``(seq_len // cp,)``

    Raises
    ------
    StrategyError
        When ``seq_len`` is not a multiple of ``2 * cp`` (the message lists the
        degrees that divide it) or ``rank`` is out of range.

    Examples
    --------
    >>> cp_positions(16, 4, 1).tolist()
    [2, 3, 12, 13]
    >>> cp_positions(4, 1, 0).tolist()
    [0, 1, 2, 3]
    """
    _check(seq_len, cp, rank)
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The part of ``x`` that context-parallel ``rank`` holds: the entries of dimension
    ``dim`` (the sequence) at :func:`cp_positions`.

    Examples
    --------
    >>> shard_sequence(torch.arange(8).view(1, 8), cp=2, rank=1).tolist()
    [[2, 3, 4, 5]]
    """
    return x.index_select(dim, cp_positions(x.shape[dim], cp, rank, device=x.device))


def next_token_targets(ids: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets of next-token prediction over whole sequences ``(batch, seq)``: position
    ``t`` predicts ``ids[:, t + 1]``; the last position predicts nothing (``ignore_index``).

    Shift *before* sharding: the next token of a rank's last local token lives on
    another rank.

    Examples
    --------
    >>> next_token_targets(torch.tensor([[5, 6, 7]])).tolist()
    [[6, 7, -100]]
    """
    return torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), ignore_index)], dim=1)


class CPBatch(NamedTuple):
    """One rank's share of a batch of token sequences."""

    ids: torch.Tensor          #: ``(batch, seq/cp)`` local token ids
    targets: torch.Tensor      #: ``(batch, seq/cp)`` their next tokens (``IGNORE_INDEX``: none)
    positions: torch.Tensor    #: ``(seq/cp,)`` their global positions


def shard_batch(ids: torch.Tensor, cp: int, rank: int) -> CPBatch:
    """Local ids, globally shifted targets and global positions of context-parallel ``rank``
    for a batch of whole sequences ``ids`` ``(batch, seq)``.

    Examples
    --------
    >>> b = shard_batch(torch.arange(8).view(1, 8), cp=2, rank=1)
    >>> b.ids.tolist(), b.targets.tolist(), b.positions.tolist()
    ([[2, 3, 4, 5]], [[3, 4, 5, 6]], [2, 3, 4, 5])
    """
    if ids.dim() != 2:
        raise ConfigError(f"shard_batch takes token ids of shape (batch, seq), got {tuple(ids.shape)}")
    pos = cp_positions(ids.shape[1], cp, rank, device=ids.device)
    return CPBatch(ids.index_select(1, pos), next_token_targets(ids).index_select(1, pos), pos)


@dataclass(frozen=True)
class NextTokenLoss:
    """Next-token cross-entropy of one context-parallel rank.

    ``loss(logits, targets)`` with this rank's logits ``(batch, seq/cp, vocab)`` and
    targets from :func:`shard_batch` is ``cp * sum(token losses) / (batch * (seq_len - 1))``:
    the mean over the ``cp`` ranks is the mean loss over every predicted token of the
    whole sequences, as :func:`autoplan.runtime.loss.token_cross_entropy` computes it in one
    process (fp32 upcast), and the mean of the ranks' gradients is its gradient.
    Sequences are whole (no padding): each predicts ``seq_len - 1`` tokens.

    Examples
    --------
    >>> loss = NextTokenLoss(seq_len=8, cp=1)
    >>> ids = torch.tensor([[1, 2, 3, 0, 1, 2, 3, 0]])
    >>> logits = torch.zeros(1, 8, 4)
    >>> round(float(loss(logits, next_token_targets(ids))), 4)   # log(4)
    1.3863
    """

    seq_len: int
    cp: int
    ignore_index: int = IGNORE_INDEX

    def __post_init__(self) -> None:
        _check(self.seq_len, self.cp)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.shape[:2] != targets.shape or targets.shape[1] * self.cp != self.seq_len:
            raise ConfigError(
                f"NextTokenLoss(seq_len={self.seq_len}, cp={self.cp}) takes one rank's logits "
                f"(batch, {self.seq_len // self.cp}, vocab) and targets (batch, "
                f"{self.seq_len // self.cp}); got {tuple(logits.shape)} and {tuple(targets.shape)}")
        total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                ignore_index=self.ignore_index, reduction="sum")
        return total * (self.cp / (targets.shape[0] * (self.seq_len - 1)))


# ---------------------------------------------------------------------- the group
@dataclass(frozen=True, eq=False)
class CPContext:
    """What a context-parallel rank needs to know, fixed for a run.

    Attributes
    ----------
    group : ProcessGroup
        The context-parallel group (ranks holding parts of the same sequences,
        ordered by context-parallel rank).
    cp, rank : int
        Its size and this process's rank in it.
    seq_len : int
        Tokens per whole sequence.
    positions : LongTensor ``(seq_len/cp,)``
        Global positions of the local tokens (:func:`cp_positions`).
    runs : tuple of (position, rank, slot, length)
        Runs of consecutive positions that one rank holds in consecutive slots, in
        position order (two a rank under :func:`cp_positions`' balanced split).
    allowed : BoolTensor ``(seq_len/cp, seq_len)``
        Causal mask of the local queries over all keys in position order (True: attend).
    """

    group: Any
    cp: int
    rank: int
    seq_len: int
    device: torch.device = torch.device("cpu")
    positions: torch.Tensor = field(init=False, repr=False)
    runs: tuple = field(init=False, repr=False)
    allowed: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(self.seq_len, self.cp, self.rank)
        held = torch.cat([cp_positions(self.seq_len, self.cp, r) for r in range(self.cp)])
        pos = cp_positions(self.seq_len, self.cp, self.rank)
        allowed = torch.arange(self.seq_len).unsqueeze(0) <= pos.unsqueeze(1)
        object.__setattr__(self, "positions", pos.to(self.device))
        order = torch.argsort(held)   # where each position sits in the rank-major tokens
        object.__setattr__(self, "runs", _runs((order // self.local_len).tolist(),
                                               (order % self.local_len).tolist()))
        object.__setattr__(self, "allowed", allowed.to(self.device))

    @property
    def local_len(self) -> int:
        """Tokens of each sequence on this rank."""
        return self.seq_len // self.cp

    def shard(self, ids: torch.Tensor) -> CPBatch:
        """This rank's :func:`shard_batch` of whole sequences ``ids``."""
        if ids.shape[-1] != self.seq_len:
            raise ConfigError(f"the batch has sequences of {ids.shape[-1]} tokens; context "
                              f"parallelism was set up for seq_len={self.seq_len}")
        return shard_batch(ids, self.cp, self.rank)

    def loss(self) -> NextTokenLoss:
        """The :class:`NextTokenLoss` of this group."""
        return NextTokenLoss(self.seq_len, self.cp)


def _runs(ranks: list[int], slots: list[int]) -> tuple[tuple[int, int, int, int], ...]:
    """``(position, rank, slot, length)`` of each run of consecutive positions that one
    rank holds in consecutive slots.

    >>> _runs([0, 0, 1, 1, 1, 0], [0, 1, 0, 1, 2, 2])
    ((0, 0, 0, 2), (2, 1, 0, 3), (5, 0, 2, 1))
    """
    runs: list[list[int]] = []
    for p, (r, j) in enumerate(zip(ranks, slots)):
        if runs and runs[-1][1] == r and runs[-1][2] + runs[-1][3] == j:
            runs[-1][3] += 1
        else:
            runs.append([p, r, j, 1])
    return tuple(tuple(run) for run in runs)  # type: ignore[misc]


def _group_of(group_or_mesh: Any):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group_or_mesh, DeviceMesh):
        if group_or_mesh.ndim != 1:
            raise ConfigError(f"apply_cp takes a 1-D context-parallel mesh, got one of "
                              f"{group_or_mesh.ndim} dimensions {group_or_mesh.mesh_dim_names}")
        return group_or_mesh.get_group()
    return group_or_mesh


# ---------------------------------------------------------------------- the all-gather
class _GatherSequence(torch.autograd.Function):
    """All-gather over ``group``, every rank's ``x`` stacked along a new leading dimension
    (``(world, *x.shape)``); backward: reduce-scatter of the gradient (sum over the ranks
    that used the gathered tensor)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, world: int) -> torch.Tensor:
        ctx.group = group
        # the concatenation along dimension 0 (what gloo takes) is the stack's memory
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(out, grad.contiguous().flatten(0, 1), group=ctx.group)
        return out, None, None


class _PositionOrder(torch.autograd.Function):
    """The ranks' tokens, stacked by rank (``(cp, ...)``, local tokens at ``dim + 1``), in
    position order at ``dim``: the runs of consecutive positions that one rank holds in
    consecutive slots (:attr:`CPContext.runs`, two a rank) concatenated, one copy of
    contiguous blocks; the backward copies the gradient's runs back into a buffer laid
    out as the stack (a bijection: no accumulation, no zero fill), which the
    reduce-scatter then takes as it is.  (An indexed copy of every token each way
    measured 3-4x a plain copy's time on a CPU.)"""

    @staticmethod
    def forward(ctx, whole: torch.Tensor, dim: int, runs: tuple) -> torch.Tensor:
        ctx.dim, ctx.shape, ctx.runs = dim, whole.shape, runs
        return torch.cat([whole[rank].narrow(dim, slot, n) for _, rank, slot, n in runs], dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(ctx.shape)
        for pos, rank, slot, n in ctx.runs:
            out[rank].narrow(ctx.dim, slot, n).copy_(grad.narrow(ctx.dim, pos, n))
        return out, None, None


def gather_sequence(x: torch.Tensor, ctx: CPContext, dim: int) -> torch.Tensor:
    """The whole sequence of ``x`` (this rank's tokens along ``dim``), in position order,
    gathered from every rank of the group; differentiable (the gradient goes back to the
    owners by a reduce-scatter).

    The ranks' tensors arrive stacked, each whole; one copy concatenates the runs of
    consecutive positions from their ranks into a new tensor laid out as ``x`` (the
    attention's matmuls then take its keys and values without copying them again), and
    one copies the gradient back into the stack's layout (:class:`_PositionOrder`)."""
    if x.shape[dim] != ctx.local_len:
        raise ConfigError(f"gather_sequence: dimension {dim} of a {tuple(x.shape)} tensor is not "
                          f"this rank's {ctx.local_len} tokens (seq_len={ctx.seq_len}, cp={ctx.cp})")
    dim = dim % x.dim()
    whole = _GatherSequence.apply(x, ctx.group, ctx.cp)            # (cp, .., local, ..)
    return _PositionOrder.apply(whole, dim, ctx.runs)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, ctx: CPContext,
               dim: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the whole sequence, in one all-gather (their gradients, by
    ``unbind``'s backward, in one stacked tensor)."""
    k, v = gather_sequence(torch.stack([k, v]), ctx, dim + 1).unbind(0)
    return k, v


# ---------------------------------------------------------------------- the package GPT
def _gpt_core(ctx: CPContext):
    """An attention core for :class:`autoplan.models.gpt.Attention`: local queries over
    the gathered keys/values, causal by global position (eager or SDPA math as the model
    is configured)."""
    import math

    def core(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = _gather_kv(k, v, ctx)
        allowed = ctx.allowed.to(q.device)
        if attn.fused:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=attn.dropout_p if attn.training else 0.0)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(attn.head_dim))
        scores = scores.masked_fill(~allowed, float("-inf"))
        return attn.attn_dropout(torch.softmax(scores, dim=-1)) @ v

    return core


# ---------------------------------------------------------------------- Hugging Face
def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None,
                  dropout: float = 0.0, **kwargs: Any):
    """The function registered as :data:`HF_ATTENTION` in Hugging Face's
    ``AttentionInterface``: gathers keys/values (``(batch, kv_heads, seq/cp, d)``, before
    grouped-query repetition) and calls the model's own eager or SDPA core with the
    causal mask of the global positions.  The mask the model built (none: a custom
    implementation gets none) is ignored."""
    state = getattr(module, "_autoplan_cp", None)
    if state is None:
        raise ConfigError(f"{type(module).__name__} runs the {HF_ATTENTION!r} attention but was "
                          "not prepared by autoplan.runtime.cp.apply_cp")
    ctx, inner = state
    key, value = _gather_kv(key, value, ctx)
    allowed = ctx.allowed.to(query.device)[None, None]
    if inner == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, allowed, scaling=scaling,
                                      dropout=dropout, **kwargs)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    additive = additive.masked_fill(~allowed, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, additive, scaling=scaling, dropout=dropout, **kwargs)


def _register_hf() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, _hf_attention)


def _hf_attention_modules(module: nn.Module) -> list[nn.Module]:
    """The attention modules of a Hugging Face decoder: they read the implementation name
    from their config and are causal."""
    return [m for m in module.modules()
            if getattr(m, "is_causal", False) is True and hasattr(m, "config")
            and hasattr(m.config, "_attn_implementation")]


# ---------------------------------------------------------------------- entry point
def cp_context(module: nn.Module) -> CPContext | None:
    """The :class:`CPContext` :func:`apply_cp` attached to ``module`` (a model or a
    pipeline stage), or None when it runs without context parallelism."""
    return getattr(module, "_autoplan_cp_context", None)


def _family(module: nn.Module, family: str | None) -> str:
    from ..models.gpt import Attention
    from .adapters import adapter_for

    if family is None:
        adapter = getattr(module, "_adapter", None) or adapter_for(module)
        if adapter is not None:
            family = adapter.family
        elif any(isinstance(m, Attention) for m in module.modules()):
            family = "gpt"
        elif _hf_attention_modules(module):
            family = "llama"
    if family not in ("gpt", "llama"):
        raise ConfigError(f"context parallelism knows the package GPT ('gpt') and Hugging Face "
                          f"Llama-style decoders ('llama'); cannot apply it to "
                          f"{type(module).__name__} (family={family!r})")
    return family


def _is_stage(module: nn.Module) -> bool:
    from .pipeline import StageModule

    return isinstance(module, StageModule)


def _positions_hook(ctx: CPContext, id_arg: str):
    """A forward pre-hook that checks the input holds this rank's tokens and passes their
    global positions as ``position_ids`` (unless the caller gave some)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0] if args else kwargs.get(id_arg, kwargs.get("inputs_embeds"))
        if x is not None and x.shape[1] != ctx.local_len:
            raise ConfigError(
                f"under context parallelism (cp={ctx.cp}, seq_len={ctx.seq_len}) the model takes "
                f"this rank's {ctx.local_len} tokens per sequence (CPContext.shard / shard_batch), "
                f"got {x.shape[1]}")
        if kwargs.get("position_ids") is None:
            pos = ctx.positions.to(x.device) if x is not None else ctx.positions
            kwargs = {**kwargs, "position_ids": pos.unsqueeze(0) if id_arg == "input_ids" else pos}
        return args, kwargs

    return hook


def check_cp(module: nn.Module, *, seq_len: int, cp: int, family: str | None = None) -> str:
    """Everything :func:`apply_cp` needs from ``module`` for degree ``cp``, checked without
    a process group (so every rank raises the same error before any collective).

    Returns the family (``"gpt"`` or ``"llama"``).

    Raises
    ------
    StrategyError
        ``seq_len`` is not a multiple of ``2 * cp`` (names the degrees that divide it).
    ConfigError
        An unknown family, an attention implementation CP cannot wrap, or a module
        that already runs context parallelism.

    Examples
    --------
    >>> from autoplan.models import GPT, GPTConfig
    >>> check_cp(GPT(GPTConfig(vocab_size=8, seq_len=16, hidden=8, heads=2, layers=1)),
    ...          seq_len=16, cp=4)
    'gpt'
    """
    _check(seq_len, cp)
    if cp_context(module) is not None:
        raise ConfigError(f"{type(module).__name__} already runs context parallelism")
    kind = _family(module, family)
    if kind == "gpt":
        from ..models.gpt import GPT, Attention

        if not _is_stage(module) and not isinstance(module, GPT):
            raise ConfigError(f"apply_cp(family='gpt') takes a GPT or a pipeline stage of "
                              f"one, got {type(module).__name__}")
        found = any(isinstance(m, Attention) for m in module.modules())
    else:
        attns = _hf_attention_modules(module)
        impls = {m.config._attn_implementation for m in attns}
        if not impls <= set(_HF_CORES):
            raise ConfigError(f"context parallelism wraps the {list(_HF_CORES)} attention of "
                              f"Hugging Face models; this one uses {sorted(map(str, impls))}: "
                              "load it with attn_implementation='sdpa' or 'eager'")
        found = bool(attns)
    if not found:
        raise ConfigError(f"apply_cp found no attention layer in {type(module).__name__}")
    return kind


def apply_cp(module: nn.Module, group: Any, *, seq_len: int, family: str | None = None) -> CPContext:
    """Switch ``module`` (a whole model or a pipeline stage) to context-parallel attention.

    After this, ``module`` takes this rank's tokens (:meth:`CPContext.shard`) instead of
    whole sequences, gives them their global positions, and its attention layers
    all-gather keys/values over ``group``.  Train it with :class:`NextTokenLoss` on the
    shard's targets and average gradients over a data-parallel group that includes
    ``group`` (``dp x cp`` ranks, also when ``dp == 1``).  Call it before data
    parallelism and activation checkpointing wrap the blocks (after tensor parallelism
    is fine: keys and values are gathered per local head); parameters are untouched.

    Parameters
    ----------
    module : nn.Module
        The package :class:`~autoplan.models.GPT`, a Hugging Face Llama-style decoder
        (``eager`` or ``sdpa`` attention; GQA supported), or a
        :class:`~autoplan.runtime.pipeline.StageModule` of either.
    group : ProcessGroup or 1-D DeviceMesh
        The context-parallel group: the ranks holding parts of the same sequences,
        in context-parallel rank order (rank ``i`` holds chunks ``i`` and ``2cp-1-i``).
    seq_len : int
        Tokens per whole sequence, a multiple of ``2 * cp``.
    family : {"gpt", "llama"}, optional
        Inferred from the module when not given.

    Returns
    -------
    CPContext
        Also attached to ``module`` (:func:`cp_context`); the pipeline adapters read it.

    Raises
    ------
    StrategyError
        ``seq_len`` is not a multiple of ``2 * cp`` (names the degrees that divide it).
    ConfigError
        An unknown family, an attention implementation CP cannot wrap, or a module
        that already runs context parallelism.

    Examples
    --------
    >>> # in every rank, with cp_mesh = mesh["cp"] of a ("dp", "cp") mesh:
    >>> # ctx = apply_cp(model, cp_mesh, seq_len=4096)
    >>> # model = DDP(model, process_group=mesh["dp", "cp"]._flatten().get_group())
    >>> # b = ctx.shard(ids); loss = ctx.loss()(model(b.ids), b.targets)
    """
    pg = _group_of(group)
    kind = check_cp(module, seq_len=seq_len, cp=dist.get_world_size(pg), family=family)
    cp, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if rank < 0:
        raise ConfigError("apply_cp: this process is not a member of the context-parallel group")
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    ctx = CPContext(pg, cp, rank, seq_len, device)
    stage = _is_stage(module)
    if kind == "gpt":
        from ..models.gpt import Attention

        for m in module.modules():
            if isinstance(m, Attention):
                m.core = _gpt_core(ctx)
        if not stage:
            module.register_forward_pre_hook(_positions_hook(ctx, "idx"), with_kwargs=True)
    else:
        _register_hf()
        attns = _hf_attention_modules(module)
        for m in attns:
            m._autoplan_cp = (ctx, m.config._attn_implementation)
        for m in attns:
            m.config._attn_implementation = HF_ATTENTION
        if not stage:
            module.register_forward_pre_hook(_positions_hook(ctx, "input_ids"), with_kwargs=True)
    module._autoplan_cp_context = ctx
    return ctx
