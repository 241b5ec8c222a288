"""The cost of an embedding table's placement, and of a whole sparse plan's step.

Per table and placement (:class:`~autoplan.sparse.plan.TablePlacement`), what each
resource does in one step of ``B`` samples over ``W`` workers (every device is a worker;
``L`` ids and ``F`` pooled vectors per sample, ``c`` columns of ``e`` bytes in a shard):

* **GPU shards** (table-, row-, column-wise; TorchRec's "pooled at the owner" flow, Ivchenko
  et al. 2022, Sec. 3.2): the owner of a shard receives the ids that fall in its rows
  (``n = B L share`` lookups, :data:`~.plan.ID_MESSAGE_BYTES` each), gathers the distinct
  rows they touch from where the rows live and reads ``n c e`` bytes of them on the device,
  sends each worker its bags' partial sums (``B F c e``),
  receives their gradients back, and updates the rows the step touched with the sparse
  optimizer (``u`` distinct rows, :meth:`~.tables.EmbeddingTable.distinct_rows`: weight and
  state read and written).  Rows in device memory are read at the device's bandwidth times
  ``hbm_gather_efficiency`` (slower for narrow rows, ``row_bytes_penalty``); distinct rows
  in host memory cross the device's host link at ``host_link_efficiency`` of it, those a
  device cache of the hottest rows holds come from device memory (updates are written
  through to host memory).  Traffic to same-node peers crosses the node's fabric,
  to others the device's NIC share, each at its all-to-all efficiency.  Every worker also
  sends its own ids, receives and sums its partials and sends their gradients (``B/W``
  samples' worth), and joins the table's four all-to-alls (counts, ids, pooled, gradients:
  :mod:`.runtime`), each a collective latency.
* **Data-parallel**: every worker looks up its own samples, all-reduces the whole
  table's gradient and updates every row (dense gradient, as DDP runs it).
* **Parameter servers** (Li et al. 2014, "Scaling Distributed Machine Learning with the
  Parameter Server"): each worker pulls the distinct rows its samples touch from the
  servers holding them (their ids out, rows back) and pushes the rows' gradients; a
  server gathers the rows it serves, sums the pushes and applies the sparse optimizer to
  the rows touched, in its DRAM at ``server_memory_efficiency`` of its bandwidth, and its
  NICs carry every worker's pulls and pushes; each message pays the network latency
  (:mod:`.server` handles them one by one).

A step is synchronous: the dense part (:func:`autoplan.estimate` of data parallelism over
the workers: forward, backward, gradient reduction, optimizer), then the embedding work
of the busiest worker, then the busiest server's (``step = dense + max_w + max_s``, the
slowest worker and the slowest server bound it).  Memory per device is the dense
part's peak plus the shards, caches and buffers it holds; per node's host and per server
their shards and optimizer state, against ``host_memory_fraction`` of their DRAM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from ..cost import estimate
from ..cost.calibration import DEFAULT_CALIBRATION, Calibration, apply_calibration, resolve_calibration
from ..cost.constants import CostOptions, cost_profiles_dir, read_yaml_record
from ..cost.result import Estimate
from ..errors import ConfigError, InputError
from ..hardware.cluster import Cluster, as_cluster
from ..records import Record
from ..strategy import Precision, Strategy
from .plan import (ID_MESSAGE_BYTES, ROW_ID_BYTES, Pooling, Sharding, SparseEstimate,
                   SparseOptimizer, Storage, TableCost, TablePlacement)
from .tables import EmbeddingTable, SparseGraph, TableColumns

__all__ = ["SparseConstants", "load_sparse_constants", "SparseCostModel", "TableLoads",
           "OptionLoads", "A2A_CALLS_PER_TABLE"]

#: All-to-alls the runtime runs per GPU-sharded table and step (split counts, ids with their
#: bags, pooled partial sums, their gradients): :mod:`.runtime`.
A2A_CALLS_PER_TABLE = 4
#: Messages a worker exchanges with each server holding a shard of a table, per step
#: (pull request, pull reply, push): :mod:`.server`.
PS_MESSAGES_PER_SHARD = 3


@dataclass(frozen=True)
class SparseConstants(Record):
    """Fractions of the profiles' figures embedding kernels reach (``profiles/cost/sparse.yaml``)."""

    name: str
    hbm_gather_efficiency: float
    hbm_gather_source: str
    row_bytes_penalty: tuple[tuple[float, float], ...]
    row_bytes_source: str
    host_link_efficiency: float
    host_link_source: str
    server_memory_efficiency: float
    server_memory_source: str
    host_memory_fraction: float
    host_memory_source: str

    def __post_init__(self) -> None:
        for key in ("hbm_gather_efficiency", "host_link_efficiency", "server_memory_efficiency",
                    "host_memory_fraction"):
            v = getattr(self, key)
            if not 0 < v <= 1:
                raise ConfigError(f"{key} must be in (0, 1], got {v!r}")
        rows = [r for r, _ in self.row_bytes_penalty]
        if not rows or rows != sorted(rows, reverse=True) or rows[-1] != 0:
            raise ConfigError("row_bytes_penalty lists [min row bytes, factor] from the widest "
                              "rows down to 0")

    def penalty(self, row_bytes):
        """The time factor of gathering rows of ``row_bytes`` (narrow rows waste the kernel);
        ``row_bytes`` may be an array."""
        rb = np.asarray(row_bytes, dtype=np.float64)
        out = np.full(rb.shape, self.row_bytes_penalty[-1][1])
        for r, f in reversed(self.row_bytes_penalty):    # the widest bound met wins
            out = np.where(rb >= r, f, out)
        return out if out.ndim else float(out)


