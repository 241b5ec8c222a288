"""Memory as the runtime holds it: the estimate's peak against a real step's, on gloo ranks.

A GPT of 4 blocks (hidden 256, sequence 128) trains under each layout; the peak bytes of
live tensor storages in a step (autoplan.runtime.ledger.LiveBytes: CPU tensors have no
allocator statistics) are compared with the estimate's memory less its runtime reserve,
per pipeline stage, within 10% (ledger_cases.MEMORY_TOLERANCE).  The layouts are those
whose memory the bf16 program changed: FSDP2's policy under ZeRO-0/1/2/3 (fp32 master
weights, bf16 compute copies, fp32 gradients, whole while micro-batches accumulate under
ZeRO-1), and a pipeline of many micro-batches, whose receive buffers exist only while
their micro-batch is in flight.
"""

from __future__ import annotations

import functools

import pytest

import ledger_cases as lc
from dist_harness import run
from autoplan.strategy import Strategy

pytestmark = pytest.mark.distributed

B = functools.partial(Strategy, precision="bf16", global_batch=16, micro_batch=2)

LAYOUTS = [
    ("bf16 dp2 (replicate)", B(dp=2)),
    ("bf16 dp2 zero1 (accumulating)", B(dp=2, zero=1)),
    ("bf16 dp2 zero2", B(dp=2, zero=2)),
    ("bf16 dp2 zero3", B(dp=2, zero=3)),
    ("bf16 pp2 1f1b, 16 micro-batches", B(pp=2, micro_batch=1, schedule="1f1b")),
    ("fp32 dp2 zero1", B(dp=2, zero=1, precision="fp32")),
]


def test_the_estimated_peak_is_the_measured_one():
    results = run(lc.measure_memory, 2, LAYOUTS, lc.memory_graph(), timeout=600)
    problems = []
    print()
    for label, _ in LAYOUTS:
        for rank, r in enumerate(res[label] for res in results):
            err = r["predicted"] / r["peak"] - 1
            print(f"  {label:34s} rank {rank}: predicted {r['predicted'] / 2**20:7.2f} MiB, "
                  f"measured {r['peak'] / 2**20:7.2f} MiB ({err:+.1%})")
            if abs(err) > lc.MEMORY_TOLERANCE:
                parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in r["breakdown"].items())
                problems.append(f"{label} rank {rank}: predicted {r['predicted'] / 2**20:.2f} MiB "
                                f"({parts}), measured {r['peak'] / 2**20:.2f} MiB ({err:+.1%})")
    assert not problems, "\n".join(problems)
