"""The host's time per operator (``OpOverhead``): tiny transformer blocks, the forward per
dispatched operator and the backward per autograd node, selective recompute's extra,
the zero-bubble split backward, and the optimizer step per parameter tensor."""

from __future__ import annotations

import math
from typing import Any, Callable

from ..graph import AttentionCore, CoreOp
from ..opstream import DispatchCount, autograd_nodes
from ..runtime.ac import apply_ac
from ..runtime.optim import default_optimizer
from ..strategy import Recompute


#: Width of the tensors the overhead is measured on: small enough that the arithmetic is
#: negligible next to the dispatch, so the time is the per-operator overhead.
OVERHEAD_WIDTH = 8


def overhead_model(torch, h: int, blocks: int):
    """``blocks`` tiny pre-norm transformer blocks of width ``h`` in an ``nn.Sequential``,
    written with modules as models are (a block's host time includes its module calls):
    two layer norms, four linears, a causal softmax attention with dropout, a GELU MLP and
    two residual adds, :data:`OVERHEAD_BLOCK_OPS` captured operators each (not counting
    ``getitem``).  Seeded, without touching the caller's random state."""
    nn = torch.nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 2, h // 2).unbind(2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(h // 2))
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril().bitwise_not()
            att = self.attn_dropout(att.masked_fill(mask, float("-inf")).softmax(-1))
            out = torch.matmul(att, v).transpose(1, 2).reshape(b, s, h)
            return self.resid_dropout(self.proj(out))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act, self.proj = nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)
            self.dropout = nn.Dropout(0.0)

        def forward(self, x):
            return self.dropout(self.proj(self.act(self.fc(x))))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(h), Attention()
            self.ln_2, self.mlp = nn.LayerNorm(h), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(*(Block() for _ in range(blocks)))


#: Captured operators in one block of :func:`overhead_model` (what the capture records
#: for it, less ``getitem``): layer_norm, linear, view, unbind, 3 transpose, transpose,
#: matmul, mul, ones, tril, bitwise_not, masked_fill, softmax, dropout, matmul, transpose,
#: reshape, linear, dropout, add, layer_norm, linear, gelu, linear, dropout, add.
OVERHEAD_BLOCK_OPS = 28
#: Blocks the forward and backward host time is measured over: the autograd engine's
#: start and the loss spread over several layers, as in a model.
OVERHEAD_BLOCKS = 4


def measure_op_overhead(torch, timed: Callable[[Callable[[], Any]], float],
                        device: Any = None) -> dict[str, float]:
    """Host time of tiny transformer blocks (:func:`overhead_model`, arithmetic
    negligible), as :class:`~autoplan.hardware.OpOverhead` fields (``timed(fn)`` is
    seconds per call):

    * over :data:`OVERHEAD_BLOCKS` blocks, the forward (with autograd recording) per
      operator it dispatches (``forward_dispatch_s``) and the backward (forward + backward
      less the forward) per autograd node it runs (``backward_node_s``), counted as the
      capture counts a layer's (:func:`~autoplan.opstream.autograd_nodes`); the same per
      captured operator (``forward_s``, ``backward_s``) for graphs without the counts;
    * over one block, the extra of forward + backward with the block wrapped as
      :func:`autoplan.parallelize` wraps a block under selective recompute (its softmax as
      the attention core), per operator its forward dispatches (``selective_dispatch_s``):
      torch's selective checkpoint pays its Python mode per operator that reaches it;
    * over the blocks, the extra of forward + backward with the backward split as torch's
      zero-bubble schedules split it (``stage_backward_input``, then
      ``stage_backward_weight``: the input gradients first, the weight gradients in a
      pass of their own, after a Python walk of the autograd graph that groups the
      weights), per autograd node (``zero_bubble_node_s``; 0 on CUDA and where torch has
      no such functions).  On one process here it read 10-11 us per node, about a
      backward node's own host time again.

    On a CUDA ``device`` the tiny blocks' kernels take less than their launch, so the
    time is the host's: what it takes to dispatch and launch each operator."""
    h = OVERHEAD_WIDTH
    stack = overhead_model(torch, h, OVERHEAD_BLOCKS).to(device)
    x = torch.randn(1, 4, h, device=device).requires_grad_(True)
    with DispatchCount() as dispatched:
        loss = stack(x).sum()
    nodes = autograd_nodes([loss], lambda t: isinstance(t, torch.nn.Parameter))
    fwd = timed(lambda: stack(x).sum())
    both = timed(lambda: stack(x).sum().backward())
    bwd = max(0.0, both - fwd)
    captured = OVERHEAD_BLOCK_OPS * OVERHEAD_BLOCKS

    block = stack[0]
    core = AttentionCore(nodes=("softmax",), ops=(CoreOp("_softmax", 0),), calls={"_softmax": 1})
    selective = apply_ac(overhead_model(torch, h, 1)[0].to(device), Recompute.SELECTIVE,
                         core=core)
    plain = timed(lambda: block(x).sum().backward())
    sac = timed(lambda: selective(x).sum().backward())
    cuda = device is not None and torch.device(device).type == "cuda"
    with DispatchCount() as one:
        block(x)
    return {"forward_s": fwd / captured, "backward_s": bwd / captured,
            "forward_dispatch_s": fwd / dispatched.total, "backward_node_s": bwd / nodes,
            "selective_dispatch_s": max(0.0, sac - plain) / one.total,
            # a CPU figure: the cost model prices it where the host is the device
            "zero_bubble_node_s": (0.0 if cuda else
                                   _split_backward_extra(torch, stack, x, timed) / nodes)}