def load_sparse_constants(path: str | os.PathLike[str] | None = None) -> SparseConstants:
    """Load ``profiles/cost/sparse.yaml`` (or ``path``)."""
    p = Path(path) if path is not None else cost_profiles_dir() / "sparse.yaml"
    if not p.is_file():
        raise ConfigError(f"no sparse cost constants file at {p}")
    return read_yaml_record(SparseConstants, str(p.resolve()), p.stat().st_mtime_ns,
                            "sparse cost constants")


@dataclass
class TableLoads:
    """What one placement of one table costs each resource (seconds, bytes per step)."""

    worker_s: dict[int, float] = field(default_factory=dict)   # every worker's own share
    owner: dict[int, list[float]] = field(default_factory=dict)   # device: [lookup, update, comm]
    server: dict[int, list[float]] = field(default_factory=dict)  # server: [lookup, update, comm]
    hbm: dict[int, float] = field(default_factory=dict)
    host: dict[int, float] = field(default_factory=dict)         # by node
    server_mem: dict[int, float] = field(default_factory=dict)

    def device_s(self, d: int) -> float:
        """Device ``d``'s seconds for this table: its own share and its shards'."""
        return self.worker_s.get(d, 0.0) + sum(self.owner.get(d, ()))

    def server_s(self, s: int) -> float:
        return sum(self.server.get(s, ()))


@dataclass
class OptionLoads:
    """What one placement costs each of several tables (:meth:`SparseCostModel.price`):
    arrays with one row per table, seconds and bytes per step.

    ``owner_s`` and ``server_s`` hold three terms per resource (lookups, updates,
    communication) of the shards it owns; ``worker_s`` what every worker pays for the
    table whoever owns it (its own ids, partial sums, pulls, latencies).
    """

    worker_s: np.ndarray       # (tables, workers)
    owner_s: np.ndarray        # (tables, workers, 3)
    server_s: np.ndarray       # (tables, servers, 3)
    hbm_bytes: np.ndarray      # (tables, workers)
    host_bytes: np.ndarray     # (tables, nodes)
    server_bytes: np.ndarray   # (tables, servers)

    def device_s(self) -> np.ndarray:
        """Every worker's seconds for each table (tables x workers)."""
        return self.worker_s + self.owner_s.sum(axis=2)


