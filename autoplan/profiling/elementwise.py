"""Memory-bound operators by kind (:data:`~autoplan.hardware.profile_records.RATE_KINDS`),
timed forward and backward and turned into the profile's ``elementwise_rates``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..hardware.profile_records import ELEMENTWISE_KINDS
from ..hardware.profiles import ElementwiseRates


#: Memory-bound operators of a kind (:data:`~autoplan.hardware.profile_records.RATE_KINDS`)
#: are timed on fp32 tensors of this many tokens x width, each call on the next of as many
#: as span ``COLD_BYTES / 2`` (with their output gradients), so none is in cache, as a
#: step's activations are not: on a CPU 2 MiB, an activation of a small model's
#: micro-batch; on a GPU 64 MiB, one of a 1-3B model's (a GPU streams 2 MiB in about its
#: launch time).
_ELEMENTWISE_SHAPE = (1024, 512)
ELEMENTWISE_SHAPE_CUDA = (8192, 2048)
#: The layout kinds' head size: a transposed view is (heads, tokens, head) of a
#: (tokens, heads x head) activation, as attention's queries are
_ELEMENTWISE_HEAD = 64


def _elementwise_calls(torch, kind: str, device, cold_bytes: int,
                       shape: tuple[int, int] = _ELEMENTWISE_SHAPE
                       ) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    """``(forward, forward + backward, counted bytes)`` of one call of ``kind``'s operator
    as a model calls it (GELU exact, softmax and layer norm over the last dimension,
    masked_fill of a boolean mask); the bytes are the cost model's count for it, its output
    plus its input (:func:`autoplan.cost.summary._elementwise`).

    The layout kinds (:func:`autoplan.cost.summary.rate_kind`): ``broadcast`` is one call
    of each of the broadcasts of a Llama block, a row's scale ``x * r`` (``r`` of one
    column), a norm's weight ``x * w`` and rotary embeddings' ``q * cos`` of a transposed
    query by a (tokens, head) table, counted at their outputs and inputs as the cost model
    counts them (the weight, a parameter, not); ``layout_copy`` is a transposed query made
    contiguous."""
    F = torch.nn.functional
    tokens, width = shape
    nbytes = tokens * width * 4
    sets = max(2, -(-cold_bytes // (4 * nbytes)))
    gen = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(tokens, width, generator=gen, device=device).requires_grad_()
          for _ in range(sets)]
    grads = [torch.randn(tokens, width, generator=gen, device=device) for _ in range(sets)]
    head = _ELEMENTWISE_HEAD
    heads = width // head

    def transposed(t):    # (heads, tokens, head), a view
        return t.view(tokens, heads, head).transpose(0, 1)

    if kind == "broadcast":
        rows = [torch.rand(tokens, 1, generator=gen, device=device).requires_grad_()
                for _ in range(sets)]
        weight = torch.ones(width, device=device, requires_grad=True)
        cos = torch.rand(tokens, head, generator=gen, device=device)
        small = rows[0].numel() * 4 + cos.numel() * 4

        def op(x, i):
            return (x * rows[i], x * weight, transposed(x) * cos)

        def wrt(i):
            return (xs[i], rows[i], weight)

        def outs_grads(i):
            return (grads[i], grads[i], transposed(grads[i]))
        counted = 3 * 2 * nbytes + small
    else:
        masks = [x.detach() > 1.0 for x in xs] if kind == "masked_fill" else []
        weight = torch.ones(width, device=device, requires_grad=True)
        bias = torch.zeros(width, device=device, requires_grad=True)
        ops: dict[str, Callable[[Any, int], Any]] = {
            "gelu": lambda x, i: F.gelu(x),
            "silu": lambda x, i: F.silu(x),
            "softmax": lambda x, i: torch.softmax(x, dim=-1),
            "layer_norm": lambda x, i: F.layer_norm(x, (width,), weight, bias),
            "masked_fill": lambda x, i: x.masked_fill(masks[i], 0.0),
            "layout_copy": lambda x, i: transposed(x).contiguous(),
        }
        one = ops[kind]

        def op(x, i):
            return (one(x, i),)

        def wrt(i):
            return (xs[i],)

        if kind == "layout_copy":   # the copy's output gradient: contiguous, transposed
            grads = [transposed(g).contiguous() for g in grads]

        def outs_grads(i):
            return (grads[i],)
        counted = 2 * nbytes
    state = [0]

    def turn() -> int:
        i = state[0]
        state[0] = (i + 1) % sets
        return i

    def forward() -> None:
        i = turn()
        with torch.no_grad():
            op(xs[i], i)

    def both() -> None:   # the inputs' gradients returned, not accumulated
        i = turn()
        torch.autograd.grad(op(xs[i], i), wrt(i), outs_grads(i))

    return forward, both, counted


def measure_elementwise(torch, timed: Callable[[Callable[[], Any]], float], device,
                        cold_bytes: int, kinds: Sequence[str] = tuple(ELEMENTWISE_KINDS),
                        shape: tuple[int, int] = _ELEMENTWISE_SHAPE
                        ) -> dict[str, list[float]]:
    """``{kind: [forward seconds, backward seconds, counted bytes]}`` per call of each
    of ``kinds`` (:func:`_elementwise_calls`; the backward is forward + backward less the
    forward).

    On a CPU such operators are arithmetic per byte, not a copy: on 4 ranks sharing 2 cores
    (three quick profiles, 2026-11-27) erf-GELU ran at 0.6-0.7 of the speed the copy
    bandwidth priced it at (the backward at twice the forward's bytes), masked_fill at a
    quarter forward and 0.4 backward, layer norm at 1.2-1.7, softmax's backward at 1.4-1.8;
    the profile times the operator kinds there (torch's CPU loops vectorize broadcasts and
    layout copies).  On a GPU every kind, the layout kinds too
    (:data:`~autoplan.hardware.profile_records.LAYOUT_KINDS`).
    A backward that reads below 5% of its forward (timing noise on a fast one) is kept at
    that."""
    out: dict[str, list[float]] = {}
    for kind in kinds:
        forward, both, nbytes = _elementwise_calls(torch, kind, device, cold_bytes, shape)
        fwd = timed(forward)
        total = timed(both)
        out[kind] = [fwd, max(total - fwd, fwd * 0.05), float(nbytes)]
    return out


def tabulate_elementwise(ranks: list[dict[str, Any]], how: str, shares_cores: bool,
                         cuda: bool = False) -> ElementwiseRates | None:
    """The ranks' memory-bound operator timings (:func:`measure_elementwise`) as rates,
    the slowest rank's per figure (as for the matmuls); ``None`` where not measured
    (results of an older profiler)."""
    measured = [r.get("elementwise") or {} for r in ranks]
    kinds = [k for k in measured[0] if all(k in m for m in measured)]
    if not kinds:
        return None
    forward = {k: min(m[k][2] / m[k][0] for m in measured) for k in kinds}
    backward = {k: min(m[k][2] / m[k][1] for m in measured) for k in kinds}
    rows, width = ELEMENTWISE_SHAPE_CUDA if cuda else _ELEMENTWISE_SHAPE
    layout = [k for k in kinds if k not in ELEMENTWISE_KINDS]
    return ElementwiseRates(
        forward_bytes_per_s=forward, backward_bytes_per_s=backward,
        source=(f"{how}: each operator as models call it (GELU exact, SiLU, softmax and "
                f"layer norm over the last dimension, masked_fill of a boolean mask"
                + (", broadcasts: a row's scale, a norm's weight and rotary embeddings' "
                   "cos of a transposed query; a transposed query made contiguous"
                   if layout else "")
                + f") on {rows} x {width} fp32 tensors, each call on the next of a rotation "
                "that no cache holds; its output plus its input per second of its forward, "
                "and per second of its backward (forward + backward less the forward)"
                + ("; the ranks share cores: each rank free-running, every rank busy, the "
                   "fastest of a few windows of the ranks' mean" if shares_cores else "")))
