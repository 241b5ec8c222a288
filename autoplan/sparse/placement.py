"""Placing embedding tables: OR-Tools CP-SAT, and a TorchRec-style greedy baseline.

Both choose, for every table, one placement (:class:`~.plan.TablePlacement`) among the
same options (:func:`table_options`: data-parallel; table-wise on any device; row-wise
over every device or over one node's; column-wise over groups of a node's devices; each
in device memory, host memory, or host memory with a device cache; table- or row-wise on
parameter servers), priced by the same cost model (:class:`~.cost.SparseCostModel`), and
the dense part's ZeRO stage.

* :func:`plan_sparse` solves it with CP-SAT: a boolean per (table, option), one per table;
  every device's memory, every node's host memory and every server's memory bound what
  they hold; the objective is the step (``dense + busiest worker + busiest server``,
  :mod:`.cost`), or with prices the cost per sample (one solve per number of servers
  rented).  The greedy solution is its hint.
* :func:`greedy_plan` is TorchRec's planner in miniature (``GreedyProposer`` +
  ``GreedyPerfPartitioner``, torchrec/distributed/planner/): tables sorted by the cost of
  their cheapest option, each placed in turn on its cheapest kind of option that fits,
  on the least loaded device.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from ortools.sat.python import cp_model

from ..cost.calibration import DEFAULT_CALIBRATION, Calibration
from ..cost.constants import CostOptions
from ..errors import ConfigError, InfeasiblePlan
from ..hardware.cluster import Cluster, as_cluster
from ..records import Record
from ..strategy import Precision
from .cost import SparseConstants, SparseCostModel, TableLoads
from .plan import Pooling, Sharding, SparseOptimizer, SparsePlan, Storage, TablePlacement
from .tables import EmbeddingTable, SparseGraph

__all__ = ["Prices", "table_options", "plan_sparse", "greedy_plan", "estimate_sparse"]

#: Integer units of the CP-SAT model: time in 10 ns ticks, memory in bytes.
_TICKS_PER_S = 1e8
_ZERO_STAGES = (0, 1, 2, 3)
#: The share of free device memory TorchRec's planner keeps from tables
#: (``HeuristicalStorageReservation(percentage=0.15)``, torchrec/distributed/planner/
#: storage_reservations.py); the greedy baseline does the same.
_TORCHREC_HBM_RESERVE = 0.15
#: Deterministic seconds CP-SAT gets at least per window of a large problem (less finds
#: nothing beyond its hint on 64 tables of 16 devices).
_WINDOW_TIME_S = 0.5


@dataclass(frozen=True)
class Prices(Record):
    """Rental prices for the ``cost`` objective, with where they come from."""

    device_hour: float     # one device (GPU) for an hour
    server_hour: float     # one CPU server for an hour
    source: str

    def __post_init__(self) -> None:
        if not (self.device_hour > 0 and self.server_hour >= 0):
            raise ConfigError(f"prices must be > 0 per device hour and >= 0 per server hour, "
                              f"got {self.device_hour!r}, {self.server_hour!r}")

    def per_hour(self, devices: int, servers: int) -> float:
        return devices * self.device_hour + servers * self.server_hour


# ---------------------------------------------------------------------------- options
def table_options(model: SparseCostModel, table: EmbeddingTable, *,
                  storages: Iterable[Storage] | None = None, cache_fraction: float = 0.2,
                  min_column_width: int = 32, servers: int | None = None) -> list[TablePlacement]:
    """Every placement the planners consider for ``table`` on ``model``'s cluster.

    ``storages`` limits where rows may live (default: device memory, host memory with
    and without a cache where the profiles state a host link, servers where the cluster
    has them); ``servers`` limits the servers to the first ones; column blocks are at
    least ``min_column_width`` wide.
    """
    c = model.cluster
    allowed = set(storages) if storages is not None else set(Storage)
    host_ok = all(d.host_link_bw is not None for d in model.devices)
    n_servers = len(c.servers) if servers is None else min(servers, len(c.servers))
    workers = model.workers
    out: list[TablePlacement] = []
    if table.pooling is Pooling.MAX:       # max pooling runs data-parallel only (cost.loads)
        return [TablePlacement(table.name, Sharding.DATA_PARALLEL, Storage.HBM, workers)]
    device_storages = [s for s in (Storage.HBM, Storage.HOST, Storage.HOST_CACHED)
                       if s in allowed and (s is Storage.HBM or host_ok)]

    def add(sharding: Sharding, storage: Storage, devices: Sequence[int]) -> None:
        cf = cache_fraction if storage is Storage.HOST_CACHED else 0.0
        out.append(TablePlacement(table.name, sharding, storage, tuple(devices), cf))

    if Storage.HBM in allowed:
        add(Sharding.DATA_PARALLEL, Storage.HBM, workers)
    groups = [tuple(c.devices_of_node(n)) for n in range(c.num_nodes)]
    for storage in device_storages:
        for d in workers:
            add(Sharding.TABLE_WISE, storage, (d,))
        row_groups = [workers] + (groups if len(groups) > 1 else [])
        for g in row_groups:
            if 1 < len(g) and _row_blocks_fill(table.rows, len(g)):
                add(Sharding.ROW_WISE, storage, g)
        for g in groups:
            k = 2
            while k <= len(g) and table.dim % k == 0 and table.dim // k >= min_column_width:
                for i in range(0, len(g) - k + 1, k):
                    add(Sharding.COLUMN_WISE, storage, g[i:i + k])
                k *= 2
    if Storage.SERVER in allowed and n_servers:
        for s in range(n_servers):
            add(Sharding.TABLE_WISE, Storage.SERVER, (s,))
        if 1 < n_servers and _row_blocks_fill(table.rows, n_servers):
            add(Sharding.ROW_WISE, Storage.SERVER, tuple(range(n_servers)))
    return out


def _row_blocks_fill(rows: int, k: int) -> bool:
    """Whether ``k`` row blocks of ``ceil(rows / k)`` rows leave none empty."""
    return -(-rows // k) * (k - 1) < rows


_KINDS = ("gpu", "dp", "server")


def _kind(p: TablePlacement) -> int:
    """The index in :data:`_KINDS` of what every worker pays for ``p``'s kind of placement."""
    if p.storage is Storage.SERVER:
        return 2
    return 1 if p.sharding is Sharding.DATA_PARALLEL else 0