@dataclass(frozen=True)
class _Device:
    node: int
    hbm_bw: float                # device memory bytes/s
    hbm_capacity: float
    host_link_bw: float | None   # bytes/s, None without a host link
    intra_share: float           # share of a worker's peers on its own node
    intra_bw: float              # all-to-all bytes/s over the node's fabric
    inter_bw: float              # all-to-all bytes/s over the device's NIC share
    a2a_latency_s: float
    ps_bw: float                 # bytes/s to parameter servers (NIC share, p2p efficiency)


@dataclass(frozen=True)
class _Server:
    dram_bw: float
    nic_bw: float
    latency_s: float
    capacity: float


class SparseCostModel:
    """Prices placements of a :class:`~.tables.SparseGraph`'s tables on a cluster.

    Parameters
    ----------
    graph : SparseGraph
    cluster : Cluster
        Every device is a worker; its servers (:meth:`~autoplan.Cluster.with_servers`)
        may hold tables.
    global_batch : int
        Samples per step, divisible by the number of devices.
    optimizer : SparseOptimizer
    precision : str
        The dense part's recipe (:class:`~autoplan.Strategy`'s ``precision``).
    options : CostOptions, optional
        For the dense part; its ``memory_fraction`` bounds device memory here too.
    constants : SparseConstants, optional
    calibration : as :func:`autoplan.estimate`

    Examples
    --------
    >>> from autoplan.sparse import trace_sparse
    >>> from autoplan.hardware import load_cluster
    >>> g = trace_sparse("zoo:dlrm-dcnv2")
    >>> m = SparseCostModel(g, load_cluster("a100-sxm4-80gb"), global_batch=65536)
    >>> t = g.tables[0]
    >>> tw = TablePlacement(t.name, Sharding.TABLE_WISE, Storage.HBM, (0,))
    >>> m.loads(t, tw).hbm[0] > t.weight_bytes
    True
    """

    def __init__(self, graph: SparseGraph, cluster: Cluster, *, global_batch: int,
                 optimizer: SparseOptimizer | str = SparseOptimizer.ROWWISE_ADAGRAD,
                 precision: Precision | str = Precision.BF16,
                 options: CostOptions | None = None, constants: SparseConstants | None = None,
                 calibration: Calibration | str | None = DEFAULT_CALIBRATION) -> None:
        if not isinstance(graph, SparseGraph):
            raise ConfigError(f"expected a SparseGraph (autoplan.sparse.trace_sparse), got "
                              f"{type(graph).__name__}")
        self.graph = graph
        self.cluster = as_cluster(cluster)
        self.workers = tuple(range(self.cluster.num_devices))
        w = len(self.workers)
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) \
                or global_batch < 1 or global_batch % w:
            raise ConfigError(f"global_batch={global_batch!r} must be a positive multiple of the "
                              f"{w} workers (every device of {self.cluster.name!r}) so that each "
                              f"gets an equal share; e.g. {w * max(1, (global_batch or w) // w)}")
        self.global_batch = global_batch
        self.optimizer = SparseOptimizer(optimizer)
        self.precision = Precision(precision)
        self.options = options or CostOptions()
        self.constants = constants or load_sparse_constants()
        self.calibration = calibration
        cal = resolve_calibration(calibration)
        self._links = apply_calibration(self.cluster, cal) if cal else self.cluster
        self.devices = tuple(self._device(d) for d in self.workers)
        self.servers = tuple(self._server(s) for s in range(len(self.cluster.servers)))
        self._dense: dict[int, tuple[Strategy, Estimate]] = {}
        # the devices' figures as columns, for pricing many tables at once
        self._all = np.arange(w)
        self._hbm_bw = np.array([d.hbm_bw for d in self.devices])
        self._intra_share = np.array([d.intra_share for d in self.devices])
        self._intra_bw = np.array([d.intra_bw for d in self.devices])
        self._inter_bw = np.array([d.inter_bw for d in self.devices])
        self._a2a_latency_s = np.array([d.a2a_latency_s for d in self.devices])
        self._ps_bw = np.array([d.ps_bw for d in self.devices])

    # ------------------------------------------------------------------ resources
    def _device(self, d: int) -> _Device:
        c = self._links
        profile = c.profile_of(d)
        dev = c._device(d)
        local = len(c.devices_of_node(dev.node))
        w = c.num_devices
        share = (local - 1) / (w - 1) if w > 1 else 1.0
        node = profile.node
        intra = node.bw_unidir_bytes_per_s * node.collective_efficiency.all_to_all
        if profile.network is not None:
            nic = c._nic_share(profile)
            inter = nic * profile.network.collective_efficiency.all_to_all
            ps = nic * profile.network.collective_efficiency.p2p
            latency = profile.network.latency_s if c.num_nodes > 1 else node.latency_s
        else:
            inter = ps = intra
            latency = node.latency_s
        host = profile.host
        return _Device(node=dev.node, hbm_bw=profile.device.memory_bw_bytes_per_s,
                       hbm_capacity=profile.device.memory_bytes * self.options.memory_fraction,
                       host_link_bw=None if host is None else host.pcie_bw_bytes_per_s,
                       intra_share=share, intra_bw=intra, inter_bw=inter,
                       a2a_latency_s=latency, ps_bw=ps)

    def _server(self, s: int) -> _Server:
        p = self.cluster.server_profile_of(s)
        latency = max([p.network.latency_s] + [
            self.cluster.server_link(s, d).latency_s for d in self.workers[:1]])
        return _Server(dram_bw=p.host.memory_bw_bytes_per_s * self.constants.server_memory_efficiency,
                       nic_bw=self.cluster.server_nic_bytes_per_s(s) * p.network.collective_efficiency.p2p,
                       latency_s=latency,
                       capacity=p.host.memory_bytes * self.constants.host_memory_fraction)

    def host_capacity(self, node: int) -> float:
        host = self.cluster.profiles[self.cluster.nodes[node].profile].host
        return 0.0 if host is None else host.memory_bytes * self.constants.host_memory_fraction

    # ------------------------------------------------------------------ the dense part
    def dense(self, zero: int = 0) -> tuple[Strategy, Estimate]:
        """The dense part's layout at ZeRO stage ``zero`` and its estimate (cached)."""
        if zero not in self._dense:
            w = len(self.workers)
            strategy = Strategy(dp=w, micro_batch=self.global_batch // w,
                                global_batch=self.global_batch, zero=zero,
                                precision=self.precision)
            est = estimate(self.graph.dense, self.cluster, strategy, options=self.options,
                           calibration=self.calibration)
            self._dense[zero] = (strategy, est)
        return self._dense[zero]

    # ------------------------------------------------------------------ pricing
    def _xfer(self, d, nbytes):
        """Seconds device(s) ``d`` take to send (or receive) ``nbytes`` spread over their
        peers: the same-node share over the node's fabric while the rest crosses the NIC
        (``d`` an index or an index array, broadcast against ``nbytes``)."""
        share = self._intra_share[d]
        if len(self.workers) == 1:
            return np.zeros(np.broadcast(np.asarray(nbytes), share).shape)
        return np.maximum(nbytes * share / self._intra_bw[d],
                          nbytes * (1 - share) / self._inter_bw[d])

    def _gather_bw(self, d, row_bytes):
        """Bytes/s device(s) ``d`` gather rows of ``row_bytes`` at from device memory."""
        return (self._hbm_bw[d] * self.constants.hbm_gather_efficiency
                / self.constants.penalty(row_bytes))

    def _host_bw(self, d: int, table: str) -> float:
        bw = self.devices[d].host_link_bw
        if bw is None:
            raise ConfigError(f"table {table!r}: device {d}'s profile states no host link "
                              "(host.pcie_bw); keep the table in device memory or on servers")
        return bw * self.constants.host_link_efficiency

    def _check(self, placement: TablePlacement) -> None:
        if placement.storage is Storage.SERVER:
            bad = [s for s in placement.devices if not 0 <= s < len(self.servers)]
            if bad:
                raise ConfigError(f"table {placement.table!r}: servers {bad} are not among the "
                                  f"cluster's {len(self.servers)} servers (Cluster.with_servers "
                                  "adds them)")
            return
        bad = [d for d in placement.devices if d not in self.workers]
        if bad:
            raise ConfigError(f"table {placement.table!r}: devices {bad} are not in the "
                              f"cluster's {len(self.workers)} devices")

    def loads(self, table: EmbeddingTable, placement: TablePlacement) -> TableLoads:
        """What ``placement`` of ``table`` costs each device, node and server per step."""
        if placement.table != table.name:
            raise ConfigError(f"placement of {placement.table!r} given for table {table.name!r}")
        _check_pooling(table, placement)
        ld = self.price(TableColumns.of([table]), placement)
        p = placement
        out = TableLoads()
        if p.storage is Storage.SERVER:
            out.worker_s = {d: float(ld.worker_s[0, d]) for d in self.workers}
            out.hbm = {d: float(ld.hbm_bytes[0, d]) for d in self.workers}
            out.server = {s: ld.server_s[0, s].tolist() for s in p.devices}
            out.server_mem = {s: float(ld.server_bytes[0, s]) for s in p.devices}
            return out
        if p.sharding is not Sharding.DATA_PARALLEL:
            out.worker_s = {d: float(ld.worker_s[0, d]) for d in self.workers}
        out.owner = {d: ld.owner_s[0, d].tolist() for d in p.devices}
        out.hbm = {d: float(ld.hbm_bytes[0, d]) for d in p.devices}
        if p.storage is not Storage.HBM:
            out.host = {n: float(ld.host_bytes[0, n])
                        for n in dict.fromkeys(self.devices[d].node for d in p.devices)}
        return out

    def price(self, tables: TableColumns, placement: TablePlacement) -> OptionLoads:
        """What ``placement`` (its sharding, storage, devices or servers and cache; not its
        table's name) costs each of ``tables`` on every resource per step: the cost model
        of the module docstring, evaluated for many tables at once (the planner prices
        every option of thousands of tables so)."""
        self._check(placement)
        g = len(tables.rows)
        n_dev, n_srv = len(self.workers), len(self.servers)
        out = OptionLoads(worker_s=np.zeros((g, n_dev)), owner_s=np.zeros((g, n_dev, 3)),
                          server_s=np.zeros((g, n_srv, 3)), hbm_bytes=np.zeros((g, n_dev)),
                          host_bytes=np.zeros((g, self.cluster.num_nodes)),
                          server_bytes=np.zeros((g, n_srv)))
        if placement.storage is Storage.SERVER:
            self._price_server(tables, placement, out)
        elif placement.sharding is Sharding.DATA_PARALLEL:
            self._price_dp(tables, placement, out)
        else:
            self._price_sharded(tables, placement, out)
        return out

    def _worker_share(self, t: TableColumns) -> np.ndarray:
        """What every worker pays for a GPU-sharded table (tables x workers): its own ids
        out, its bags' partial sums in and their gradients out, summing the partials, and
        the table's all-to-all latencies."""
        w = len(self.workers)
        bw = self.global_batch / w
        pooled_bytes = (bw * t.bags_per_sample * t.dim * t.bytes_per_element)[:, None]
        ids = (bw * t.ids_per_sample * ID_MESSAGE_BYTES * (w - 1) / w)[:, None]
        comm = self._xfer(self._all, ids) + 2 * self._xfer(self._all, pooled_bytes * (w - 1) / w)
        pool = 2 * pooled_bytes / self._hbm_bw
        return comm + pool + A2A_CALLS_PER_TABLE * self._a2a_latency_s

    def _price_sharded(self, t: TableColumns, p: TablePlacement, out: OptionLoads) -> None:
        w = len(self.workers)
        b, e = self.global_batch, t.bytes_per_element
        out.worker_s[:] = self._worker_share(t)
        lookups = b * t.ids_per_sample
        for d, row0, row1, col0, col1 in p.blocks(t.rows, t.dim):
            c = col1 - col0
            n = lookups * t.lookup_share(row0, row1)
            u = t.distinct_rows(lookups, row0, row1)
            row_bytes = (c * e).astype(np.float64)
            state = self.optimizer.state_bytes(c)
            shard_bytes = (row1 - row0) * (row_bytes + state)
            gather_bytes = n * row_bytes
            partial_bytes = b * t.bags_per_sample * row_bytes
            grad_bytes = n * row_bytes + u * row_bytes        # read per lookup, sum per row
            update_bytes = u * (2 * row_bytes + 2 * state)    # weight and state, read + write
            hbm = self._gather_bw(d, row_bytes)
            if p.storage is Storage.HBM:
                lookup_s = gather_bytes / hbm
                update_s = grad_bytes / hbm + update_bytes / hbm
                out.hbm_bytes[:, d] += shard_bytes
            else:
                # the distinct rows cross the host link (the cache's from device memory),
                # then each lookup reads its row on the device
                host = self._host_bw(d, p.table)
                hot = 0.0
                if p.storage is Storage.HOST_CACHED:
                    cached = np.rint(p.cache_fraction * (row1 - row0))
                    hot = t.distinct_rows(lookups, row0, row0 + cached)
                    out.hbm_bytes[:, d] += cached * row_bytes
                lookup_s = (gather_bytes + hot * row_bytes) / hbm + (u - hot) * row_bytes / host
                update_s = grad_bytes / hbm + update_bytes / host   # written through to host
                out.host_bytes[:, self.devices[d].node] += shard_bytes
            lookup_s = lookup_s + partial_bytes / self._hbm_bw[d]     # the partial sums written
            comm_s = (self._xfer(d, n * ID_MESSAGE_BYTES * (w - 1) / w)
                      + 2 * self._xfer(d, partial_bytes * (w - 1) / w))
            # received ids and bags, kept for backward; the partial sums sent
            out.hbm_bytes[:, d] += n * ID_MESSAGE_BYTES + partial_bytes
            out.owner_s[:, d, 0] += lookup_s
            out.owner_s[:, d, 1] += update_s
            out.owner_s[:, d, 2] += comm_s

    def _price_dp(self, t: TableColumns, p: TablePlacement, out: OptionLoads) -> None:
        w = len(self.workers)
        bw = self.global_batch / w
        row_bytes = (t.dim * t.bytes_per_element).astype(np.float64)
        weight = t.rows * row_bytes
        state = t.rows * self.optimizer.state_bytes(t.dim)
        if w > 1:
            algorithms = self.cluster.collective_candidates("all_reduce", self.workers)
            reduce_s = np.array([min(a.time(float(x)) for a in algorithms) for x in weight])
        else:
            reduce_s = np.zeros(len(weight))
        d = np.array(p.devices)
        hbm = self._gather_bw(d, row_bytes[:, None])
        lookup_s = (bw * t.ids_per_sample * row_bytes)[:, None] / hbm
        out.owner_s[:, d, 0] = lookup_s
        out.owner_s[:, d, 1] = (lookup_s                                  # gradient scatter
                                + (2 * weight + 2 * state + weight)[:, None] / self._hbm_bw[d])
        out.owner_s[:, d, 2] = reduce_s[:, None]
        out.hbm_bytes[:, d] = (2 * weight + state)[:, None]    # weight, dense gradient, state

    def _price_server(self, t: TableColumns, p: TablePlacement, out: OptionLoads) -> None:
        w = len(self.workers)
        b = self.global_batch
        bw = b / w
        row_bytes = (t.dim * t.bytes_per_element).astype(np.float64)
        state = self.optimizer.state_bytes(t.dim)
        blocks = p.blocks(t.rows, t.dim)
        ids = bw * t.ids_per_sample
        u = t.distinct_rows(ids, 0, t.rows)
        pull = (np.maximum(u * ROW_ID_BYTES, u * row_bytes))[:, None] / self._ps_bw
        push = (u * (ROW_ID_BYTES + row_bytes))[:, None] / self._ps_bw
        pool = 2 * (ids * row_bytes)[:, None] / self._gather_bw(self._all, row_bytes[:, None])
        latency = PS_MESSAGES_PER_SHARD * len(blocks) * self._a2a_latency_s
        out.worker_s[:] = pull + push + pool + latency
        out.hbm_bytes[:] = (u * row_bytes * 2 + ids * ROW_ID_BYTES)[:, None]  # rows, grads, ids
        for s, row0, row1, _, _ in blocks:
            srv = self.servers[s]
            pulled = w * t.distinct_rows(ids, row0, row1)
            touched = t.distinct_rows(b * t.ids_per_sample, row0, row1)
            out.server_s[:, s, 0] = pulled * row_bytes / srv.dram_bw
            out.server_s[:, s, 1] = (pulled * row_bytes
                                     + touched * (2 * row_bytes + 2 * state)) / srv.dram_bw
            out.server_s[:, s, 2] = ((pulled * row_bytes + pulled * (ROW_ID_BYTES + row_bytes))
                                     / srv.nic_bw + 2 * w * srv.latency_s)
            out.server_bytes[:, s] = ((row1 - row0) * (row_bytes + state)
                                      + pulled * (row_bytes + ROW_ID_BYTES))

    # ------------------------------------------------------------------ a whole plan
    def estimate(self, placements: Iterable[TablePlacement], dense: Strategy) -> SparseEstimate:
        """The step of ``placements`` (one per table) with the dense part laid out as
        ``dense`` (a data-parallel :class:`~autoplan.Strategy` over every worker)."""
        placements = tuple(placements)
        by_name = {p.table: p for p in placements}
        names = [t.name for t in self.graph.tables]
        missing = [n for n in names if n not in by_name]
        extra = sorted(set(by_name) - set(names))
        if missing or extra or len(placements) != len(names):
            raise ConfigError(f"a sparse plan places every table once: missing {missing[:5]}, "
                              f"unknown {extra[:5]}")
        strategy, dense_est = self.dense(dense.zero)
        if dense.dp != len(self.workers) or dense.global_batch != self.global_batch:
            raise ConfigError(f"the dense layout must be data parallel over all "
                              f"{len(self.workers)} workers at global batch {self.global_batch}")
        n_dev, n_srv, n_tab = len(self.workers), len(self.servers), len(names)
        # the tables of each placement (devices, sharding, storage) priced together
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(self.graph.tables):
            p = by_name[t.name]
            _check_pooling(t, p)
            groups.setdefault((p.sharding, p.storage, p.devices, p.cache_fraction), []).append(i)
        worker = np.zeros((n_tab, n_dev))
        owner = np.zeros((n_tab, n_dev, 3))
        server = np.zeros((n_tab, n_srv, 3))
        hbm, host = np.zeros((n_tab, n_dev)), np.zeros((n_tab, self.cluster.num_nodes))
        smem = np.zeros((n_tab, n_srv))
        busiest = np.zeros((n_tab, 3))
        for idx in groups.values():
            p = by_name[names[idx[0]]]
            ld = self.price(TableColumns.of([self.graph.tables[i] for i in idx]), p)
            worker[idx], owner[idx], server[idx] = ld.worker_s, ld.owner_s, ld.server_s
            hbm[idx], host[idx], smem[idx] = ld.hbm_bytes, ld.host_bytes, ld.server_bytes
            held = (ld.server_s if p.storage is Storage.SERVER else ld.owner_s)[:, list(p.devices)]
            busiest[idx] = held[np.arange(len(idx)), held.sum(axis=2).argmax(axis=1)]
        costs = tuple(TableCost(
            table=names[i], lookup_s=float(busiest[i, 0]), update_s=float(busiest[i, 1]),
            comm_s=float(busiest[i, 2]), worker_s=float(worker[i].max(initial=0.0)),
            hbm_bytes=float(hbm[i].sum()), host_bytes=float(host[i].sum()),
            server_bytes=float(smem[i].sum())) for i in range(n_tab))
        terms = np.concatenate([owner.sum(axis=0), worker.sum(axis=0)[:, None]], axis=1)
        device_s = terms.sum(axis=1)
        server_terms = server.sum(axis=0)
        server_s = server_terms.sum(axis=1)
        hbm_used = hbm.sum(axis=0) + dense_est.stages[0].peak_memory_bytes
        host_used, smem_used = host.sum(axis=0), smem.sum(axis=0)
        emb = float(device_s.max(initial=0.0))
        srv = float(server_s.max(initial=0.0))
        step = dense_est.step_time_s + emb + srv
        hbm_cap = [d.hbm_capacity for d in self.devices]
        host_cap = [self.host_capacity(n) for n in range(self.cluster.num_nodes)]
        srv_cap = [s.capacity for s in self.servers]
        fits = bool((hbm_used <= hbm_cap).all() and (host_used <= host_cap).all()
                    and (smem_used <= srv_cap).all())
        return SparseEstimate(
            step_time_s=step, samples_per_s=self.global_batch / step,
            dense_s=dense_est.step_time_s, worker_s=tuple(device_s.tolist()),
            server_s=tuple(server_s.tolist()),
            bound_by=_bound_by(dense_est.step_time_s, device_s.tolist(), terms.tolist(),
                               server_terms.tolist()),
            hbm_bytes=tuple(hbm_used.tolist()), host_bytes=tuple(host_used.tolist()),
            server_bytes=tuple(smem_used.tolist()), hbm_capacity_bytes=tuple(hbm_cap),
            host_capacity_bytes=tuple(host_cap), server_capacity_bytes=tuple(srv_cap),
            tables=costs, fits=fits)


