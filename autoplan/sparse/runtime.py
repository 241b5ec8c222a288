"""Running a :class:`~.plan.SparsePlan` with torch.distributed, torch-natively.

Every process calls :func:`parallelize_sparse` (or :func:`autoplan.parallelize` with the
plan) with the same model.  The first ``num_devices`` ranks are workers, the next
``num_servers`` CPU parameter servers (:mod:`.server`), one torchrun job.  On a worker,
each table of the plan is replaced by a :class:`ShardedTable` that keeps only this rank's
shards; the dense rest runs data parallel over the workers (DDP, or FSDP2 for ZeRO 1-3)
with its own optimizer, as :func:`autoplan.parallelize` runs dense models.

A table's forward, by placement (what :mod:`.cost` prices):

* **table-, row-, column-wise on workers** (TorchRec's pooled-at-owner flow): the ids are
  bucketed by the shard their row falls in and sent, with the index of their bag, to the
  shards' owners (two all-to-alls: counts, then ids); each owner gathers its rows, sums
  them per bag and sends every worker its bags' partial sums (an all-to-all); the worker
  adds the row blocks' partials and places the column blocks'.
* **data-parallel**: a local lookup in the worker's replica.
* **parameter servers**: the worker pulls the distinct rows its ids touch from the servers
  holding them and pools locally.

Backward: the loss's backward gives each pooled output its gradient; then, table by
table in the plan's order, a worker sends each owner the gradient of the partials it
received (an all-to-all), the owner scatters it onto the rows it looked up, and after
every call of the step each owner applies the sparse optimizer (:mod:`.optim`) to the rows
touched, their gradients summed over the workers and divided by them (each worker's loss
is a mean over its samples, as DDP averages); a data-parallel table all-reduces its
dense gradient; a worker pushes its rows' gradients to the servers, which update.
Rows in host memory (``host``) are gathered on the host and copied to the device;
``host_cached`` keeps the shard's hottest rows (the lowest ids: ranked by frequency,
:mod:`.tables`) in a device cache written through on every update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError, PlanMismatchError
from ..runtime.parallelize import _replace, _rows_of, split_rows
from .optim import SparseOptimizerConfig, SparseUpdate
from .plan import Pooling, Shard, Sharding, SparsePlan, Storage, TablePlacement
from .server import PSClient, make_shards, serve
from .tables import TABLE_MODULES

__all__ = ["parallelize_sparse", "SparseParallelModel", "ShardedTable"]


# ---------------------------------------------------------------------------- shards
class _LocalShard:
    """This rank's block of a table: its rows where the plan stores them, its optimizer."""

    def __init__(self, shard: Shard, full: torch.Tensor, storage: Storage, cache_fraction: float,
                 device: torch.device, config: SparseOptimizerConfig) -> None:
        self.shard = shard
        self.storage = storage
        self.device = device
        rows = full[shard.row0:shard.row1, shard.col0:shard.col1].detach().clone()
        self.weight = rows.to(device) if storage is Storage.HBM else rows.to("cpu")
        self.cached = int(round(cache_fraction * shard.rows)) if storage is Storage.HOST_CACHED else 0
        self.cache = self.weight[:self.cached].to(device) if self.cached else None
        self.update = SparseUpdate(config, shard.rows, shard.cols, device=self.weight.device)
        self.hits = 0
        self.misses = 0

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (local row ids) on the worker's device."""
        if self.storage is Storage.HBM:
            return self.weight[ids]
        host_ids = ids.to(self.weight.device)
        if self.cache is None:
            self.misses += len(ids)
            return self.weight[host_ids].to(self.device)
        hit = ids < self.cached
        out = torch.empty(len(ids), self.shard.cols, dtype=self.weight.dtype, device=self.device)
        out[hit] = self.cache[ids[hit]]
        out[~hit] = self.weight[host_ids[~hit.to(host_ids.device)]].to(self.device)
        n_hit = int(hit.sum())
        self.hits += n_hit
        self.misses += len(ids) - n_hit
        return out

    def apply(self, ids: torch.Tensor, grad: torch.Tensor, row_square_sum=None,
              total_cols: int | None = None) -> None:
        ids = ids.to(self.weight.device)
        self.update.apply(self.weight, ids, grad.to(self.weight.device), row_square_sum, total_cols)
        if self.cache is not None:      # written through: the cache never goes stale
            hot = ids[ids < self.cached]
            self.cache[hot.to(self.device)] = self.weight[hot].to(self.device)


