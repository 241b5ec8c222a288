"""How long the sparse planner takes for thousands of tables, and its gain over greedy.

A DLRM-DCNv2's dense part with ``--tables`` synthetic tables (rows log-uniform from 100 to 10M,
dimension 32, 64 or 128, 1 to 20 ids per sample, a fixed seed) on ``--nodes`` DGX
A100 80GB nodes and ``--servers`` CPU servers; prints the planning time (target: a few
seconds for thousands of tables, ``--target-s``), the CP-SAT status and the step of the
plan against the TorchRec-style greedy baseline on the same cost model.

    python benchmarks/sparse_plan_speed.py --tables 2000
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time


def synthetic_graph(n: int, seed: int = 0):
    from autoplan.sparse import EmbeddingTable, Pooling, trace_sparse

    base = trace_sparse("zoo:dlrm-dcnv2")
    rng = random.Random(seed)
    tables = tuple(EmbeddingTable(
        name=f"t{i}", rows=int(10 ** rng.uniform(2, 7)), dim=rng.choice((32, 64, 128)),
        bytes_per_element=4, pooling=Pooling.SUM, ids_per_sample=float(rng.randint(1, 20)),
        bags_per_sample=1.0) for i in range(n))
    return dataclasses.replace(base, tables=tables, title=f"{n} synthetic tables")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=65536)
    ap.add_argument("--target-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    from autoplan.hardware import load_cluster
    from autoplan.sparse import plan_sparse

    graph = synthetic_graph(args.tables)
    cluster = load_cluster("a100-sxm4-80gb", nodes=args.nodes)
    if args.servers:
        cluster = cluster.with_servers("cpu-server-2s-epyc", args.servers)
    start = time.perf_counter()
    plan = plan_sparse(graph, cluster, global_batch=args.global_batch)
    took = time.perf_counter() - start
    e = plan.estimate
    print(f"{args.tables} tables on {cluster.num_devices} devices + {len(cluster.servers)} servers: "
          f"planned in {took:.1f} s (target {args.target_s:.0f} s), {plan.search}")
    bound = ("" if plan.bound_step_time_s is None
             else f"; solver bound {plan.bound_step_time_s * 1e3:.2f} ms")
    print(f"step {e.step_time_s * 1e3:.2f} ms; greedy baseline {plan.baseline_step_time_s * 1e3:.2f} ms "
          f"(gain {plan.gain_over_baseline:.2f}x){bound}")
    return 0 if took <= args.target_s else 1


if __name__ == "__main__":
    sys.exit(main())
