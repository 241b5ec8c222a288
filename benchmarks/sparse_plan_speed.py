"""How long the sparse planner takes, for thousands of tables and for DLRM-DCNv2, and its
gain over the TorchRec-style greedy placement on the same cost model (issue 67).

Cases (``--case`` picks some by substring):

* ``2000 tables``: DLRM-DCNv2's dense part with 2,000 synthetic tables (rows log-uniform
  from 100 to 10M, dimension 32, 64 or 128, 1 to 20 ids per sample, seed 0) on two DGX
  A100 80GB nodes (16 GPUs) and two CPU servers (``cpu-server-2s-epyc``), global batch 65,536;
* ``dlrm-dcnv2 @ 8 A100``: MLPerf's DLRM-DCNv2 (26 tables, 97 GiB of rows) on one node;
* ``dlrm-dcnv2 @ 16 A100 + 2 servers``: on two nodes with two CPU servers.

Target: every case plans in at most ``--target-s`` seconds (default 5) of the planning
process's CPU time (the planner is single-threaded, CP-SAT with one worker; on the shared
2-core machine the wall time, printed beside it with the load average, also counts other
people's work).  Each case is planned ``--repeat`` times (default 3): the median is
reported and every plan's JSON must be byte-identical.  Printed per case: the step of
the plan, of the greedy baseline, the gain, and a proven lower bound (the gap says how
far from optimal the plan can be at most).

    python benchmarks/sparse_plan_speed.py [--case 2000] [--repeat 3] [--target-s 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time


def synthetic_graph(n: int, seed: int = 0):
    """DLRM-DCNv2's dense part with ``n`` synthetic tables (see the module docstring)."""
    from autoplan.sparse import EmbeddingTable, Pooling, trace_sparse

    base = trace_sparse("zoo:dlrm-dcnv2")
    rng = random.Random(seed)
    tables = tuple(EmbeddingTable(
        name=f"t{i}", rows=int(10 ** rng.uniform(2, 7)), dim=rng.choice((32, 64, 128)),
        bytes_per_element=4, pooling=Pooling.SUM, ids_per_sample=float(rng.randint(1, 20)),
        bags_per_sample=1.0) for i in range(n))
    return dataclasses.replace(base, tables=tables, title=f"{n} synthetic tables")


def _cases(tables: int):
    from autoplan.hardware import load_cluster
    from autoplan.sparse import trace_sparse

    def two_nodes():
        return load_cluster("a100-sxm4-80gb", nodes=2).with_servers("cpu-server-2s-epyc", 2)

    return [
        (f"{tables} tables @ 16 A100 + 2 servers", lambda: synthetic_graph(tables), two_nodes),
        ("dlrm-dcnv2 @ 8 A100", lambda: trace_sparse("zoo:dlrm-dcnv2"),
         lambda: load_cluster("a100-sxm4-80gb")),
        ("dlrm-dcnv2 @ 16 A100 + 2 servers", lambda: trace_sparse("zoo:dlrm-dcnv2"), two_nodes),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=[], help="substring of a case's name")
    ap.add_argument("--tables", type=int, default=2000)
    ap.add_argument("--global-batch", type=int, default=65536)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--target-s", type=float, default=5.0)
    args = ap.parse_args(argv)
    from autoplan.sparse import plan_sparse

    ok = True
    print(f"{'case':<36} {'cpu s':>6} {'wall s':>6} {'target':>6} {'same':>5} {'step ms':>8} "
          f"{'greedy ms':>9} {'gain':>6} {'bound ms':>8} {'gap':>6}  search")
    for name, graph_of, cluster_of in _cases(args.tables):
        if args.case and not any(c in name for c in args.case):
            continue
        graph, cluster = graph_of(), cluster_of()
        cpu, wall, texts = [], [], set()
        for _ in range(args.repeat):
            c0, w0 = time.process_time(), time.perf_counter()
            plan = plan_sparse(graph, cluster, global_batch=args.global_batch)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            texts.add(plan.to_json())
        e = plan.estimate
        bound = plan.bound_step_time_s
        gap = "" if bound is None else f"{e.step_time_s / bound - 1:6.1%}"
        med = statistics.median(cpu)
        same = len(texts) == 1
        ok &= same and med <= args.target_s
        print(f"{name:<36} {med:6.2f} {statistics.median(wall):6.2f} {args.target_s:6.1f} "
              f"{'yes' if same else 'NO':>5} {e.step_time_s * 1e3:8.2f} "
              f"{plan.baseline_step_time_s * 1e3:9.2f} {plan.gain_over_baseline:5.2f}x "
              f"{'' if bound is None else f'{bound * 1e3:8.2f}':>8} {gap:>6}  {plan.search}")
        print(f"{'':<36} cpu s of the {args.repeat} runs: "
              f"{', '.join(f'{c:.2f}' for c in cpu)}; load average {os.getloadavg()[0]:.1f}")
    print("all within target, deterministic" if ok else "TARGET MISSED or plans differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