@dataclass
class _Call:
    """One forward call of a table in this step, kept for its backward."""

    pooled: torch.Tensor                    # the leaf the dense part's gradient reaches
    uniq: torch.Tensor | None = None        # owner: distinct local rows looked up; DP/PS: rows
    inv: torch.Tensor | None = None
    segments: list[tuple[int, int, torch.Tensor, int]] = field(default_factory=list)
    n_bags: int = 0
    rows_leaf: torch.Tensor | None = None   # DP / PS: the rows the lookup read


class ShardedTable(nn.Module):
    """Replaces an ``nn.Embedding`` / ``nn.EmbeddingBag`` on a worker: this rank's shards
    of the table and the exchanges a lookup needs (see the module docstring)."""

    def __init__(self, name: str, index: int, module: nn.Module, placement: TablePlacement,
                 rt: "_Runtime") -> None:
        super().__init__()
        self.name = name
        self.index = index
        self.placement = placement
        self.rows, self.dim = module.weight.shape
        self.dtype = module.weight.dtype
        self.bag = isinstance(module, nn.EmbeddingBag)
        self.pooling = Pooling(module.mode) if self.bag else Pooling.NONE
        self.padding_idx = module.padding_idx
        self.include_last_offset = getattr(module, "include_last_offset", False)
        self._rt = rt
        self.shards = placement.shards(self.rows, self.dim)
        full = module.weight.detach()
        me = rt.rank
        if placement.sharding is Sharding.DATA_PARALLEL:
            self.replica = full.clone().to(rt.device)
            self.update = SparseUpdate(rt.config, self.rows, self.dim, device=rt.device)
        self.local = None
        if placement.storage is not Storage.SERVER:
            mine = [s for s in self.shards if s.owner == me]
            if mine and placement.sharding is not Sharding.DATA_PARALLEL:
                self.local = _LocalShard(mine[0], full, placement.storage,
                                         placement.cache_fraction, rt.device, rt.config)
        self.calls: list[_Call] = []

    def extra_repr(self) -> str:
        return f"{self.name}: {self.rows}x{self.dim}, {self.placement.describe()}"

    # ------------------------------------------------------------------ inputs
    def _flat(self, input: torch.Tensor, offsets: torch.Tensor | None):
        """Ids, the bag of each, the number of bags and the ids per bag (padding dropped)."""
        dev = input.device
        if not self.bag:
            ids = input.reshape(-1)
            bags = torch.arange(len(ids), device=dev)
            n_bags = len(ids)
        elif input.dim() == 2:
            n_bags, per = input.shape
            ids = input.reshape(-1)
            bags = torch.arange(n_bags, device=dev).repeat_interleave(per)
        else:
            if offsets is None:
                raise ConfigError(f"table {self.name!r}: a 1-D input needs offsets")
            n_bags = len(offsets) - (1 if self.include_last_offset else 0)
            ids = input
            bags = torch.bucketize(torch.arange(len(ids), device=dev), offsets[1:n_bags], right=True)
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            ids, bags = ids[keep], bags[keep]
        if (ids < 0).any() or (ids >= self.rows).any():
            raise ConfigError(f"table {self.name!r}: ids must be in [0, {self.rows})")
        lengths = torch.zeros(n_bags, dtype=torch.float32, device=dev).index_add_(
            0, bags, torch.ones(len(ids), dtype=torch.float32, device=dev))
        return ids, bags, n_bags, lengths

    def _finish(self, pooled: torch.Tensor, lengths: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        if self.pooling is Pooling.MEAN:
            return pooled / lengths.clamp(min=1)[:, None].to(pooled.dtype)
        if self.pooling is Pooling.NONE:
            return pooled.reshape(*input.shape, self.dim)
        return pooled

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if per_sample_weights is not None:
            raise ConfigError(f"table {self.name!r}: per_sample_weights are not supported sharded")
        ids, bags, n_bags, lengths = self._flat(input, offsets)
        p = self.placement
        if p.sharding is Sharding.DATA_PARALLEL or p.storage is Storage.SERVER:
            uniq, inv = ids.unique(return_inverse=True)
            rows = self.replica[uniq] if p.sharding is Sharding.DATA_PARALLEL else self._pull(uniq)
            leaf = rows.detach().requires_grad_()
            values = leaf[inv]
            pooled = torch.zeros(n_bags, self.dim, dtype=values.dtype,
                                 device=values.device).index_add(0, bags, values)
            self.calls.append(_Call(pooled=pooled, uniq=uniq, rows_leaf=leaf))
            return self._finish(pooled, lengths, input)
        pooled = self._sharded_forward(ids, bags, n_bags)
        return self._finish(pooled, lengths, input)

    # ------------------------------------------------------------------ parameter servers
    def _pull(self, uniq: torch.Tensor) -> torch.Tensor:
        parts = []
        for s in self.shards:
            mask = (uniq >= s.row0) & (uniq < s.row1)
            parts.append(self._rt.client.pull(s.owner, self.index, uniq[mask] - s.row0,
                                              self.dim, self.dtype))
        return torch.cat(parts).to(self._rt.device)

    # ------------------------------------------------------------------ pooled at the owner
    def _sharded_forward(self, ids: torch.Tensor, bags: torch.Tensor, n_bags: int) -> torch.Tensor:
        rt = self._rt
        w, dev = rt.workers, rt.device
        # bucket the ids by the shard holding their row: (local id, bag) pairs per owner
        sends: list[torch.Tensor] = [torch.empty(0, 2, dtype=torch.int64, device=dev)] * w
        for s in self.shards:
            mask = (ids >= s.row0) & (ids < s.row1)
            sends[s.owner] = torch.stack([ids[mask] - s.row0, bags[mask]], dim=1).to(torch.int64)
        counts = torch.tensor([[len(x), n_bags] for x in sends], dtype=torch.int64, device=dev)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=rt.group)
        n_in = [int(v) for v in got[:, 0]]
        bags_in = [int(v) for v in got[:, 1]]
        recv = torch.empty(sum(n_in), 2, dtype=torch.int64, device=dev)
        dist.all_to_all_single(recv.view(-1), torch.cat(sends).view(-1),
                               [2 * n for n in n_in], [2 * len(x) for x in sends], group=rt.group)
        call = _Call(pooled=torch.empty(0), n_bags=n_bags)
        local = self.local
        partial = torch.empty(0, dtype=self.dtype, device=dev)
        in_splits = [0] * w
        if local is not None:
            cols = local.shard.cols
            call.uniq, call.inv = recv[:, 0].unique(return_inverse=True)
            values = local.gather(call.uniq)[call.inv]
            pieces, start = [], 0
            for q in range(w):
                seg_bags = recv[start:start + n_in[q], 1]
                pieces.append(torch.zeros(bags_in[q], cols, dtype=values.dtype, device=dev)
                              .index_add_(0, seg_bags, values[start:start + n_in[q]]))
                call.segments.append((start, n_in[q], seg_bags, bags_in[q]))
                in_splits[q] = bags_in[q] * cols
                start += n_in[q]
            partial = torch.cat([x.reshape(-1) for x in pieces])
        out_splits = [0] * w
        for s in self.shards:
            out_splits[s.owner] = n_bags * s.cols
        got_partials = torch.empty(sum(out_splits), dtype=self.dtype, device=dev)
        dist.all_to_all_single(got_partials, partial, out_splits, in_splits, group=rt.group)
        pooled = torch.zeros(n_bags, self.dim, dtype=self.dtype, device=dev)
        offsets = _offsets(out_splits)
        for s in self.shards:
            seg = got_partials[offsets[s.owner]:offsets[s.owner] + out_splits[s.owner]]
            pooled[:, s.col0:s.col1] += seg.view(n_bags, s.cols)
        pooled.requires_grad_()
        call.pooled = pooled
        self.calls.append(call)
        return pooled

    # ------------------------------------------------------------------ backward
    def backward_calls(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After the loss's backward: each call's gradient exchange; returns the local
        shard's (or, for data-parallel and server tables, this worker's) row gradients."""
        rt = self._rt
        out = []
        p = self.placement
        for call in self.calls:
            if call.rows_leaf is not None:          # data-parallel or servers: rows read here
                g = call.rows_leaf.grad
                out.append((call.uniq, g if g is not None else torch.zeros_like(call.rows_leaf)))
                continue
            g = call.pooled.grad
            if g is None:
                g = torch.zeros_like(call.pooled)
            in_splits = [0] * rt.workers
            sends = []
            for s in self.shards:
                in_splits[s.owner] = call.n_bags * s.cols
            for q in range(rt.workers):           # in owner order, each its column block
                block = [s for s in self.shards if s.owner == q]
                if block:
                    sends.append(g[:, block[0].col0:block[0].col1].contiguous().reshape(-1))
            local = self.local
            out_splits = [0] * rt.workers
            if local is not None:
                for q, (_, _, _, nb) in enumerate(call.segments):
                    out_splits[q] = nb * local.shard.cols
            recv = torch.empty(sum(out_splits), dtype=g.dtype, device=rt.device)
            send = torch.cat(sends) if sends else torch.empty(0, dtype=g.dtype, device=rt.device)
            dist.all_to_all_single(recv, send, out_splits, in_splits, group=rt.group)
            if local is None:
                continue
            offsets = _offsets(out_splits)
            per_id = []
            for q, (start, n, seg_bags, nb) in enumerate(call.segments):
                grads_q = recv[offsets[q]:offsets[q] + out_splits[q]].view(nb, local.shard.cols)
                per_id.append(grads_q[seg_bags])
            values = torch.cat(per_id) if per_id else recv.new_zeros(0, local.shard.cols)
            row_grad = torch.zeros(len(call.uniq), local.shard.cols, dtype=values.dtype,
                                   device=rt.device).index_add_(0, call.inv, values)
            out.append((call.uniq, row_grad))
        self.calls = []
        return out

    def apply(self, row_grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The step's sparse update of this table where its rows live."""
        rt = self._rt
        p = self.placement
        ids, grads = _merge(row_grads, self.dim if self.local is None else self.local.shard.cols,
                            self.dtype, rt.device)
        if p.sharding is Sharding.DATA_PARALLEL:
            dense = torch.zeros(self.rows, self.dim, dtype=self.dtype, device=rt.device)
            touched = torch.zeros(self.rows, dtype=torch.int32, device=rt.device)
            dense.index_add_(0, ids, grads)
            touched[ids] = 1
            dist.all_reduce(dense, group=rt.group)
            dist.all_reduce(touched, group=rt.group)
            rows = touched.nonzero().reshape(-1)
            self.update.apply(self.replica, rows, dense[rows] / rt.workers)
            return
        if p.storage is Storage.SERVER:
            for s in self.shards:
                mask = (ids >= s.row0) & (ids < s.row1)
                rt.client.push(s.owner, self.index, ids[mask] - s.row0, grads[mask])
            return
        if self.local is None:
            return
        square_sum = None
        if p.sharding is Sharding.COLUMN_WISE and self.local.update.needs_row_squares:
            group = rt.column_groups[tuple(sorted(p.devices))]

            def square_sum(s: torch.Tensor) -> torch.Tensor:
                dist.all_reduce(s, group=group)
                return s
        self.local.apply(ids, grads / rt.workers, square_sum, self.dim)

    # ------------------------------------------------------------------ state
    def local_state(self) -> list[tuple[Shard, torch.Tensor]]:
        if self.placement.sharding is Sharding.DATA_PARALLEL:
            return [(Shard(self._rt.rank, 0, self.rows, 0, self.dim), self.replica.detach().cpu())]
        if self.local is None:
            return []
        return [(self.local.shard, self.local.weight.detach().cpu())]


