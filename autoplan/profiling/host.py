"""The host: its RAM, cores, the bandwidth of a copy in host memory, and on CUDA one GPU's
host link (:func:`measure_host`), for embedding tables kept in host memory."""

from __future__ import annotations

import os
import platform
import socket
import time
from pathlib import Path
from typing import Any, Callable

from ..hardware.hosts import HostSpec
from .timing import fmt_bytes


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    try:  # platforms without sysconf
        import psutil  # type: ignore[import-not-found]
    except ImportError:
        raise RuntimeError("cannot read the physical memory size here; install psutil") from None
    return int(psutil.virtual_memory().total)


def measure_host(*, cuda: bool, quick: bool = False) -> HostSpec:
    """The host of this machine: its RAM, its cores, the bandwidth of a large copy in host
    memory with every core, and on CUDA one GPU's host link (a pinned host buffer copied to
    the device; ``None`` without one).

    The copy counts the bytes read and written, as the device's copy bandwidth does; the
    host link counts the bytes moved one way, one device alone (devices that share a
    PCIe switch's uplink get less each when they all read at once).
    """
    import torch

    nbytes = (64 if quick else 512) * 2**20
    repeats = 3 if quick else 5
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = min(_timed_once(lambda: dst.copy_(src)) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    copy_bw = 2.0 * nbytes / best
    pcie = None
    how = (f"measured by `autoplan profile` on {socket.gethostname()}: RAM from the OS, "
           f"{os.cpu_count()} logical cores, a {fmt_bytes(nbytes)} tensor copy with every "
           f"core (bytes read + written, best of {repeats})")
    if cuda:
        host = torch.ones(nbytes // 4, dtype=torch.float32).pin_memory()
        dev = torch.empty_like(host, device="cuda")

        def h2d() -> None:
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        h2d()
        pcie = nbytes / min(_timed_once(h2d) for _ in range(repeats))
        how += (f"; host link: a pinned {fmt_bytes(nbytes)} buffer copied to GPU 0, one "
                f"device alone, best of {repeats}")
    return HostSpec(memory_bytes=physical_memory_bytes(), memory_bw_bytes_per_s=copy_bw,
                    cores=max(1, os.cpu_count() or 1), source=how, pcie_bw_bytes_per_s=pcie)


def _timed_once(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
