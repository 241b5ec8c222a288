"""Plan quality against what experts ran (issue: search).

For every published run with a measured step time (validation/published_public.csv,
built into model, cluster, layout and implementation options exactly as
benchmarks/published_runs.py does), plan the same model on the same cluster and global
batch with the implementation options of the row's software, and compare predicted step
times.  For Narayanan et al. 2021 the planner is given the software of that time: Megatron-LM
(2021) for tensor/pipeline/data parallelism and DeepSpeed for ZeRO-3 (their Table 2 compares
exactly these two), i.e. ``published_runs.DEEPSPEED_ZERO3_2021``: Megatron-LM's options plus
DeepSpeed's ZeRO-3 behaviour.  The published 3D layouts (tp = 8: one data-parallel rank per
node) are priced the same under both option sets, so the comparison stays like for like.

    ratio = planned layout's predicted step time / published layout's predicted step time

Targets: every ratio <= 1 (the search never misses what an expert chose) and every plan
fits memory; where Narayanan et al. 2021 Table 2 measured ZeRO-3 slower than their 3D
layout (the 175B and 530B rows), the planner does not pick a ZeRO-3-only layout.
Prints the ratio per row and the geometric mean.

    python benchmarks/plan_quality.py [--rows N]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published_runs as pr  # noqa: E402  (same folder: the row -> layout builders)

import autoplan  # noqa: E402
from autoplan.cost import engine_for  # noqa: E402
from autoplan.search import search  # noqa: E402


def _zero3_only(plan) -> bool:
    return plan.pp == 1 and max(s.tp for s in plan.stages) == 1 and \
        all(lp.zero == 3 for lp in plan.layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=None, help="only the first N rows")
    ap.add_argument("--source", default=None, help="only rows of this source group")
    args = ap.parse_args(argv)
    # the bf16 dense runs (the FP8 and MoE rows are priced by published_runs.py, not planned here)
    specs = [sp for sp in pr.load_specs(pr.CSV) if sp.source != "megatron_bridge_perf"
             and args.source in (None, sp.source)][: args.rows]
    graphs = pr.load_graphs(specs)
    clusters: dict = {}
    ok = True
    ratios = []
    zero3_measured_slower = {sp.model.key for sp in specs
                             if sp.source == "narayanan2021" and sp.strategy.zero == 3}
    print(f"{'run':<44} {'published layout':<34} {'pub s':>8} {'plan s':>8} {'ratio':>6} "
          f"{'fits':>5} {'search s':>8}  planned layout")
    for sp in specs:
        key = (sp.profile, sp.nodes)
        if key not in clusters:
            clusters[key] = autoplan.load_cluster(sp.profile, nodes=sp.nodes)
        cluster, graph = clusters[key], graphs[sp.model.key]
        published = engine_for(graph, cluster, options=sp.options).estimate(sp.strategy)
        fraction = 1.0        # the published layouts ran in the whole GPU memory
        t0 = time.perf_counter()
        options = pr.DEEPSPEED_ZERO3_2021 if sp.source == "narayanan2021" else sp.options
        result = search(graph, cluster, global_batch=sp.strategy.global_batch,
                        memory_fraction=fraction, options=options, top_k=1)
        elapsed = time.perf_counter() - t0
        best = result.best
        est = best.estimate
        ratio = est.step_time_s / published.step_time_s
        ratios.append(ratio)
        row_ok = ratio <= 1 + 1e-9 and est.fits
        if sp.model.key in zero3_measured_slower and sp.source == "narayanan2021" \
                and sp.strategy.zero != 3 and _zero3_only(best):
            row_ok = False
        if sp.source == "narayanan2021" and sp.strategy.zero == 3 and _zero3_only(best):
            row_ok = False
        ok &= row_ok
        print(f"{sp.run_id:<44} {sp.strategy.describe():<34} {published.step_time_s:>8.3f} "
              f"{est.step_time_s:>8.3f} {ratio:>6.3f} {str(est.fits):>5} {elapsed:>8.2f}  "
              f"{'ok ' if row_ok else 'BAD'} {best.summary().split(' on ')[0]}")
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    worst = max(ratios)
    print(f"\n{len(ratios)} rows: geometric mean ratio {geo:.3f}, worst {worst:.3f} "
          f"(target: every ratio <= 1, every plan fits, no ZeRO-3-only plan where Narayanan "
          f"et al. measured ZeRO-3 slower): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