def _offsets(splits: list[int]) -> list[int]:
    out, acc = [], 0
    for s in splits:
        out.append(acc)
        acc += s
    return out


def _merge(row_grads: list[tuple[torch.Tensor, torch.Tensor]], cols: int, dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One gradient per distinct row over a step's calls."""
    if not row_grads:
        return (torch.empty(0, dtype=torch.int64, device=device),
                torch.empty(0, cols, dtype=dtype, device=device))
    ids = torch.cat([i for i, _ in row_grads])
    grads = torch.cat([g for _, g in row_grads])
    uniq, inv = ids.unique(return_inverse=True)
    return uniq, torch.zeros(len(uniq), grads.shape[1], dtype=grads.dtype,
                             device=grads.device).index_add_(0, inv, grads)


# ---------------------------------------------------------------------------- the program
@dataclass
class _Runtime:
    rank: int
    workers: int
    device: torch.device
    group: Any
    config: SparseOptimizerConfig
    client: PSClient
    column_groups: dict[tuple[int, ...], Any]


@dataclass
class SparseParallelModel:
    """A :class:`~.plan.SparsePlan` running on this process: a worker's model or a server.

    Attributes
    ----------
    plan : SparsePlan
    role : str
        ``"worker"`` or ``"server"`` (a server's :func:`parallelize_sparse` returns once
        the workers have called :meth:`close`).
    module : nn.Module or None
        A worker's model: its tables replaced by :class:`ShardedTable` s, the dense rest
        under DDP (ZeRO 0) or FSDP2.
    tables : dict of str to ShardedTable
    optimizer : torch.optim.Optimizer or None
        The dense part's.
    """

    plan: SparsePlan
    role: str
    module: nn.Module | None = None
    tables: dict[str, ShardedTable] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None
    loss_fn: Callable | None = None
    runtime: _Runtime | None = None
    steps: int = 0
    closed: bool = False

    @property
    def is_server(self) -> bool:
        return self.role == "server"

    def _check_worker(self, what: str) -> _Runtime:
        if self.is_server or self.runtime is None:
            raise ConfigError(f"{what} runs on a worker; this process is a parameter server "
                              "(its parallelize returned after the workers closed the job)")
        if self.closed:
            raise ConfigError(f"{what} after close(): the servers have stopped")
        return self.runtime

    def step(self, batch: Any) -> float:
        """One training step on the global ``batch`` = ``(inputs, targets)``, every tensor
        with ``global_batch`` rows; returns the mean loss over the global batch."""
        rt = self._check_worker("step()")
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError("a batch is (inputs, targets); inputs a tensor, a tuple or a dict "
                              "of tensors, each with global_batch rows")
        inputs, targets = batch
        rows = _rows_of(inputs) | _rows_of(targets)
        if rows != {self.plan.global_batch}:
            raise ConfigError(f"every tensor of the batch has global_batch={self.plan.global_batch} "
                              f"rows; got {sorted(rows)}")
        n = self.plan.global_batch // rt.workers
        x = split_rows(inputs, rt.rank * n, n, rt.device)
        y = split_rows(targets, rt.rank * n, n, rt.device)
        assert self.module is not None and self.optimizer is not None and self.loss_fn is not None
        out = (self.module(**x) if isinstance(x, dict) else
               self.module(*x) if isinstance(x, (tuple, list)) else self.module(x))
        loss = self.loss_fn(out, y)
        loss.backward()
        for table in self.tables.values():           # the plan's order on every worker
            table.apply(table.backward_calls())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total, group=rt.group)
        return float(total) / rt.workers

    def table_weights(self) -> dict[str, torch.Tensor] | None:
        """Every table's full weight on worker 0 (``None`` on the others); collective over
        the workers (and the servers, which send theirs)."""
        rt = self._check_worker("table_weights()")
        mine = {name: t.local_state() for name, t in self.tables.items()}
        gathered: list | None = [None] * rt.workers if rt.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=rt.group)
        server_parts: dict[str, list[tuple[Shard, torch.Tensor]]] = {}
        for s in range(self.plan.num_servers):
            shards = [(t.index, sh) for t in self.tables.values()
                      if t.placement.storage is Storage.SERVER for sh in t.shards if sh.owner == s]
            got = rt.client.state(s, shards, next(iter(self.tables.values())).dtype)
            if got is not None:
                names = {t.index: name for name, t in self.tables.items()}
                for (i, sh), w in zip(shards, got):
                    server_parts.setdefault(names[i], []).append((sh, w))
        if rt.rank != 0:
            return None
        out = {}
        for name, t in self.tables.items():
            full = torch.zeros(t.rows, t.dim, dtype=t.dtype)
            parts = [p for g in gathered for p in g[name]] + server_parts.get(name, [])
            for sh, w in parts:
                full[sh.row0:sh.row1, sh.col0:sh.col1] = w
            out[name] = full
        return out

    def cache_stats(self) -> dict[str, tuple[int, int]]:
        """``(hits, misses)`` of this worker's device caches, per host-cached table."""
        return {name: (t.local.hits, t.local.misses) for name, t in self.tables.items()
                if t.local is not None and t.local.cache is not None}

    def close(self) -> None:
        """Stop the parameter servers (every worker calls it once training is over)."""
        if self.is_server or self.closed:
            return
        rt = self._check_worker("close()")
        for s in range(self.plan.num_servers):
            rt.client.stop(s)
        self.closed = True


