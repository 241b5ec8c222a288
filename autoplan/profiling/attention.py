"""Torch's fused attention (causal SDPA, forward and backward) on CUDA, timed and tabled as the
profile's ``attention_efficiency``."""

from __future__ import annotations

from typing import Any, Callable

from ..hardware.profiles import EfficiencyTable


#: Fused attention is timed on calls of this many tokens (batch x sequence), as a step's
#: micro-batch of a 1-3B model, at sequence lengths 512-8192 and these (heads, head dim):
#: width 2048 in heads of 128 (Llama 3 8B and up, GPT-3 1.3B; the profile's table) and of
#: 64 (Llama 3.2 1B; recorded in the measurements only: a table has one curve)
ATTENTION_TOKENS = 16384
ATTENTION_HEADS = ((16, 128), (32, 64))
#: The FLOPs the cost model prices a causal fused attention's forward and backward at, in
#: units of one ``QK^T`` product: the forward's two products, the backward's four and the
#: forward the kernel recomputes in it (2 + 4 + 2), halved by the causal mask
#: (autoplan.cost.engine: CAUSAL_BLOCK_FRACTION)
ATTENTION_FLOPS_PER_QK = 4.0


def qk_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """FLOPs of one ``QK^T`` product (``2 b h s^2 d``), the engine's key for attention."""
    return 2.0 * batch * heads * seq * seq * head_dim


def attention_call(torch, batch: int, heads: int, seq: int, head_dim: int,
                   device) -> Callable[[], Any]:
    """One causal ``scaled_dot_product_attention`` forward and backward in bf16 (torch picks
    its fused kernel, as a model's SDPA call does)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16,
                           generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16,
                       generator=gen)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call() -> None:   # gradients returned, not accumulated into .grad
        torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad)

    return call


def tabulate_attention(ranks: list[dict[str, Any]], peaks: dict[str, float], how: str
                       ) -> tuple[list[dict[str, Any]], EfficiencyTable | None]:
    """The measured attention calls (the slowest rank's time per shape) and the profile's
    table: for the shapes of the first (heads, head dim) of :data:`ATTENTION_HEADS`, the
    fraction of the 16-bit peak at which :data:`ATTENTION_FLOPS_PER_QK` ``QK^T`` products
    take the measured time, against one product's FLOPs.  ``None`` without measurements."""
    shapes = [tuple(r[:4]) for r in ranks[0].get("attention") or []]
    if not shapes:
        return [], None
    peak = peaks.get("bf16") or peaks.get("fp16")
    rows = []
    for i, shape in enumerate(shapes):
        sec = max(float(r["attention"][i][4]) for r in ranks)
        qk = qk_flops(*shape)
        rows.append({"batch": shape[0], "heads": shape[1], "seq": shape[2], "head_dim": shape[3],
                     "seconds": sec, "qk_flops": qk,
                     "priced_flops_per_s": ATTENTION_FLOPS_PER_QK * qk / sec})
    if peak is None:
        return rows, None
    heads, head_dim = ATTENTION_HEADS[0]
    points = sorted((r["qk_flops"], min(1.0, r["priced_flops_per_s"] / peak)) for r in rows
                    if (r["heads"], r["head_dim"]) == (heads, head_dim))
    if not points:
        return rows, None
    table = EfficiencyTable(
        tuple(points),
        source=(f"{how}: causal torch scaled_dot_product_attention in bf16, forward and "
                f"backward, {ATTENTION_TOKENS} tokens a call, {heads} heads of {head_dim}, "
                f"sequence {min(r['seq'] for r in rows)}-{max(r['seq'] for r in rows)}: "
                f"{ATTENTION_FLOPS_PER_QK:g} QK^T products' FLOPs (the cost model's price of a "
                "causal fused attention) over the time, over the best measured 16-bit matmul"))
    return rows, table
