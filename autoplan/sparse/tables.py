"""Capture of an embedding-heavy model: its tables, their traffic, and the dense rest.

:func:`find_tables` recognises every ``nn.Embedding`` and ``nn.EmbeddingBag`` wherever it
sits in the model and runs one forward of the example batch to count, per table, the ids
a sample looks up and the pooled vectors (bags) it produces; a table two features share
counts both.  The user may state the traffic instead (:class:`TableTraffic`): the mean
ids per sample of real, skewed traffic and how concentrated it is (a fraction of the rows
receiving a fraction of the lookups).  :func:`trace_sparse` adds the dense part, captured
as :func:`autoplan.trace` captures any model, without the tables' parameters: the tables
are placed by :mod:`.placement`, not laid out as weights.

The access model is piecewise uniform: the ``hot_rows_fraction`` of rows with the lowest
ids receive ``hot_lookups_fraction`` of the lookups, uniformly, and the other rows the
rest (ids ranked by frequency, as vocabularies built from counts are).  It gives the
share of lookups a block of rows receives (:meth:`EmbeddingTable.lookup_share`) and the
expected distinct rows a batch touches (:meth:`EmbeddingTable.distinct_rows`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

import torch
from torch import nn

from ..errors import InputError
from ..graph import ModelGraph
from ..records import Record
from .plan import Pooling

__all__ = ["TableTraffic", "EmbeddingTable", "TableColumns", "SparseGraph", "find_tables",
           "trace_sparse", "TABLE_MODULES"]

#: The modules recognised as embedding tables.
TABLE_MODULES = (nn.Embedding, nn.EmbeddingBag)


@dataclass(frozen=True)
class TableTraffic(Record):
    """What the user states about a table's real traffic (``None``: from the example batch).

    Parameters
    ----------
    ids_per_sample : float, optional
        Mean ids a sample looks up in the table (over all features that use it).
    hot_rows_fraction, hot_lookups_fraction : float
        The ``hot_rows_fraction`` of the rows (the lowest ids) receive
        ``hot_lookups_fraction`` of the lookups; 1 and 1 (the default) is uniform access.
    """

    ids_per_sample: float | None = None
    hot_rows_fraction: float = 1.0
    hot_lookups_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.ids_per_sample is not None and not (
                math.isfinite(self.ids_per_sample) and self.ids_per_sample > 0):
            raise InputError(f"ids_per_sample must be a number > 0, got {self.ids_per_sample!r}")
        _check_skew(self.hot_rows_fraction, self.hot_lookups_fraction)


def _check_skew(rows: float, lookups: float) -> None:
    for name, v in (("hot_rows_fraction", rows), ("hot_lookups_fraction", lookups)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise InputError(f"{name} must be in (0, 1], got {v!r}")
    if lookups < rows:
        raise InputError(f"hot_lookups_fraction={lookups} < hot_rows_fraction={rows}: the hot "
                         "rows get at least their share of lookups (equal values: uniform)")


@dataclass(frozen=True)
class EmbeddingTable(Record):
    """One embedding table of a model and the traffic it gets.

    Attributes
    ----------
    name : str
        The module's path in the model (``tables.3``).
    rows, dim : int
    bytes_per_element : int
        Of its weight (4 for fp32).
    pooling : Pooling
        ``NONE`` for ``nn.Embedding`` (one row out per id).
    ids_per_sample : float
        Mean ids one sample looks up (all its calls together).
    bags_per_sample : float
        Vectors one sample gets out (bags; ids for ``NONE``).
    hot_rows_fraction, hot_lookups_fraction : float
        The access skew (see the module docstring).
    padding_idx : int or None
        Ids equal to it are skipped (not looked up, not counted).
    stated : bool
        Whether ``ids_per_sample`` was stated by the user rather than counted.
    """

    name: str
    rows: int
    dim: int
    bytes_per_element: int
    pooling: Pooling
    ids_per_sample: float
    bags_per_sample: float
    hot_rows_fraction: float = 1.0
    hot_lookups_fraction: float = 1.0
    padding_idx: int | None = None
    stated: bool = False

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1:
            raise InputError(f"table {self.name!r}: rows and dim must be >= 1, got "
                             f"{self.rows} x {self.dim}")
        if not (self.ids_per_sample > 0 and self.bags_per_sample > 0):
            raise InputError(f"table {self.name!r}: the example batch looks nothing up in it "
                             f"({self.ids_per_sample} ids per sample); state its traffic with "
                             "TableTraffic(ids_per_sample=...)")
        _check_skew(self.hot_rows_fraction, self.hot_lookups_fraction)

    @property
    def weight_bytes(self) -> int:
        return self.rows * self.dim * self.bytes_per_element

    @property
    def ids_per_bag(self) -> float:
        return self.ids_per_sample / self.bags_per_sample

    def lookup_share(self, row0: int, row1: int) -> float:
        """The share of lookups that fall in rows ``[row0, row1)``.

        >>> t = EmbeddingTable("t", 100, 4, 4, Pooling.SUM, 2.0, 1.0, 0.1, 0.9)
        >>> round(t.lookup_share(0, 10), 6), round(t.lookup_share(10, 100), 6)
        (0.9, 0.1)
        """
        return float(TableColumns.of([self]).lookup_share(row0, row1)[0])

    def distinct_rows(self, lookups: float, row0: int = 0, row1: int | None = None) -> float:
        """Expected distinct rows of ``[row0, row1)`` that ``lookups`` lookups of the whole
        table touch (each piece of uniform access: ``n (1 - (1 - 1/n)^k)`` rows for ``k``
        draws over ``n`` rows).

        >>> t = EmbeddingTable("t", 1000, 4, 4, Pooling.SUM, 1.0, 1.0)
        >>> round(t.distinct_rows(1000))   # 1000 (1 - (1 - 1/1000)^1000)
        632
        """
        row1 = self.rows if row1 is None else row1
        return float(TableColumns.of([self]).distinct_rows(lookups, row0, row1)[0])


@dataclass(frozen=True)
class TableColumns:
    """Several tables' figures as columns (numpy arrays, one entry per table), and their
    access model evaluated for all of them at once (what the planner prices thousands of
    tables with; :meth:`EmbeddingTable.lookup_share` and
    :meth:`EmbeddingTable.distinct_rows` are its one-table case)."""

    rows: np.ndarray                  # int64
    dim: np.ndarray                   # int64
    bytes_per_element: np.ndarray     # int64
    ids_per_sample: np.ndarray
    bags_per_sample: np.ndarray
    hot_rows: np.ndarray              # hot_rows_fraction * rows
    hot_lookups_fraction: np.ndarray

    @classmethod
    def of(cls, tables: "Sequence[EmbeddingTable]") -> "TableColumns":
        def col(key, dtype=np.float64):
            return np.array([getattr(t, key) for t in tables], dtype=dtype)

        rows = col("rows", np.int64)
        return cls(rows=rows, dim=col("dim", np.int64),
                   bytes_per_element=col("bytes_per_element", np.int64),
                   ids_per_sample=col("ids_per_sample"), bags_per_sample=col("bags_per_sample"),
                   hot_rows=col("hot_rows_fraction") * rows,
                   hot_lookups_fraction=col("hot_lookups_fraction"))

    def _cdf(self, x: np.ndarray) -> np.ndarray:
        hot, a = self.hot_rows, self.hot_lookups_fraction
        cold = self.rows - hot
        in_hot = a * x / np.where(hot > 0, hot, 1.0)
        in_cold = a + (1 - a) * (x - hot) / np.where(cold > 0, cold, 1.0)
        return np.where(x <= hot, in_hot, np.where(cold > 0, in_cold, 1.0))

    def lookup_share(self, row0, row1) -> np.ndarray:
        """Each table's share of lookups in rows ``[row0, row1)`` (scalars or arrays)."""
        return self._cdf(np.asarray(row1, dtype=np.float64)) - self._cdf(
            np.asarray(row0, dtype=np.float64))

    def distinct_rows(self, lookups, row0, row1) -> np.ndarray:
        """Each table's expected distinct rows of ``[row0, row1)`` that ``lookups`` lookups
        of the whole table touch (see :meth:`EmbeddingTable.distinct_rows`)."""
        row0 = np.asarray(row0, dtype=np.float64)
        row1 = np.asarray(row1, dtype=np.float64)
        lookups = np.asarray(lookups, dtype=np.float64)
        hot, a, rows = self.hot_rows, self.hot_lookups_fraction, self.rows.astype(np.float64)
        total = np.zeros(np.broadcast(row0, row1, lookups, rows).shape)
        for lo, hi, share, span in ((0.0, hot, a, hot), (hot, rows, 1 - a, rows - hot)):
            n = np.maximum(0.0, np.minimum(hi, row1) - np.maximum(lo, row0))
            live = (n > 0) & (span > 0) & (share > 0)
            draws = lookups * share * n / np.where(span > 0, span, 1.0)
            wide = np.where(n > 1, n, 2.0)        # (1 - 1/n)^k for n > 1; one row otherwise
            spread = wide * -np.expm1(draws * np.log1p(-1 / wide))
            piece = np.where(n > 1, spread, np.where(draws > 0, 1.0, 0.0))
            total = total + np.where(live, piece, 0.0)
        return total