def _check(model: nn.Module, plan: SparsePlan) -> dict[str, nn.Module]:
    """The model's tables against the plan, before any collective (same error everywhere)."""
    if not isinstance(plan, SparsePlan):
        raise ConfigError(f"expected a SparsePlan, got {type(plan).__name__}")
    world = dist.get_world_size()
    if world != plan.num_devices + plan.num_servers:
        raise PlanMismatchError(f"the plan has {plan.num_devices} workers + {plan.num_servers} "
                                f"servers = {plan.num_devices + plan.num_servers} processes, the "
                                f"job {world}; launch that many (torchrun --nproc-per-node ...)")
    if plan.global_batch % plan.num_devices:
        raise PlanMismatchError(f"global_batch={plan.global_batch} does not split evenly over "
                                f"{plan.num_devices} workers")
    modules = {name: m for name, m in model.named_modules() if isinstance(m, TABLE_MODULES)}
    planned = [p.table for p in plan.tables]
    missing = [n for n in planned if n not in modules]
    unplanned = [n for n in modules if n not in planned]
    if missing or unplanned:
        raise PlanMismatchError(f"the plan places tables {missing[:5]} the model lacks, and not "
                                f"{unplanned[:5]} it has: plan this model (trace_sparse)")
    for p in plan.tables:
        m = modules[p.table]
        if isinstance(m, nn.EmbeddingBag) and m.mode == "max" and p.sharding is not Sharding.DATA_PARALLEL:
            raise ConfigError(f"table {p.table!r} max-pools: only data-parallel runs it")
        if p.storage is Storage.SERVER and any(s >= plan.num_servers for s in p.devices):
            raise PlanMismatchError(f"table {p.table!r} names servers {list(p.devices)} of "
                                    f"{plan.num_servers}")
        if p.storage is not Storage.SERVER and any(d >= plan.num_devices for d in p.devices):
            raise PlanMismatchError(f"table {p.table!r} names devices {list(p.devices)} of "
                                    f"{plan.num_devices}")
        p.shards(m.num_embeddings, m.embedding_dim)     # raises on an impossible split
        if any(x.is_meta for x in m.parameters()):
            raise ConfigError("the model has parameters on the meta device; materialise and "
                              "initialise it (identically on every rank) before parallelize()")
    return modules


