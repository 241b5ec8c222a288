"""Matmuls timed cold, as a training step runs them (:func:`cold_matmul`)."""

from __future__ import annotations

from typing import Any, Callable


#: Matmuls are timed cold, as a training step runs them (other layers' weights and
#: activations have evicted the caches since the last use): each call takes the next of
#: several input/output sets that together span at least this many bytes, twice this
#: machine's 32 MiB last-level CPU cache (on CUDA, twice the device's L2 where larger;
#: Triton's ``do_bench`` clears the L2 before each call likewise).  Warm, back to back, the
#: step's matmul sizes on this CPU run 7-22% faster (median ~15%).
COLD_BYTES = 64 * 2**20


def cold_matmul(torch, n: int, dtype, device, cold_bytes: int) -> Callable[[], Any]:
    """A call that multiplies two ``n x n`` matrices into a third, each call the next of
    as many distinct sets (views into three flat buffers) as span ``cold_bytes``, so no
    call finds its operands in cache (:data:`COLD_BYTES`)."""
    per_set = 3 * n * n * torch.empty((), dtype=dtype).element_size()
    sets = max(2, -(-cold_bytes // per_set))
    a_all = torch.randn(sets * n * n, device=device).to(dtype)
    b_all = torch.randn(sets * n * n, device=device).to(dtype)
    # written once here: a step's outputs land in memory its allocator has used before,
    # while a fresh page faults on its first write (~0.5-1.7 ms per MiB on this kind of VM);
    # a quick profile's few calls of a size would otherwise all pay it
    out_all = torch.zeros(sets * n * n, device=device, dtype=dtype)
    views = [(a_all[i * n * n:(i + 1) * n * n].view(n, n),
              b_all[i * n * n:(i + 1) * n * n].view(n, n),
              out_all[i * n * n:(i + 1) * n * n].view(n, n)) for i in range(sets)]
    state = [0]

    def call() -> None:
        a, b, out = views[state[0]]
        state[0] = (state[0] + 1) % sets
        torch.matmul(a, b, out=out)

    call.sets = views  # type: ignore[attr-defined]
    return call