@dataclass(frozen=True)
class SparseGraph(Record):
    """An embedding-heavy model as the sparse planner sees it.

    Attributes
    ----------
    model, title : str
    samples : int
        Samples in the example batch the traffic was counted on.
    dense : ModelGraph
        The capture of the whole model (:func:`autoplan.trace`) with the tables'
        parameters taken out: what data parallelism replicates.
    tables : tuple of EmbeddingTable
    """

    model: str
    title: str
    samples: int
    dense: ModelGraph
    tables: tuple[EmbeddingTable, ...]

    def table(self, name: str) -> EmbeddingTable:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no table {name!r}; tables are {[t.name for t in self.tables][:8]}")

    @property
    def table_bytes(self) -> int:
        return sum(t.weight_bytes for t in self.tables)

    def with_traffic(self, traffic: Mapping[str, TableTraffic]) -> "SparseGraph":
        """This graph with the traffic of some tables stated (see :class:`TableTraffic`)."""
        return dataclasses.replace(self, tables=_apply_traffic(self.tables, traffic))

    def __repr__(self) -> str:
        return (f"<SparseGraph {self.title or self.model}: {len(self.tables)} tables, "
                f"{self.table_bytes / 2**30:.2f} GiB of rows, dense "
                f"{self.dense.num_params:,} params>")