@dataclass
class _Table:
    """One table's options as arrays (options x resources): what both planners read.

    ``own``/``srv``: seconds on each device (the shards it owns) and server; ``base``:
    per kind, what every device pays whichever option of the kind is taken (``worker``
    minus ``base`` of an option is added to its own); ``hbm`` (options x devices) and
    ``hbm_base`` (kinds x devices), ``host`` (options x nodes), ``smem`` (options x servers).
    """

    options: list[TablePlacement]
    kind: np.ndarray
    own: np.ndarray
    srv: np.ndarray
    base: np.ndarray
    hbm: np.ndarray
    hbm_base: np.ndarray
    host: np.ndarray
    smem: np.ndarray

    def __post_init__(self) -> None:
        self._device_s = self.own + self.base[self.kind]
        self._device_hbm = self.hbm + self.hbm_base[self.kind]
        self._storage = [p.storage for p in self.options]
        # TorchRec's perf of an option: the seconds its shards take where they run
        self.perf = self.own.sum(axis=1) + self.srv.sum(axis=1)
        kinds: dict[tuple, list[int]] = {}
        for o, p in enumerate(self.options):
            kinds.setdefault((p.sharding, p.storage, p.cache_fraction, len(p.devices)), []).append(o)
        # the options of each kind (same sharding and storage, other devices), cheapest first
        self.groups = [np.array(g) for g in sorted(
            kinds.values(), key=lambda g: (float(self.perf[g].min()), g[0]))]

    def device_s(self) -> np.ndarray:
        """Seconds of every option on every device (options x devices)."""
        return self._device_s

    def device_hbm(self) -> np.ndarray:
        return self._device_hbm

    def storage_in(self, storages: frozenset[Storage]) -> np.ndarray:
        return np.array([s in storages for s in self._storage])


def _arrays(model: SparseCostModel, options: list[TablePlacement], table: EmbeddingTable,
            classes: tuple[list[int], list[int]]) -> _Table:
    n_o, n_d, n_s = len(options), len(model.workers), len(model.servers)
    n_n = model.cluster.num_nodes
    worker = np.zeros((n_o, n_d))
    own, srv = np.zeros((n_o, n_d)), np.zeros((n_o, n_s))
    hbm, host, smem = np.zeros((n_o, n_d)), np.zeros((n_o, n_n)), np.zeros((n_o, n_s))
    kind = np.array([_kind(p) for p in options], dtype=np.int64)
    loads = _loads_by_translation(model, table, options, classes)
    for o, ld in enumerate(loads):
        for d, v in ld.worker_s.items():
            worker[o, d] = v
        for d, v in ld.owner.items():
            own[o, d] = sum(v)
        for s_, v in ld.server.items():
            srv[o, s_] = sum(v)
        for d, v in ld.hbm.items():
            hbm[o, d] = v
        for n, v in ld.host.items():
            host[o, n] = v
        for s_, v in ld.server_mem.items():
            smem[o, s_] = v
    base, hbm_base = np.zeros((len(_KINDS), n_d)), np.zeros((len(_KINDS), n_d))
    for k in range(len(_KINDS)):
        rows = kind == k
        if rows.any():
            base[k] = worker[rows].min(axis=0)
            if k == 2:      # a server option's buffers sit on every worker: a kind's
                hbm_base[k] = hbm[rows].min(axis=0)
    own += worker - base[kind]
    hbm -= hbm_base[kind]
    return _Table(options, kind, own, srv, base, hbm, hbm_base, host, smem)


