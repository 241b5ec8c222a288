"""Every placement a table may take, priced on every resource: what the planners search.

:func:`table_options` lists one table's options (data-parallel; table-wise on any device;
row-wise over every device or one node's; column-wise over groups of a node's devices;
each in device memory, host memory, or host memory with a device cache; table- or
row-wise on parameter servers).  :class:`Problem` holds every option of every table as
arrays (tables x options x resources), priced by :meth:`~.cost.SparseCostModel.price`.

Pricing thousands of tables one option at a time would take seconds, so tables whose
options are alike (the same dimension, pooling and row blocks that fill) share one list
of options and are priced together, a numpy column per table; an option on devices of
the same figures as one already priced (the same profile and link shares) is that one's
prices moved to its devices and nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..errors import InfeasiblePlan
from .cost import OptionLoads, SparseCostModel
from .plan import Pooling, Sharding, Storage, TablePlacement
from .tables import EmbeddingTable, TableColumns

__all__ = ["table_options", "Problem", "KINDS"]

#: What every worker pays whichever option of a kind a table takes (the worker share):
#: GPU shards, data-parallel, parameter servers (:func:`kind_of`).
KINDS = ("gpu", "dp", "server")
_ZERO_STAGES = (0, 1, 2, 3)


def table_options(model: SparseCostModel, table: EmbeddingTable, *,
                  storages: Iterable[Storage] | None = None, cache_fraction: float = 0.2,
                  min_column_width: int = 32, servers: int | None = None) -> list[TablePlacement]:
    """Every placement the planners consider for ``table`` on ``model``'s cluster.

    ``storages`` limits where rows may live (default: device memory, host memory with
    and without a cache where the profiles state a host link, servers where the cluster
    has them); ``servers`` limits the servers to the first ones; column blocks are at
    least ``min_column_width`` wide.  The list depends on the table only through its
    pooling, its dimension and which row splits fill (:func:`_option_key`).
    """
    c = model.cluster
    allowed = set(storages) if storages is not None else set(Storage)
    host_ok = all(d.host_link_bw is not None for d in model.devices)
    n_servers = _servers(model, servers)
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
        for g in _row_groups(model):
            if _row_blocks_fill(table.rows, len(g)):
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


def _servers(model: SparseCostModel, servers: int | None) -> int:
    return len(model.cluster.servers) if servers is None else min(servers, len(model.cluster.servers))


def _row_groups(model: SparseCostModel) -> list[tuple[int, ...]]:
    """The device groups a row-wise table may span: every worker, and each node's when
    there are several (TorchRec's table-row-wise); only groups of two or more."""
    c = model.cluster
    nodes = [tuple(c.devices_of_node(n)) for n in range(c.num_nodes)]
    return [g for g in [model.workers] + (nodes if len(nodes) > 1 else []) if len(g) > 1]


def _row_blocks_fill(rows: int, k: int) -> bool:
    """Whether ``k`` row blocks of ``ceil(rows / k)`` rows leave none empty."""
    return -(-rows // k) * (k - 1) < rows


def _option_key(model: SparseCostModel, table: EmbeddingTable, servers: int | None) -> tuple:
    """What :func:`table_options` reads of a table: tables of one key have the same list."""
    sizes = sorted({len(g) for g in _row_groups(model)} | {_servers(model, servers)})
    return (table.pooling is Pooling.MAX, table.dim,
            tuple(_row_blocks_fill(table.rows, k) for k in sizes if k > 1))


def kind_of(p: TablePlacement) -> int:
    """The index in :data:`KINDS` of what every worker pays for ``p``'s kind of placement."""
    if p.storage is Storage.SERVER:
        return 2
    return 1 if p.sharding is Sharding.DATA_PARALLEL else 0


@dataclass
class Problem:
    """Every option of every table, priced, and the dense part's ZeRO stages.

    Arrays are tables x options (padded to the longest list; ``valid`` says which
    entries are options) x resources.  ``device_s`` is each option's seconds on every
    device: ``own`` (its shards, and its worker share beyond its kind's) plus ``base``
    (tables x kinds x devices: what every device pays whichever option of the kind is
    taken), so that a CP-SAT model adds each kind's share once.  ``device_hbm`` is its
    bytes on every device, ``hbm_base`` (tables x kinds x devices) the part every option
    of the kind holds (a server option's buffers sit on every worker); ``host`` is per
    node, ``srv`` and ``smem`` per server.
    """

    model: SparseCostModel
    names: list[str]
    options: list[list[TablePlacement]]   # each table's list (its group's, named as the first)
    count: np.ndarray                     # options per table
    valid: np.ndarray                     # (T, O) bool
    kind: np.ndarray                      # (T, O) index in KINDS
    storage: np.ndarray                   # (T, O) index in list(Storage)
    own: np.ndarray                       # (T, O, D) seconds
    base: np.ndarray                      # (T, K, D) seconds
    device_s: np.ndarray                  # (T, O, D) seconds
    srv: np.ndarray                       # (T, O, S) seconds
    device_hbm: np.ndarray                # (T, O, D) bytes
    hbm_base: np.ndarray                  # (T, K, D) bytes
    host: np.ndarray                      # (T, O, N) bytes
    smem: np.ndarray                      # (T, O, S) bytes
    perf: np.ndarray                      # (T, O) TorchRec's perf: seconds where its shards run
    slower_twin: np.ndarray               # (T, O) host-stored, no faster than its device twin
    groups: list[list[np.ndarray]]        # each table's option kinds (sharding, storage, size)
    dense_s: dict[int, float] = dataclasses.field(default_factory=dict)
    dense_hbm: dict[int, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, model: SparseCostModel, *, servers: int | None = None, **option_kw) -> "Problem":
        tables = model.graph.tables
        by_key: dict[tuple, list[int]] = {}
        for i, t in enumerate(tables):
            by_key.setdefault(_option_key(model, t, servers), []).append(i)
        lists: list[list[TablePlacement]] = [[] for _ in tables]
        for idx in by_key.values():
            opts = table_options(model, tables[idx[0]], servers=servers, **option_kw)
            if not opts:
                raise InfeasiblePlan(f"table {tables[idx[0]].name!r} has no placement to "
                                     "choose from: allow more storages (device memory, host "
                                     "memory, servers)")
            for i in idx:
                lists[i] = opts
        n_t, n_o = len(tables), max((len(o) for o in lists), default=0)
        n_d, n_s, n_n = len(model.workers), len(model.servers), model.cluster.num_nodes
        arr = {key: np.zeros((n_t, n_o, n)) for key, n in (
            ("own", n_d), ("device_s", n_d), ("srv", n_s), ("device_hbm", n_d), ("host", n_n),
            ("smem", n_s))}
        arr["device_s"][:] = np.inf          # not an option: never taken
        arr["device_hbm"][:] = np.inf
        base, hbm_base = np.zeros((n_t, len(KINDS), n_d)), np.zeros((n_t, len(KINDS), n_d))
        valid = np.zeros((n_t, n_o), dtype=bool)
        kind = np.zeros((n_t, n_o), dtype=np.int64)
        storage = np.zeros((n_t, n_o), dtype=np.int64)
        slower_twin = np.zeros((n_t, n_o), dtype=bool)
        perf = np.full((n_t, n_o), np.inf)
        groups: list[list[np.ndarray]] = [[] for _ in tables]
        classes = _classes(model)
        for idx in by_key.values():
            opts = lists[idx[0]]
            g = _Group.price(model, TableColumns.of([tables[i] for i in idx]), opts, classes)
            rows, width = np.array(idx), len(opts)
            for key, values in (("own", g.own), ("device_s", g.device_s), ("srv", g.srv),
                                ("device_hbm", g.hbm), ("host", g.host), ("smem", g.smem)):
                arr[key][rows, :width] = values
            base[rows], hbm_base[rows] = g.base, g.hbm_base
            valid[rows, :width] = True
            kind[rows, :width] = g.kind
            storage[rows, :width] = [list(Storage).index(p.storage) for p in opts]
            perf[rows, :width] = g.perf
            slower_twin[rows, :width] = g.slower_twin
            for i, order in zip(idx, g.cheapest_kind_first()):
                groups[i] = [g.kinds[k] for k in order]
        prob = cls(model=model, names=[t.name for t in tables], options=lists,
                   count=np.array([len(o) for o in lists]), valid=valid, kind=kind,
                   storage=storage, base=base, hbm_base=hbm_base, perf=perf,
                   slower_twin=slower_twin, groups=groups, **arr)
        for z in _ZERO_STAGES:
            _, est = model.dense(z)
            prob.dense_s[z] = est.step_time_s
            prob.dense_hbm[z] = est.stages[0].peak_memory_bytes
        return prob

    def __len__(self) -> int:
        return len(self.names)

    def placement(self, table: int, option: int) -> TablePlacement:
        """Option ``option`` of table ``table``, named for it."""
        p = self.options[table][option]
        return p if p.table == self.names[table] else dataclasses.replace(p, table=self.names[table])

    def storage_in(self, storages: frozenset[Storage] | None) -> np.ndarray:
        """Which options (tables x options) store their rows in ``storages`` (all: None)."""
        if storages is None:
            return self.valid
        codes = [i for i, s in enumerate(Storage) if s in storages]
        return self.valid & np.isin(self.storage, codes)

    def capacities(self, zero: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = self.model
        return (np.array([d.hbm_capacity - self.dense_hbm[zero] for d in m.devices]),
                np.array([m.host_capacity(n) for n in range(m.cluster.num_nodes)]),
                np.array([s.capacity for s in m.servers]))

    def totals(self, chosen: np.ndarray) -> tuple[np.ndarray, ...]:
        """Every resource's seconds and bytes under ``chosen`` (an option per table):
        devices' seconds, servers' seconds, devices', hosts' and servers' bytes."""
        t = np.arange(len(self))
        return (self.device_s[t, chosen].sum(axis=0), self.srv[t, chosen].sum(axis=0),
                self.device_hbm[t, chosen].sum(axis=0), self.host[t, chosen].sum(axis=0),
                self.smem[t, chosen].sum(axis=0))

    def objective(self, chosen: np.ndarray, zero: int) -> float:
        dev, srv, *_ = self.totals(chosen)
        return self.dense_s[zero] + float(dev.max(initial=0.0)) + float(srv.max(initial=0.0))

    def lower_bound(self) -> float:
        """A lower bound on the step of every plan (memory left out): the busiest worker
        is at least as busy as the mean one, the busiest server as the mean server, so
        no plan beats the fastest dense stage plus, table by table, the option that adds
        least to the mean worker and mean server."""
        per = self.device_s.mean(axis=2)
        if self.srv.shape[2]:
            per = per + self.srv.mean(axis=2)
        per = np.where(self.valid, per, np.inf)
        return min(self.dense_s.values()) + float(per.min(axis=1).sum())

    def fits(self, chosen: np.ndarray, zero: int) -> bool:
        _, _, hbm, host, smem = self.totals(chosen)
        hbm_cap, host_cap, srv_cap = self.capacities(zero)
        return bool((hbm <= hbm_cap).all() and (host <= host_cap).all() and (smem <= srv_cap).all())


@dataclass
class _Group:
    """The options of tables that share one list of them (G tables, O options), priced."""

    kind: np.ndarray          # (O,)
    kinds: list[np.ndarray]   # the options of each kind: same sharding, storage and size
    own: np.ndarray           # (G, O, D)
    base: np.ndarray          # (G, K, D)
    device_s: np.ndarray      # (G, O, D)
    srv: np.ndarray           # (G, O, S)
    hbm: np.ndarray           # (G, O, D)
    hbm_base: np.ndarray      # (G, K, D)
    host: np.ndarray          # (G, O, N)
    smem: np.ndarray          # (G, O, S)
    perf: np.ndarray          # (G, O)
    slower_twin: np.ndarray   # (G, O)

    @classmethod
    def price(cls, model: SparseCostModel, cols: TableColumns, options: list[TablePlacement],
              classes: tuple[list[int], list[int]]) -> "_Group":
        loads = _price_all(model, cols, options, classes)

        def stack(get) -> np.ndarray:
            return np.stack([get(ld) for ld in loads], axis=1)

        worker = stack(lambda ld: ld.worker_s)
        owner = stack(lambda ld: ld.owner_s.sum(axis=2))
        srv = stack(lambda ld: ld.server_s.sum(axis=2))
        hbm = stack(lambda ld: ld.hbm_bytes)
        kind = np.array([kind_of(p) for p in options])
        g, n_d = worker.shape[0], worker.shape[2]
        # each kind's base: what every option of the kind costs every device at least
        base, hbm_base = np.zeros((g, len(KINDS), n_d)), np.zeros((g, len(KINDS), n_d))
        for k in np.unique(kind):
            base[:, k] = worker[:, kind == k].min(axis=1)
            if KINDS[k] == "server":    # a server option's buffers sit on every worker
                hbm_base[:, k] = hbm[:, kind == k].min(axis=1)
        own = owner + (worker - base[:, kind])
        device_s = own + base[:, kind]
        # an option holding rows in host memory that is nowhere faster than the same
        # sharding on the same devices in device memory only ever saves memory
        slower_twin = np.zeros((g, len(options)), dtype=bool)
        for o, twin in _device_twins(options):
            slower_twin[:, o] = ((device_s[:, o] >= device_s[:, twin]).all(axis=1)
                                 & (srv[:, o] >= srv[:, twin]).all(axis=1))
        return cls(kind=kind, kinds=_same_kind(options), own=own, base=base, device_s=device_s,
                   srv=srv, hbm=hbm, hbm_base=hbm_base, host=stack(lambda ld: ld.host_bytes),
                   smem=stack(lambda ld: ld.server_bytes), perf=own.sum(axis=2) + srv.sum(axis=2),
                   slower_twin=slower_twin)

    def cheapest_kind_first(self) -> np.ndarray:
        """Each table's kinds, the kind with its cheapest option first (TorchRec's
        proposer order; ties: the kind listed first), tables x kinds."""
        lowest = np.stack([self.perf[:, k].min(axis=1) for k in self.kinds], axis=1)
        first = np.broadcast_to(np.array([k[0] for k in self.kinds]), lowest.shape)
        return np.lexsort((first, lowest), axis=1)


def _device_twins(options: list[TablePlacement]) -> list[tuple[int, int]]:
    """Each host-stored option's index with its device-memory twin's (same sharding and
    devices), where the list has one."""
    hbm = {(p.sharding, p.devices): o for o, p in enumerate(options) if p.storage is Storage.HBM}
    return [(o, hbm[(p.sharding, p.devices)]) for o, p in enumerate(options)
            if p.storage in (Storage.HOST, Storage.HOST_CACHED) and (p.sharding, p.devices) in hbm]


def _same_kind(options: list[TablePlacement]) -> list[np.ndarray]:
    """The options of each kind: the same sharding, storage and size on other devices."""
    kinds: dict[tuple, list[int]] = {}
    for o, p in enumerate(options):
        kinds.setdefault((p.sharding, p.storage, p.cache_fraction, len(p.devices)), []).append(o)
    return [np.array(g) for g in kinds.values()]


def _classes(model: SparseCostModel) -> tuple[list[int], list[int]]:
    """Each device's node, and the class of its figures without the node (devices of equal
    figures price a placement alike)."""
    node_of = [d.node for d in model.devices]
    ids: dict[object, int] = {}
    classes = [ids.setdefault(dataclasses.replace(dev, node=0), len(ids)) for dev in model.devices]
    return node_of, classes


def _price_all(model: SparseCostModel, cols: TableColumns, options: list[TablePlacement],
               classes: tuple[list[int], list[int]]) -> list[OptionLoads]:
    """``model.price`` of every option for ``cols``, computed once per class of equivalent
    placements: the same sharding and storage on devices of the same figures is priced
    once and moved to the other devices and their nodes."""
    node_of, device_class = classes
    done: dict[tuple, tuple[TablePlacement, OptionLoads]] = {}
    out = []
    for p in options:
        if p.storage is Storage.SERVER or p.sharding is Sharding.DATA_PARALLEL:
            out.append(model.price(cols, p))
            continue
        key = (p.sharding, p.storage, p.cache_fraction, tuple(device_class[d] for d in p.devices))
        if key not in done:
            done[key] = (p, model.price(cols, p))
            out.append(done[key][1])
            continue
        first, ld = done[key]
        moved = OptionLoads(worker_s=ld.worker_s, owner_s=np.zeros_like(ld.owner_s),
                            server_s=ld.server_s, hbm_bytes=np.zeros_like(ld.hbm_bytes),
                            host_bytes=np.zeros_like(ld.host_bytes), server_bytes=ld.server_bytes)
        moved.owner_s[:, list(p.devices)] = ld.owner_s[:, list(first.devices)]
        moved.hbm_bytes[:, list(p.devices)] = ld.hbm_bytes[:, list(first.devices)]
        for a, b in dict(zip((node_of[d] for d in first.devices),
                             (node_of[d] for d in p.devices))).items():
            moved.host_bytes[:, b] = ld.host_bytes[:, a]
        out.append(moved)
    return out
