"""A reliable multi-process harness for torch.distributed tests on CPU (gloo).

``run(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn),
each running ``fn(rank, world_size, *args)`` inside an initialised gloo process
group, and returns the per-rank return values.  What makes it reliable:

- the rendezvous store is a ``TCPStore`` the parent opens on a free port and
  holds, so there is no race for a port between picking and binding it;
- ``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS=1`` per worker (2-core CI);
- collective timeout (``pg_timeout``) in every worker and a wall-clock
  ``timeout`` for the whole run: a hung or crashed rank becomes an error,
  never a hang;
- a worker ends with ``barrier(); destroy_process_group(); flush; os._exit``,
  which avoids gloo's SIGABRT at interpreter exit;
- results and tracebacks come back through files; a failure reports every
  rank's traceback, exit code and the tail of its output;
- a run in which a rank dies of a signal (torch or gloo crashing natively) runs
  again once in fresh processes, its report on stderr (see :func:`run`).

``fn`` must be importable by the workers (a module-level function, or a
``functools.partial`` of one to pass keyword arguments).

Examples
--------
>>> def hello(rank, world):            # doctest: +SKIP
...     return rank * 10
>>> run(hello, 2)                        # doctest: +SKIP
[0, 10]
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["run", "run_outcomes", "RankOutcome", "DistributedFailure"]


class DistributedFailure(AssertionError):
    """One or more ranks failed, crashed or timed out; the message has the details."""


def _worker(fn: Callable, rank: int, world: int, port: int, outdir: str, args: tuple,
            pg_timeout: float) -> None:
    log = os.open(os.path.join(outdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # a native crash (SIGSEGV, SIGABRT) prints every thread's Python stack into the log
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    status = 0
    result: tuple[str, Any]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout)
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", traceback.format_exc())
        status = 1
    try:
        with open(os.path.join(outdir, f"rank{rank}.pkl.tmp"), "wb") as f:
            pickle.dump(result, f)
        os.replace(os.path.join(outdir, f"rank{rank}.pkl.tmp"), os.path.join(outdir, f"rank{rank}.pkl"))
    except BaseException:  # noqa: BLE001 - e.g. an unpicklable result
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        status = 1
    try:
        if dist.is_initialized():
            if status == 0:
                dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - a peer is gone; the result is already written
        traceback.print_exc()
        status = status or 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


#: Modules the fork server imports once, so that every worker starts with them loaded
#: (importing torch.distributed and the runtime costs ~3 s per process, x4 on 2 cores).
#: Missing ones are skipped by the server.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint", "torch._dynamo",
           "torch.export", "autoplan.runtime", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.masking_utils"]


def _context():
    """A ``forkserver`` context preloading :data:`PRELOAD`: workers are forked from a clean,
    single-threaded server that has imported torch but never run an op or made a thread
    pool, so each start costs a fork instead of a fresh interpreter and imports."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


#: Lines of a crashed rank's output kept before faulthandler's report: what the native
#: code printed as it died (a C++ ``terminate called after throwing ...`` and its
#: ``what()``, gloo's reason).
_BEFORE_CRASH_LINES = 6


