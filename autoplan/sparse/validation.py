"""The sparse cost model against published embedding-model training runs.

``validation/published_sparse.csv`` holds measured throughputs of DLRM training with
their hardware, batch, precision and layout, each with its source: the TorchRec DLRM
example's results (8x A100 40GB, one node, 1-8 GPUs), NVIDIA DeepLearningExamples' DLRM
(DGX A100 and DGX-1, 1 and 8 GPUs, mixed precision and FP32) and MLPerf Training
DLRM-DCNv2.  :func:`score` predicts every scored row with the cost model: the row's
model and tables, its cluster (the shipped profile, one node of the row's GPUs), its
layout (the published one, or for TorchRec's planner autoplan's TorchRec-style greedy).

One constant is fitted, ``hbm_gather_efficiency`` (``profiles/cost/sparse.yaml``): the
fraction of HBM bandwidth embedding lookups and updates reach.  :func:`held_out` fits it
without each source and scores that source; ``python -m autoplan.sparse.validation --fit``
writes the fit on every source to the constants and the held-out errors to
``validation/sparse_held_out.csv``.  Rows marked ``scored=no`` say why they could not be
matched (a system without a profile, a time to train without the samples it took).
``tf32`` rows run FP32 with TF32 matmuls (``CostOptions(fp32_matmuls="tf32")``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import re
import sys
from functools import lru_cache
from pathlib import Path

from ..cost.constants import CostOptions
from ..errors import ConfigError
from ..hardware.cluster import load_cluster
from ..records import Record, atomic_write_text
from .cost import SparseConstants, load_sparse_constants
from .placement import estimate_sparse, greedy_plan
from .plan import Sharding, Storage, TablePlacement
from .tables import SparseGraph, trace_sparse

__all__ = ["PublishedRun", "load_runs", "predict", "score", "fit", "held_out", "main",
           "validation_dir"]

_EFFICIENCY_RANGE = (0.02, 1.0)


def validation_dir() -> Path:
    """The repository's ``validation/`` folder."""
    return Path(__file__).resolve().parents[2] / "validation"


@dataclasses.dataclass(frozen=True)
class PublishedRun(Record):
    """One row of ``published_sparse.csv``."""

    run_id: str
    source: str
    system: str
    profile: str
    gpus: int
    model: str
    table_gib: float | None
    global_batch: int | None
    precision: str
    layout: str
    measured_samples_per_s: float | None
    scored: bool
    note: str
    reference: str


def load_runs(path: str | Path | None = None) -> list[PublishedRun]:
    """The published runs (every row; :attr:`PublishedRun.scored` says which are scored)."""
    p = Path(path) if path is not None else validation_dir() / "published_sparse.csv"
    out = []
    with open(p, newline="", encoding="utf-8") as fh:
        for i, row in enumerate(csv.DictReader(fh)):
            try:
                out.append(PublishedRun(
                    run_id=row["run_id"], source=row["source"], system=row["system"],
                    profile=row["profile"], gpus=int(row["gpus"]), model=row["model"],
                    table_gib=float(row["table_gib"]) if row["table_gib"] else None,
                    global_batch=int(row["global_batch"]) if row["global_batch"] else None,
                    precision=row["precision"], layout=row["layout"],
                    measured_samples_per_s=(float(row["measured_samples_per_s"])
                                            if row["measured_samples_per_s"] else None),
                    scored=row["scored"] == "yes", note=row["note"], reference=row["reference"]))
            except (KeyError, ValueError) as exc:
                raise ConfigError(f"{p}: row {i + 2}: {exc}") from None
    return out


@lru_cache(maxsize=8)
def _zoo_graph(model: str) -> SparseGraph:
    return trace_sparse(f"zoo:{model}")


def _graph(run: PublishedRun) -> SparseGraph:
    """The row's model; its tables scaled to the row's size where the sizes are not
    published table by table (NVIDIA's frequency-thresholded Criteo)."""
    g = _zoo_graph(run.model)
    if run.table_gib is None:
        return g
    scale = run.table_gib * 2**30 / g.table_bytes
    if abs(scale - 1) < 0.01:
        return g
    tables = tuple(dataclasses.replace(t, rows=max(1, int(round(t.rows * scale)))) for t in g.tables)
    return dataclasses.replace(g, tables=tables)


