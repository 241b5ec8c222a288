"""CPU parameter servers: hold table shards, serve pulls, apply pushes.

The processes of a job after its ``W`` workers are servers (ranks ``W .. W + S - 1``;
:class:`~autoplan.sparse.plan.TablePlacement` devices ``s`` of :attr:`Storage.SERVER`
tables name server ``s``, rank ``W + s``).  A worker talks to a server with
point-to-point messages (gloo ``send``/``recv``), each request a header
``[op, table, n, width]`` and its payload:

* ``PULL``: ``n`` distinct row ids (local to the shard) -> the server sends the rows back;
* ``PUSH``: ``n`` row ids and their ``n x width`` summed gradients -> nothing back; when
  every worker has pushed a table the server sums them, divides by the workers (each
  worker's loss is a mean over its own samples) and applies the sparse optimizer
  (:class:`~.optim.SparseUpdate`) to the rows touched;
* ``STATE``: the server sends its shards to worker 0 (a full state dict);
* ``STOP``: the job is over.

Training is synchronous and every worker issues the same requests in the same order, so
a server works in rounds: one request from each worker, in worker order (each pull
answered as it comes), then, after a round of pushes, the update.  A worker's pull of the
next step therefore sees the rows every worker's push of this step updated.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .optim import SparseOptimizerConfig, SparseUpdate
from .plan import Shard

__all__ = ["Op", "ServerShard", "PSClient", "serve"]


class Op(enum.IntEnum):
    PULL = 1
    PUSH = 2
    STATE = 3
    STOP = 4


_HEADER = 4


@dataclass
class ServerShard:
    """One table's row block on this server, its optimizer state and pending pushes."""

    table: int
    shard: Shard
    weight: torch.Tensor
    update: SparseUpdate
    pending: list[tuple[torch.Tensor, torch.Tensor]]

    def apply(self, workers: int) -> None:
        """Sum the round's pushes and update the rows they touched (mean over workers)."""
        if not self.pending:
            return
        ids = torch.cat([i for i, _ in self.pending])
        grads = torch.cat([g for _, g in self.pending])
        self.pending = []
        uniq, inv = ids.unique(return_inverse=True)
        summed = torch.zeros(len(uniq), grads.shape[1], dtype=grads.dtype).index_add_(0, inv, grads)
        self.update.apply(self.weight, uniq, summed / workers)


class PSClient:
    """A worker's side of the protocol (see the module docstring)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def _rank(self, server: int) -> int:
        return self.workers + server

    def _header(self, op: Op, table: int, n: int, width: int, server: int) -> None:
        dist.send(torch.tensor([int(op), table, n, width], dtype=torch.int64), dst=self._rank(server))

    def pull(self, server: int, table: int, ids: torch.Tensor, width: int,
             dtype: torch.dtype) -> torch.Tensor:
        """The rows ``ids`` (local to the server's shard of ``table``)."""
        self._header(Op.PULL, table, len(ids), width, server)
        rows = torch.empty(len(ids), width, dtype=dtype)
        if len(ids):
            dist.send(ids.to(torch.int64).cpu().contiguous(), dst=self._rank(server))
            dist.recv(rows, src=self._rank(server))
        return rows

    def push(self, server: int, table: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """The summed gradients ``grads`` of rows ``ids`` of this worker's samples."""
        self._header(Op.PUSH, table, len(ids), grads.shape[1], server)
        if len(ids):
            dist.send(ids.to(torch.int64).cpu().contiguous(), dst=self._rank(server))
            dist.send(grads.detach().cpu().contiguous(), dst=self._rank(server))

    def state(self, server: int, shards: list[tuple[int, Shard]],
              dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Every worker asks; worker 0 receives the server's shards (in ``shards`` order)."""
        self._header(Op.STATE, -1, 0, 0, server)
        if dist.get_rank() != 0:
            return None
        out = []
        for _, shard in shards:
            w = torch.empty(shard.rows, shard.cols, dtype=dtype)
            dist.recv(w, src=self._rank(server))
            out.append(w)
        return out

    def stop(self, server: int) -> None:
        self._header(Op.STOP, -1, 0, 0, server)


def serve(shards: list[ServerShard], workers: int) -> int:
    """Run this server until every worker has sent ``STOP``; returns the rounds served.

    Raises
    ------
    ConfigError
        When the workers' requests of a round disagree (they do not run the same
        program) or name a table this server does not hold.
    """
    by_table = {s.table: s for s in shards}
    rounds = 0
    while True:
        kind = None
        for w in range(workers):
            header = torch.empty(_HEADER, dtype=torch.int64)
            dist.recv(header, src=w)
            op, table, n, width = (int(v) for v in header)
            if kind is None:
                kind = (op, table)
            elif kind != (op, table):
                raise ConfigError(f"server rank {dist.get_rank()}: worker {w} sent {Op(op).name} "
                                  f"of table {table} in a round of {Op(kind[0]).name} of table "
                                  f"{kind[1]}: the workers do not run the same program")
            if op == Op.STOP:
                continue
            if op == Op.STATE:
                continue
            shard = by_table.get(table)
            if shard is None:
                raise ConfigError(f"server rank {dist.get_rank()} holds no shard of table {table}")
            ids = torch.empty(n, dtype=torch.int64)
            if op == Op.PULL:
                if n:
                    dist.recv(ids, src=w)
                    dist.send(shard.weight[ids].contiguous(), dst=w)
            elif op == Op.PUSH:
                if n:
                    grads = torch.empty(n, width, dtype=shard.weight.dtype)
                    dist.recv(ids, src=w)
                    dist.recv(grads, src=w)
                    shard.pending.append((ids, grads))
            else:
                raise ConfigError(f"server rank {dist.get_rank()}: unknown request {op}")
        rounds += 1
        assert kind is not None
        if kind[0] == Op.STOP:
            return rounds
        if kind[0] == Op.STATE:
            for s in shards:
                dist.send(s.weight.contiguous(), dst=0)
        elif kind[0] == Op.PUSH:
            by_table[kind[1]].apply(workers)


def make_shards(placements, tables, weights: dict[str, torch.Tensor], server: int,
                config: SparseOptimizerConfig) -> list[ServerShard]:
    """This server's shards, copied from the model's tables (identical on every rank)."""
    out = []
    for t, (p, table) in enumerate(zip(placements, tables)):
        if p.storage.value != "server":
            continue
        for shard in p.shards(table.rows, table.dim):
            if shard.owner == server:
                w = weights[table.name][shard.row0:shard.row1].detach().to("cpu").clone()
                out.append(ServerShard(t, shard, w, SparseUpdate(config, shard.rows, shard.cols),
                                       []))
    return out