def _split_backward_extra(torch, stack: Any, x: Any,
                          timed: Callable[[Callable[[], Any]], float]) -> float:
    """Seconds a forward + backward of ``stack`` takes more with its backward split as
    torch's zero-bubble schedules split it (input gradients, then weight gradients) than
    whole; 0 where torch has no such functions."""
    try:
        from torch.distributed.pipelining._backward import (stage_backward_input,
                                                            stage_backward_weight)
    except ImportError:
        return 0.0
    grad = torch.ones_like(stack(x))

    def whole() -> None:
        xi = x.detach().requires_grad_(True)
        stack(xi).backward(grad)

    def split() -> None:
        xi = x.detach().requires_grad_(True)
        _, groups = stage_backward_input([stack(xi)], [grad], [xi], stack.parameters())
        stage_backward_weight(stack.parameters(), groups)

    return max(0.0, timed(split) - timed(whole))


#: Parameter tensors the optimizer-step overhead is measured over (width ``OVERHEAD_WIDTH``)
OPTIMIZER_TENSORS = 32
#: ... and the per-element figure: tensors of this many fp32 elements (1 MiB, as the linears
#: of a small model), 64 MiB of parameters, gradients and moments in all: beyond the caches
OPTIMIZER_LARGE = (16, 2**18)


def measure_optimizer_overhead(torch, timed: Callable[[Callable[[], Any]], float],
                               group: Any = None) -> tuple[float, float, float]:
    """Seconds per parameter tensor of one ``torch.optim.AdamW`` step as
    :func:`autoplan.parallelize` builds it by default
    (:func:`~autoplan.runtime.optim.default_optimizer`: fused), ``(plain, DTensor)``: over
    :data:`OPTIMIZER_TENSORS` tiny tensors (the bytes negligible, so the time is the
    operators' dispatch), plain and as DTensors sharded on the one-rank mesh of ``group``
    (as FSDP2 and tensor parallelism leave the parameters); without ``group`` the DTensor
    figure is 0 (one rank runs no DTensor parameters).  Third, seconds per parameter
    element: a step over :data:`OPTIMIZER_LARGE` tensors less their per-tensor part,
    over their elements (``OpOverhead.optimizer_element_s``)."""
    def per_tensor(params: list) -> float:
        for p in params:
            p.grad = torch.ones_like(p)
        opt = default_optimizer(params)
        return timed(opt.step) / len(params)

    h, n = OVERHEAD_WIDTH, OPTIMIZER_TENSORS
    plain = per_tensor([torch.nn.Parameter(torch.randn(h)) for _ in range(n)])
    count, size = OPTIMIZER_LARGE
    large = per_tensor([torch.nn.Parameter(torch.randn(size)) for _ in range(count)])
    element = max(0.0, large - plain) / size
    if group is None:
        return plain, 0.0, element
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = DeviceMesh.from_group(group, "cpu")
    sharded = per_tensor([torch.nn.Parameter(distribute_tensor(torch.randn(h), mesh, [Shard(0)]))
                          for _ in range(n)])
    return plain, sharded, element