def _classes(model: SparseCostModel) -> tuple[list[int], list[int]]:
    """Each device's node, and the class of its figures without the node (devices of equal
    figures price a placement alike)."""
    node_of = [model.cluster._device(d).node for d in model.workers]
    ids: dict[object, int] = {}
    classes = [ids.setdefault(dataclasses.replace(dev, node=0), len(ids)) for dev in model.devices]
    return node_of, classes


def _loads_by_translation(model: SparseCostModel, table: EmbeddingTable,
                          options: list[TablePlacement],
                          classes: tuple[list[int], list[int]]) -> list[TableLoads]:
    """``model.loads`` of every option, computed once per class of equivalent placements:
    the same sharding and storage on devices of the same figures (profile, link shares) is
    priced once and moved to the other devices and their nodes."""
    node_of, device_class = classes
    done: dict[tuple, tuple[TablePlacement, TableLoads]] = {}
    out = []
    for p in options:
        if p.storage is Storage.SERVER or p.sharding is Sharding.DATA_PARALLEL:
            out.append(model.loads(table, p))
            continue
        key = (p.sharding, p.storage, p.cache_fraction, tuple(device_class[d] for d in p.devices))
        if key not in done:
            done[key] = (p, model.loads(table, p))
            out.append(done[key][1])
            continue
        first, ld = done[key]
        dev = dict(zip(first.devices, p.devices))
        node = {node_of[a]: node_of[b] for a, b in dev.items()}
        out.append(TableLoads(worker_s=ld.worker_s,
                              owner={dev[d]: v for d, v in ld.owner.items()},
                              hbm={dev[d]: v for d, v in ld.hbm.items()},
                              host={node[n]: v for n, v in ld.host.items()}))
    return out