def _check_pooling(table: EmbeddingTable, placement: TablePlacement) -> None:
    if placement.sharding is not Sharding.DATA_PARALLEL and table.pooling is Pooling.MAX:
        raise InputError(f"table {table.name!r} max-pools, which the sharded runtime does not "
                         "split (partial maxima have no exact gradient split); keep it "
                         "data-parallel")


_TERMS = ("lookups", "updates", "all-to-all", "its own ids and pooling")


def _bound_by(dense_s: float, worker: list[float], terms: list[list[float]],
              server: list[list[float]]) -> str:
    """The largest of the step's three parts, and inside it the busiest resource's
    largest term."""
    emb = max(worker, default=0.0)
    srv_s = [sum(v) for v in server]
    srv = max(srv_s, default=0.0)
    if dense_s >= emb and dense_s >= srv:
        return f"the dense part ({dense_s * 1e3:.3g} ms)"
    if emb >= srv:
        d = max(range(len(worker)), key=lambda i: (worker[i], -i))
        k = max(range(4), key=lambda i: terms[d][i])
        return f"device {d}'s embeddings ({worker[d] * 1e3:.3g} ms, most in {_TERMS[k]})"
    s = max(range(len(srv_s)), key=lambda i: (srv_s[i], -i))
    k = max(range(3), key=lambda i: server[s][i])
    names = ("serving pulls", "applying pushes", "its NICs")
    return f"server {s} ({srv_s[s] * 1e3:.3g} ms, most in {names[k]})"