# ---------------------------------------------------------------------------- capture
def _pooling(module: nn.Module) -> Pooling:
    if isinstance(module, nn.EmbeddingBag):
        return Pooling(module.mode)
    return Pooling.NONE


def find_tables(model: nn.Module, example_inputs: Any, *,
                traffic: Mapping[str, TableTraffic] | None = None) -> tuple[EmbeddingTable, ...]:
    """Every embedding table of ``model`` with the traffic one sample gives it.

    Parameters
    ----------
    model : nn.Module
        May live on the meta device (the example batch is then moved there: only shapes
        are counted, so a ``padding_idx`` cannot be told apart).
    example_inputs : tensor, tuple or dict
        One batch, the first dimension of every tensor the samples.
    traffic : mapping of table name to TableTraffic, optional

    Examples
    --------
    >>> from autoplan.sparse.models import DLRM
    >>> m = DLRM([100, 50], 8, hot=[3, 1], bottom=(16,), top=(16, 1))
    >>> ts = find_tables(m, (torch.zeros(4, 13), torch.zeros(4, 4, dtype=torch.long)))
    >>> [(t.name, t.rows, t.ids_per_sample, t.bags_per_sample) for t in ts]
    [('tables.0', 100, 3.0, 1.0), ('tables.1', 50, 1.0, 1.0)]
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"find_tables() takes an nn.Module, got {type(model).__name__}")
    args, kwargs = _as_call(example_inputs)
    tables = [(name, m) for name, m in model.named_modules() if isinstance(m, TABLE_MODULES)]
    if not tables:
        raise InputError(f"{type(model).__name__} has no nn.Embedding or nn.EmbeddingBag: "
                         "nothing for the sparse planner to place (plan it with autoplan.plan)")
    meta = any(p.is_meta for p in model.parameters())
    samples = _samples(args, kwargs)
    counts: dict[str, list[float]] = {name: [0.0, 0.0] for name, _ in tables}
    hooks = [m.register_forward_pre_hook(_counter(name, m, counts, meta), with_kwargs=True)
             for name, m in tables]
    try:
        if meta:
            args, kwargs = tuple(_to_meta(a) for a in args), {k: _to_meta(v) for k, v in kwargs.items()}
        with torch.no_grad():
            model(*args, **kwargs)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own error, named
        raise InputError(f"running {type(model).__name__} on the example batch failed "
                         f"({type(exc).__name__}: {exc}); pass inputs its forward accepts") from None
    finally:
        for h in hooks:
            h.remove()
    out = []
    for name, m in tables:
        ids, bags = counts[name]
        out.append(EmbeddingTable(
            name=name, rows=m.num_embeddings, dim=m.embedding_dim,
            bytes_per_element=m.weight.element_size(), pooling=_pooling(m),
            ids_per_sample=ids / samples, bags_per_sample=bags / samples,
            padding_idx=m.padding_idx))
    return _apply_traffic(tuple(out), traffic or {})


def _counter(name: str, module: nn.Module, counts: dict[str, list[float]], meta: bool) -> Callable:
    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs.get("input")
        offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
        if kwargs.get("per_sample_weights") is not None or (len(args) > 2 and args[2] is not None):
            raise InputError(f"table {name!r} is called with per_sample_weights, which the "
                             "sparse mode does not price or run; drop them or plan the model "
                             "with autoplan.plan")
        n_ids = float(ids.numel())
        if mod.padding_idx is not None and not meta and not ids.is_meta:
            n_ids = float((ids != mod.padding_idx).sum())
        if isinstance(mod, nn.EmbeddingBag):
            if ids.dim() == 2:
                bags = float(ids.shape[0])
            else:
                if offsets is None:
                    raise InputError(f"table {name!r} gets a 1-D input without offsets")
                bags = float(offsets.numel() - (1 if mod.include_last_offset else 0))
        else:
            bags = n_ids if mod.padding_idx is None else float(ids.numel())
        counts[name][0] += n_ids
        counts[name][1] += bags
    return hook


def _as_call(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError(f"example_inputs must be a tensor, a tuple of tensors or a dict of keyword "
                     f"tensors, got {type(example_inputs).__name__}")


def _samples(args: tuple, kwargs: dict) -> int:
    """The samples of a batch: its first tensor's first dimension (a jagged 1-D ids input
    with offsets may follow; the runtime, which splits every input by rows, wants
    ``(samples, ids)`` tensors padded with the table's ``padding_idx``)."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise InputError("example_inputs needs a tensor whose first dimension is the samples")
    return int(tensors[0].shape[0])


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _apply_traffic(tables: tuple[EmbeddingTable, ...],
                   traffic: Mapping[str, TableTraffic]) -> tuple[EmbeddingTable, ...]:
    names = [t.name for t in tables]
    unknown = sorted(set(traffic) - set(names))
    if unknown:
        raise InputError(f"traffic names tables {unknown} the model does not have; its tables "
                         f"are {names}")
    out = []
    for t in tables:
        stated = traffic.get(t.name)
        if stated is None:
            out.append(t)
            continue
        if not isinstance(stated, TableTraffic):
            raise InputError(f"traffic[{t.name!r}] must be a TableTraffic, got "
                             f"{type(stated).__name__}")
        ids = t.ids_per_sample if stated.ids_per_sample is None else stated.ids_per_sample
        bags = t.bags_per_sample * (ids / t.ids_per_sample) if t.pooling is Pooling.NONE \
            else t.bags_per_sample
        out.append(dataclasses.replace(
            t, ids_per_sample=float(ids), bags_per_sample=float(bags),
            hot_rows_fraction=stated.hot_rows_fraction,
            hot_lookups_fraction=stated.hot_lookups_fraction,
            stated=t.stated or stated.ids_per_sample is not None))
    return tuple(out)


