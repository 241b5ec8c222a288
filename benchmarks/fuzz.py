"""Fuzz autoplan with many more cases than CI runs (issue 15: at least 1000).

Runs every family of ``tests/fuzz_cases.py``: corrupted profile YAML (loaded with
``load_cluster``), corrupted plan JSON (through ``autoplan report``), random command lines
(through the CLI, in-process), model shapes (Hugging Face configs and plain modules,
traced, planned and estimated), ``Strategy`` keywords, composed clusters, plans of
mid-size models where memory binds, and corrupted checkpoints.  Prints the case count of each family, then the failures by kind:
tracebacks, error messages that are not one line, plans or estimates over their devices'
memory, outputs that differ on a second run, and other broken promises; exits 1 if there
are any.  Failures listed in ``fuzz_cases.KNOWN_BUGS`` (reported, in code others own) are
counted apart; ``--allow-known`` exits 0 when they are all there is.

    python benchmarks/fuzz.py                 # 3,580 cases, ~15 minutes on 2 cores
    python benchmarks/fuzz.py --scale 0.1     # a tenth of that
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

import fuzz_cases as fc  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402

#: Cases per family at ``--scale 1``.
CASES = {"profile yaml": 1000, "plan json": 500, "command line": 200, "strategy": 600,
         "cluster": 400, "memory bound": 300, "plain module": 200, "hf model": 80,
         "checkpoint": 300}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every case count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=sorted(CASES), action="append",
                        help="run only this family (repeatable)")
    parser.add_argument("--allow-known", action="store_true",
                        help="exit 0 when every failure is one of fuzz_cases.KNOWN_BUGS")
    args = parser.parse_args(argv)
    import autoplan
    from autoplan.hardware.profiles import find_profile_file
    from autoplan.models import GPT, GPTConfig

    work = Path(tempfile.mkdtemp(prefix="autoplan-fuzz-"))
    failures: list[fc.Failure] = []
    counts: dict[str, int] = {}
    seconds: dict[str, float] = {}

    def run(name: str, strategy, check) -> None:
        if args.only and name not in args.only:
            return
        counts[name] = 0
        start = time.perf_counter()

        @settings(max_examples=max(1, int(CASES[name] * args.scale)), deadline=None,
                  database=None, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def body(case):
            counts[name] += 1
            why = check(case)
            if why is not None:
                failures.append(why)

        seed(args.seed)(body)()
        seconds[name] = time.perf_counter() - start
        print(f"  {name}: {counts[name]} cases in {seconds[name]:.0f} s, {len(failures)} failures "
              "so far", file=sys.stderr, flush=True)

    files = iter(range(10**9))

    def profile_case(data: bytes) -> fc.Failure | None:
        # a file per case: profiles are cached by path, mtime and size
        path = work / "yaml" / str(next(files))
        path.mkdir(parents=True)
        path = fc.write(path / "a100-sxm4-80gb.yaml", data)
        seen = []
        for _ in range(2):
            try:
                seen.append(autoplan.load_cluster(path, nodes=2).num_devices)
            except AutoplanError as exc:
                seen.append(str(exc))
            except Exception as exc:  # noqa: BLE001 - what is counted
                return fc.Failure(fc.TRACEBACK, f"profile {data[:200]!r}", f"{type(exc).__name__}: {exc}")
        if seen[0] != seen[1]:
            return fc.Failure(fc.DIFFERS, f"profile {data[:200]!r}", "a second load differed")
        return None

    graph = autoplan.trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)),
                           seq_len=16)
    plan = autoplan.plan(graph, autoplan.load_cluster("a100-sxm4-80gb"), global_batch=8)
    plan_doc = json.loads(plan.to_json())

    def plan_case(data: bytes) -> fc.Failure | None:
        path = fc.write(work / "plan.json", data)
        return fc.check_case(["report", "--plan", str(path), "--cluster", "a100-sxm4-80gb"])

    start = time.perf_counter()
    profile_text = find_profile_file("a100-sxm4-80gb").read_text()
    run("profile yaml", fc.corrupted_texts(profile_text, fc._YAML_NOISE), profile_case)
    run("plan json", fc.corrupted_json_values(plan_doc), plan_case)
    run("command line", fc.command_lines(), fc.check_case)
    run("strategy", fc.strategy_cases(), fc.check_strategy_case)
    run("cluster", fc.cluster_cases(), lambda case: fc.check_cluster_case(case, work))
    run("memory bound", fc.memory_bound_cases(), fc.check_memory_bound_case)
    run("plain module", fc.model_cases("module"), fc.check_model_case)
    run("hf model", fc.model_cases("hf"), fc.check_model_case)
    if not args.only or "checkpoint" in args.only:
        bench = fc.CheckpointBench(work / "checkpoints")
        try:
            run("checkpoint", fc.checkpoint_corruptions(bench.files, bench.json_docs),
                lambda ops: fc.check_checkpoint_case(bench, ops))
        finally:
            bench.close()

    total = sum(counts.values())
    for name, n in counts.items():
        print(f"{name:>13}: {n:5d} cases in {seconds[name]:5.0f} s")
    known = collections.Counter(fc.known_bug(f) for f in failures if fc.known_bug(f))
    new = [f for f in failures if not fc.known_bug(f)]
    by_kind = collections.Counter(f.kind for f in new)
    print(f"{total} cases in {time.perf_counter() - start:.0f} s: "
          + ", ".join(f"{by_kind[k]} {k}" for k in fc.FAILURE_KINDS)
          + f" ({by_kind[fc.TRACEBACK]} tracebacks, {by_kind[fc.OVER_MEMORY]} over-memory plans, "
            f"{by_kind[fc.DIFFERS]} non-repeatable outputs)")
    for name, n in known.items():
        print(f"  known, left to its owners ({n} cases): {name}")
    for f in new[:20]:
        print(f"\n{str(f)[-3000:]}")
    for f in [f for f in failures if fc.known_bug(f)][:3]:
        print(f"\nknown: {f.case}\n  {f.detail.strip().splitlines()[-1][:300]}")
    return 1 if new or (known and not args.allow_known) else 0


if __name__ == "__main__":
    sys.exit(main())