@dataclass
class _Problem:
    """Every option of every table, priced, and the dense part's ZeRO stages."""

    model: SparseCostModel
    tables: list[_Table]
    dense_s: dict[int, float] = field(default_factory=dict)
    dense_hbm: dict[int, float] = field(default_factory=dict)

    @classmethod
    def build(cls, model: SparseCostModel, **option_kw) -> "_Problem":
        tables = []
        classes = _classes(model)
        for t in model.graph.tables:
            opts = table_options(model, t, **option_kw)
            if not opts:
                raise InfeasiblePlan(f"table {t.name!r} has no placement to choose from: allow "
                                     "more storages (device memory, host memory, servers)")
            tables.append(_arrays(model, opts, t, classes))
        prob = cls(model, tables)
        for z in _ZERO_STAGES:
            _, est = model.dense(z)
            prob.dense_s[z] = est.step_time_s
            prob.dense_hbm[z] = est.stages[0].peak_memory_bytes
        return prob

    def capacities(self, zero: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = self.model
        return (np.array([d.hbm_capacity - self.dense_hbm[zero] for d in m.devices]),
                np.array([m.host_capacity(n) for n in range(m.cluster.num_nodes)]),
                np.array([s.capacity for s in m.servers]))

    def objective(self, chosen: list[int], zero: int) -> float:
        dev = sum(t.device_s()[o] for t, o in zip(self.tables, chosen))
        srv = sum(t.srv[o] for t, o in zip(self.tables, chosen))
        return self.dense_s[zero] + float(dev.max(initial=0.0)) + float(srv.max(initial=0.0))


# ---------------------------------------------------------------------------- greedy
def _greedy(prob: _Problem, storages: frozenset[Storage] | None = None) -> list[int]:
    """TorchRec-style greedy: tables by the perf of their cheapest option, largest first;
    each on its cheapest kind of option that fits, on the least loaded devices (options
    storing rows in ``storages`` only, when given)."""
    m = prob.model
    hbm, host, srv = prob.capacities(0)
    # as TorchRec's planner, tables take at most (1 - reserve) of the free device memory;
    # the reserve is the last resort of a table that fits nowhere else
    reserve = hbm * _TORCHREC_HBM_RESERVE
    table_hbm = hbm - reserve
    load = np.zeros(len(m.workers))
    sload = np.zeros(len(m.servers))
    # (the order is TorchRec's: by the cheapest option of any storage)
    order = sorted(range(len(prob.tables)), key=lambda i: (-float(prob.tables[i].perf.min()), i))
    chosen = [-1] * len(prob.tables)
    for i in order:
        t = prob.tables[i]
        dev_hbm = t.device_hbm()
        rest = (t.host <= host).all(axis=1) & (t.smem <= srv).all(axis=1)
        if storages is not None:
            rest &= t.storage_in(storages)
        fits = (dev_hbm <= table_hbm).all(axis=1) & rest
        if not fits.any():
            fits = (dev_hbm <= table_hbm + reserve).all(axis=1) & rest
        for group in t.groups:
            fitting = group[fits[group]]
            if not len(fitting):
                continue
            # the least loaded of the devices (or servers) each option would use
            busy = np.maximum(np.where(t.own[fitting] > 0, load, 0.0).max(axis=1, initial=0.0),
                              np.where(t.srv[fitting] > 0, sload, 0.0).max(axis=1, initial=0.0))
            o = int(fitting[int(np.argmin(busy))])
            load += t.device_s()[o]
            sload += t.srv[o]
            table_hbm -= dev_hbm[o]
            reserve += np.minimum(table_hbm, 0.0)       # what the reserve lent
            table_hbm = np.maximum(table_hbm, 0.0)
            host -= t.host[o]
            srv -= t.smem[o]
            chosen[i] = o
            break
        if chosen[i] < 0:
            tb = m.graph.tables[i]
            raise InfeasiblePlan(
                f"no placement of table {tb.name!r} ({tb.weight_bytes / 2**30:.2f} GiB) fits what "
                "the tables placed before it left: add devices, host memory or servers",
                required_bytes=float(tb.weight_bytes), binding="memory")
    return chosen


def _hint(prob: _Problem) -> list[int]:
    """The CP-SAT hint: the best of hill climbs from greedy placements that keep rows in
    device memory, and in host memory or on servers or both.  One move changes one table,
    so a climb from a start that uses servers rarely empties them (each table moved off
    costs the workers before the last one frees the servers); starting without them
    finds the plans that do not rent them."""
    present = {p.storage for t in prob.tables for p in t.options}
    families = [frozenset({Storage.HOST, Storage.HOST_CACHED}) & present,
                frozenset({Storage.SERVER}) & present]
    families = [f for f in families if f]
    best: tuple[float, list[int]] | None = None
    for r in range(len(families) + 1):
        for extra in itertools.combinations(families, r):
            allowed = frozenset({Storage.HBM}.union(*extra))
            try:
                start = _greedy(prob, allowed)
            except InfeasiblePlan:
                continue
            chosen = _improve(prob, _improve(prob, start, 0, allowed), 0)
            score = prob.objective(chosen, 0)
            if best is None or score < best[0]:
                best = (score, chosen)
    if best is None:        # no greedy start fits: CP-SAT starts from the cheapest options
        return [int(np.argmin(t.perf)) for t in prob.tables]
    return best[1]


def _improve(prob: _Problem, chosen: list[int], zero: int,
             storages: frozenset[Storage] | None = None, max_passes: int = 10) -> list[int]:
    """Hill climbing from ``chosen``: move one table at a time to the option that lowers
    the step most while every memory fits (options storing rows in ``storages`` only,
    when given), until no move helps."""
    chosen = list(chosen)
    hbm_cap, host_cap, srv_cap = prob.capacities(zero)
    dev = sum(t.device_s()[o] for t, o in zip(prob.tables, chosen))
    srv = sum(t.srv[o] for t, o in zip(prob.tables, chosen))
    hbm = sum(t.device_hbm()[o] for t, o in zip(prob.tables, chosen))
    host = sum(t.host[o] for t, o in zip(prob.tables, chosen))
    smem = sum(t.smem[o] for t, o in zip(prob.tables, chosen))
    for _ in range(max_passes):
        moved = False
        for i, t in enumerate(prob.tables):
            o = chosen[i]
            ds, dh = t.device_s(), t.device_hbm()
            new_dev = dev - ds[o] + ds                  # options x devices
            new_srv = srv - t.srv[o] + t.srv
            step = new_dev.max(axis=1, initial=0.0) + new_srv.max(axis=1, initial=0.0)
            # ties on the step broken by the spread of the loads, so that a move off one
            # of several equally busy devices counts (a plateau of the max otherwise)
            spread = (new_dev ** 2).sum(axis=1) + (new_srv ** 2).sum(axis=1)
            ok = (((hbm - dh[o] + dh) <= hbm_cap).all(axis=1)
                  & ((host - t.host[o] + t.host) <= host_cap).all(axis=1)
                  & ((smem - t.smem[o] + t.smem) <= srv_cap).all(axis=1))
            step = np.where(ok, step, np.inf)
            tol = step[o] * 1e-9
            better = (step < step[o] - tol) | ((step <= step[o] + tol) & (spread < spread[o] * (1 - 1e-9)))
            better &= ok
            if storages is not None:
                better &= t.storage_in(storages)
            if not better.any():
                continue
            cand = np.flatnonzero(better)
            best = int(cand[np.lexsort((spread[cand], step[cand]))[0]])
            dev, srv = new_dev[best], new_srv[best]
            hbm, host, smem = hbm - dh[o] + dh[best], host - t.host[o] + t.host[best], \
                smem - t.smem[o] + t.smem[best]
            chosen[i] = best
            moved = True
        if not moved:
            break
    return chosen


# ---------------------------------------------------------------------------- CP-SAT
def _ticks(values: np.ndarray) -> np.ndarray:
    return np.rint(values * _TICKS_PER_S).astype(np.int64)


def _bytes(values: np.ndarray) -> np.ndarray:
    return np.ceil(values).astype(np.int64)


def _solve(prob: _Problem, hint: list[int], hint_zero: int, free: Sequence[int], *,
           max_deterministic_time_s: float, seed: int,
           presolve: bool = True) -> tuple[list[int], int, str, float]:
    """CP-SAT over the options of the ``free`` tables (the others keep their ``hint``
    option) and the dense ZeRO stage; returns every table's option, the ZeRO stage, the
    solver's status and its proven lower bound on the step (seconds)."""
    m = prob.model
    n_dev, n_srv, n_node = len(m.workers), len(m.servers), m.cluster.num_nodes
    free = list(free)
    fixed = [i for i in range(len(prob.tables)) if i not in set(free)]
    tabs = [prob.tables[i] for i in free]

    # Data: what the fixed tables already load every resource with.
    def held(arr_of, size: int) -> np.ndarray:
        return sum((arr_of(prob.tables[i])[hint[i]] for i in fixed), np.zeros(size))

    fixed_dev = _ticks(held(lambda t: t.device_s(), n_dev))
    fixed_srv = _ticks(held(lambda t: t.srv, n_srv))
    fixed_hbm = _bytes(held(lambda t: t.device_hbm(), n_dev))
    fixed_host = _bytes(held(lambda t: t.host, n_node))
    fixed_smem = _bytes(held(lambda t: t.smem, n_srv))

    model = cp_model.CpModel()
    # Variables: x[t, o] = table t takes option o; y[t, k] = its option is of kind k;
    # z[s] = the dense part runs ZeRO stage s; the busiest worker's and server's ticks.
    names = [m.graph.tables[i].name for i in free]
    x = [[model.new_bool_var(f"x[{names[j]},{o}]") for o in range(len(t.options))]
         for j, t in enumerate(tabs)]
    y = [{k: model.new_bool_var(f"y[{names[j]},{_KINDS[k]}]") for k in sorted(set(t.kind.tolist()))}
         for j, t in enumerate(tabs)]
    z = {s: model.new_bool_var(f"zero[{s}]") for s in _ZERO_STAGES}
    horizon = int(fixed_dev.max(initial=0) + fixed_srv.max(initial=0) + sum(
        int(_ticks(t.device_s()).max() + _ticks(t.srv).max(initial=0)) for t in tabs)) + 1
    busiest_worker = model.new_int_var(0, horizon, "busiest_worker")
    busiest_server = model.new_int_var(0, horizon, "busiest_server")

    # Each table takes exactly one option, and y[t, k] says which kind it is.
    for j, t in enumerate(tabs):
        model.add_exactly_one(x[j])
        for k, yk in y[j].items():
            model.add(yk == sum(x[j][o] for o in np.flatnonzero(t.kind == k)))
    # The dense part runs one ZeRO stage.
    model.add_exactly_one(z.values())

    # Terms of every resource's time and memory, from the options' arrays.
    def collect(n_res: int, per_option, per_kind=None) -> list[tuple[list, list]]:
        out: list[tuple[list, list]] = [([], []) for _ in range(n_res)]
        for j, t in enumerate(tabs):
            arr = per_option(t)
            for o, r in zip(*np.nonzero(arr)):
                out[r][0].append(x[j][o])
                out[r][1].append(int(arr[o, r]))
            if per_kind is not None:
                karr = per_kind(t)
                for k, yk in y[j].items():
                    for r in np.flatnonzero(karr[k]):
                        out[r][0].append(yk)
                        out[r][1].append(int(karr[k, r]))
        return out

    def total(terms: tuple[list, list]) -> cp_model.LinearExpr:
        return cp_model.LinearExpr.weighted_sum(*terms)

    dev_time = collect(n_dev, lambda t: _ticks(t.own), lambda t: _ticks(t.base))
    dev_mem = collect(n_dev, lambda t: _bytes(t.hbm), lambda t: _bytes(t.hbm_base))
    srv_time = collect(n_srv, lambda t: _ticks(t.srv))
    srv_mem = collect(n_srv, lambda t: _bytes(t.smem))
    host_mem = collect(n_node, lambda t: _bytes(t.host))
    zs = [z[s] for s in _ZERO_STAGES]
    dense_bytes = [int(_bytes(np.array(prob.dense_hbm[s]))) for s in _ZERO_STAGES]
    for d in range(n_dev):
        # Every worker's embedding time is at most the busiest worker's.
        model.add(total(dev_time[d]) + int(fixed_dev[d]) <= busiest_worker)
        # Every device holds the dense part's peak at its ZeRO stage and its tables' shards.
        model.add(cp_model.LinearExpr.weighted_sum(dev_mem[d][0] + zs, dev_mem[d][1] + dense_bytes)
                  + int(fixed_hbm[d]) <= int(m.devices[d].hbm_capacity))
    for n in range(n_node):
        # Every node's host memory holds its host-stored shards.
        model.add(total(host_mem[n]) + int(fixed_host[n]) <= int(m.host_capacity(n) ))
    for s in range(n_srv):
        # Every server's time is at most the busiest server's; its memory holds its shards.
        model.add(total(srv_time[s]) + int(fixed_srv[s]) <= busiest_server)
        model.add(total(srv_mem[s]) + int(fixed_smem[s]) <= int(m.servers[s].capacity))

    # Objective: the step (dense part + busiest worker + busiest server).
    dense_ticks = [int(_ticks(np.array(prob.dense_s[s]))) for s in _ZERO_STAGES]
    model.minimize(cp_model.LinearExpr.weighted_sum(zs, dense_ticks) + busiest_worker
                   + busiest_server)
    for j, (i, t) in enumerate(zip(free, tabs)):
        for o in range(len(t.options)):
            model.add_hint(x[j][o], int(o == hint[i]))
        for k, yk in y[j].items():
            model.add_hint(yk, int(t.kind[hint[i]] == k))
    for s in _ZERO_STAGES:
        model.add_hint(z[s], int(s == hint_zero))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1                  # reproducible
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = max_deterministic_time_s
    solver.parameters.cp_model_presolve = presolve
    status = solver.solve(model)
    if status == cp_model.UNKNOWN:
        # out of time before a solution of its own: the hint (feasible) stands
        return list(hint), hint_zero, "unknown", 0.0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasiblePlan(f"no placement of the {len(prob.tables)} tables fits the devices', "
                             f"hosts' and servers' memory ({solver.status_name(status)}): add "
                             "devices, host memory or servers", binding="memory")
    chosen = list(hint)
    for j, (i, t) in enumerate(zip(free, tabs)):
        chosen[i] = next(o for o in range(len(t.options)) if solver.value(x[j][o]))
    zero = next(s for s in _ZERO_STAGES if solver.value(z[s]))
    return chosen, zero, solver.status_name(status).lower(), solver.best_objective_bound / _TICKS_PER_S


def _search(prob: _Problem, hint: list[int], *, window: int, max_deterministic_time_s: float,
            seed: int) -> tuple[list[int], int, str, float | None]:
    """CP-SAT on the whole problem when it has at most ``window`` tables; otherwise on
    windows of ``window`` tables at a time, the others fixed (a large-neighbourhood search:
    the busiest tables first), the time shared among the windows."""
    n = len(prob.tables)
    if n <= window:
        chosen, zero, status, bound = _solve(prob, hint, 0, range(n), seed=seed,
                                             max_deterministic_time_s=max_deterministic_time_s)
        return chosen, zero, f"cp-sat {status}", bound if status != "unknown" else None
    load = [float(t.device_s()[o].max() + t.srv[o].max(initial=0.0))
            for t, o in zip(prob.tables, hint)]
    order = sorted(range(n), key=lambda i: (-load[i], i))
    # the busiest tables' windows, each with enough time to improve on its hint
    count = max(1, min(-(-n // window), int(max_deterministic_time_s / _WINDOW_TIME_S)))
    windows = [order[i * window:(i + 1) * window] for i in range(count)]
    chosen, zero = list(hint), 0
    each = max_deterministic_time_s / len(windows)
    solved = 0
    for w in windows:
        # (presolving a window's model took its whole time in trials: 64 tables, 16 devices)
        before = prob.objective(chosen, zero)
        chosen, zero, status, _ = _solve(prob, chosen, zero, w, seed=seed, presolve=False,
                                         max_deterministic_time_s=each)
        solved += prob.objective(chosen, zero) < before
    return (chosen, zero, f"cp-sat on the {len(windows)} busiest windows of {window} tables "
            f"({solved} improved on)", None)


# ---------------------------------------------------------------------------- entry points
def _model(graph: SparseGraph, cluster: Cluster | str, global_batch: int, **kw) -> SparseCostModel:
    if not isinstance(graph, SparseGraph):
        raise ConfigError(f"expected a SparseGraph (autoplan.sparse.trace_sparse), got "
                          f"{type(graph).__name__}")
    return SparseCostModel(graph, as_cluster(cluster), global_batch=global_batch, **kw)


def _plan(prob: _Problem, chosen: list[int], zero: int, search: str,
          baseline: float | None = None, solve_s: float = 0.0,
          bound: float | None = None) -> SparsePlan:
    m = prob.model
    placements = tuple(prob.tables[t].options[o] for t, o in enumerate(chosen))
    dense, _ = m.dense(zero)
    est = m.estimate(placements, dense)
    return SparsePlan(model=m.graph.model, title=m.graph.title, cluster=m.cluster.name,
                      num_devices=m.cluster.num_devices, num_servers=len(m.cluster.servers),
                      global_batch=m.global_batch, dense=dense, tables=placements,
                      optimizer=m.optimizer, estimate=est, search=search,
                      baseline_step_time_s=baseline, bound_step_time_s=bound,
                      solve_time_s=solve_s)


def greedy_plan(graph: SparseGraph, cluster: Cluster | str, *, global_batch: int,
                optimizer: SparseOptimizer | str = SparseOptimizer.ROWWISE_ADAGRAD,
                precision: Precision | str = Precision.BF16,
                storages: Iterable[Storage | str] | None = None, cache_fraction: float = 0.2,
                min_column_width: int = 32, options: CostOptions | None = None,
                constants: SparseConstants | None = None,
                calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> SparsePlan:
    """The TorchRec-style greedy placement (see the module docstring), priced by the same
    cost model as :func:`plan_sparse`; the dense part runs plain data parallelism (DDP)."""
    start = time.perf_counter()
    m = _model(graph, cluster, global_batch, optimizer=optimizer, precision=precision,
               options=options, constants=constants, calibration=calibration)
    prob = _Problem.build(m, storages=_storages(storages), cache_fraction=cache_fraction,
                          min_column_width=min_column_width)
    return _plan(prob, _greedy(prob), 0, "greedy", solve_s=time.perf_counter() - start)


def plan_sparse(graph: SparseGraph, cluster: Cluster | str, *, global_batch: int,
                optimizer: SparseOptimizer | str = SparseOptimizer.ROWWISE_ADAGRAD,
                precision: Precision | str = Precision.BF16,
                storages: Iterable[Storage | str] | None = None, cache_fraction: float = 0.2,
                min_column_width: int = 32, objective: str = "time",
                prices: Prices | None = None, max_deterministic_time_s: float = 2.0,
                window: int = 64, seed: int = 0, options: CostOptions | None = None,
                constants: SparseConstants | None = None,
                calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> SparsePlan:
    """Place every table and choose the dense part's ZeRO stage with CP-SAT.

    Parameters
    ----------
    graph : SparseGraph
        From :func:`~autoplan.sparse.trace_sparse`.
    cluster : Cluster or str
        Every device is a worker; servers (:meth:`~autoplan.Cluster.with_servers`) may hold
        tables.
    global_batch : int
        Samples per step, a multiple of the number of devices.
    optimizer : SparseOptimizer or str
        The embedding rows' optimizer (default row-wise Adagrad).
    precision : str
        The dense part's recipe.
    storages : iterable of Storage, optional
        Where rows may live (default: everywhere the cluster allows).
    cache_fraction : float
        The share of a host-stored shard's rows its device cache holds.
    min_column_width : int
        Narrowest column block a column-wise split may make.
    objective : {"time", "cost"}
        Minimise the step, or the cost per sample (``prices`` needed): one solve per
        number of servers rented (the first ones), the cheapest kept.
    prices : Prices, optional
    max_deterministic_time_s : float
        CP-SAT's deterministic time limit (a plan does not depend on the machine's load);
        the result says whether it proved optimality.
    window : int
        Up to this many tables, one CP-SAT model holds them all; beyond, CP-SAT improves
        the hill-climbed hint ``window`` tables at a time, the busiest first.
    seed : int

    Returns
    -------
    SparsePlan
        With the greedy baseline's step on the same cost model
        (:attr:`~.plan.SparsePlan.baseline_step_time_s`).

    Raises
    ------
    InfeasiblePlan
        When no placement fits every memory (the message says what to add).
    """
    if objective not in ("time", "cost"):
        raise ConfigError(f"objective must be 'time' or 'cost', got {objective!r}")
    if objective == "cost" and prices is None:
        raise ConfigError("objective='cost' needs prices=Prices(device_hour=..., server_hour=..., "
                          "source=...)")
    start = time.perf_counter()
    m = _model(graph, cluster, global_batch, optimizer=optimizer, precision=precision,
               options=options, constants=constants, calibration=calibration)
    kw = dict(storages=_storages(storages), cache_fraction=cache_fraction,
              min_column_width=min_column_width)
    counts = range(len(m.servers) + 1) if objective == "cost" else [len(m.servers)]
    best: tuple[float, SparsePlan] | None = None
    for n in counts:
        prob = _Problem.build(m, servers=n, **kw)
        try:
            baseline_s: float | None = _plan(prob, _greedy(prob), 0, "greedy").estimate.step_time_s
        except InfeasiblePlan:
            baseline_s = None     # the greedy baseline found no placement that fits
        improved = _hint(prob)
        try:
            chosen, zero, status, bound = _search(prob, improved, window=window, seed=seed,
                                                  max_deterministic_time_s=max_deterministic_time_s)
        except InfeasiblePlan:
            if n != counts[-1]:
                continue          # too few servers rented: the next count may fit
            raise
        plan = _plan(prob, chosen, zero, status, baseline_s, bound=bound)
        hinted = _plan(prob, improved, 0, f"hill climbing ({status} found nothing better)",
                       baseline_s, bound=bound)
        if hinted.estimate.fits and (hinted.estimate.step_time_s < plan.estimate.step_time_s
                                     or not plan.estimate.fits):
            plan = hinted    # the integer model rounds: never return worse than its hint
        if not plan.estimate.fits:
            if n != counts[-1]:
                continue
            raise InfeasiblePlan(f"no placement of the {len(prob.tables)} tables that fits was "
                                 f"found in {max_deterministic_time_s} deterministic seconds: add "
                                 "devices, host memory or servers, or give the search more time",
                                 binding="memory")
        score = plan.estimate.step_time_s * (prices.per_hour(m.cluster.num_devices, n)
                                             if objective == "cost" else 1.0)
        if best is None or score < best[0]:
            best = (score, plan)
    assert best is not None
    plan = best[1]
    object.__setattr__(plan, "solve_time_s", time.perf_counter() - start)
    return plan


def estimate_sparse(graph: SparseGraph, cluster: Cluster | str, placements: Iterable[TablePlacement],
                    *, global_batch: int, zero: int = 0,
                    optimizer: SparseOptimizer | str = SparseOptimizer.ROWWISE_ADAGRAD,
                    precision: Precision | str = Precision.BF16, options: CostOptions | None = None,
                    constants: SparseConstants | None = None,
                    calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> SparsePlan:
    """The :class:`~.plan.SparsePlan` of placements chosen by hand, with its estimate."""
    m = _model(graph, cluster, global_batch, optimizer=optimizer, precision=precision,
               options=options, constants=constants, calibration=calibration)
    dense, _ = m.dense(zero)
    placements = tuple(placements)
    est = m.estimate(placements, dense)
    return SparsePlan(model=graph.model, title=graph.title, cluster=m.cluster.name,
                      num_devices=m.cluster.num_devices, num_servers=len(m.cluster.servers),
                      global_batch=global_batch, dense=dense,
                      tables=tuple(sorted(placements, key=lambda p: [t.name for t in graph.tables].index(p.table))),
                      optimizer=m.optimizer, estimate=est, search="given")


def _storages(storages: Iterable[Storage | str] | None) -> list[Storage] | None:
    if storages is None:
        return None
    out = []
    for s in storages:
        try:
            out.append(Storage(s))
        except ValueError:
            raise ConfigError(f"unknown storage {s!r}; expected some of "
                              f"{[x.value for x in Storage]}") from None
    return out
