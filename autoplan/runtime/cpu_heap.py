"""Keep a CPU training process's freed memory for its next step.

On CUDA, torch's caching allocator keeps the blocks a step frees for the next step.  On
CPU, tensors come from the C library's ``malloc``, and glibc's defaults hand large freed
blocks back to the operating system: a tensor above the ``mmap`` threshold (128 KiB,
raised as large blocks are freed, to 32 MiB at most) is unmapped when freed, and a heap
whose free top grows past the trim threshold is shrunk.  The next step maps the memory
again and the kernel zeroes every page as it is first touched.  A pipeline stage, which
holds several micro-batches' activations and frees them together, paid for that on every
step: thousands of page faults per step per rank, 2-10% of the step on 4 ranks sharing 2
cores (measured side by side, the retired ``benchmarks/local_truth.py``'s layouts, 2026-11-24), and
none of it in the compute the profiler times.

:func:`keep_cpu_heap` raises both thresholds once per process (glibc's ``mallopt``), so
freed blocks stay in the heap for reuse, as CUDA's allocator keeps them.  The price is
that the process keeps up to :data:`TRIM_THRESHOLD_BYTES` of freed memory instead of
returning it.  Set ``AUTOPLAN_KEEP_CPU_HEAP=0`` to leave the C library's defaults.  Other C
libraries (macOS, musl) are left alone.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["keep_cpu_heap", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "ENV_VAR"]

#: Blocks up to this size come from the heap (and stay there when freed), not from ``mmap``.
MMAP_THRESHOLD_BYTES = 1 << 30
#: Free memory at the top of the heap up to this size is kept rather than returned.
TRIM_THRESHOLD_BYTES = 1 << 30
#: ``0`` (or ``false``, ``no``, ``off``) leaves the C library's defaults.
ENV_VAR = "AUTOPLAN_KEEP_CPU_HEAP"

_M_TRIM_THRESHOLD = -1   # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3

_applied: bool | None = None


def _glibc():
    """The process's glibc, or ``None`` under another C library.  The symbols already
    loaded into the process (``CDLL(None)``), not ``find_library``, which runs ``ldconfig``."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version   # glibc only
        libc.mallopt
    except (OSError, AttributeError):
        return None
    return libc


def keep_cpu_heap() -> bool:
    """Raise glibc's ``mmap`` and trim thresholds for this process (once); ``True`` when
    they are raised (now or by an earlier call), ``False`` when left alone: opted out with
    ``AUTOPLAN_KEEP_CPU_HEAP=0``, not glibc, or refused by ``mallopt``."""
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        _applied = False
        return False
    libc = _glibc()
    if libc is None:
        _applied = False
        return False
    # M_MMAP_THRESHOLD first: setting either turns off glibc's own raising of the mmap
    # threshold, and a trim threshold alone would leave it at 128 KiB (every tensor mapped)
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD_BYTES)) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD_BYTES)) == 1)
    _applied = bool(ok)
    return _applied
