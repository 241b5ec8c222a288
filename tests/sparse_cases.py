"""Shared pieces of the sparse runtime's parity tests (importable by spawned ranks).

:class:`ParityModel` holds one table per placement the runtime runs (table-, row- and
column-wise in device memory, data-parallel, host memory with and without a device cache,
table- and row-wise on parameter servers, and an ``nn.Embedding`` with a row per id),
sum and mean pooling, and a small dense part.  :func:`reference` trains it in one
process on the whole global batch (AdamW for the dense part, the sparse optimizer's
reference for the tables); :func:`worker` trains the same steps under a plan and returns
its losses and, on rank 0, every table and dense parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.sparse.optim import SparseOptimizerConfig, reference_optimizer

GLOBAL_BATCH = 12
DIM = 8
STEPS = 3
ATOL = 1e-5
DENSE_LR = 1e-2
SPARSE_LR = {"sgd": 5.0, "rowwise_adagrad": 0.1, "adam": 0.1}   # each moves every table
#: name -> (rows, ids per sample, pooling); "seq" is an nn.Embedding (a row per id)
TABLES = {
    "tw": (40, 3, "sum"), "rw": (37, 4, "sum"), "cw": (30, 2, "mean"), "dp": (10, 2, "sum"),
    "ps_tw": (2000, 3, "sum"), "ps_rw": (3000, 3, "mean"), "host": (25, 2, "sum"),
    "cached": (60, 4, "sum"), "seq": (20, 2, "none"),
}


class ParityModel(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(4, DIM), nn.ReLU())
        self.tables = nn.ModuleDict({
            name: (nn.Embedding(rows, DIM, sparse=sparse) if mode == "none"
                   else nn.EmbeddingBag(rows, DIM, mode=mode, sparse=sparse))
            for name, (rows, _, mode) in TABLES.items()})
        self.top = nn.Sequential(nn.Linear(DIM * (len(TABLES) + 1), 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        parts = ids.split([hot for _, hot, _ in TABLES.values()], dim=1)
        pooled = []
        for (name, (_, _, mode)), part in zip(TABLES.items(), parts):
            out = self.tables[name](part)
            pooled.append(out.mean(dim=1) if mode == "none" else out)
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(-1)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(out, y)


def make_model(sparse: bool = False) -> ParityModel:
    torch.manual_seed(0)
    return ParityModel(sparse=sparse)


def batch(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    dense = torch.randn(GLOBAL_BATCH, 4, generator=g)
    cols = []
    for rows, hot, _ in TABLES.values():
        # skewed ids: the lowest ids (the "hot" rows of a frequency-ranked vocabulary) most
        u = torch.rand(GLOBAL_BATCH, hot, generator=g)
        cols.append((u ** 2 * rows).long().clamp(max=rows - 1))
    targets = torch.randint(0, 2, (GLOBAL_BATCH,), generator=g).float()
    return (dense, torch.cat(cols, dim=1)), targets


def example_inputs():
    return batch(0)[0]


def config(kind: str) -> SparseOptimizerConfig:
    return SparseOptimizerConfig(kind=kind, lr=SPARSE_LR[kind])


def reference(kind: str, steps: int = STEPS,
              default_lr: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the whole global batch: losses, final parameters."""
    from autoplan.runtime.optim import default_optimizer

    model = make_model(sparse=kind == "adam")
    tables = [m.weight for m in model.tables.values()]
    ids = {id(p) for p in tables}
    dense = default_optimizer([p for p in model.parameters() if id(p) not in ids], lr=DENSE_LR)
    sparse = reference_optimizer(SparseOptimizerConfig(kind=kind) if default_lr else config(kind),
                                 tables)
    return _train(model, [dense, sparse], steps)


