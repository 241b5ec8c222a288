"""Fitted device figures, kept apart from the datasheet profiles until they move there.

A :class:`Calibration` holds, per device type name, an achievable matmul
efficiency curve and the collective efficiencies of the intra-node and
inter-node links, each fitted against published runs by
``benchmarks/published_runs.py --fit`` and stored with its source in
``profiles/cost/<name>.yaml``.  :func:`apply_calibration` returns a copy of a
cluster whose device profiles carry the fitted figures; every formula then
reads them through the ordinary hardware API (``DeviceType.efficiency``,
``Cluster.collective_time``).  Only what carries over between runs is fitted:
one curve per GPU type, one efficiency per link kind.

Examples
--------
>>> from autoplan.hardware import load_cluster
>>> cal = load_calibration()
>>> c = apply_calibration(load_cluster("h100-sxm5-80gb"), cal)
>>> c.device_type_of(0).matmul_efficiency["default"].source.startswith("fitted")
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path


from ..errors import ConfigError
from ..hardware import Cluster, CollectiveEfficiency, EfficiencyTable
from ..records import Record
from .constants import cost_profiles_dir, read_yaml_record

__all__ = ["DeviceCalibration", "Calibration", "load_calibration", "apply_calibration",
           "resolve_calibration", "DEFAULT_CALIBRATION"]

#: The calibration fitted to the published runs in the repository's
#: ``validation/published_public.csv`` (``benchmarks/published_runs.py --fit``).
DEFAULT_CALIBRATION = "published-fit"


@dataclass(frozen=True)
class DeviceCalibration(Record):
    """Fitted figures of one device type (``None``: keep the profile's).

    ``attention_efficiency`` is the achieved fraction of peak of a fused
    attention kernel (FlashAttention) versus the FLOPs of its ``QK^T`` product
    on one device; the device profiles have no such table yet.
    """

    matmul_efficiency: EfficiencyTable | None = None
    attention_efficiency: EfficiencyTable | None = None
    intra_node_efficiency: CollectiveEfficiency | None = None
    inter_node_efficiency: CollectiveEfficiency | None = None


@dataclass(frozen=True)
class Calibration(Record):
    """Fitted figures per device type name (e.g. ``"H100-SXM5-80GB"``)."""

    name: str
    source: str
    devices: dict[str, DeviceCalibration]


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


def apply_calibration(cluster: Cluster, calibration: Calibration) -> Cluster:
    """A copy of ``cluster`` whose profiles carry the fitted figures of ``calibration``.

    The fitted matmul curve replaces the ``default`` table (tables for other
    dtypes, e.g. ``fp32``, stay); fitted collective efficiencies replace the
    node's and the network's.
    """
    profiles = {}
    for name, profile in cluster.profiles.items():
        cal = calibration.devices.get(profile.device.name)
        if cal is None:
            profiles[name] = profile
            continue
        device = profile.device
        if cal.matmul_efficiency is not None:
            tables = dict(device.matmul_efficiency)
            tables["default"] = cal.matmul_efficiency
            for dtype in ("bf16", "fp16"):
                tables.pop(dtype, None)
            device = replace(device, matmul_efficiency=tables)
        node = profile.node
        if cal.intra_node_efficiency is not None:
            node = replace(node, collective_efficiency=cal.intra_node_efficiency)
        network = profile.network
        if network is not None and cal.inter_node_efficiency is not None:
            network = replace(network, collective_efficiency=cal.inter_node_efficiency)
        profiles[name] = replace(profile, device=device, node=node, network=network)
    return Cluster(cluster.name, profiles, cluster.nodes, cluster.site_links)


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
