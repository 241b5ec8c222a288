"""Plans that leave processes idle: the active ones train in a process group of their own.

A plan may use fewer devices than the job has processes (:attr:`autoplan.Plan.idle_devices`:
1,016 GPUs force every layout of all of them into 127 replicas, 1,008 run a pipeline; a
mixed cluster's slow nodes may slow more than they add).  Process ``r`` runs device
``r``; the processes of the plan's devices are *active*, the others *idle*.

:class:`IdleSplit` re-forms the job's process groups (what the elastic launcher's idle
processes do, :func:`autoplan.elastic.run_elastic`): rank 0 hosts a TCPStore, every
process leaves the world's default group, the active ones form a default group of their
own on the store (their ranks renumbered in device order: :func:`compact`), and the idle
ones one of theirs.  The active ones run the plan unchanged; the idle ones wait, and end
their wait when the active ones finish or one of them fails (its reason, not a hang);
:meth:`IdleSplit.rejoin` puts every process back in one default group over the world.

:func:`autoplan.parallelize` does this for a plan with idle devices: on an idle process
it returns an :class:`IdleProgram`, whose ``step`` returns each step's loss as the active
processes computed it (it waits for it), and whose ``finish`` (and the active
program's) rejoins the world.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import PlanMismatchError
from ..plan import MeshPlan, Plan

__all__ = ["IdleSplit", "IdleProgram", "compact", "active_ranks"]

#: How long an idle process waits for the active ones (a failure ends the wait sooner).
IDLE_WAIT = datetime.timedelta(days=365)
#: How long a failing active process waits for the idle ones to read why.
ACK_WAIT = datetime.timedelta(seconds=10)
#: How often an idle process waiting for a step's loss looks for a failure.
POLL = datetime.timedelta(seconds=1)


def _timed_out(e: Exception) -> bool:
    return "timeout" in str(e).lower() or "timed out" in str(e).lower()


def _lost(e: Exception) -> RuntimeError:
    return RuntimeError(f"an active process of this job failed: the store rank 0 hosts is "
                        f"gone ({type(e).__name__}: {e})")


def _all_left(store: Any, key: str, world: int, timeout: datetime.timedelta) -> None:
    """Wait until every process of the job has left its process group (each counts itself
    in ``key``), so that no process connects a new group while a peer still tears its old
    one down: gloo then failed to connect the new group now and then on a loaded machine
    (``connectFullMesh ... Connection closed by peer``, the idle processes' group, in 2 of
    3 runs of the fast suite on 2026-11-29)."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every process of the job left its process group within "
                               f"{timeout}: one of them failed or hangs")
        time.sleep(0.01)


def active_ranks(plan: Plan) -> tuple[int, ...]:
    """The processes (devices) the plan runs on, in order."""
    return tuple(sorted(plan.mesh.devices))


def compact(plan: Plan) -> Plan:
    """The plan over its active processes renumbered ``0 .. n - 1`` in device order (their
    ranks in the active group); the same layout, estimate and stages.

    >>> from autoplan.models import GPT, GPTConfig
    >>> from autoplan import trace, Strategy
    >>> g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)), seq_len=16)
    >>> p = Plan.from_strategy(g, 8, Strategy(dp=2, global_batch=4), devices=(4, 6))
    >>> compact(p).mesh.devices, compact(p).num_devices
    ((0, 1), 2)
    """
    order = {d: i for i, d in enumerate(active_ranks(plan))}
    if all(order[d] == d for d in order) and plan.cluster.num_devices == len(order):
        return plan
    mesh = MeshPlan(plan.mesh.dims, plan.mesh.degrees,
                    tuple(order[d] for d in plan.mesh.devices), ep=plan.mesh.ep)
    stages = tuple(replace(st, devices=tuple(order[d] for d in st.devices))
                   for st in plan.stages)
    cluster = replace(plan.cluster, num_devices=len(order),
                      name=f"{plan.cluster.name} (the plan's {len(order)} active devices)")
    return replace(plan, mesh=mesh, stages=stages, cluster=cluster, idle_reason="")