def _train(model: nn.Module, optimizers: list, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` steps on the whole global batch: the losses and the final state."""
    losses = []
    for s in range(steps):
        (x, i), y = batch(s)
        loss = loss_fn(model(x, i), y)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(rank: int, world: int, plan_json: str, kind: str, steps: int = STEPS,
           default_lr: bool = False) -> dict | None:
    """One rank of a job running ``plan_json``: losses, and on rank 0 the state.

    ``default_lr``: through :func:`autoplan.parallelize` with the sparse optimizer's
    default hyper-parameters; otherwise :func:`parallelize_sparse` with :data:`SPARSE_LR`.
    """
    import functools

    import autoplan
    from autoplan.runtime.optim import default_optimizer
    from autoplan.sparse import SparsePlan
    from autoplan.sparse.runtime import parallelize_sparse

    plan = SparsePlan.from_json(plan_json)
    model = make_model()
    dense_opt = functools.partial(default_optimizer, lr=DENSE_LR)
    if default_lr:
        pm = autoplan.parallelize(model, plan, loss_fn=loss_fn, optimizer=dense_opt)
    else:
        pm = parallelize_sparse(model, plan, loss_fn=loss_fn, optimizer=dense_opt,
                                sparse_optimizer=config(kind))
    if pm.is_server:
        return None
    losses = [pm.step(batch(s)) for s in range(steps)]
    weights = pm.table_weights()
    dense = None
    module = pm.module.module if isinstance(pm.module, nn.parallel.DistributedDataParallel) \
        else pm.module
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in module.state_dict().items()}
    cache = pm.cache_stats()
    pm.close()
    if rank == 0:
        dense = state
    return {"losses": losses, "tables": weights, "dense": dense, "cache": cache}


# ---------------------------------------------------------------------------- plans
def graph():
    from autoplan.sparse import trace_sparse

    return trace_sparse(make_model(), example_inputs())


def plan_json(graph, workers: int, servers: int, kind: str, layout: dict, zero: int = 0) -> str:
    """A hand-made plan: ``layout`` maps table -> (sharding, storage, devices[, cache]),
    priced on ``workers`` A100s of one node and ``servers`` CPU servers."""
    from autoplan.hardware import load_cluster
    from autoplan.sparse import TablePlacement, estimate_sparse

    cluster = load_cluster("a100-sxm4-80gb", devices_per_node=workers)
    if servers:
        cluster = cluster.with_servers("cpu-server-2s-epyc", servers)
    placements = [TablePlacement(f"tables.{name}", sh, st, tuple(dev), *rest)
                  for name, (sh, st, dev, *rest) in layout.items()]
    return estimate_sparse(graph, cluster, placements, global_batch=GLOBAL_BATCH, zero=zero,
                           optimizer=kind, precision="fp32").to_json()


def expected_hits(layout_devices: tuple[int, ...], cache_fraction: float, steps: int = STEPS) -> dict[int, int]:
    """Device cache hits of the row-wise ``cached`` table per owner: the distinct rows of a
    step's lookups whose local id falls in the shard's cached rows (lookups gather
    distinct rows)."""
    from autoplan.sparse import Sharding, Storage, TablePlacement

    rows = TABLES["cached"][0]
    p = TablePlacement("tables.cached", Sharding.ROW_WISE, Storage.HOST_CACHED, layout_devices,
                       cache_fraction)
    col = list(TABLES).index("cached")
    start = sum(h for _, h, _ in list(TABLES.values())[:col])
    hits = {d: 0 for d in layout_devices}
    for s in range(steps):
        ids = batch(s)[0][1][:, start:start + TABLES["cached"][1]].reshape(-1)
        for sh in p.shards(rows, DIM):
            local = ids[(ids >= sh.row0) & (ids < sh.row1)].unique() - sh.row0
            hits[sh.owner] += int((local < round(cache_fraction * sh.rows)).sum())
    return hits


# ---------------------------------------------------------------------------- dense mode
def dense_reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The model of several inputs trained in one process, every parameter by AdamW."""
    from autoplan.runtime.optim import default_optimizer

    model = make_model()
    return _train(model, [default_optimizer(model.parameters(), lr=DENSE_LR)], steps)


def dense_worker(rank: int, world: int, zero: int, micro_batch: int) -> dict:
    """The same model of several inputs under autoplan.parallelize's collective mode (its
    tables replicated as weights): ``step(((dense, ids), targets))``."""
    import functools

    import autoplan
    from autoplan.runtime.optim import default_optimizer

    strategy = autoplan.Strategy(dp=world, micro_batch=micro_batch, global_batch=GLOBAL_BATCH,
                                 zero=zero, precision="fp32")
    pm = autoplan.parallelize(make_model(), strategy, example_inputs=example_inputs(),
                              loss_fn=loss_fn,
                              optimizer=functools.partial(default_optimizer, lr=DENSE_LR))
    losses = [pm.step(batch(s)) for s in range(STEPS)]
    return {"losses": losses, "state": pm.full_state_dict()}