def nvidia_layout(graph: SparseGraph, gpus: int, capacity_bytes: float) -> list[TablePlacement]:
    """NVIDIA DeepLearningExamples DLRM's placement (its README, "Embedding table placement
    and load balancing"): table-wise; the largest table first, each onto the GPU with the
    most free memory; none on GPU 0 (it runs the bottom MLP) when there are others; at
    most ``ceil(tables / GPUs)`` per GPU."""
    avail = list(range(1, gpus)) if gpus > 1 else [0]
    cap = math.ceil(len(graph.tables) / len(avail))
    free = {d: capacity_bytes for d in avail}
    count = {d: 0 for d in avail}
    out = {}
    for t in sorted(graph.tables, key=lambda t: (-t.weight_bytes, t.name)):
        d = max(free, key=lambda d: (free[d], -d))
        out[t.name] = TablePlacement(t.name, Sharding.TABLE_WISE, Storage.HBM, (d,))
        free[d] -= t.weight_bytes
        count[d] += 1
        if count[d] == cap:
            del free[d]
    return [out[t.name] for t in graph.tables]


def predict(run: PublishedRun, constants: SparseConstants | None = None) -> float:
    """The cost model's samples per second for a scored row."""
    if not run.scored:
        raise ConfigError(f"{run.run_id} is not scored: {run.note}")
    graph = _graph(run)
    cluster = load_cluster(run.profile, devices_per_node=run.gpus)
    kw = dict(global_batch=run.global_batch, optimizer="sgd", constants=constants,
              **_precision(run.precision))
    if run.layout == "planner":
        return greedy_plan(graph, cluster, **kw).estimate.samples_per_s
    if run.layout == "nvidia":
        capacity = cluster.device_type_of(0).memory_bytes
        return estimate_sparse(graph, cluster, nvidia_layout(graph, run.gpus, capacity),
                               **kw).estimate.samples_per_s
    raise ConfigError(f"{run.run_id}: unknown layout {run.layout!r}")


def _precision(precision: str) -> dict:
    """The recipe of a row's ``precision``: ``tf32`` is FP32 with the matmuls on TF32
    tensor cores (:attr:`~autoplan.cost.constants.CostOptions.fp32_matmuls`)."""
    if precision == "tf32":
        return dict(precision="fp32", options=CostOptions(fp32_matmuls="tf32"))
    return dict(precision=precision)


def _with(constants: SparseConstants, efficiency: float) -> SparseConstants:
    return dataclasses.replace(constants, hbm_gather_efficiency=efficiency)


def score(runs: list[PublishedRun], constants: SparseConstants | None = None):
    """Every scored row's prediction and relative error (pandas DataFrame)."""
    import pandas as pd

    constants = constants or load_sparse_constants()
    rows = []
    for r in runs:
        if not r.scored:
            continue
        pred = predict(r, constants)
        rows.append({"run_id": r.run_id, "source": r.source, "measured": r.measured_samples_per_s,
                     "predicted": pred,
                     "error": (pred - r.measured_samples_per_s) / r.measured_samples_per_s})
    return pd.DataFrame(rows)


def _loss(runs: list[PublishedRun], constants: SparseConstants) -> float:
    """Mean absolute log ratio of predicted to measured throughput."""
    errs = [abs(math.log(predict(r, constants) / r.measured_samples_per_s)) for r in runs]
    return sum(errs) / len(errs)


def fit(runs: list[PublishedRun], constants: SparseConstants | None = None,
        iterations: int = 18) -> float:
    """The ``hbm_gather_efficiency`` minimising the mean absolute log error over the scored
    ``runs`` (golden-section search over its log, in [0.02, 1])."""
    constants = constants or load_sparse_constants()
    scored = [r for r in runs if r.scored]
    if not scored:
        raise ConfigError("no scored run to fit on")
    lo, hi = (math.log(v) for v in _EFFICIENCY_RANGE)
    phi = (math.sqrt(5) - 1) / 2
    a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
    fa = _loss(scored, _with(constants, math.exp(a)))
    fb = _loss(scored, _with(constants, math.exp(b)))
    for _ in range(iterations):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - phi * (hi - lo)
            fa = _loss(scored, _with(constants, math.exp(a)))
        else:
            lo, a, fa = a, b, fb
            b = lo + phi * (hi - lo)
            fb = _loss(scored, _with(constants, math.exp(b)))
    return round(math.exp((lo + hi) / 2), 4)