def parallelize_sparse(model: nn.Module, plan: SparsePlan, *, loss_fn: Callable | None = None,
                       optimizer: Callable | None = None,
                       sparse_optimizer: SparseOptimizerConfig | None = None) -> SparseParallelModel:
    """Lay ``model`` out over the job as ``plan`` says (every rank calls it alike).

    Parameters
    ----------
    model : nn.Module
        The full model, materialised and identical on every rank.
    plan : SparsePlan
        From :func:`~autoplan.sparse.plan_sparse` (or built by hand).
    loss_fn : callable
        ``loss_fn(output, targets) -> scalar``, a mean over the samples.
    optimizer : callable, optional
        ``optimizer(params)`` for the dense part; default
        :func:`~autoplan.runtime.optim.default_optimizer` (AdamW, fused).
    sparse_optimizer : SparseOptimizerConfig, optional
        The embedding rows' optimizer; default the plan's kind with its default
        hyper-parameters.

    Returns
    -------
    SparsePlan's program on this rank: a worker's (train with :meth:`~SparseParallelModel.step`,
    end with :meth:`~SparseParallelModel.close`), or a server's, returned once the workers
    closed the job.
    """
    from ..runtime.optim import default_optimizer

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("parallelize() runs inside a torch.distributed job: call "
                          "torch.distributed.init_process_group first (e.g. under torchrun)")
    modules = _check(model, plan)
    config = sparse_optimizer or SparseOptimizerConfig(kind=plan.optimizer)
    if config.kind is not plan.optimizer:
        raise ConfigError(f"sparse_optimizer is {config.kind.value} but the plan was priced with "
                          f"{plan.optimizer.value}")
    if loss_fn is None:
        raise ConfigError("pass loss_fn(output, targets) for an embedding model")
    workers, rank = plan.num_devices, dist.get_rank()
    # ---- collectives from here on, in the same order on every rank
    group = dist.new_group(list(range(workers))) if plan.num_servers else dist.group.WORLD
    column_groups: dict[tuple[int, ...], Any] = {}
    if SparseUpdate(config, 1, 1).needs_row_squares:
        for p in plan.tables:
            key = tuple(sorted(p.devices))
            if p.sharding is Sharding.COLUMN_WISE and key not in column_groups:
                column_groups[key] = dist.new_group(list(key))
    client = PSClient(workers)
    if rank >= workers:
        shards = make_shards(plan.tables, [_Shape(p.table, modules[p.table]) for p in plan.tables],
                             {p.table: modules[p.table].weight for p in plan.tables},
                             rank - workers, config)
        serve(shards, workers)
        return SparseParallelModel(plan=plan, role="server")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    rt = _Runtime(rank=rank, workers=workers, device=device, group=group, config=config,
                  client=client, column_groups=column_groups)
    tables = {}
    for i, p in enumerate(plan.tables):
        tables[p.table] = ShardedTable(p.table, i, modules[p.table], p, rt)
    for name, t in tables.items():
        _replace(model, name, t)
    module = _data_parallel(model, plan, group, workers)
    params = [q for q in module.parameters() if q.requires_grad]
    dense_opt = (optimizer or default_optimizer)(params)
    return SparseParallelModel(plan=plan, role="worker", module=module, tables=tables,
                               optimizer=dense_opt, loss_fn=loss_fn, runtime=rt)


@dataclass(frozen=True)
class _Shape:
    name: str
    module: nn.Module

    @property
    def rows(self) -> int:
        return self.module.num_embeddings

    @property
    def dim(self) -> int:
        return self.module.embedding_dim


def _data_parallel(model: nn.Module, plan: SparsePlan, group: Any, workers: int) -> nn.Module:
    """The dense rest over the workers: DDP at ZeRO 0, FSDP2 (the root as one unit) above."""
    if workers == 1 or not any(True for _ in model.parameters()):
        return model
    if plan.dense.zero == 0:
        return nn.parallel.DistributedDataParallel(model, process_group=group)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type)
    fully_shard(model, mesh=mesh, reshard_after_forward=plan.dense.zero == 3)
    return model