@dataclass
class IdleSplit:
    """The job's processes split into the plan's active ones and the idle rest (see the
    module docstring).  Collective: every process of the job calls :meth:`open`."""

    store: Any
    rank: int                   # in the world
    world: int
    backend: str
    timeout: datetime.timedelta
    active: bool
    plan: Plan                  # compacted on active processes; as given on idle ones
    finished: bool = field(default=False)

    DONE = "autoplan/done"
    ACKS = "autoplan/acks"

    @classmethod
    def open(cls, plan: Plan, timeout: datetime.timedelta | None = None) -> "IdleSplit":
        """Split the current default group: afterwards the active processes' default
        group holds them alone (rank = index among them) and the idle ones' the idle."""
        import torch.distributed as dist

        from .agree import on_rank0

        rank, world = dist.get_rank(), dist.get_world_size()
        ranks = active_ranks(plan)
        bad = [d for d in ranks if not 0 <= d < world]
        if bad:
            raise PlanMismatchError(f"the plan runs on devices {bad[:5]}, but the job has "
                                    f"processes 0..{world - 1}")
        timeout = timeout or datetime.timedelta(minutes=10)
        server: list[Any] = []

        def host() -> tuple[str, int]:
            # where the other processes reach rank 0 (torchrun's MASTER_ADDR)
            name = os.environ.get("MASTER_ADDR") or socket.getfqdn()
            server.append(dist.TCPStore(name, 0, None, is_master=True, timeout=timeout,
                                        wait_for_workers=False))
            return name, server[0].port

        name, port = on_rank0(host)
        store = server[0] if server else dist.TCPStore(name, port, None, is_master=False,
                                                       timeout=timeout)
        backend = dist.get_backend()
        dist.destroy_process_group()
        _all_left(store, "autoplan/left", world, timeout)
        active = rank in ranks
        members = ranks if active else tuple(r for r in range(world) if r not in ranks)
        prefix = "autoplan/active/" if active else "autoplan/idle/"
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store),
                                rank=members.index(rank), world_size=len(members),
                                timeout=timeout)
        return cls(store, rank, world, backend, timeout, active,
                   compact(plan) if active else plan)

    # -------------------------------------------------------------- active processes
    def publish(self, step: int, loss: float) -> None:
        """Rank 0 of the active group: the loss of ``step``, for the idle processes."""
        import torch.distributed as dist

        if self.active and dist.get_rank() == 0:
            self.store.set(f"autoplan/loss/{step}", repr(float(loss)))

    def fail(self, why: str) -> None:
        """An active process failed: end the idle ones' wait with ``why`` (waiting, up to
        :data:`ACK_WAIT`, until they have read it: rank 0 hosts the store they read).

        The first failure's reason is kept: the others' collectives fail because of it
        (a peer's connection closed), and their reasons would hide it."""
        with contextlib.suppress(Exception):
            self.store.compare_set(self.DONE, "", why)
            idle = self.world - self.plan.num_devices
            deadline = time.monotonic() + ACK_WAIT.total_seconds()
            while self.store.add(self.ACKS, 0) < idle and time.monotonic() < deadline:
                time.sleep(0.05)

    # -------------------------------------------------------------- idle processes
    def wait_loss(self, step: int) -> float:
        """The loss of ``step`` as the active processes computed it; raises if one of them
        failed first."""
        key = f"autoplan/loss/{step}"
        while True:
            if self._done():
                raise RuntimeError(f"the active processes of this job finished without a "
                                   f"step {step}: call step() as many times on every process")
            try:
                self.store.wait([key], POLL)
                return float(self.store.get(key).decode())
            except Exception as e:  # noqa: BLE001 - a timeout: look for a failure, again
                if not _timed_out(e):
                    raise _lost(e) from None

    def wait_done(self) -> None:
        """Block until the active processes finish; raise if one of them failed."""
        try:
            self.store.wait([self.DONE], IDLE_WAIT)
            status = self.store.get(self.DONE).decode()
        except Exception as e:  # noqa: BLE001 - the store's host is gone
            raise _lost(e) from None
        if status != "ok":
            with contextlib.suppress(Exception):
                self.store.add(self.ACKS, 1)
            raise RuntimeError(f"an active process of this job failed ({status})")

    def _done(self) -> bool:
        """Whether the active processes finished (raises when one of them failed)."""
        if not self.store.check([self.DONE]):
            return False
        self.wait_done()                    # raises when they failed
        return True

    # -------------------------------------------------------------- everyone
    def rejoin(self) -> None:
        """Every process of the job in one default process group over the world again
        (collective over the world; the idle processes first wait for the active ones to
        finish)."""
        import torch.distributed as dist

        if self.finished:
            return
        if self.active:
            dist.barrier()                       # every active process is done
            if dist.get_rank() == 0:
                self.store.set(self.DONE, "ok")
        dist.destroy_process_group()
        if not self.active:
            self.wait_done()
        _all_left(self.store, "autoplan/rejoin", self.world, self.timeout)
        dist.init_process_group(self.backend,
                                store=dist.PrefixStore("autoplan/world/", self.store),
                                rank=self.rank, world_size=self.world, timeout=self.timeout)
        self.finished = True


@dataclass
class IdleProgram:
    """What :func:`autoplan.parallelize` returns on a process the plan leaves idle.

    ``step(batch)`` returns the step's loss as the active processes computed it (it
    waits for them, and raises if one of them failed); ``finish()`` waits for them to
    finish and puts every process back in one process group.  State and checkpoints are
    the active processes' (``state_dict`` is empty here, ``save``/``load`` do nothing)."""

    plan: Plan
    split: IdleSplit
    steps: int = 0
    active: bool = False

    def step(self, batch: Any) -> float:
        self.steps += 1
        return self.split.wait_loss(self.steps)

    def finish(self) -> None:
        self.split.rejoin()

    def state_dict(self) -> dict:
        return {}

    def full_state_dict(self) -> None:
        return None

    def save(self, path: str) -> None:
        return None

    def load(self, path: str) -> None:
        return None


def split_idle(target: Any, graph: Any, global_batch: int | None,
               timeout: datetime.timedelta | None = None) -> tuple[Any, IdleSplit | None]:
    """For :func:`autoplan.parallelize`: a plan that leaves some of the job's processes
    idle is checked against the model (every process alike, before any collective), then
    the processes split (:class:`IdleSplit`); returns the plan this process runs
    (compacted; the given one on an idle process) and the split, or the target unchanged
    and None for a plan of every process (or any other target)."""
    import torch.distributed as dist

    from .layout import check_plan

    if not isinstance(target, Plan) or target.num_devices >= dist.get_world_size():
        return target, None
    check_plan(compact(target), target.num_devices, graph, global_batch)
    split = IdleSplit.open(target, timeout)
    return split.plan, split
