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
from .tables import EmbeddingTable, SparseGraph

__all__ = ["SparseConstants", "load_sparse_constants", "SparseCostModel", "TableLoads",
           "A2A_CALLS_PER_TABLE"]

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

    def penalty(self, row_bytes: float) -> float:
        """The time factor of gathering rows of ``row_bytes`` (narrow rows waste the kernel)."""
        return next(f for r, f in self.row_bytes_penalty if row_bytes >= r)


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
        self._shares: dict[tuple[str, str], dict[int, float]] = {}

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

    # ------------------------------------------------------------------ one table
    def _xfer(self, d: int, nbytes: float) -> float:
        """Seconds device ``d`` takes to send (or receive) ``nbytes`` spread over its peers:
        the same-node share over the node's fabric while the rest crosses its NIC."""
        if len(self.workers) == 1 or nbytes <= 0:
            return 0.0
        dev = self.devices[d]
        return max(nbytes * dev.intra_share / dev.intra_bw,
                   nbytes * (1 - dev.intra_share) / dev.inter_bw)

    def _gather_bw(self, d: int, row_bytes: float) -> float:
        dev = self.devices[d]
        return dev.hbm_bw * self.constants.hbm_gather_efficiency / self.constants.penalty(row_bytes)

    def _host_bw(self, d: int, table: str) -> float:
        bw = self.devices[d].host_link_bw
        if bw is None:
            raise ConfigError(f"table {table!r}: device {d}'s profile states no host link "
                              "(host.pcie_bw); keep the table in device memory or on servers")
        return bw * self.constants.host_link_efficiency

    def loads(self, table: EmbeddingTable, placement: TablePlacement) -> TableLoads:
        """What ``placement`` of ``table`` costs each device, node and server per step."""
        if placement.table != table.name:
            raise ConfigError(f"placement of {placement.table!r} given for table {table.name!r}")
        if placement.sharding is not Sharding.DATA_PARALLEL and table.pooling is Pooling.MAX:
            raise InputError(f"table {table.name!r} max-pools, which the sharded runtime does not "
                             "split (partial maxima have no exact gradient split); keep it "
                             "data-parallel")
        if placement.storage is Storage.SERVER:
            return self._server_loads(table, placement)
        bad = [d for d in placement.devices if d not in self.workers]
        if bad:
            raise ConfigError(f"table {table.name!r}: devices {bad} are not in the cluster's "
                              f"{len(self.workers)} devices")
        if placement.sharding is Sharding.DATA_PARALLEL:
            return self._dp_loads(table, placement)
        return self._sharded_loads(table, placement)

    def _worker_share(self, table: EmbeddingTable) -> dict[int, float]:
        """What every worker pays for a GPU-sharded table: its own ids out, its bags'
        partial sums in and their gradients out, summing the partials, and the table's
        all-to-all latencies (the same for every placement: cached per table)."""
        key = ("gpu", table.name)
        if key not in self._shares:
            w = len(self.workers)
            bw = self.global_batch / w
            e = table.bytes_per_element
            share = {}
            for d in self.workers:
                ids = bw * table.ids_per_sample * ID_MESSAGE_BYTES * (w - 1) / w
                pooled = bw * table.bags_per_sample * table.dim * e * (w - 1) / w
                comm = self._xfer(d, ids) + 2 * self._xfer(d, pooled)
                pool = 2 * bw * table.bags_per_sample * table.dim * e / self.devices[d].hbm_bw
                share[d] = comm + pool + A2A_CALLS_PER_TABLE * self.devices[d].a2a_latency_s
            self._shares[key] = share
        return self._shares[key]

    def _sharded_loads(self, table: EmbeddingTable, p: TablePlacement) -> TableLoads:
        loads = TableLoads(worker_s=dict(self._worker_share(table)))
        w = len(self.workers)
        b, e = self.global_batch, table.bytes_per_element
        lookups = b * table.ids_per_sample
        for shard in p.shards(table.rows, table.dim):
            d, c = shard.owner, shard.cols
            share = table.lookup_share(shard.row0, shard.row1)
            n = lookups * share
            u = table.distinct_rows(lookups, shard.row0, shard.row1)
            row_bytes = c * e
            state = self.optimizer.state_bytes(c)
            gather_bytes = n * row_bytes
            partial_bytes = b * table.bags_per_sample * row_bytes
            grad_bytes = n * row_bytes + u * row_bytes        # read per lookup, sum per row
            update_bytes = u * (2 * row_bytes + 2 * state)    # weight and state, read + write
            hbm = self._gather_bw(d, row_bytes)
            dev = self.devices[d]
            if p.storage is Storage.HBM:
                lookup_s = gather_bytes / hbm
                update_s = grad_bytes / hbm + update_bytes / hbm
                loads.hbm[d] = loads.hbm.get(d, 0.0) + shard.rows * (row_bytes + state)
            else:
                # the distinct rows cross the host link (the cache's from device memory),
                # then each lookup reads its row on the device
                host = self._host_bw(d, table.name)
                hot = 0.0
                if p.storage is Storage.HOST_CACHED:
                    cached = int(round(p.cache_fraction * shard.rows))
                    hot = table.distinct_rows(lookups, shard.row0, shard.row0 + cached)
                    loads.hbm[d] = loads.hbm.get(d, 0.0) + cached * row_bytes
                lookup_s = (gather_bytes + hot * row_bytes) / hbm + (u - hot) * row_bytes / host
                update_s = grad_bytes / hbm + update_bytes / host   # written through to host
                loads.host[dev.node] = loads.host.get(dev.node, 0.0) + shard.rows * (row_bytes + state)
            lookup_s += partial_bytes / dev.hbm_bw                  # the partial sums written
            comm_s = (self._xfer(d, n * ID_MESSAGE_BYTES * (w - 1) / w)
                      + 2 * self._xfer(d, partial_bytes * (w - 1) / w))
            # received ids and bags, kept for backward; the partial sums sent
            loads.hbm[d] = loads.hbm.get(d, 0.0) + n * ID_MESSAGE_BYTES + partial_bytes
            terms = loads.owner.setdefault(d, [0.0, 0.0, 0.0])
            terms[0] += lookup_s
            terms[1] += update_s
            terms[2] += comm_s
        return loads

    def _dp_loads(self, table: EmbeddingTable, p: TablePlacement) -> TableLoads:
        loads = TableLoads()
        w = len(self.workers)
        bw = self.global_batch / w
        e = table.bytes_per_element
        row_bytes = table.dim * e
        weight = table.rows * row_bytes
        state = table.rows * self.optimizer.state_bytes(table.dim)
        reduce_s = self.cluster.collective_time("all_reduce", self.workers, weight) if w > 1 else 0.0
        for d in p.devices:
            hbm = self._gather_bw(d, row_bytes)
            lookup_s = bw * table.ids_per_sample * row_bytes / hbm
            update_s = (bw * table.ids_per_sample * row_bytes / hbm          # gradient scatter
                        + (2 * weight + 2 * state + weight) / self.devices[d].hbm_bw)
            loads.owner[d] = [lookup_s, update_s, reduce_s]
            loads.hbm[d] = 2 * weight + state          # weight, dense gradient, state
        return loads

    def _server_loads(self, table: EmbeddingTable, p: TablePlacement) -> TableLoads:
        loads = TableLoads()
        n_servers = len(self.servers)
        bad = [s for s in p.devices if not 0 <= s < n_servers]
        if bad:
            raise ConfigError(f"table {table.name!r}: servers {bad} are not among the cluster's "
                              f"{n_servers} servers (Cluster.with_servers adds them)")
        w = len(self.workers)
        bw = self.global_batch / w
        e = table.bytes_per_element
        row_bytes = table.dim * e
        state = self.optimizer.state_bytes(table.dim)
        shards = p.shards(table.rows, table.dim)
        u = table.distinct_rows(bw * table.ids_per_sample)
        for d in self.workers:
            dev = self.devices[d]
            pull = max(u * ROW_ID_BYTES, u * row_bytes) / dev.ps_bw
            push = u * (ROW_ID_BYTES + row_bytes) / dev.ps_bw
            pool = 2 * bw * table.ids_per_sample * row_bytes / self._gather_bw(d, row_bytes)
            latency = PS_MESSAGES_PER_SHARD * len(shards) * dev.a2a_latency_s
            loads.worker_s[d] = pull + push + pool + latency
            loads.hbm[d] = u * row_bytes * 2 + bw * table.ids_per_sample * 8  # rows, grads, ids
        for shard in shards:
            srv = self.servers[shard.owner]
            per_worker = table.distinct_rows(bw * table.ids_per_sample, shard.row0, shard.row1)
            pulled = w * per_worker
            u = table.distinct_rows(self.global_batch * table.ids_per_sample,
                                    shard.row0, shard.row1)
            lookup_s = pulled * row_bytes / srv.dram_bw
            update_s = (pulled * row_bytes + u * (2 * row_bytes + 2 * state)) / srv.dram_bw
            comm_s = (pulled * row_bytes + pulled * (ROW_ID_BYTES + row_bytes)) / srv.nic_bw \
                + 2 * w * srv.latency_s
            loads.server[shard.owner] = [lookup_s, update_s, comm_s]
            loads.server_mem[shard.owner] = (shard.rows * (row_bytes + state)
                                             + pulled * (row_bytes + ROW_ID_BYTES))
        return loads

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
        n_dev, n_srv = len(self.workers), len(self.servers)
        worker = [0.0] * n_dev
        terms = [[0.0, 0.0, 0.0, 0.0] for _ in range(n_dev)]     # lookup, update, comm, own share
        server = [[0.0, 0.0, 0.0] for _ in range(n_srv)]
        hbm = [dense_est.stages[0].peak_memory_bytes] * n_dev
        host = [0.0] * self.cluster.num_nodes
        smem = [0.0] * n_srv
        costs = []
        for t in self.graph.tables:
            loads = self.loads(t, by_name[t.name])
            for d in self.workers:
                worker[d] += loads.device_s(d)
                terms[d][3] += loads.worker_s.get(d, 0.0)
                for i, v in enumerate(loads.owner.get(d, ())):
                    terms[d][i] += v
            for s, v in loads.server.items():
                for i, x in enumerate(v):
                    server[s][i] += x
            for d, v in loads.hbm.items():
                hbm[d] += v
            for n, v in loads.host.items():
                host[n] += v
            for s, v in loads.server_mem.items():
                smem[s] += v
            owners = list(loads.owner.values()) + list(loads.server.values())
            busiest = max(owners, key=sum, default=[0.0, 0.0, 0.0])
            costs.append(TableCost(
                table=t.name, lookup_s=busiest[0], update_s=busiest[1], comm_s=busiest[2],
                worker_s=max(loads.worker_s.values(), default=0.0),
                hbm_bytes=sum(loads.hbm.values()), host_bytes=sum(loads.host.values()),
                server_bytes=sum(loads.server_mem.values())))
        server_s = [sum(v) for v in server]
        emb = max(worker, default=0.0)
        srv = max(server_s, default=0.0)
        step = dense_est.step_time_s + emb + srv
        hbm_cap = [d.hbm_capacity for d in self.devices]
        host_cap = [self.host_capacity(n) for n in range(self.cluster.num_nodes)]
        srv_cap = [s.capacity for s in self.servers]
        fits = (all(a <= b for a, b in zip(hbm, hbm_cap)) and all(a <= b for a, b in zip(host, host_cap))
                and all(a <= b for a, b in zip(smem, srv_cap)))
        return SparseEstimate(
            step_time_s=step, samples_per_s=self.global_batch / step,
            dense_s=dense_est.step_time_s, worker_s=tuple(worker), server_s=tuple(server_s),
            bound_by=_bound_by(dense_est.step_time_s, worker, terms, server),
            hbm_bytes=tuple(hbm), host_bytes=tuple(host), server_bytes=tuple(smem),
            hbm_capacity_bytes=tuple(hbm_cap), host_capacity_bytes=tuple(host_cap),
            server_capacity_bytes=tuple(srv_cap), tables=tuple(costs), fits=fits)


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