def _tail(path: str, n: int = 3000) -> str:
    """The last ``n`` characters of a rank's output; after a native crash, faulthandler's
    report instead (the signal and every thread's stack, from its start), after the
    :data:`_BEFORE_CRASH_LINES` lines printed before it and less the list of loaded
    extension modules it ends with: that list alone (~3 KB with torch, pandas and scipy
    loaded) filled the whole tail of an 8-rank run whose rank died of SIGABRT."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    fatal = text.rfind("Fatal Python error")
    if fatal < 0:
        return text[-n:]
    report = text[fatal:]
    modules = report.find("\nExtension modules:")
    if modules >= 0:
        report = report[:modules] + "\n(faulthandler's list of extension modules left out)"
    before = "\n".join(text[:fatal].rstrip("\n").splitlines()[-_BEFORE_CRASH_LINES:])
    before = before[-(n // 4):]   # a long line printed last cannot crowd out the stacks
    return ((before + "\n") if before else "") + report[:n - len(before) - 1]


@dataclass
class RankOutcome:
    """What one rank did: exit code, return value or traceback, and its output."""

    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None
    returned: bool = False
    killed: str | None = None
    log: str = ""

    def describe(self) -> str:
        if self.killed:
            what = f"killed ({self.killed})"
        elif self.exitcode is not None and self.exitcode < 0:
            what = f"died of {signal.Signals(-self.exitcode).name}"
        else:
            what = f"exit code {self.exitcode}"
        if self.returned and self.error is None:
            what += " after returning normally (teardown failed)"
        return what


def run_outcomes(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
                 pg_timeout: float = 120.0, grace: float = 10.0) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; never raises for
    a rank's failure: returns every rank's :class:`RankOutcome`.

    After the first rank exits abnormally the others get ``grace`` seconds
    before they are killed; the whole run gets ``timeout`` seconds.
    """
    import torch.distributed as dist

    outdir = tempfile.mkdtemp(prefix="dist_harness_")
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True,
                          timeout=datetime.timedelta(seconds=pg_timeout), wait_for_workers=False)
    ctx = _context()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store.port, outdir, args,
                                               pg_timeout), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at = None
        reason = ""
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > grace:
                reason = f"still running {grace:.0f}s after another rank failed"
                break
            if now > deadline:
                reason = f"run exceeded its {timeout:.0f}s timeout"
                break
            time.sleep(0.02)
        killed = set()
        for r, p in enumerate(procs):
            if p.is_alive():
                killed.add(r)
                p.kill()
        for p in procs:
            p.join(5)
        outcomes = []
        for r, p in enumerate(procs):
            o = RankOutcome(r, p.exitcode, killed=reason if r in killed else None,
                            log=_tail(os.path.join(outdir, f"rank{r}.log")))
            path = os.path.join(outdir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    kind, payload = pickle.load(f)
                o.returned = True
                if kind == "ok":
                    o.value = payload
                else:
                    o.error = payload
            outcomes.append(o)
        return outcomes
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        del store
        shutil.rmtree(outdir, ignore_errors=True)


#: Errors of a process group that failed to form inside gloo's own connection code, not
#: of the code under test (:func:`run` runs such a run again).
RENDEZVOUS_FLAKES = ("Gloo connectFullMesh failed",)


def run(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
        pg_timeout: float = 120.0, grace: float = 10.0, native_retries: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; per-rank results.

    Raises :class:`DistributedFailure` when a rank raises, exits abnormally or
    is killed (timeout), with every failed rank's traceback and output tail.

    A run in which a rank died of a signal (a native crash inside torch or gloo, not an
    error of ``fn``'s own) runs again in fresh processes, up to ``native_retries`` times,
    its report written to stderr: torch 2.13's gloo path on CPU crashes so now and then in
    8-rank runs (``malloc(): unaligned tcache chunk`` in a DTensor redistribute, a C++
    terminate in a tensor-parallel all-gather: CI runs of 2026-11-26 and 2026-11-28 went
    red on one such rank, every rerun of the test passing).  A crash that repeats fails.
    So does a run in which a rank's process group failed to form inside gloo
    (:data:`RENDEZVOUS_FLAKES`): on a loaded 2-core machine a peer's connection is now and
    then closed while gloo connects the full mesh (the idle processes' group in
    test_elastic's idle run failed so in a fast-suite run of 2026-11-29).
    """
    name = getattr(getattr(fn, "func", fn), "__name__", "fn")   # functools.partial too
    for attempt in range(native_retries + 1):
        start = time.monotonic()
        outcomes = run_outcomes(fn, world_size, *args, timeout=timeout,
                                pg_timeout=pg_timeout, grace=grace)
        bad = [o for o in outcomes
               if o.error is not None or o.exitcode != 0 or not o.returned]
        if not bad:
            return [o.value for o in outcomes]
        # a rank with a traceback is usually the root cause; list it first
        bad.sort(key=lambda o: (o.error is None, o.rank))
        head = (f"{name} on {world_size} ranks failed after "
                f"{time.monotonic() - start:.1f}s")
        body = "\n\n".join(f"--- rank {o.rank}: {o.describe()}\n{o.error or '(no traceback)'}"
                            f"\n--- output tail:\n{o.log}" for o in bad)
        crashed = any(o.exitcode is not None and o.exitcode < 0 and not o.killed for o in bad)
        unformed = any(flake in (o.error or "") for o in bad for flake in RENDEZVOUS_FLAKES)
        if not (crashed or unformed) or attempt == native_retries:
            raise DistributedFailure(head + "\n" + body)
        what = "a rank crashed natively" if crashed else \
            "a rank's process group failed to form in gloo"
        print(f"dist_harness: {what}; running {name} again in fresh "
              f"processes ({attempt + 1} of {native_retries})\n{head}\n{body}",
              file=sys.stderr)
    raise AssertionError("unreachable")
