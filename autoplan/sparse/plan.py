"""Records of the sparse mode: how each embedding table is sharded and where it lives.

A :class:`TablePlacement` says, for one table, its sharding type
(:class:`Sharding`: data-parallel, table-wise, row-wise, column-wise), where its rows
are stored (:class:`Storage`: a GPU's memory, its node's host memory read over the
host link with or without a device cache of hot rows, or CPU parameter servers) and
which devices (or servers) hold its shards.  A :class:`SparsePlan` is every table's
placement, the dense part's data-parallel layout (a :class:`~autoplan.Strategy`) and
the sparse optimizer, with the estimate the cost model (:mod:`.cost`) made of it.
The planner (:mod:`.placement`) writes it, the runtime (:mod:`.runtime`) runs it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from ..records import TRANSIENT, Record
from ..strategy import Strategy

__all__ = ["Sharding", "Storage", "Pooling", "SparseOptimizer", "Shard", "TablePlacement",
           "TableCost", "SparseEstimate", "SparsePlan", "ID_MESSAGE_BYTES", "ROW_ID_BYTES"]

#: Bytes a pooled-at-owner lookup sends in the id all-to-all: the id and the index of its
#: bag, both int64 (what :mod:`.runtime` sends; TorchRec sends ids and per-bag lengths).
ID_MESSAGE_BYTES = 16
#: Bytes of one row id a worker sends a parameter server (int64, :mod:`.server`).
ROW_ID_BYTES = 8


class Sharding(str, enum.Enum):
    """How a table is split (TorchRec's sharding types; Ivchenko et al. 2022, Sec. 3)."""

    DATA_PARALLEL = "data_parallel"   # whole on every worker, gradients all-reduced
    TABLE_WISE = "table_wise"         # whole on one device or server
    ROW_WISE = "row_wise"             # contiguous blocks of rows over several devices/servers
    COLUMN_WISE = "column_wise"       # equal blocks of columns over several devices


class Storage(str, enum.Enum):
    """Where a table's rows live (TorchRec's compute kernels, and parameter servers)."""

    HBM = "hbm"                   # the device's memory
    HOST = "host"                 # the node's host memory, read over the device's host link
    HOST_CACHED = "host_cached"   # host memory, with a device cache of the hottest rows
    SERVER = "server"             # CPU parameter servers, over the network


class Pooling(str, enum.Enum):
    """How a bag of ids becomes one vector (``NONE``: ``nn.Embedding``, a row per id)."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    NONE = "none"


class SparseOptimizer(str, enum.Enum):
    """The update embedding rows get, where they live (only the rows a step touched).

    ==================  ===============================================  =================
    optimizer           update of a touched row ``w`` with gradient ``g``  state per row
    ==================  ===============================================  =================
    sgd                 ``w -= lr g``                                     none
    rowwise_adagrad     ``s += mean(g^2); w -= lr g / (sqrt(s) + eps)``   one fp32
    adam                lazy Adam (torch ``SparseAdam``): ``m``, ``v``     two fp32 per column
    ==================  ===============================================  =================

    Row-wise Adagrad is what DLRM-DCNv2 trains with (MLPerf; fbgemm's
    ``EXACT_ROWWISE_ADAGRAD``, Gupta et al. 2014).
    """

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"

    def state_bytes(self, columns: int) -> int:
        """Optimizer state bytes of one row of ``columns`` columns (fp32 state)."""
        if self is SparseOptimizer.SGD:
            return 0
        if self is SparseOptimizer.ROWWISE_ADAGRAD:
            return 4
        return 8 * columns


@dataclass(frozen=True)
class Shard:
    """One block of a table: rows ``[row0, row1)`` and columns ``[col0, col1)`` on ``owner``
    (a global device index, or a server index for :attr:`Storage.SERVER`)."""

    owner: int
    row0: int
    row1: int
    col0: int
    col1: int

    @property
    def rows(self) -> int:
        return self.row1 - self.row0

    @property
    def cols(self) -> int:
        return self.col1 - self.col0


@dataclass(frozen=True)
class TablePlacement(Record):
    """Where one table lives.

    Parameters
    ----------
    table : str
        The table's module path (:attr:`~autoplan.sparse.tables.EmbeddingTable.name`).
    sharding : Sharding
    storage : Storage
    devices : tuple of int
        The global device indices holding the shards, in shard order (row or column
        blocks in order); every worker for data-parallel; server indices for
        :attr:`Storage.SERVER`.
    cache_fraction : float
        For :attr:`Storage.HOST_CACHED`: the share of each shard's rows its device cache
        holds (the hottest ones); 0 otherwise.
    """

    table: str
    sharding: Sharding
    storage: Storage
    devices: tuple[int, ...]
    cache_fraction: float = 0.0

    def __post_init__(self) -> None:
        where = f"table {self.table!r}"
        if not self.devices:
            raise ConfigError(f"{where}: a placement needs at least one device or server")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(f"{where}: devices {list(self.devices)} repeat one; each shard "
                              "needs its own device")
        if self.sharding is Sharding.TABLE_WISE and len(self.devices) != 1:
            raise ConfigError(f"{where}: table-wise puts the table on one device, got "
                              f"{len(self.devices)}")
        if self.sharding is Sharding.DATA_PARALLEL and self.storage is not Storage.HBM:
            raise ConfigError(f"{where}: a data-parallel table is replicated in every device's "
                              f"memory (storage 'hbm'), got {self.storage.value!r}")
        if self.storage is Storage.SERVER and self.sharding not in (Sharding.TABLE_WISE,
                                                                   Sharding.ROW_WISE):
            raise ConfigError(f"{where}: parameter servers hold whole tables or row blocks "
                              f"(table_wise, row_wise), not {self.sharding.value!r}")
        cached = self.storage is Storage.HOST_CACHED
        if not (math.isfinite(self.cache_fraction) and
                (0 < self.cache_fraction <= 1 if cached else self.cache_fraction == 0)):
            raise ConfigError(f"{where}: cache_fraction must be in (0, 1] for host_cached "
                              f"storage and 0 otherwise, got {self.cache_fraction!r}")

    def shards(self, rows: int, dim: int) -> tuple[Shard, ...]:
        """The blocks of a ``rows x dim`` table: row blocks of ``ceil(rows / k)`` rows (the
        last one shorter), column blocks of ``dim / k`` columns, one per device.

        Raises
        ------
        ConfigError
            A column-wise split that does not divide ``dim``, or more row blocks than rows.
        """
        return tuple(Shard(d, int(r0), int(r1), int(c0), int(c1))
                     for d, r0, r1, c0, c1 in self.blocks(rows, dim))

    def blocks(self, rows, dim) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`shards` of several tables at once: ``rows`` and ``dim`` are integer arrays
        (one entry per table), each block ``(owner, row0, row1, col0, col1)`` of arrays."""
        rows, dim = np.asarray(rows, dtype=np.int64), np.asarray(dim, dtype=np.int64)
        zero = np.zeros_like(rows)
        k = len(self.devices)
        if self.sharding in (Sharding.TABLE_WISE, Sharding.DATA_PARALLEL):
            return [(d, zero, rows, zero, dim) for d in self.devices]
        if self.sharding is Sharding.COLUMN_WISE:
            if np.any(dim % k):
                raise ConfigError(f"table {self.table!r}: {k} column blocks do not divide its "
                                  f"dimension {dim}; use a number of devices that divides it")
            w = dim // k
            return [(d, zero, rows, i * w, (i + 1) * w) for i, d in enumerate(self.devices)]
        block = -(-rows // k)
        if np.any(block * (k - 1) >= rows):
            raise ConfigError(f"table {self.table!r}: {k} row blocks for {rows} rows leave one "
                              "empty; use fewer devices")
        return [(d, i * block, np.minimum(rows, (i + 1) * block), zero, dim)
                for i, d in enumerate(self.devices)]

    def describe(self) -> str:
        """``row_wise/hbm on 0-7``, ``table_wise/server on s1``, ``host_cached(25%)``."""
        storage = self.storage.value
        if self.storage is Storage.HOST_CACHED:
            storage += f"({self.cache_fraction:.0%})"
        prefix = "s" if self.storage is Storage.SERVER else ""
        return f"{self.sharding.value}/{storage} on {_ranges(self.devices, prefix)}"


def _ranges(ids: tuple[int, ...], prefix: str = "") -> str:
    """``0-3,6`` for ``(0, 1, 2, 3, 6)``."""
    out, start = [], None
    ordered = sorted(ids)
    for i, x in enumerate(ordered):
        if start is None:
            start = x
        if i + 1 == len(ordered) or ordered[i + 1] != x + 1:
            out.append(f"{prefix}{start}" if start == x else f"{prefix}{start}-{prefix}{x}")
            start = None
    return ",".join(out)


@dataclass(frozen=True)
class TableCost(Record):
    """What one table's placement costs per step (:func:`autoplan.sparse.cost.table_cost`).

    Seconds are the busiest owner's (a device or a server holding a shard); bytes are the
    whole table's, summed over its shards or replicas.
    """

    table: str
    lookup_s: float          # gathering rows from where they live (forward)
    update_s: float          # gradient accumulation and the sparse optimizer where rows live
    comm_s: float            # id, pooled-embedding and gradient traffic of the busiest owner
    worker_s: float          # what every worker pays for the table (its own ids, pulls, pushes)
    hbm_bytes: float
    host_bytes: float
    server_bytes: float


@dataclass(frozen=True)
class SparseEstimate(Record):
    """The cost of a :class:`SparsePlan`'s step.

    The step is the dense part (forward, backward, its gradient reduction and
    optimizer, :func:`autoplan.estimate`) plus the embedding work of the busiest worker
    plus that of the busiest parameter server: a synchronous step waits for both
    (``step_time_s = dense_s + max(worker_s) + max(server_s)``).

    Attributes
    ----------
    worker_s : tuple of float
        Embedding seconds of each device (lookups and updates of the shards it holds,
        its all-to-all traffic, what every worker pays per table).
    server_s : tuple of float
        Each server's seconds (serving pulls, applying pushes, its NICs).
    bound_by : str
        What bounds the step: the busiest worker or server and its largest term, or the
        dense part.
    hbm_bytes, host_bytes, server_bytes : tuple of float
        Memory per device (the dense part's peak included), per node's host, per server.
    """

    step_time_s: float
    samples_per_s: float
    dense_s: float
    worker_s: tuple[float, ...]
    server_s: tuple[float, ...]
    bound_by: str
    hbm_bytes: tuple[float, ...]
    host_bytes: tuple[float, ...]
    server_bytes: tuple[float, ...]
    hbm_capacity_bytes: tuple[float, ...]
    host_capacity_bytes: tuple[float, ...]
    server_capacity_bytes: tuple[float, ...]
    tables: tuple[TableCost, ...]
    fits: bool

    @property
    def embedding_s(self) -> float:
        return max(self.worker_s, default=0.0)

    @property
    def servers_s(self) -> float:
        return max(self.server_s, default=0.0)

    def table_cost(self, name: str) -> TableCost:
        for t in self.tables:
            if t.table == name:
                return t
        raise KeyError(f"no table {name!r} in the estimate")


@dataclass(frozen=True)
class SparsePlan(Record):
    """A layout of an embedding-heavy model: every table's placement and the dense part's.

    Attributes
    ----------
    model, title : str
        The captured model's class and its name for people.
    cluster : str
        The cluster's name; ``num_devices`` workers (every device) and ``num_servers``.
    global_batch : int
    dense : Strategy
        The dense part's layout: data parallel over every worker, with its ZeRO stage
        and precision (:func:`autoplan.estimate` prices it, :func:`autoplan.parallelize`
        runs it with DDP or FSDP2).
    tables : tuple of TablePlacement
        One per table, in the graph's order.
    optimizer : SparseOptimizer
        The embedding rows' optimizer.
    estimate : SparseEstimate
    search : str
        How the plan was found (``cp-sat optimal``, ``cp-sat feasible``, ``greedy``,
        ``given``).
    baseline_step_time_s : float or None
        The TorchRec-style greedy placement's step on the same cost model (``None`` when
        not compared).
    bound_step_time_s : float or None
        A proven lower bound on the step of any placement: CP-SAT's (of its integer
        model) where one model held every table, else the relaxation's
        (:meth:`~.options.Problem.lower_bound`).
    solve_time_s : float
        Seconds the search took (not written to JSON: a plan is byte-identical however
        long it took).
    """

    model: str
    title: str
    cluster: str
    num_devices: int
    num_servers: int
    global_batch: int
    dense: Strategy
    tables: tuple[TablePlacement, ...]
    optimizer: SparseOptimizer
    estimate: SparseEstimate
    search: str = "given"
    baseline_step_time_s: float | None = None
    bound_step_time_s: float | None = None
    solve_time_s: float = field(default=0.0, compare=False, metadata=TRANSIENT)

    def placement(self, table: str) -> TablePlacement:
        for p in self.tables:
            if p.table == table:
                return p
        raise KeyError(f"no table {table!r} in the plan; tables are "
                       f"{[p.table for p in self.tables][:8]}")

    @property
    def gain_over_baseline(self) -> float | None:
        """The greedy baseline's step over this plan's (1.25: this plan 25% faster)."""
        if self.baseline_step_time_s is None:
            return None
        return self.baseline_step_time_s / self.estimate.step_time_s

    def summary(self) -> str:
        """One line: layout, step, throughput, what bounds it."""
        e = self.estimate
        kinds: dict[str, int] = {}
        for p in self.tables:
            key = f"{p.sharding.value}/{p.storage.value}"
            kinds[key] = kinds.get(key, 0) + 1
        mix = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        servers = f" + {self.num_servers} servers" if self.num_servers else ""
        return (f"{self.title or self.model} on {self.num_devices} devices{servers} "
                f"({self.cluster}), batch {self.global_batch}: step {e.step_time_s * 1e3:.3f} ms, "
                f"{e.samples_per_s:,.0f} samples/s; tables {mix}; dense dp{self.dense.dp} "
                f"zero{self.dense.zero}; bound by {e.bound_by}")
