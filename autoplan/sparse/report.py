"""Reports of sparse plans: per-table placements, what bounds the step, cluster what-ifs.

:func:`plan_frame` is one row per table (where it lives, what it costs);
:func:`plan_text` the plan as ``autoplan plan`` prints it; :func:`sparse_whatif` plans a
model on several clusters (device counts, CPU servers, prices) and returns one row each,
which :func:`whatif_text` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ..errors import ConfigError, InfeasiblePlan
from ..hardware.cluster import Cluster, load_cluster
from ..records import Record
from .placement import Prices, plan_sparse
from .plan import SparsePlan
from .tables import SparseGraph, trace_sparse

__all__ = ["plan_frame", "plan_text", "sparse_whatif", "whatif_text", "ServerSpec"]

_GIB = 2**30


def plan_frame(plan: SparsePlan, graph: SparseGraph | None = None):
    """One row per table: its shape and traffic (with ``graph``), its placement and its
    costs on the busiest resource holding it (pandas DataFrame)."""
    import pandas as pd

    tables = {t.name: t for t in graph.tables} if graph is not None else {}
    rows = []
    for p, c in zip(plan.tables, plan.estimate.tables):
        t = tables.get(p.table)
        rows.append({
            "table": p.table,
            "rows": t.rows if t else None, "dim": t.dim if t else None,
            "ids_per_sample": t.ids_per_sample if t else None,
            "sharding": p.sharding.value, "storage": p.storage.value,
            "devices": p.describe().split(" on ")[-1],
            "lookup_ms": c.lookup_s * 1e3, "update_ms": c.update_s * 1e3,
            "comm_ms": c.comm_s * 1e3, "worker_ms": c.worker_s * 1e3,
            "hbm_GiB": c.hbm_bytes / _GIB, "host_GiB": c.host_bytes / _GIB,
            "server_GiB": c.server_bytes / _GIB,
        })
    return pd.DataFrame(rows)


def _memory_line(plan: SparsePlan) -> str:
    e = plan.estimate
    parts = []
    if e.hbm_bytes:
        d = max(range(len(e.hbm_bytes)), key=lambda i: e.hbm_bytes[i] / e.hbm_capacity_bytes[i])
        parts.append(f"device {d} {e.hbm_bytes[d] / _GIB:.1f} of {e.hbm_capacity_bytes[d] / _GIB:.1f} GiB")
    if any(e.host_bytes):
        n = max(range(len(e.host_bytes)), key=lambda i: e.host_bytes[i])
        parts.append(f"host of node {n} {e.host_bytes[n] / _GIB:.1f} of "
                     f"{e.host_capacity_bytes[n] / _GIB:.1f} GiB")
    if e.server_bytes:
        s = max(range(len(e.server_bytes)), key=lambda i: e.server_bytes[i])
        parts.append(f"server {s} {e.server_bytes[s] / _GIB:.1f} of "
                     f"{e.server_capacity_bytes[s] / _GIB:.1f} GiB")
    return "fullest: " + "; ".join(parts) + ("" if e.fits else "  DOES NOT FIT")


def plan_text(plan: SparsePlan, graph: SparseGraph | None = None) -> str:
    """The plan as ``autoplan plan`` prints it: the summary, how it was found against the
    greedy baseline, what bounds the step, memory, and one line per table."""
    e = plan.estimate
    lines = [plan.summary()]
    found = f"search: {plan.search}"
    if plan.solve_time_s:
        found += f" in {plan.solve_time_s:.1f} s"
    if plan.baseline_step_time_s is not None:
        found += (f"; TorchRec-style greedy on the same cost model: "
                  f"{plan.baseline_step_time_s * 1e3:.3f} ms (this plan {plan.gain_over_baseline:.2f}x)")
    if plan.bound_step_time_s:
        found += f"; lower bound {plan.bound_step_time_s * 1e3:.3f} ms"
    lines.append(found)
    lines.append(f"step = dense {e.dense_s * 1e3:.3f} ms + busiest worker's embeddings "
                 f"{e.embedding_s * 1e3:.3f} ms + busiest server {e.servers_s * 1e3:.3f} ms")
    lines.append(_memory_line(plan))
    df = plan_frame(plan, graph)
    cols = [c for c in ("table", "rows", "dim", "ids_per_sample", "sharding", "storage", "devices",
                        "lookup_ms", "update_ms", "comm_ms", "hbm_GiB", "host_GiB", "server_GiB")
            if c in df and df[c].notna().any()]
    lines += ["", df[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}")]
    return "\n".join(lines)


@dataclass(frozen=True)
class ServerSpec(Record):
    """CPU servers to add to a cluster: ``count`` of ``profile`` (``"cpu-server-2s-epyc:2"``)."""

    profile: str
    count: int

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ConfigError(f"a server count is an integer >= 0, got {self.count!r}")

    @classmethod
    def parse(cls, text: str) -> "ServerSpec":
        """``PROFILE:COUNT``."""
        profile, sep, count = text.rpartition(":")
        if not sep or not profile:
            raise ConfigError(f"servers are PROFILE:COUNT (e.g. cpu-server-2s-epyc:2), got {text!r}")
        try:
            return cls(profile, int(count))
        except ValueError:
            raise ConfigError(f"servers are PROFILE:COUNT with a whole count, got {text!r}") from None


def sparse_whatif(model, *, clusters: Iterable[tuple[str, int] | str | Cluster],
                  global_batch: Sequence[int] | int,
                  servers: Sequence[ServerSpec | None] = (None,),
                  prices: Prices | None = None, example_inputs=None,
                  progress: Callable[[str], None] | None = None, **plan_kw):
    """Plan ``model`` on every combination of cluster, servers and global batch.

    Parameters
    ----------
    model : SparseGraph, nn.Module or str
        A captured graph, or what :func:`~.tables.trace_sparse` takes.
    clusters : iterable
        ``(profile, nodes)``, a profile name or a :class:`~autoplan.Cluster`.
    global_batch : int or sequence of int
    servers : sequence of ServerSpec or None
        CPU servers added to each cluster (``None``: none).
    prices : Prices, optional
        Adds the cost per million samples (devices and servers rented by the hour).
    plan_kw
        Passed to :func:`~.placement.plan_sparse` (``storages``, ``objective``...).

    Returns
    -------
    pandas.DataFrame
        One row per scenario: devices, servers, step, samples/s, what bounds the step,
        the mix of placements, the greedy baseline's step, cost; an infeasible scenario
        has its reason in ``note``.
    """
    import pandas as pd

    graph = model if isinstance(model, SparseGraph) else trace_sparse(model, example_inputs)
    batches = [global_batch] if isinstance(global_batch, int) else list(global_batch)
    rows = []
    for spec in clusters:
        base = spec if isinstance(spec, Cluster) else (
            load_cluster(spec[0], nodes=spec[1]) if isinstance(spec, tuple) else load_cluster(spec))
        for srv in servers:
            cluster = base.with_servers(srv.profile, srv.count) if srv and srv.count else base
            for b in batches:
                label = f"{cluster.name} x{cluster.num_nodes}" + (
                    f" + {len(cluster.servers)} servers" if cluster.servers else "")
                if progress:
                    progress(f"planning {label}, batch {b}")
                row = {"cluster": cluster.name, "nodes": cluster.num_nodes,
                       "devices": cluster.num_devices, "servers": len(cluster.servers),
                       "global_batch": b}
                try:
                    plan = plan_sparse(graph, cluster, global_batch=b, prices=prices, **plan_kw)
                except (InfeasiblePlan, ConfigError) as exc:
                    rows.append({**row, "note": str(exc).split(";")[0]})
                    continue
                e = plan.estimate
                kinds: dict[str, int] = {}
                for p in plan.tables:
                    kinds[p.storage.value] = kinds.get(p.storage.value, 0) + 1
                row.update(step_ms=e.step_time_s * 1e3, samples_per_s=e.samples_per_s,
                           dense_ms=e.dense_s * 1e3, embedding_ms=e.embedding_s * 1e3,
                           server_ms=e.servers_s * 1e3, bound_by=e.bound_by,
                           tables=", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                           greedy_step_ms=(plan.baseline_step_time_s or 0.0) * 1e3,
                           servers_used=len({s for p in plan.tables if p.storage.value == "server"
                                             for s in p.devices}),
                           note="")
                if prices is not None:
                    used = row["servers_used"] if plan_kw.get("objective") == "cost" else row["servers"]
                    per_hour = prices.per_hour(cluster.num_devices, used)
                    row.update(price_per_hour=per_hour,
                               usd_per_million_samples=per_hour / 3600 * 1e6 / e.samples_per_s)
                rows.append(row)
    return pd.DataFrame(rows)


def whatif_text(df) -> str:
    """The what-if table as the command line prints it."""
    cols = [c for c in ("cluster", "nodes", "devices", "servers", "global_batch", "step_ms",
                        "samples_per_s", "usd_per_million_samples", "tables", "bound_by", "note")
            if c in df]
    return df[cols].to_string(index=False, float_format=lambda v: f"{v:,.3f}")
