"""What-if tables: the best plan for every combination of cluster, batch and sequence length.

:func:`whatif` runs :func:`autoplan.plan` over the cross product of the
scenarios and returns one row per scenario (``top_k`` rows with ``top_k > 1``),
so capacity questions -- how many GPUs of which kind, at what batch, for what
price -- become one table.  A scenario where nothing fits is a row with
``fits=False`` and the planner's reason, never an exception.  Each model is
captured once per sequence length and reused for every cluster and batch.

Cost (when a price per GPU-hour is given)
-----------------------------------------
``cost_per_hour = sum over the cluster's GPUs of their price``;
``cost_per_step = cost_per_hour * step_time_s / 3600``;
``cost_per_million_tokens = cost_per_step / tokens_per_step * 1e6``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..errors import AutoplanError, ConfigError, InfeasiblePlan, StrategyError
from ..search.search import WORK_LIMIT
from ._text import model_name, plan_label

__all__ = ["whatif_text", "whatif", "WHATIF_COLUMNS", "cluster_price_per_hour"]

_GiB = float(2**30)

#: Columns of a :func:`whatif` table, in order (the cost columns only with a price).
WHATIF_COLUMNS: tuple[str, ...] = (
    "model", "cluster", "device_types", "nodes", "gpus", "global_batch", "seq_len", "rank",
    "plan", "dp", "tp", "pp", "cp", "ep", "micro_batch", "num_micro_batches", "schedule",
    "virtual_stages", "zero", "recompute", "sequence_parallel",
    "step_time_s", "tokens_per_s", "mfu", "model_tflops_per_gpu", "peak_memory_GiB", "fits",
    "reason", "cost_per_hour", "cost_per_step", "cost_per_million_tokens")

_COST_COLUMNS = ("cost_per_hour", "cost_per_step", "cost_per_million_tokens")
_INT_COLUMNS = ("dp", "tp", "pp", "cp", "ep", "micro_batch", "num_micro_batches", "virtual_stages",
                "zero")
_FLOAT_COLUMNS = ("step_time_s", "tokens_per_s", "mfu", "model_tflops_per_gpu",
                  "peak_memory_GiB") + _COST_COLUMNS


@dataclass(frozen=True)
class _ModelSpec:
    label: str
    source: Any            # nn.Module, spec string, or ModelGraph
    default_seq: int | None


# ------------------------------------------------------------------ inputs
def _as_list(value: Any, what: str) -> list:
    if value is None:
        return [None]
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return [value]
    items = list(value)
    if not items:
        raise ConfigError(f"{what} is empty; give at least one value")
    return items


def _model_specs(model: Any) -> list[_ModelSpec]:
    from torch import nn

    from ..graph import ModelGraph
    items = [model] if isinstance(model, (str, nn.Module, ModelGraph)) else _as_list(model, "model")
    specs = []
    for m in items:
        if isinstance(m, str):
            from ..zoo import build_model
            module, seq = build_model(m)      # on the meta device: nothing is allocated
            specs.append(_ModelSpec(m, module, seq))
        elif isinstance(m, ModelGraph):
            specs.append(_ModelSpec(model_name(m), m, m.seq_len))
        elif isinstance(m, nn.Module):
            specs.append(_ModelSpec(type(m).__name__, m, None))
        else:
            raise ConfigError(f"whatif() takes a model spec (zoo:<name>, gpt, hf:<type>), an "
                              f"nn.Module or a ModelGraph, got {type(m).__name__}")
    return specs


def _load_clusters(clusters: Any) -> list:
    from ..hardware import Cluster, load_cluster
    if isinstance(clusters, (str, Cluster)) or (isinstance(clusters, tuple) and len(clusters) == 2
                                                and isinstance(clusters[1], int)):
        clusters = [clusters]
    out = []
    for i, c in enumerate(_as_list(clusters, "clusters")):
        if isinstance(c, Cluster):
            out.append(c)
        elif isinstance(c, str):
            out.append(load_cluster(c))
        elif isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str):
            out.append(load_cluster(c[0], nodes=c[1]))
        else:
            raise ConfigError(f"clusters[{i}] must be a profile name, a (name, nodes) tuple or a "
                              f"Cluster, got {c!r}")
    return out


def _batches(global_batch: Any, gpus: int) -> list[int]:
    values = global_batch(gpus) if callable(global_batch) else global_batch
    out = []
    for b in _as_list(values, "global_batch"):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError(f"global_batch must be positive integers (sequences per step), "
                              f"got {b!r}")
        out.append(b)
    return out


def _prices(cluster, price_per_gpu_hour: Any) -> list[float] | None:
    """Price per hour of each device of ``cluster`` (None without a price)."""
    if price_per_gpu_hour is None:
        return None
    if isinstance(price_per_gpu_hour, Mapping):
        table = {str(k).lower(): float(v) for k, v in price_per_gpu_hour.items()}
        prices, missing = [], set()
        for i in range(cluster.num_devices):
            names = (cluster.device_type_of(i).name.lower(), cluster.node_of(i).profile.lower())
            hit = next((table[n] for n in names if n in table), None)
            if hit is None:
                missing.add(cluster.device_type_of(i).name)
            prices.append(hit if hit is not None else math.nan)
        if missing:
            raise ConfigError(f"price_per_gpu_hour has no price for {sorted(missing)} (cluster "
                              f"{cluster.name!r}); it has {sorted(price_per_gpu_hour)}; key by "
                              "device type name or node profile name")
        return prices
    if isinstance(price_per_gpu_hour, bool) or not isinstance(price_per_gpu_hour, (int, float)):
        raise ConfigError(f"price_per_gpu_hour must be a number or a dict by device type, got "
                          f"{price_per_gpu_hour!r}")
    return [float(price_per_gpu_hour)] * cluster.num_devices


def cluster_price_per_hour(cluster, price_per_gpu_hour: float | Mapping[str, float]) -> float:
    """The price of one hour of every GPU of ``cluster``.

    ``price_per_gpu_hour`` is one number, or a dict keyed by device type name
    (``"A100-SXM4-80GB"``) or node profile name (``"a100-sxm4-80gb"``), case-insensitive.

    Examples
    --------
    >>> from autoplan.hardware import load_cluster
    >>> cluster_price_per_hour(load_cluster("a100-sxm4-80gb", nodes=2), 2.0)
    32.0
    """
    prices = _prices(cluster, price_per_gpu_hour)
    assert prices is not None
    return float(sum(prices))


# ------------------------------------------------------------------ rows
def _plan_row(p, rank: int) -> dict[str, Any]:
    est = p.estimate
    zeros = sorted({lp.zero for lp in p.layers})
    rcs = sorted({lp.recompute.value for lp in p.layers if lp.recompute.value != "none"})
    return {
        "rank": rank, "plan": plan_label(p),
        "dp": p.dp, "tp": p.mesh.degree("tp"), "pp": p.pp, "cp": p.mesh.degree("cp"), "ep": p.ep,
        "micro_batch": p.micro_batch, "num_micro_batches": p.num_micro_batches,
        "schedule": p.schedule.value if p.pp > 1 else "none",
        "virtual_stages": p.virtual_stages, "zero": max(zeros),
        "recompute": "/".join(rcs) if rcs else "none",
        "sequence_parallel": any(lp.sequence_parallel for lp in p.layers),
        "step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu,
        "model_tflops_per_gpu": est.model_tflops_per_gpu,
        "peak_memory_GiB": est.peak_memory_bytes / _GiB, "fits": bool(est.fits), "reason": "",
        "_tokens_per_step": est.tokens_per_step, "_devices": p.mesh.devices,
    }


def whatif(model: Any, clusters: Any, global_batch: int | Sequence[int] | Callable[[int], Any],
           seq_len: int | Sequence[int] | None = None, *,
           price_per_gpu_hour: float | Mapping[str, float] | None = None,
           memory_fraction: float = 0.9, top_k: int = 1, precision: str = "bf16",
           time_limit_s: float | None = None, options: Any = None, space: Any = None,
           progress: Callable[[str], None] | None = None,
           work_limit: int | None = WORK_LIMIT):
    """The best plan for every scenario: one row per (model, seq_len, cluster, global_batch).

    Parameters
    ----------
    model : str, nn.Module, ModelGraph, or a list of them
        A model spec (``zoo:gpt3-175b``, ``gpt:...``, ``hf:llama``; see
        :func:`autoplan.zoo.build_model`), a module, or a captured graph (which
        fixes the sequence length).
    clusters : name, (name, nodes), Cluster, or a list of them
        Shipped profile names (:func:`autoplan.available_profiles`), homogeneous
        profiles with a node count, or built clusters.
    global_batch : int, list of int, or callable
        Sequences per step; a callable gets the cluster's GPU count and returns
        one or several batches (weak scaling: ``lambda gpus: 2 * gpus``).
    seq_len : int or list of int, optional
        Default: the model spec's own (a module needs one).
    price_per_gpu_hour : float or dict, optional
        One price, or a dict by device type / node profile name (mixed clusters);
        adds ``cost_per_hour``, ``cost_per_step`` and ``cost_per_million_tokens``.
    memory_fraction, top_k, precision, time_limit_s, work_limit, options, space
        Passed to :func:`autoplan.plan`; with ``top_k > 1`` each scenario has
        up to ``top_k`` rows, ``rank`` 1 the best.
    progress : callable, optional
        Called with a line per scenario (e.g. ``print``).

    Returns
    -------
    pandas.DataFrame
        Columns :data:`WHATIF_COLUMNS` (cost columns only with a price).
        Infeasible scenarios have ``fits=False``, ``reason`` set, NaN numbers.

    Raises
    ------
    ConfigError
        For arguments that cannot work in any scenario (unknown cluster, a price
        missing for a device type, a module without ``seq_len``).

    Examples
    --------
    >>> from autoplan.models import GPT, GPTConfig
    >>> from autoplan import trace
    >>> g = trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4)), seq_len=16)
    >>> df = whatif(g, [("a100-sxm4-80gb", 1), ("a100-sxm4-80gb", 2)], global_batch=[16, 32],
    ...             price_per_gpu_hour=2.0)
    >>> len(df), df["gpus"].tolist()
    (4, [8, 8, 16, 16])
    >>> bool((df["cost_per_hour"] == 2.0 * df["gpus"]).all())
    True
    """
    import pandas as pd

    from ..capture import trace
    from ..graph import ModelGraph
    from ..search import plan as _plan

    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {top_k!r}")
    specs = _model_specs(model)
    cluster_list = _load_clusters(clusters)
    prices = [_prices(c, price_per_gpu_hour) for c in cluster_list]   # fail early on a bad price
    seqs = _as_list(seq_len, "seq_len")
    for s in seqs:
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ConfigError(f"seq_len must be positive integers, got {s!r}")

    rows: list[dict[str, Any]] = []
    for spec in specs:
        for s in seqs:
            seq = s if s is not None else spec.default_seq
            graph, trace_error = None, ""
            if isinstance(spec.source, ModelGraph):
                if seq != spec.source.seq_len:
                    raise ConfigError(f"a ModelGraph fixes seq_len={spec.source.seq_len}; to plan "
                                      f"seq_len={seq} pass the model (or its spec) instead")
                graph = spec.source
            elif seq is None:
                raise ConfigError(f"{spec.label} needs seq_len (tokens per sequence)")
            else:
                try:
                    from ..zoo import model_title
                    title = model_title(spec.label) if isinstance(spec.label, str) else None
                    graph = trace(spec.source, seq_len=seq, title=title)
                except AutoplanError as exc:
                    trace_error = f"capture failed: {exc}"
            for cluster, cluster_prices in zip(cluster_list, prices):
                for gb in _batches(global_batch, cluster.num_devices):
                    base = {
                        "model": model_name(graph) if graph is not None else spec.label,
                        "cluster": cluster.name,
                        "device_types": "+".join(t.name for t in cluster.device_types),
                        "nodes": cluster.num_nodes, "gpus": cluster.num_devices,
                        "global_batch": gb, "seq_len": seq,
                    }
                    found: list[dict[str, Any]] = []
                    reason = trace_error
                    if graph is not None:
                        try:
                            # a scenario is its cluster: a row per cluster prices all of
                            # it (plan() may leave devices idle)
                            best = _plan(graph, cluster, global_batch=gb, top_k=top_k,
                                         memory_fraction=memory_fraction, precision=precision,
                                         time_limit_s=time_limit_s, options=options, space=space,
                                         work_limit=work_limit,
                                         use_all_devices=True)
                            plans = [best, *getattr(best, "runners_up", ())][:top_k]
                            found = [_plan_row(p, i + 1) for i, p in enumerate(plans)]
                        except (InfeasiblePlan, StrategyError, ConfigError) as exc:
                            reason = f"{type(exc).__name__}: {exc}"
                    if not found:
                        found = [{"rank": pd.NA, "fits": False, "reason": reason}]
                    for r in found:
                        row = {**base, **r}
                        devices = row.pop("_devices", None)
                        tokens_per_step = row.pop("_tokens_per_step", None)
                        if cluster_prices is not None:
                            used = devices if devices is not None else range(cluster.num_devices)
                            row["cost_per_hour"] = float(sum(cluster_prices[d] for d in used))
                            if tokens_per_step is not None:
                                row["cost_per_step"] = row["cost_per_hour"] * row["step_time_s"] / 3600.0
                                row["cost_per_million_tokens"] = \
                                    row["cost_per_step"] / tokens_per_step * 1e6
                        rows.append(row)
                    if progress is not None:
                        first = found[0]
                        progress(f"{spec.label} seq {seq} on {cluster.num_devices}x {cluster.name}, "
                                 f"batch {gb}: " + (first["plan"] if first.get("fits")
                                                    else "infeasible"))
    columns = [c for c in WHATIF_COLUMNS if price_per_gpu_hour is not None or c not in _COST_COLUMNS]
    df = pd.DataFrame(rows).reindex(columns=columns)
    for c in _INT_COLUMNS + ("rank", "nodes", "gpus", "global_batch", "seq_len"):
        df[c] = df[c].astype("Int64")
    for c in _FLOAT_COLUMNS:
        if c in df.columns:
            df[c] = df[c].astype(float)
    df["fits"] = df["fits"].astype(bool)
    df["sequence_parallel"] = df["sequence_parallel"].astype("boolean")
    return df


def whatif_text(df: Any) -> str:
    """A :func:`whatif` table for a terminal: the columns a person compares, rounded.

    The model, cluster and device types are printed once above the table when they
    are the same on every row; the degrees are in the plan label (see
    :data:`autoplan.report.LEGEND`); step time in seconds to 3 significant figures,
    throughput in tokens/s, MFU and memory rounded, costs to 4 significant figures.
    Full precision stays in the DataFrame (``--csv``/``--json``)."""
    import pandas as pd

    if df.empty:
        return "(no scenarios)"
    head, out = [], pd.DataFrame(index=df.index)
    for col in ("model", "cluster", "device_types"):
        values = df[col].unique()
        if len(values) == 1:
            head.append(f"{col.replace('_', ' ')}: {values[0]}")
        else:
            out[col] = df[col]
    out["nodes"] = df["nodes"]
    out["gpus"] = df["gpus"]
    out["batch"] = df["global_batch"]
    out["seq"] = df["seq_len"]
    if df["rank"].max() > 1:
        out["rank"] = df["rank"]
    out["plan"] = df["plan"].fillna("-")

    def fmt(series, f):
        return [("-" if pd.isna(v) else f(v)) for v in series]

    out["step_s"] = fmt(df["step_time_s"], lambda v: f"{v:.3g}")
    out["tokens/s"] = fmt(df["tokens_per_s"], lambda v: f"{v:,.0f}")
    out["MFU"] = fmt(df["mfu"], lambda v: f"{v:.1%}")
    out["peak_GiB"] = fmt(df["peak_memory_GiB"], lambda v: f"{v:.1f}")
    out["fits"] = df["fits"].map({True: "yes", False: "no"}).fillna("-")
    for col, name in (("cost_per_hour", "$/h"), ("cost_per_step", "$/step"),
                      ("cost_per_million_tokens", "$/Mtok")):
        if col in df.columns:
            out[name] = fmt(df[col], lambda v: f"{v:.4g}")
    reasons = df["reason"].fillna("")
    if (reasons != "").any():
        out["reason"] = [r if len(r) <= 60 else r[:57] + "..." for r in reasons]
    return "\n".join(head + ["", out.to_string(index=False)] if head else [out.to_string(index=False)])
