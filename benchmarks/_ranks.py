"""What the CPU benchmarks share: a free port, ranks spawned and joined by a deadline with
their errors reported, one rank's gloo set-up and teardown, and the cost options that
price gloo on CPU.

A rank is ``worker(rank, world, port, outdir, *args)``, a top-level function (it is
pickled to a fresh process).  It writes what it measured under ``outdir`` and any error to
``error<rank>.txt``; :func:`_run_ranks` raises those reports, else returns what its
``read(outdir)`` makes of the results.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from autoplan.cost import CostOptions  # noqa: E402

#: gloo on CPU runs its collectives on the cores that compute: nothing overlaps.
GLOO_ON_CPU = CostOptions(overlap_grad_reduce=False, overlap_param_gather=False,
                          tp_comm_overlap=False, pp_comm_overlap=False)


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def error_chain(exc: BaseException) -> str:
    """``exc`` and the exceptions it was raised from, the innermost (the cause) first: a
    pipeline stage wraps its forward's error as "[Stage 0] failed to run forward", whose
    own message says nothing of why."""
    chain, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(f"{type(e).__name__}: {str(e).strip()}")
        e = e.__cause__ or e.__context__
    return " <- ".join(reversed(chain))


def init_rank(rank: int, world: int, port: int, timeout_s: float | None = None):
    """This process as rank ``rank`` of a gloo group on 127.0.0.1:``port``, one thread
    (the ranks share the cores); returns ``torch``."""
    import datetime
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", rank=rank, world_size=world, **kw)
    return torch


def end_rank(status: int) -> None:
    """Tear the group down (a barrier first: gloo can abort a rank whose peers have gone)
    and end the process with ``status`` (os._exit: gloo can abort at interpreter exit)."""
    import torch.distributed as dist
    try:
        if status == 0:
            dist.barrier()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _run_ranks(worker, world: int, args: tuple, timeout_s: float, read, *, ctx=None):
    """Start ``world`` processes ``worker(rank, world, port, outdir, *args)`` (``ctx``: a
    multiprocessing context, default ``spawn``), join them by one deadline ``timeout_s``
    away, killing stragglers, and raise RuntimeError with the ranks' ``error*.txt`` reports
    (or the timeout); else return ``read(outdir)``."""
    import multiprocessing as mp
    ctx = ctx or mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, outdir, *args))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        late = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = sorted(Path(outdir).glob("error*.txt"))
        if errors:
            raise RuntimeError("; ".join(e.read_text()[:400] for e in errors))
        if late:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s (ranks {late} still running)")
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"ranks {failed} exited with "
                               f"{[procs[r].exitcode for r in failed]} and no report")
        return read(Path(outdir))
