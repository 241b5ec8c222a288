"""Fuzz autoplan with many more cases than CI runs (issue 15: at least 1000).

Runs the strategies of ``tests/fuzz_cases.py``: corrupted profile YAML (loaded with
``load_cluster``), corrupted plan JSON (through ``autoplan report``) and random command
lines (through the CLI, in-process), and prints the case count and the number of
tracebacks (and second runs that differ); exits 1 if any.

    python benchmarks/fuzz.py                 # 1000 YAML + 500 plan + 200 command-line cases
    python benchmarks/fuzz.py --scale 0.1     # a tenth of that
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from hypothesis import HealthCheck, given, settings  # noqa: E402

import fuzz_cases as fc  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every case count")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import autoplan
    from autoplan.hardware.profiles import find_profile_file
    from autoplan.models import GPT, GPTConfig

    work = Path(tempfile.mkdtemp(prefix="autoplan-fuzz-"))
    failures: list[str] = []
    counts: dict[str, int] = {}

    def run(name: str, n: int, strategy, check) -> None:
        counts[name] = 0

        @settings(max_examples=max(1, int(n * args.scale)), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def body(case):
            counts[name] += 1
            why = check(case)
            if why:
                failures.append(f"[{name}] {why}")

        from hypothesis import seed
        seed(args.seed)(body)()

    def profile_case(data: bytes) -> str | None:
        path = fc.write(work / "a100-sxm4-80gb.yaml", data)
        seen = []
        for _ in range(2):
            try:
                seen.append(autoplan.load_cluster(path, nodes=2).num_devices)
            except AutoplanError as exc:
                seen.append(str(exc))
            except Exception as exc:  # noqa: BLE001 - what is counted
                return f"{type(exc).__name__}: {exc}"
        return None if seen[0] == seen[1] else "a second load differed"

    graph = autoplan.trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)),
                           seq_len=16)
    plan = autoplan.plan(graph, autoplan.load_cluster("a100-sxm4-80gb"), global_batch=8)
    plan_doc = json.loads(plan.to_json())

    def plan_case(data: bytes) -> str | None:
        path = fc.write(work / "plan.json", data)
        return fc.check_case(["report", "--plan", str(path), "--cluster", "a100-sxm4-80gb"])

    start = time.perf_counter()
    profile_text = find_profile_file("a100-sxm4-80gb").read_text()
    run("profile yaml", 1000, fc.corrupted_texts(profile_text, fc._YAML_NOISE), profile_case)
    run("plan json", 500, fc.corrupted_json_values(plan_doc), plan_case)
    run("command line", 200, fc.command_lines(), fc.check_case)
    total = sum(counts.values())
    for name, n in counts.items():
        print(f"{name:>13}: {n} cases")
    print(f"{total} cases, {len(failures)} tracebacks or differing second runs "
          f"in {time.perf_counter() - start:.0f} s")
    for f in failures[:20]:
        print(f"\n{f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
