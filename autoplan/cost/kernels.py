"""Measured kernel speeds of a software stack, per GPU architecture, carried to its devices.

The published-run fit (:mod:`autoplan.cost.calibration`) describes the kernels the
published stacks ran: Megatron-LM, LLM Foundry and torchtitan, in the CUDA, cuBLAS and
FlashAttention versions of 2021-2026.  On an H100 it prices a large 16-bit matmul at 57%
of the datasheet peak, plus 41 us a kernel.  autoplan's own program
(:func:`autoplan.parallelize`, the ``autoplan`` stack) runs the kernels of the torch it
is installed with: cuBLAS matmuls, ``scaled_dot_product_attention``, torch's
elementwise kernels.  ``autoplan profile --device cuda`` times them (on an H100 with
torch 2.11: a large bf16 matmul at 76% of the datasheet peak), and the committed
GPU-truth runs (``benchmarks/gpu_truth/``) step at those speeds.

A :class:`KernelTables` file (``profiles/cost/kernels-<name>.yaml``, written by
``benchmarks/stack_kernels.py`` from a measured profile) keeps these measurements per
architecture.  Each one is stored against the datasheet of the device measured, so it
carries over to every device of the architecture (H100 -> H200):

* a matmul of a dtype runs at the same fraction of that dtype's datasheet peak;
* fused attention runs at the same fraction of the 16-bit datasheet peak;
* a memory-bound operator of a kind runs at the same fraction of the datasheet memory
  bandwidth.

A stack names its tables (``CostOptions.kernel_tables``).  :func:`apply_kernel_tables`
gives the GPUs of each listed architecture those tables, on top of the fit.  The fit
still gives the links, and the FP8 curve where nothing was measured.  Measured profiles
(``DeviceType.measured``) keep their own tables.

Examples
--------
>>> from autoplan.hardware import load_cluster
>>> tables = load_kernel_tables("torch-eager")
>>> c = apply_kernel_tables(load_cluster("h200-sxm-141gb"), tables)
>>> c.device_type_of(0).matmul_efficiency["bf16"].source.startswith("measured")
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from ..hardware import Cluster, EfficiencyTable
from ..hardware.profile_records import ARCHITECTURES, RATE_KINDS, DeviceType, ElementwiseRates
from ..records import Record, atomic_write_text
from .calibration import cached_copy
from .constants import cost_profiles_dir, read_yaml_record

__all__ = ["ArchitectureKernels", "KernelTables", "load_kernel_tables", "apply_kernel_tables",
           "kernels_from_profiles", "write_kernel_tables"]


@dataclass(frozen=True)
class ArchitectureKernels(Record):
    """One architecture's measured kernels, as fractions of the measured device's datasheet.

    Parameters
    ----------
    measured_on : str
        The device measured and the shipped profile whose datasheet the fractions are of.
    matmul_efficiency : dict of str to EfficiencyTable
        Per dtype, the fraction of the dtype's datasheet peak against a matmul's FLOPs.
    attention_efficiency : EfficiencyTable or None
        Fused attention (forward and backward) as a fraction of the 16-bit datasheet peak,
        against the FLOPs of one ``QK^T`` product (the engine's key).
    elementwise_bw_fraction : dict or None
        ``{"forward": {kind: fraction}, "backward": {...}}``: memory-bound operators of
        each kind (:data:`~autoplan.hardware.profile_records.RATE_KINDS`) in the bytes
        the cost model counts for them, per second, over the datasheet memory bandwidth.
    source : str
        How and where they were measured.
    """

    measured_on: str
    matmul_efficiency: dict[str, EfficiencyTable]
    attention_efficiency: EfficiencyTable | None
    elementwise_bw_fraction: dict[str, dict[str, float]] | None
    source: str

    def __post_init__(self) -> None:
        if not self.matmul_efficiency:
            raise ConfigError("matmul_efficiency: expected at least one dtype's table")
        if self.elementwise_bw_fraction is not None:
            for direction, rates in self.elementwise_bw_fraction.items():
                if direction not in ("forward", "backward"):
                    raise ConfigError(f"elementwise_bw_fraction.{direction}: expected "
                                      "'forward' or 'backward'")
                for kind, value in rates.items():
                    if kind not in RATE_KINDS or not 0 < value < 10:
                        raise ConfigError(
                            f"elementwise_bw_fraction.{direction}.{kind}: expected one of "
                            f"{list(RATE_KINDS)} with a fraction of the datasheet bandwidth "
                            f"in (0, 10), got {value!r}")

    def device(self, device: DeviceType) -> DeviceType:
        """``device`` (a datasheet profile of this architecture) with these kernels."""
        tables = dict(device.matmul_efficiency)
        for dtype, table in self.matmul_efficiency.items():
            if dtype in device.peak_flops_per_s:
                tables[dtype] = replace(table, source=self.source)
        attention = (replace(self.attention_efficiency, source=self.source)
                     if self.attention_efficiency is not None else device.attention_efficiency)
        rates = device.elementwise_rates
        if self.elementwise_bw_fraction is not None:
            bw = device.memory_bw_bytes_per_s
            f = self.elementwise_bw_fraction
            rates = ElementwiseRates({k: v * bw for k, v in f.get("forward", {}).items()},
                                     {k: v * bw for k, v in f.get("backward", {}).items()},
                                     source=self.source)
        return replace(device, matmul_efficiency=tables, attention_efficiency=attention,
                       elementwise_rates=rates)


@dataclass(frozen=True)
class KernelTables(Record):
    """A software stack's measured kernels per GPU architecture (:mod:`this module
    <autoplan.cost.kernels>`)."""

    name: str
    description: str
    architectures: dict[str, ArchitectureKernels]

    def __post_init__(self) -> None:
        for arch in self.architectures:
            if arch not in ARCHITECTURES or arch == "cpu":
                raise ConfigError(f"architectures.{arch}: unknown GPU architecture; expected one "
                                  f"of {[a for a in ARCHITECTURES if a != 'cpu']}")


def _path(name_or_path: str | os.PathLike[str]) -> Path:
    text = os.fspath(name_or_path)
    if text.endswith((".yaml", ".yml")) or os.sep in text:
        return Path(text)
    return cost_profiles_dir() / f"kernels-{text}.yaml"


def load_kernel_tables(name_or_path: str | os.PathLike[str]) -> KernelTables:
    """``profiles/cost/kernels-<name>.yaml`` (or a path).

    Raises
    ------
    ConfigError
        When the file is missing (saying which names exist) or malformed (naming the field).
    """
    p = _path(name_or_path)
    if not p.is_file():
        known = sorted(f.stem.removeprefix("kernels-")
                       for f in cost_profiles_dir().glob("kernels-*.yaml"))
        raise ConfigError(f"no kernel tables {os.fspath(name_or_path)!r} ({p}); known: "
                          f"{', '.join(known) or 'none'}")
    return read_yaml_record(KernelTables, str(p.resolve()), p.stat().st_mtime_ns,
                            "a stack's measured kernel tables")


def _takes_tables(device: DeviceType, tables: KernelTables) -> bool:
    return not device.measured and device.architecture in tables.architectures


#: The last clusters given kernels, so engines of one cluster share one copy (and its
#: device index); keyed by the two objects' ids, checked by identity.
_APPLIED: dict[tuple[int, int], tuple[Cluster, object, Cluster]] = {}


def apply_kernel_tables(cluster: Cluster, tables: KernelTables | None) -> Cluster:
    """A copy of ``cluster`` whose datasheet GPUs of the architectures in ``tables`` run
    those kernels (:meth:`ArchitectureKernels.device`); ``cluster`` itself when none does.
    Cached per cluster and tables object."""
    if tables is None or not any(_takes_tables(p.device, tables)
                                 for p in cluster.profiles.values()):
        return cluster
    return cached_copy(_APPLIED, cluster, tables, _apply)


def _apply(cluster: Cluster, tables: KernelTables) -> Cluster:
    profiles = {name: (replace(p, device=tables.architectures[p.device.architecture]
                               .device(p.device))
                       if _takes_tables(p.device, tables) else p)
                for name, p in cluster.profiles.items()}
    return Cluster(cluster.name, profiles, cluster.nodes, cluster.site_links)


def kernels_from_profiles(measured: DeviceType, datasheet: DeviceType, *, profile_name: str,
                          source: str) -> ArchitectureKernels:
    """One architecture's kernels from a measured device (``autoplan profile``) and the
    shipped datasheet profile of the same GPU: each measured table rescaled from the
    measured peak (the best matmul it timed) to the datasheet peak of its dtype, and each
    memory-bound rate to a fraction of the datasheet bandwidth."""
    if not measured.measured:
        raise ConfigError(f"{measured.name}: not a measured profile (autoplan profile writes "
                          "'measured: true'); the kernels come from a measurement")
    if datasheet.measured or datasheet.architecture in ("", "cpu"):
        raise ConfigError(f"{datasheet.name}: expected the shipped datasheet profile of a GPU")

    def rescaled(table: EfficiencyTable, ratio: float) -> EfficiencyTable:
        return EfficiencyTable(tuple((f, min(1.0, e * ratio)) for f, e in table.points),
                               source=f"measured on {measured.name}: see the architecture")

    matmul = {}
    for dtype, table in sorted(measured.matmul_efficiency.items()):
        if dtype in measured.peak_flops_per_s and dtype in datasheet.peak_flops_per_s:
            matmul[dtype] = rescaled(table, measured.peak_flops_per_s[dtype]
                                     / datasheet.peak_flops_per_s[dtype])
    half = datasheet.resolve_dtype("bf16")
    attention = (rescaled(measured.attention_efficiency,
                          measured.peak(half) / datasheet.peak(half))
                 if measured.attention_efficiency is not None else None)
    rates = measured.elementwise_rates
    fractions = None
    if rates is not None:
        bw = datasheet.memory_bw_bytes_per_s
        fractions = {"forward": {k: v / bw for k, v in sorted(rates.forward_bytes_per_s.items())},
                     "backward": {k: v / bw for k, v in
                                  sorted(rates.backward_bytes_per_s.items())}}
    return ArchitectureKernels(measured_on=f"{measured.name} (datasheet: {profile_name})",
                               matmul_efficiency=matmul, attention_efficiency=attention,
                               elementwise_bw_fraction=fractions, source=source)


def write_kernel_tables(tables: KernelTables, path: Path, header: str = "") -> Path:
    """Write ``tables`` as YAML to ``path`` (a temporary name, then renamed)."""
    import yaml
    text = yaml.safe_dump(tables.to_dict(), sort_keys=False, width=100,
                          default_flow_style=None)
    atomic_write_text(path, header + text)
    return path
