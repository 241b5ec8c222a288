"""Fitted device figures, per GPU architecture and link kind, scaled by each device's datasheet.

A :class:`Calibration` holds few parameters, each with a physical meaning, fitted
against published runs by ``benchmarks/published_runs.py --fit`` and stored with
their source in ``profiles/cost/<name>.yaml``:

* per GPU *architecture* (:data:`autoplan.hardware.profile_records.ARCHITECTURES`,
  a profile's ``device.architecture``), an :class:`ArchitectureCalibration`: the
  fraction of the dense datasheet peak a large matmul reaches
  (``matmul_peak_fraction``), a fixed time per matmul kernel
  (``matmul_overhead_s``: launch, wave quantization, tails), the fraction a fused
  attention kernel reaches (``attention_peak_fraction``) and, for FP8 matmuls,
  the fraction of the FP8 peak (``fp8_peak_fraction``).  A matmul of ``F`` FLOPs
  on a device of peak ``P`` then takes ``F / (P e) + t0``, i.e. runs at the
  fraction ``e / (1 + e P t0 / F)`` of peak (a roofline with a per-kernel
  latency; Williams et al. 2009 for the roofline, the latency term as in
  Calculon, Isaev et al. 2023).  Because the curve is built from each device's
  own peak, the same figures carry over to every device of the architecture
  (H100 -> H200, A100-80GB -> A100-40GB, B200 -> GB200);
* per *link kind*, a :class:`LinkCalibration`: the bus bandwidth NCCL collectives
  reach over the raw link, for NVLink (intra-node NVSwitch / NVLink mesh) and for
  the inter-node network (InfiniBand / RoCE).

An architecture without fitted figures (no published run on it) gets the mean of
the fitted architectures' figures (:meth:`Calibration.for_architecture`, its
source says so).  Devices whose architecture is ``"cpu"`` or not stated (measured
profiles) keep their own measured matmul tables and links; their fused attention
is priced from their own matmul table scaled by the fitted attention / matmul
ratio.  So every device gets a fused-attention model.

:func:`apply_calibration` returns a copy of a cluster whose device profiles carry
the fitted figures; every formula then reads them through the ordinary hardware
API (``DeviceType.efficiency``, ``Cluster.collective_time``), and
:func:`attention_tables` gives the fused-attention curve of each device type.

Examples
--------
>>> from autoplan.hardware import load_cluster
>>> cal = load_calibration()
>>> c = apply_calibration(load_cluster("h100-sxm5-80gb"), cal)
>>> c.device_type_of(0).matmul_efficiency["default"].source.startswith("fitted")
True
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from ..hardware import Cluster, CollectiveEfficiency, EfficiencyTable
from ..hardware.profile_records import ARCHITECTURES, DeviceType, IntraNodeTopology
from ..records import Record
from .constants import cost_profiles_dir, read_yaml_record

__all__ = ["ArchitectureCalibration", "LinkCalibration", "Calibration", "load_calibration",
           "apply_calibration", "attention_tables", "resolve_calibration", "DEFAULT_CALIBRATION",
           "FLASH_ATTENTION_2_HOPPER_VS_AMPERE", "FLASH_ATTENTION_2_SPEED",
           "ATTENTION_PRICED_FROM"]

#: The calibration fitted to the published runs in the repository's
#: ``validation/published_public.csv`` (``benchmarks/published_runs.py --fit``).
DEFAULT_CALIBRATION = "published-fit"

#: Matmul sizes (FLOPs of one matmul on one device) at which the fitted curve is
#: tabulated for a device (half-decades; the table interpolates in log size).
CURVE_FLOPS = tuple(10.0 ** (k / 2) for k in range(12, 31))

_NVLINK = (IntraNodeTopology.NVSWITCH, IntraNodeTopology.HYBRID_CUBE_MESH)


#: FlashAttention-2 on Hopper, as a multiple of the fraction of peak it reaches on Ampere.
#: FlashAttention-2 has no Hopper code path: the same kernels (Ampere's ``mma.sync``
#: instructions) run on both, reaching up to 230 TFLOP/s on an A100 (73% of its 312
#: TFLOP/s 16-bit peak) and up to 335 TFLOP/s on an H100 SXM5 (of 989): Dao 2023,
#: "FlashAttention-2", arXiv:2307.08691, Sec. 4.1.  So its fraction on Hopper is
#: (335/989) / (230/312) = 0.46 of its fraction on Ampere, where it is the fused kernel
#: the fitted ``attention_peak_fraction`` describes (torchtitan's SDPA flash runs).
FLASH_ATTENTION_2_HOPPER_VS_AMPERE = (335 / 989) / (230 / 312)

#: Architectures whose fused attention, when they have no fitted figure of their own, is
#: priced from another architecture's fitted FlashAttention-2 fraction
#: (:meth:`Calibration.attention_fraction`; the published fit then fits only that one).
ATTENTION_PRICED_FROM = {"hopper": "ampere"}

#: Speed of FlashAttention-2 relative to an architecture's own fused kernels
#: (Transformer Engine's cuDNN kernels, ``CostOptions.attention_kernel="cudnn"``).
#: Hopper: FlashAttention-3 (and cuDNN's kernels of its class) run 1.5-2.0x faster than
#: FlashAttention-2 in 16-bit (Shah et al. 2024, "FlashAttention-3", arXiv:2407.08608,
#: abstract; FlashAttention-2 reaches 35% of the H100's peak): the midpoint, 1/1.75.
#: Blackwell: FlashAttention-2 runs its Ampere code there, like on Hopper; no published
#: comparison was found, so Hopper's ratio stands in.  Ampere and Volta: FlashAttention-2
#: is the kernel of their generation (1.0).
FLASH_ATTENTION_2_SPEED = {"hopper": 1 / 1.75, "blackwell": 1 / 1.75}


@dataclass(frozen=True)
class ArchitectureCalibration(Record):
    """Fitted figures of one GPU architecture (fractions of the dense datasheet peak).

    ``matmul_peak_fraction`` / ``attention_peak_fraction`` / ``fp8_peak_fraction``:
    ``None`` where no run measured them (the mean of the other architectures' figures
    is used): e.g. Blackwell's 16-bit matmul fraction, when every Blackwell run trains
    its matmuls in FP8.
    """

    matmul_peak_fraction: float | None
    matmul_overhead_s: float
    attention_peak_fraction: float | None
    fp8_peak_fraction: float | None
    source: str

    def __post_init__(self) -> None:
        for name in ("matmul_peak_fraction", "attention_peak_fraction", "fp8_peak_fraction"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {v!r}")
        if not 0 <= self.matmul_overhead_s < 1:
            raise ConfigError(f"matmul_overhead_s must be in [0, 1) s, got "
                              f"{self.matmul_overhead_s!r}")

    def curve(self, peak_flops_per_s: float, fraction: float, source: str) -> EfficiencyTable:
        """The achieved fraction of ``peak_flops_per_s`` vs matmul FLOPs:
        ``e / (1 + e P t0 / F)`` at :data:`CURVE_FLOPS` (see the module docstring)."""
        e, t0 = fraction, self.matmul_overhead_s
        return EfficiencyTable(tuple((f, e / (1 + e * peak_flops_per_s * t0 / f))
                                     for f in CURVE_FLOPS), source=source)


@dataclass(frozen=True)
class LinkCalibration(Record):
    """Collective bus bandwidth over the raw link, per link kind (NCCL busbw / link)."""

    nvlink: float
    network: float
    source: str

    def __post_init__(self) -> None:
        for name in ("nvlink", "network"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {v!r}")


@dataclass(frozen=True)
class Calibration(Record):
    """Fitted figures per GPU architecture (e.g. ``"hopper"``) and per link kind."""

    name: str
    source: str
    architectures: dict[str, ArchitectureCalibration]
    links: LinkCalibration

    def __post_init__(self) -> None:
        for arch in self.architectures:
            if arch not in ARCHITECTURES or arch == "cpu":
                raise ConfigError(f"architectures.{arch}: unknown GPU architecture; expected one "
                                  f"of {[a for a in ARCHITECTURES if a != 'cpu']}")
        if not self.architectures:
            raise ConfigError("architectures: expected at least one fitted architecture")

    def for_architecture(self, arch: str) -> ArchitectureCalibration:
        """The fitted figures of ``arch``, with every missing figure the mean of the
        fitted architectures' (an architecture with no published run gets all of them
        that way; the source says so)."""
        fitted = self.architectures

        def mean(name: str) -> float | None:
            vals = [getattr(a, name) for a in fitted.values() if getattr(a, name) is not None]
            if not vals:
                return None
            if name == "matmul_overhead_s":
                return sum(vals) / len(vals)
            return math.exp(sum(math.log(v) for v in vals) / len(vals))

        own = fitted.get(arch)
        if own is None:
            return ArchitectureCalibration(
                mean("matmul_peak_fraction"), mean("matmul_overhead_s"),
                mean("attention_peak_fraction"), mean("fp8_peak_fraction"),
                source=(f"carried over: mean of the figures fitted for {sorted(fitted)} "
                        f"(no published run on {arch or 'this device'}); {self.source}"))
        return replace(own,
                       matmul_peak_fraction=(own.matmul_peak_fraction
                                             if own.matmul_peak_fraction is not None
                                             else mean("matmul_peak_fraction")),
                       attention_peak_fraction=(own.attention_peak_fraction
                                                if own.attention_peak_fraction is not None
                                                else mean("attention_peak_fraction")),
                       fp8_peak_fraction=(own.fp8_peak_fraction if own.fp8_peak_fraction
                                          is not None else mean("fp8_peak_fraction")))

    def attention_fraction(self, arch: str, kernel: str = "cudnn") -> tuple[float | None, str]:
        """The fraction of the 16-bit peak the fused attention ``kernel``
        (``CostOptions.attention_kernel``) reaches on a large problem on ``arch``, and its
        source.

        Hopper, when it has no fitted figure of its own (the published fit leaves it out):
        FlashAttention-2 at Ampere's fitted fraction times
        :data:`FLASH_ATTENTION_2_HOPPER_VS_AMPERE` (the same kernel, measured on both),
        and the cuDNN kernels at that over ``FLASH_ATTENTION_2_SPEED["hopper"]`` (measured
        against it on the same H100).  Elsewhere: ``"cudnn"`` is the architecture's
        ``attention_peak_fraction`` (:meth:`for_architecture`) and FlashAttention-2 that
        times :data:`FLASH_ATTENTION_2_SPEED` (1 on Ampere and Volta, where it is the
        fused kernel).  ``None`` where nothing gives a figure.
        """
        fa2 = kernel == "flash-attention-2"
        own = self.architectures.get(arch)
        ampere = self.architectures.get(ATTENTION_PRICED_FROM.get(arch, ""))
        if ((own is None or own.attention_peak_fraction is None)
                and ampere is not None and ampere.attention_peak_fraction is not None):
            f = ampere.attention_peak_fraction * FLASH_ATTENTION_2_HOPPER_VS_AMPERE
            why = (f"Ampere's fitted FlashAttention-2 fraction x "
                   f"{FLASH_ATTENTION_2_HOPPER_VS_AMPERE:.3f} (Dao 2023, Sec. 4.1)")
            if not fa2:
                f /= FLASH_ATTENTION_2_SPEED["hopper"]
                why += f" / {FLASH_ATTENTION_2_SPEED['hopper']:.3f} (Shah et al. 2024)"
            return min(1.0, f), f"{why}; {ampere.source}"
        fig = self.for_architecture(arch)
        if fig.attention_peak_fraction is None:
            return None, fig.source
        if fa2 and arch in FLASH_ATTENTION_2_SPEED:
            speed = FLASH_ATTENTION_2_SPEED[arch]
            return (fig.attention_peak_fraction * speed,
                    f"FlashAttention-2: x {speed:.3f} of the fused kernels (Shah et al. 2024); "
                    f"{fig.source}")
        return fig.attention_peak_fraction, fig.source


def _load(path: str, mtime_ns: int) -> Calibration:
    return read_yaml_record(Calibration, path, mtime_ns, "the calibration")


def load_calibration(name_or_path: str | os.PathLike[str] = DEFAULT_CALIBRATION) -> Calibration:
    """Load ``profiles/cost/<name>.yaml`` (or a path).

    Raises
    ------
    ConfigError
        When the file is missing or malformed (names the field).
    """
    text = os.fspath(name_or_path)
    p = Path(text) if text.endswith((".yaml", ".yml")) or os.sep in text \
        else cost_profiles_dir() / f"{text}.yaml"
    if not p.is_file():
        raise ConfigError(f"no calibration file {p}")
    return _load(str(p.resolve()), p.stat().st_mtime_ns)


def _is_gpu(device: DeviceType) -> bool:
    return device.architecture not in ("", "cpu")


def _takes_fit(device: DeviceType) -> bool:
    """Whether the fitted figures apply: a GPU profile of datasheet figures.  A measured
    profile (``device.measured``, ``autoplan profile``) keeps its own tables: its peak is
    already the best achieved, and the fitted fraction of a datasheet peak would count
    the shortfall twice."""
    return _is_gpu(device) and not device.measured


def _half_peak(device: DeviceType) -> float:
    return device.peak(device.resolve_dtype("bf16"))


#: The last calibrated clusters, so engines of one cluster and calibration share one
#: copy (and its device index); keyed by the two objects' ids, checked by identity.
_APPLIED: dict[tuple[int, int], tuple[Cluster, object, Cluster]] = {}


def cached_copy(cache: dict, cluster: Cluster, figures: object, build) -> Cluster:
    """``build(cluster, figures)``, made once per pair of objects while they live: ``cache``
    is keyed by their ids and checked by identity (the last 64 pairs are kept)."""
    key = (id(cluster), id(figures))
    hit = cache.get(key)
    if hit is not None and hit[0] is cluster and hit[1] is figures:
        return hit[2]
    out = build(cluster, figures)
    if len(cache) >= 64:
        cache.pop(next(iter(cache)))
    cache[key] = (cluster, figures, out)
    return out


def apply_calibration(cluster: Cluster, calibration: Calibration) -> Cluster:
    """A copy of ``cluster`` with the fitted figures (see :func:`_apply`), cached per
    cluster and calibration object."""
    return cached_copy(_APPLIED, cluster, calibration, _apply)


def _apply(cluster: Cluster, calibration: Calibration) -> Cluster:
    """A copy of ``cluster`` whose GPU profiles carry the fitted figures of ``calibration``.

    For a GPU (a profile naming a GPU architecture): the fitted matmul curve,
    built from the device's 16-bit peak, replaces the ``default`` table (its
    ``bf16``/``fp16`` tables go; ``fp32``/``tf32`` stay); the FP8 curve, from its
    FP8 peak, becomes the ``fp8`` table where the device has one; the NVLink
    figure replaces the node's collective efficiency on NVLink nodes, the network
    figure the network's.  CPU, unstated-architecture and measured profiles
    (``DeviceType.measured``) are kept as they are.
    """
    profiles = {}
    links = calibration.links
    for name, profile in cluster.profiles.items():
        device = profile.device
        if not _takes_fit(device):
            profiles[name] = profile
            continue
        arch = calibration.for_architecture(device.architecture)
        tables = dict(device.matmul_efficiency)
        for dtype in ("bf16", "fp16"):
            tables.pop(dtype, None)
        tables["default"] = arch.curve(_half_peak(device), arch.matmul_peak_fraction,
                                       arch.source)
        if "fp8" in device.peak_flops_per_s and arch.fp8_peak_fraction is not None:
            tables["fp8"] = arch.curve(device.peak("fp8"), arch.fp8_peak_fraction, arch.source)
        device = replace(device, matmul_efficiency=tables)
        node = profile.node
        if node.topology in _NVLINK:
            node = replace(node, collective_efficiency=CollectiveEfficiency.uniform(
                links.nvlink, links.source))
        network = profile.network
        if network is not None:
            network = replace(network, collective_efficiency=CollectiveEfficiency.uniform(
                links.network, links.source))
        profiles[name] = replace(profile, device=device, node=node, network=network)
    return Cluster(cluster.name, profiles, cluster.nodes, cluster.site_links)


def attention_tables(cluster: Cluster, calibration: Calibration,
                     kernel: str = "cudnn") -> dict[str, EfficiencyTable]:
    """Device type name -> fused-attention efficiency curve (fraction of the 16-bit peak vs
    the FLOPs of one ``QK^T`` product on one device), for every device type of ``cluster``,
    for the attention ``kernel`` (``CostOptions.attention_kernel``).

    A device with a measured attention table (``DeviceType.attention_efficiency``,
    ``autoplan profile`` on CUDA), either kernel: that table.  Other GPUs:
    :meth:`Calibration.attention_fraction` of the architecture, with its matmul
    overhead.  CPU, unstated-architecture and measured devices without a measured table,
    either kernel: their own matmul table scaled by the fitted attention / matmul ratio
    (mean over the fitted architectures).
    """
    out: dict[str, EfficiencyTable] = {}
    for profile in cluster.profiles.values():
        device = profile.device
        if device.attention_efficiency is not None:
            out[device.name] = device.attention_efficiency
            continue
        if _takes_fit(device):
            fraction, source = calibration.attention_fraction(device.architecture, kernel)
            if fraction is not None:
                arch = calibration.for_architecture(device.architecture)
                out[device.name] = arch.curve(_half_peak(device), fraction, source)
            continue
        arch = calibration.for_architecture("")
        if arch.attention_peak_fraction is None:
            continue
        ratio = arch.attention_peak_fraction / arch.matmul_peak_fraction
        dtype = device.resolve_dtype("bf16") if any(
            d in device.peak_flops_per_s for d in ("bf16", "fp16")) else "fp32"
        own = device.matmul_efficiency.get(dtype) or device.matmul_efficiency["default"]
        out[device.name] = EfficiencyTable(
            tuple((f, min(1.0, e * ratio)) for f, e in own.points),
            source=f"the device's own {dtype} matmul table x the fitted attention/matmul "
                   f"ratio {ratio:.3f}; {arch.source}")
    return out


def resolve_calibration(calibration: "Calibration | str | os.PathLike[str] | None"
                        ) -> Calibration | None:
    """A :class:`Calibration` from a record, a name/path, or ``None``.

    The default name (:data:`DEFAULT_CALIBRATION`) resolves to ``None`` when its
    file is absent (the device profiles are then used as they are); any other
    missing name raises :class:`ConfigError`.
    """
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    try:
        return load_calibration(calibration)
    except ConfigError:
        if os.fspath(calibration) == DEFAULT_CALIBRATION:
            return None
        raise