def held_out(runs: list[PublishedRun], constants: SparseConstants | None = None,
             by: str = "source"):
    """Each group's rows predicted by a fit on the other groups (pandas DataFrame): the
    groups are sources (``by="source"``) or hardware profiles (``by="profile"``: how the
    model carries over to another GPU within what ``runs`` holds)."""
    import pandas as pd

    if by not in ("source", "profile"):
        raise ConfigError(f"held_out groups by 'source' or 'profile', got {by!r}")
    constants = constants or load_sparse_constants()
    groups = sorted({getattr(r, by) for r in runs if r.scored})
    if len(groups) < 2:
        raise ConfigError(f"holding out by {by} needs scored runs of two {by}s at least, "
                          f"got {groups}")
    frames = []
    for g in groups:
        eff = fit([r for r in runs if getattr(r, by) != g], constants)
        df = score([r for r in runs if getattr(r, by) == g], _with(constants, eff))
        df["fitted_efficiency"] = eff
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def _write_constant(path: Path, efficiency: float, source: str) -> None:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^hbm_gather_efficiency: .*$", f"hbm_gather_efficiency: {efficiency}", text,
                  count=1, flags=re.M)
    text = re.sub(r"^hbm_gather_source: >-\n(  .*\n)+", "hbm_gather_source: >-\n"
                  + "".join(f"  {line}\n" for line in _wrap(source)), text, count=1, flags=re.M)
    atomic_write_text(path, text)


def _wrap(text: str, width: int = 88) -> list[str]:
    words, lines, line = text.split(), [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return lines + ([line] if line else [])


def main(argv: list[str] | None = None) -> int:
    """Print every scored row's error under the shipped constants; ``--fit`` refits."""
    ap = argparse.ArgumentParser(prog="python -m autoplan.sparse.validation",
                                 description=main.__doc__)
    ap.add_argument("--fit", action="store_true", help="refit hbm_gather_efficiency and write "
                    "profiles/cost/sparse.yaml and validation/sparse_held_out.csv")
    ap.add_argument("--held-out-by", choices=("source", "profile"), help="print each group's "
                    "rows predicted by a fit on the others (with --source, of that source's rows)")
    ap.add_argument("--source", help="only the rows of this source")
    args = ap.parse_args(argv)
    if args.fit and (args.source or args.held_out_by):
        ap.error("--fit fits on every source and writes the held-out file by source: "
                 "drop --source and --held-out-by")
    runs = load_runs()
    if args.source:
        runs = [r for r in runs if r.source == args.source]
        if not runs:
            ap.error(f"no rows of source {args.source!r}; the sources are "
                     f"{sorted({r.source for r in load_runs()})}")
    if args.held_out_by:
        try:
            out = held_out(runs, by=args.held_out_by)
        except ConfigError as exc:
            ap.error(str(exc))
        print(out.to_string(index=False))
        for g, frame in out.groupby(out["run_id"].map({r.run_id: getattr(r, args.held_out_by)
                                                        for r in runs})):
            print(f"{g}: held out mean |error| {frame['error'].abs().mean():.1%}")
        return 0
    if args.fit:
        from ..cost.constants import cost_profiles_dir

        out = held_out(runs)
        atomic_write_text(validation_dir() / "sparse_held_out.csv",
                          out.to_csv(index=False, float_format="%.6g"))
        eff = fit(runs)
        base = load_sparse_constants()
        full = score(runs, _with(base, eff))
        sources = ", ".join(sorted({r.source for r in runs if r.scored}))
        _write_constant(cost_profiles_dir() / "sparse.yaml", eff, (
            f"fitted by python -m autoplan.sparse.validation --fit to {len(full)} published DLRM "
            f"runs ({sources}; validation/published_sparse.csv), in-sample mean |error| "
            f"{full['error'].abs().mean():.1%}, leave-one-source-out {out['error'].abs().mean():.1%} "
            "(validation/sparse_held_out.csv)"))
        print(out.to_string(index=False))
        print(f"fitted hbm_gather_efficiency = {eff}")
        return 0
    df = score(runs)
    print(df.to_string(index=False))
    print(f"mean |error| {df['error'].abs().mean():.1%} over {len(df)} runs")
    for r in runs:
        if not r.scored:
            print(f"not scored: {r.run_id}: {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
