"""keep_cpu_heap: freed tensors stay in the process for the next step (glibc only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autoplan.runtime import cpu_heap

pytestmark = pytest.mark.skipif(cpu_heap._glibc() is None, reason="glibc's mallopt only")

# A "step" of twelve tensors (four of 40 MiB, above glibc's largest default mmap
# threshold of 32 MiB, and eight of 1-2 MiB) made, written and freed six times.  By
# default the 40 MiB ones are mapped afresh each step and fault in every page.
_STEP_BYTES = 4 * ((10 << 20) + (1 << 18) + (1 << 19)) * 4
_FAULTS = """
import resource, sys, torch
from autoplan.runtime.cpu_heap import keep_cpu_heap
applied = keep_cpu_heap()
counts = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ts = [torch.empty(n).fill_(1.0) for n in (10 << 20, 1 << 18, 1 << 19) * 4]
    del ts
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *counts)
"""


def _faults(env_value: str | None) -> tuple[bool, list[int]]:
    env = dict(os.environ)
    env.pop(cpu_heap.ENV_VAR, None)
    if env_value is not None:
        env[cpu_heap.ENV_VAR] = env_value
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0] == "True", [int(x) for x in out[1:]]


def test_a_kept_heap_reuses_a_freed_tensor_without_faulting_its_pages_again():
    pages = _STEP_BYTES // os.sysconf("SC_PAGE_SIZE")
    applied, kept = _faults(None)
    assert applied
    assert kept[0] >= pages // 2                  # the first touch faults, as always
    # then the heap's pages are reused: the last four steps together fault less than half of
    # one step (now and then glibc places one 40 MiB block anew: 10240 faults, once)
    assert sum(kept[2:]) < pages // 2, kept
    applied, default = _faults("0")               # opted out: glibc maps the large ones
    assert not applied                            # afresh every step
    assert min(default[2:]) >= pages // 2, default


def test_the_setting_applies_once_and_the_opt_out_is_read(monkeypatch):
    monkeypatch.setattr(cpu_heap, "_applied", None)
    monkeypatch.setenv(cpu_heap.ENV_VAR, "off")
    assert cpu_heap.keep_cpu_heap() is False
    monkeypatch.setenv(cpu_heap.ENV_VAR, "1")
    assert cpu_heap.keep_cpu_heap() is False      # decided once per process