def _without_tables(graph: ModelGraph, tables: tuple[EmbeddingTable, ...]) -> ModelGraph:
    """``graph`` with the tables' parameters taken out of the layers that own them."""
    layers = list(graph.layers)
    for t in tables:
        owner = next((i for i, l in enumerate(layers)
                      if any(t.name == m or t.name.startswith(m + ".") or m == ""
                             for m in l.modules)), None)
        if owner is None:
            raise InputError(f"the capture records no layer holding table {t.name!r}: is it "
                             "called in the forward?")
        l = layers[owner]
        n = t.rows * t.dim
        layers[owner] = dataclasses.replace(
            l, param_count=max(0, l.param_count - n),
            param_bytes=max(0, l.param_bytes - t.weight_bytes),
            param_tensors=max(0, l.param_tensors - 1))
    return dataclasses.replace(
        graph, layers=tuple(layers),
        num_params=graph.num_params - sum(t.rows * t.dim for t in tables),
        param_bytes=graph.param_bytes - sum(t.weight_bytes for t in tables))


def trace_sparse(model: nn.Module | str, example_inputs: Any = None, *,
                 loss_fn: Callable | None = None,
                 traffic: Mapping[str, TableTraffic] | None = None,
                 title: str | None = None) -> SparseGraph:
    """Capture an embedding-heavy model: its tables and its dense part.

    Parameters
    ----------
    model : nn.Module or str
        A module (the meta device is fine) or a zoo spec (``"zoo:dlrm-dcnv2"``), built on
        the meta device with its example batch.
    example_inputs : tensor, tuple or dict
        One batch (dense features, ids...), every tensor's first dimension the samples;
        optional for a zoo spec.
    loss_fn : callable, optional
        ``loss_fn(output, *inputs)``, as :func:`autoplan.trace` takes it.
    traffic : mapping of table name to TableTraffic, optional
        Stated traffic of real data (mean ids per sample, skew).
    title : str, optional

    Returns
    -------
    SparseGraph

    Examples
    --------
    >>> from autoplan.sparse.models import DLRM
    >>> m = DLRM([1000, 50], 8, bottom=(16,), top=(16, 1))
    >>> g = trace_sparse(m, (torch.zeros(4, 13), torch.zeros(4, 2, dtype=torch.long)))
    >>> [t.name for t in g.tables], g.dense.num_params == sum(p.numel() for p in m.parameters()) - 1050 * 8
    (['tables.0', 'tables.1'], True)
    """
    from ..capture import trace

    if isinstance(model, str):
        from ..zoo import build_sparse_model
        model, default_inputs, zoo_title = build_sparse_model(model)
        example_inputs = default_inputs if example_inputs is None else example_inputs
        title = title or zoo_title
    if example_inputs is None:
        raise InputError("trace_sparse() needs example_inputs: one batch of the model's inputs")
    tables = find_tables(model, example_inputs, traffic=traffic)
    args, kwargs = _as_call(example_inputs)
    graph = trace(model, example_inputs=kwargs if kwargs else args, loss_fn=loss_fn, title=title)
    dense = _without_tables(dataclasses.replace(graph, fx_graph=None), tables)
    return SparseGraph(model=type(model).__name__, title=graph.title, samples=_samples(args, kwargs),
                       dense=dense, tables=tables)
