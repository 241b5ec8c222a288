"""Hardware profiles: typed records, and loading them from YAML files.

A *profile* describes one kind of node: its device type (peak FLOP/s per dtype,
memory, memory bandwidth, achievable matmul efficiency), the fabric inside the
node and the network between nodes.  A *composite profile* describes a
heterogeneous cluster: groups of nodes of different profiles, placed at sites,
and the links between the sites.

YAML keys carry their unit (``memory_GiB``, ``bw_bidir_GBps``, ``bw_per_nic_Gbps``,
``latency_us``); values are converted to SI units (bytes, bytes/s, seconds,
FLOP/s) exactly once, here, at load.  Every record field name carries its SI
unit.  Loading rejects missing and unknown keys, wrong types and physically
impossible values with a :class:`~autoplan.errors.ProfileError` that names the
file, the field path and what was expected.

Profiles are found by name, searched in this order: the folders listed in the
``AUTOPLAN_PROFILES`` environment variable (separated by ``os.pathsep``), the
user's folder ``$AUTOPLAN_HOME/profiles`` (default ``~/.autoplan/profiles``,
where ``autoplan profile`` writes), then the shipped profiles.  An earlier folder
overrides a later one.  The file ``<name>.yaml`` must declare ``name: <name>``.

The shipped profiles are the repository's top-level ``profiles/`` folder; a wheel
carries it as ``autoplan/_profiles`` (see ``setup.py``).

Examples
--------
>>> from autoplan.hardware.profiles import load_profile
>>> p = load_profile("a100-sxm4-80gb")
>>> p.device.peak_flops_per_s["bf16"]
312000000000000.0
>>> p.node.devices_per_node, p.node.bw_unidir_bytes_per_s
(8, 300000000000.0)
"""

from __future__ import annotations

import bisect
import difflib
import enum
import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from ..errors import ConfigError, ProfileError, UnknownProfileError
from ..records import Record

__all__ = [
    "DTYPES",
    "DTYPE_FALLBACK",
    "COLLECTIVE_OPS",
    "IntraNodeTopology",
    "NetworkTopology",
    "EfficiencyTable",
    "DeviceType",
    "CollectiveEfficiency",
    "MeshLink",
    "NodeSpec",
    "NetworkSpec",
    "Profile",
    "NodeGroup",
    "SiteLink",
    "CompositeProfile",
    "PROFILES_ENV",
    "HOME_ENV",
    "shipped_profiles_dir",
    "user_profiles_dir",
    "profile_dirs",
    "available_profiles",
    "find_profile_file",
    "load_profile",
    "parse_profile",
    "profile_to_yaml",
]

#: Numeric formats a device may list a peak for.
DTYPES: tuple[str, ...] = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")

#: What a matmul in one dtype runs as on a device that lacks it: TF32 mode on a
#: device without TF32 units (V100, CPU) computes in FP32; a device without BF16
#: units (V100) trains in FP16 instead.
DTYPE_FALLBACK: dict[str, str] = {"tf32": "fp32", "bf16": "fp16"}

#: Operations a :class:`CollectiveEfficiency` gives a figure for.
COLLECTIVE_OPS: tuple[str, ...] = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")

#: Environment variable naming extra profile folders (``os.pathsep``-separated).
PROFILES_ENV = "AUTOPLAN_PROFILES"

#: Environment variable naming the user's autoplan folder (default ``~/.autoplan``);
#: its ``profiles/`` subfolder holds the profiles the user wrote or measured.
HOME_ENV = "AUTOPLAN_HOME"

_DEFAULT_TABLE_KEY = "default"


class IntraNodeTopology(str, enum.Enum):
    """How the devices of one node are connected to each other.

    ``nvswitch``, ``pcie``, ``shared_memory`` and ``uniform`` are *switched*:
    every pair of devices gets the per-device bandwidth.  ``hybrid_cube_mesh``
    (DGX-1) is a *mesh*: only listed pairs are linked, with the listed
    bandwidth; other pairs route through an intermediate device.
    """

    NVSWITCH = "nvswitch"
    HYBRID_CUBE_MESH = "hybrid_cube_mesh"
    PCIE = "pcie"
    SHARED_MEMORY = "shared_memory"
    UNIFORM = "uniform"

    @property
    def is_mesh(self) -> bool:
        return self is IntraNodeTopology.HYBRID_CUBE_MESH


class NetworkTopology(str, enum.Enum):
    """The inter-node network.  ``rail_optimized``: NIC *i* of every node on leaf *i*."""

    FAT_TREE = "fat_tree"
    RAIL_OPTIMIZED = "rail_optimized"
    SINGLE_SWITCH = "single_switch"


# --------------------------------------------------------------------------- records


def _require(ok: bool, field_name: str, message: str) -> None:
    """Raise the error a record constructor gives for an impossible value."""
    if not ok:
        exc = ProfileError(message, path=field_name)
        exc.detail = message  # type: ignore[attr-defined]  # the message without the path
        raise exc


def _finite_positive(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _finite_nonnegative(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _is_fraction(value: float) -> bool:
    return _finite_positive(value) and value <= 1


@dataclass(frozen=True)
class EfficiencyTable(Record):
    """Achievable fraction of peak FLOP/s as a function of matmul size.

    Parameters
    ----------
    points : tuple of (float, float)
        ``(flops, efficiency)`` pairs: FLOPs of one matmul (``2*m*n*k``),
        strictly increasing, and the achieved fraction of peak in (0, 1].
    source : str
        Where the points come from (measurement, fit, estimate).

    Examples
    --------
    >>> t = EfficiencyTable(((1e9, 0.2), (1e11, 0.8)), source="example")
    >>> t.efficiency(1e10)  # halfway in log-size
    0.5
    >>> t.efficiency(1e6), t.efficiency(1e14)  # clamped at the ends
    (0.2, 0.8)
    """

    points: tuple[tuple[float, float], ...]
    source: str

    def __post_init__(self) -> None:
        _require(len(self.points) >= 1, "points", "expected at least one (flops, efficiency) point")
        for i, (flops, eff) in enumerate(self.points):
            _require(_finite_positive(flops), f"points[{i}][0]",
                     f"expected matmul FLOPs > 0, got {flops!r}")
            _require(_is_fraction(eff), f"points[{i}][1]",
                     f"expected an efficiency in (0, 1], got {eff!r}")
            if i:
                _require(flops > self.points[i - 1][0], f"points[{i}][0]",
                         f"expected FLOPs strictly increasing, got {flops!r} after "
                         f"{self.points[i - 1][0]!r}")
        _require(bool(self.source.strip()), "source", "expected a non-empty source")

    def efficiency(self, flops: float) -> float:
        """Efficiency at ``flops`` FLOPs per matmul: linear in log10(flops), clamped."""
        if not _finite_positive(flops):
            raise ConfigError(f"matmul FLOPs must be a finite number > 0, got {flops!r}")
        xs = [p[0] for p in self.points]
        i = bisect.bisect_left(xs, flops)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        w = (math.log10(flops) - math.log10(x0)) / (math.log10(x1) - math.log10(x0))
        return y0 + w * (y1 - y0)


@dataclass(frozen=True)
class DeviceType(Record):
    """One accelerator (or CPU) kind.

    Parameters
    ----------
    name : str
        E.g. ``"A100-SXM4-80GB"``.
    peak_flops_per_s : dict of str to float
        Dense peak FLOP/s per dtype (keys from :data:`DTYPES`).  A dtype the
        device lacks is absent; see :meth:`resolve_dtype`.
    memory_bytes : int
        Device memory capacity.
    memory_bw_bytes_per_s : float
        Device memory bandwidth.
    matmul_efficiency : dict of str to EfficiencyTable
        Achievable fraction of peak vs matmul size, per dtype, or under the key
        ``"default"`` for every dtype without its own table.
    source : str
        Where the peak, memory and bandwidth figures come from.
    """

    name: str
    peak_flops_per_s: dict[str, float]
    memory_bytes: int
    memory_bw_bytes_per_s: float
    matmul_efficiency: dict[str, EfficiencyTable]
    source: str

    def __post_init__(self) -> None:
        _require(bool(self.name.strip()), "name", "expected a non-empty device name")
        _require(bool(self.peak_flops_per_s), "peak_flops_per_s", "expected at least one dtype")
        for dtype, flops in self.peak_flops_per_s.items():
            _require(dtype in DTYPES, f"peak_flops_per_s.{dtype}",
                     f"unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
            _require(_finite_positive(flops), f"peak_flops_per_s.{dtype}",
                     f"expected a peak FLOP/s > 0, got {flops!r}")
        _require(isinstance(self.memory_bytes, int) and self.memory_bytes > 0, "memory_bytes",
                 f"expected a memory capacity > 0 bytes, got {self.memory_bytes!r}")
        _require(_finite_positive(self.memory_bw_bytes_per_s), "memory_bw_bytes_per_s",
                 f"expected a memory bandwidth > 0, got {self.memory_bw_bytes_per_s!r}")
        for key in self.matmul_efficiency:
            _require(key in DTYPES or key == _DEFAULT_TABLE_KEY, f"matmul_efficiency.{key}",
                     f"unknown key {key!r}; expected a dtype {list(DTYPES)} or "
                     f"{_DEFAULT_TABLE_KEY!r}")
        for dtype in self.peak_flops_per_s:
            _require(dtype in self.matmul_efficiency or _DEFAULT_TABLE_KEY in self.matmul_efficiency,
                     "matmul_efficiency",
                     f"no efficiency table for dtype {dtype!r}: add a {dtype!r} or "
                     f"{_DEFAULT_TABLE_KEY!r} table")
        _require(bool(self.source.strip()), "source", "expected a non-empty source")

    def resolve_dtype(self, dtype: str) -> str:
        """The dtype a matmul requested in ``dtype`` runs in on this device.

        ``dtype`` itself when the device has a peak for it, else its
        :data:`DTYPE_FALLBACK` (``tf32 -> fp32``, ``bf16 -> fp16``).

        Raises
        ------
        ConfigError
            When neither is available; the message lists the device's dtypes.
        """
        if dtype in self.peak_flops_per_s:
            return dtype
        fallback = DTYPE_FALLBACK.get(dtype)
        if fallback in self.peak_flops_per_s:
            return fallback
        raise ConfigError(f"device {self.name!r} has no {dtype!r} peak (and no fallback); "
                          f"it supports {sorted(self.peak_flops_per_s)}")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (after :meth:`resolve_dtype`)."""
        return self.peak_flops_per_s[self.resolve_dtype(dtype)]

    def efficiency(self, flops: float, dtype: str) -> float:
        """Achievable fraction of peak for one matmul of ``flops`` FLOPs in ``dtype``."""
        resolved = self.resolve_dtype(dtype)
        table = self.matmul_efficiency.get(resolved) or self.matmul_efficiency[_DEFAULT_TABLE_KEY]
        return table.efficiency(flops)

    def achieved_flops_per_s(self, flops: float, dtype: str) -> float:
        """Achieved FLOP/s for one matmul of ``flops`` FLOPs: peak times efficiency."""
        return self.peak(dtype) * self.efficiency(flops, dtype)

    def matmul_time_s(self, flops: float, dtype: str) -> float:
        """Seconds for one matmul of ``flops`` FLOPs in ``dtype``."""
        return flops / self.achieved_flops_per_s(flops, dtype)


@dataclass(frozen=True)
class CollectiveEfficiency(Record):
    """Achievable fraction of link bandwidth per collective operation.

    Each field is the bus bandwidth a collective reaches (NCCL's "busbw")
    divided by the raw link bandwidth it runs over, in (0, 1].
    """

    all_reduce: float
    all_gather: float
    reduce_scatter: float
    all_to_all: float
    broadcast: float
    p2p: float
    source: str

    def __post_init__(self) -> None:
        for op in COLLECTIVE_OPS:
            value = getattr(self, op)
            _require(_is_fraction(value), op, f"expected an efficiency in (0, 1], got {value!r}")
        _require(bool(self.source.strip()), "source", "expected a non-empty source")

    def of(self, op: str) -> float:
        """The efficiency of ``op`` (one of :data:`COLLECTIVE_OPS`)."""
        if op not in COLLECTIVE_OPS:
            raise ConfigError(f"unknown collective {op!r}; expected one of {list(COLLECTIVE_OPS)}")
        return float(getattr(self, op))

    @classmethod
    def uniform(cls, value: float, source: str) -> "CollectiveEfficiency":
        """The same efficiency for every operation (``1.0``: the raw link)."""
        return cls(**{op: value for op in COLLECTIVE_OPS}, source=source)


@dataclass(frozen=True)
class MeshLink(Record):
    """A direct link between two local devices of a mesh node (e.g. 2 NVLinks)."""

    devices: tuple[int, int]
    bw_unidir_bytes_per_s: float

    def __post_init__(self) -> None:
        a, b = self.devices
        _require(a != b, "devices", f"expected two different local devices, got {list(self.devices)}")
        _require(min(a, b) >= 0, "devices", f"expected local device indices >= 0, got {list(self.devices)}")
        _require(_finite_positive(self.bw_unidir_bytes_per_s), "bw_unidir_bytes_per_s",
                 f"expected a bandwidth > 0, got {self.bw_unidir_bytes_per_s!r}")


@dataclass(frozen=True)
class NodeSpec(Record):
    """The fabric inside one node.

    Parameters
    ----------
    devices_per_node : int
    topology : IntraNodeTopology
    bw_unidir_bytes_per_s : float
        Per device, one direction: what one device can send to the others at
        once (A100 NVLink3: 600 GB/s bidirectional = 300 GB/s each way).
    latency_s : float
        Per-hop latency of one transfer step.
    collective_efficiency : CollectiveEfficiency
        Achievable fraction of ``bw_unidir_bytes_per_s`` per operation.
    source, latency_source : str
        Where the bandwidth and the latency come from.
    links : tuple of MeshLink
        Only for mesh topologies: the direct links.  A device's links may sum
        to at most ``bw_unidir_bytes_per_s``.
    """

    devices_per_node: int
    topology: IntraNodeTopology
    bw_unidir_bytes_per_s: float
    latency_s: float
    collective_efficiency: CollectiveEfficiency
    source: str
    latency_source: str
    links: tuple[MeshLink, ...] = ()

    def __post_init__(self) -> None:
        _require(isinstance(self.devices_per_node, int) and self.devices_per_node >= 1,
                 "devices_per_node", f"expected an integer >= 1, got {self.devices_per_node!r}")
        _require(_finite_positive(self.bw_unidir_bytes_per_s), "bw_unidir_bytes_per_s",
                 f"expected a bandwidth > 0, got {self.bw_unidir_bytes_per_s!r}")
        _require(_finite_nonnegative(self.latency_s), "latency_s",
                 f"expected a latency >= 0, got {self.latency_s!r}")
        _require(bool(self.source.strip()), "source", "expected a non-empty source")
        _require(bool(self.latency_source.strip()), "latency_source", "expected a non-empty source")
        if not self.topology.is_mesh:
            _require(not self.links, "links",
                     f"links are only for mesh topologies, not {self.topology.value!r}")
            return
        _require(bool(self.links) or self.devices_per_node == 1, "links",
                 f"topology {self.topology.value!r} needs the list of direct links")
        seen: set[frozenset[int]] = set()
        per_device = [0.0] * self.devices_per_node
        for i, link in enumerate(self.links):
            a, b = link.devices
            _require(max(a, b) < self.devices_per_node, f"links[{i}].devices",
                     f"expected local devices < {self.devices_per_node}, got {list(link.devices)}")
            pair = frozenset((a, b))
            _require(pair not in seen, f"links[{i}].devices", f"duplicate link {sorted(pair)}")
            seen.add(pair)
            per_device[a] += link.bw_unidir_bytes_per_s
            per_device[b] += link.bw_unidir_bytes_per_s
        for dev, total in enumerate(per_device):
            _require(total <= self.bw_unidir_bytes_per_s * (1 + 1e-12), "links",
                     f"device {dev}'s links sum to {total:.6g} B/s, more than the per-device "
                     f"bandwidth {self.bw_unidir_bytes_per_s:.6g} B/s")

    def link_bw_bytes_per_s(self, a: int, b: int) -> float:
        """Direct bandwidth between local devices ``a`` and ``b`` (0.0 when not linked).

        Switched topologies link every pair at :attr:`bw_unidir_bytes_per_s`.
        """
        if a == b:
            raise ConfigError(f"no link from local device {a} to itself")
        if not self.topology.is_mesh:
            return self.bw_unidir_bytes_per_s
        return _mesh_matrix(self.links).get((min(a, b), max(a, b)), 0.0)


@lru_cache(maxsize=64)
def _mesh_matrix(links: tuple[MeshLink, ...]) -> dict[tuple[int, int], float]:
    return {(min(l.devices), max(l.devices)): l.bw_unidir_bytes_per_s for l in links}


@dataclass(frozen=True)
class NetworkSpec(Record):
    """The network between nodes, seen from one node.

    Parameters
    ----------
    nics_per_node : int
    bw_per_nic_bytes_per_s : float
        One NIC, one direction (HDR InfiniBand: 200 Gb/s = 25e9 B/s).
    latency_s : float
        End-to-end latency of one message between two nodes.
    topology : NetworkTopology
    oversubscription : float
        >= 1; the NIC bandwidth a node can use under full load is divided by it.
    collective_efficiency : CollectiveEfficiency
    source, latency_source : str
    """

    nics_per_node: int
    bw_per_nic_bytes_per_s: float
    latency_s: float
    topology: NetworkTopology
    oversubscription: float
    collective_efficiency: CollectiveEfficiency
    source: str
    latency_source: str

    def __post_init__(self) -> None:
        _require(isinstance(self.nics_per_node, int) and self.nics_per_node >= 1, "nics_per_node",
                 f"expected an integer >= 1, got {self.nics_per_node!r}")
        _require(_finite_positive(self.bw_per_nic_bytes_per_s), "bw_per_nic_bytes_per_s",
                 f"expected a bandwidth > 0, got {self.bw_per_nic_bytes_per_s!r}")
        _require(_finite_nonnegative(self.latency_s), "latency_s",
                 f"expected a latency >= 0, got {self.latency_s!r}")
        _require(isinstance(self.oversubscription, (int, float)) and math.isfinite(self.oversubscription)
                 and self.oversubscription >= 1, "oversubscription",
                 f"expected a ratio >= 1 (1 = non-blocking), got {self.oversubscription!r}")
        _require(bool(self.source.strip()), "source", "expected a non-empty source")
        _require(bool(self.latency_source.strip()), "latency_source", "expected a non-empty source")

    @property
    def bw_per_node_bytes_per_s(self) -> float:
        """All NICs of a node, one direction, before oversubscription."""
        return self.nics_per_node * self.bw_per_nic_bytes_per_s

    @property
    def effective_bw_per_node_bytes_per_s(self) -> float:
        """All NICs of a node under full load: divided by the oversubscription."""
        return self.bw_per_node_bytes_per_s / self.oversubscription


@dataclass(frozen=True)
class Profile(Record):
    """One node kind: device type, intra-node fabric and (optionally) network.

    A profile without ``network`` (e.g. a measured single machine) can only
    form one-node clusters.
    """

    name: str
    description: str
    device: DeviceType
    node: NodeSpec
    network: NetworkSpec | None = None

    def __post_init__(self) -> None:
        _require(bool(_NAME_RE.fullmatch(self.name)), "name",
                 f"expected a profile name of lowercase letters, digits, '-', '_' and '.', "
                 f"got {self.name!r}")


@dataclass(frozen=True)
class NodeGroup(Record):
    """``nodes`` nodes of one profile at one site.

    ``profile`` is a profile name, a path to a profile file, or a
    :class:`Profile`; a :class:`~autoplan.hardware.cluster.Cluster` always
    holds the :class:`Profile` itself.
    """

    profile: str | Profile
    nodes: int
    site: str = "site0"

    def __post_init__(self) -> None:
        _require(isinstance(self.nodes, int) and self.nodes >= 1, "nodes",
                 f"expected a node count >= 1, got {self.nodes!r}")
        _require(bool(self.site.strip()), "site", "expected a non-empty site name")

    @property
    def profile_name(self) -> str:
        return self.profile.name if isinstance(self.profile, Profile) else self.profile


@dataclass(frozen=True)
class SiteLink(Record):
    """The link between two sites: aggregate bandwidth (one direction) and latency.

    All traffic between the two sites shares it.
    """

    sites: tuple[str, str]
    bw_bytes_per_s: float
    latency_s: float
    collective_efficiency: CollectiveEfficiency
    source: str

    def __post_init__(self) -> None:
        _require(self.sites[0] != self.sites[1], "sites",
                 f"expected two different sites, got {list(self.sites)}")
        _require(_finite_positive(self.bw_bytes_per_s), "bw_bytes_per_s",
                 f"expected a bandwidth > 0, got {self.bw_bytes_per_s!r}")
        _require(_finite_nonnegative(self.latency_s), "latency_s",
                 f"expected a latency >= 0, got {self.latency_s!r}")
        _require(bool(self.source.strip()), "source", "expected a non-empty source")


@dataclass(frozen=True)
class CompositeProfile(Record):
    """A heterogeneous cluster: node groups (by profile name) and site links."""

    name: str
    description: str
    groups: tuple[NodeGroup, ...]
    site_links: tuple[SiteLink, ...] = ()

    def __post_init__(self) -> None:
        _require(bool(_NAME_RE.fullmatch(self.name)), "name",
                 f"expected a profile name of lowercase letters, digits, '-', '_' and '.', "
                 f"got {self.name!r}")
        _require(bool(self.groups), "groups", "expected at least one node group")

    @property
    def total_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)


_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")

# --------------------------------------------------------------------------- YAML schema

# Unit suffixes accepted per quantity, with the factor to SI.  The SI spelling
# comes first: profile_to_yaml writes it, so a dump reloads exactly.
_BYTES = {"bytes": 1, "GiB": 2**30, "GB": 10**9, "MiB": 2**20}
_BW_BYTES = {"bytes_per_s": 1.0, "GBps": 1e9, "TBps": 1e12, "Gbps": 1e9 / 8}
_BW_BITS = {"bytes_per_s": 1.0, "Gbps": 1e9 / 8, "GBps": 1e9}
_LATENCY = {"s": 1.0, "us": 1e-6, "ms": 1e-3}
_FLOPS = {"flops_per_s": 1.0, "TFLOPs_per_s": 1e12}


class _YamlLoader(yaml.SafeLoader):
    """Safe loader that reads ``1e9`` as a float (YAML 1.2) and rejects duplicate keys."""


_YamlLoader.yaml_implicit_resolvers = {
    k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    keys = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in keys:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        keys.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _Section:
    """One YAML mapping being read: tracks the keys used, names paths in errors."""

    def __init__(self, data: Any, file: str | None, path: str, what: str) -> None:
        if not isinstance(data, dict):
            raise ProfileError(f"expected a mapping ({what}), got {_describe(data)}",
                               file=file, path=path)
        self.data, self.file, self.path, self.what = data, file, path, what
        self.allowed: list[str] = []

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, message: str) -> ProfileError:
        return ProfileError(message, file=self.file, path=self.at(key))

    def _get(self, key: str, what: str, required: bool) -> Any:
        self.allowed.append(key)
        if key not in self.data:
            if required:
                raise self.error(key, f"missing key {key!r}: expected {what}")
            return None
        return self.data[key]

    def text(self, key: str, what: str, *, required: bool = True) -> str | None:
        value = self._get(key, what, required)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"expected {what} (a non-empty string), got {_describe(value)}")
        return value

    def integer(self, key: str, what: str, *, minimum: int = 1) -> int:
        value = self._get(key, what, True)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key, f"expected {what}: an integer >= {minimum}, got {_describe(value)}")
        return value

    def number(self, key: str, what: str, check: Callable[[float], bool], expectation: str,
               *, required: bool = True, value: Any = None) -> float | None:
        if value is None:
            value = self._get(key, what, required)
            if value is None and not required:
                return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected {what}: a number {expectation}, got {_describe(value)}")
        if not math.isfinite(value) or not check(value):
            raise self.error(key, f"expected {what}: a number {expectation}, got {value!r}")
        return float(value)

    def quantity(self, base: str, units: Mapping[str, float], what: str,
                 check: Callable[[float], bool], expectation: str) -> float:
        """Exactly one of ``<base>_<unit>`` for the units given; returns SI."""
        keys = [f"{base}_{u}" for u in units]
        self.allowed.extend(keys)
        present = [k for k in keys if k in self.data]
        if not present:
            raise self.error(keys[-1] if len(keys) == 1 else base,
                             f"missing key: expected {what} as one of {keys}")
        if len(present) > 1:
            raise self.error(present[1], f"{what} is given twice ({present}); keep one")
        key = present[0]
        raw = self.number(key, what, check, expectation, value=self.data[key])
        assert raw is not None
        return raw * units[key[len(base) + 1:]]

    def mapping(self, key: str, what: str, *, required: bool = True) -> "_Section | None":
        value = self._get(key, what, required)
        if value is None and not required:
            return None
        return _Section(value, self.file, self.at(key), what)

    def listing(self, key: str, what: str, *, required: bool = True) -> list[Any]:
        value = self._get(key, what, required)
        if value is None and not required:
            return []
        if not isinstance(value, list):
            raise self.error(key, f"expected {what} (a list), got {_describe(value)}")
        return value

    def choice(self, key: str, enum_cls: type[enum.Enum], what: str) -> Any:
        value = self._get(key, what, True)
        options = [m.value for m in enum_cls]
        if value not in options:
            raise self.error(key, f"expected {what}: one of {options}, got {_describe(value)}")
        return enum_cls(value)

    def finish(self) -> None:
        unknown = sorted(str(k) for k in set(self.data) - set(self.allowed))
        if unknown:
            raise self.error(unknown[0], f"unknown key(s) {unknown} in {self.what}; "
                                         f"expected keys {sorted(set(self.allowed))}")


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__}"
    return f"{value!r}"


def _positive(x: float) -> bool:
    return x > 0


def _nonnegative(x: float) -> bool:
    return x >= 0


def _fraction(x: float) -> bool:
    return 0 < x <= 1


def _build(cls: type, section: _Section, **kwargs: Any) -> Any:
    """Construct a record; a constructor check failing becomes a ProfileError at the section."""
    try:
        return cls(**kwargs)
    except ProfileError as exc:
        raise ProfileError(getattr(exc, "detail", str(exc)), file=section.file,
                           path=section.at(exc.path) if exc.path else section.path) from None


def _parse_efficiency_table(sec: _Section) -> EfficiencyTable:
    raw = sec.listing("points", "[flops_per_matmul, efficiency] pairs")
    points = []
    for i, pair in enumerate(raw):
        where = f"points[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise sec.error(where, f"expected a pair [flops_per_matmul, efficiency], got {_describe(pair)}")
        flops = sec.number(where, "matmul FLOPs", _positive, "> 0", value=pair[0])
        eff = sec.number(where, "efficiency", _fraction, "in (0, 1]", value=pair[1])
        points.append((flops, eff))
    source = sec.text("source", "where the efficiencies come from")
    sec.finish()
    return _build(EfficiencyTable, sec, points=tuple(points), source=source)


def _parse_device(sec: _Section) -> DeviceType:
    name = sec.text("name", "the device name")
    peaks_key = [k for k in (f"peak_{u}" for u in _FLOPS) if k in sec.data]
    sec.allowed.extend(f"peak_{u}" for u in _FLOPS)
    if len(peaks_key) != 1:
        raise sec.error("peak", f"expected exactly one of {[f'peak_{u}' for u in _FLOPS]} "
                                f"(dense peak per dtype), found {peaks_key or 'none'}")
    peaks_sec = _Section(sec.data[peaks_key[0]], sec.file, sec.at(peaks_key[0]),
                         "peak FLOP/s per dtype")
    factor = _FLOPS[peaks_key[0][len("peak_"):]]
    peaks = {}
    for dtype in DTYPES:
        value = peaks_sec.number(dtype, f"the {dtype} peak", _positive, "> 0", required=False)
        if value is not None:
            peaks[dtype] = value * factor
    peaks_sec.finish()
    if not peaks:
        raise sec.error(peaks_key[0], f"expected a peak for at least one dtype of {list(DTYPES)}")
    memory = sec.quantity("memory", _BYTES, "the memory capacity", _positive, "> 0")
    memory_bw = sec.quantity("memory_bw", _BW_BYTES, "the memory bandwidth", _positive, "> 0")
    tables_sec = sec.mapping("matmul_efficiency", "efficiency tables per dtype or 'default'")
    assert tables_sec is not None
    tables = {}
    for key in [*DTYPES, _DEFAULT_TABLE_KEY]:
        table_sec = tables_sec.mapping(key, "an efficiency table", required=False)
        if table_sec is not None:
            tables[key] = _parse_efficiency_table(table_sec)
    tables_sec.finish()
    source = sec.text("source", "where the peak, memory and bandwidth figures come from")
    sec.finish()
    return _build(DeviceType, sec, name=name, peak_flops_per_s=peaks, memory_bytes=int(round(memory)),
                  memory_bw_bytes_per_s=memory_bw, matmul_efficiency=tables, source=source)


def _parse_collective_efficiency(sec: _Section) -> CollectiveEfficiency:
    values = {op: sec.number(op, f"the {op} efficiency", _fraction, "in (0, 1]")
              for op in COLLECTIVE_OPS}
    source = sec.text("source", "where the efficiencies come from")
    sec.finish()
    return _build(CollectiveEfficiency, sec, **values, source=source)


_INTRA_BW = {"bw_unidir_bytes_per_s": 1.0, "bw_unidir_GBps": 1e9, "bw_bidir_GBps": 0.5e9}


def _intra_bw(sec: _Section, what: str) -> float:
    # Bidirectional figures (datasheets quote those) are halved: one direction.
    sec.allowed.extend(_INTRA_BW)
    present = [k for k in _INTRA_BW if k in sec.data]
    if len(present) != 1:
        raise sec.error("bw", f"expected {what} as exactly one of {list(_INTRA_BW)}, "
                              f"found {present or 'none'}")
    key = present[0]
    value = sec.number(key, what, _positive, "> 0", value=sec.data[key])
    assert value is not None
    return value * _INTRA_BW[key]


def _parse_node(sec: _Section) -> NodeSpec:
    devices = sec.integer("devices_per_node", "the number of devices per node")
    topology = sec.choice("topology", IntraNodeTopology, "the intra-node topology")
    bw = _intra_bw(sec, "the per-device intra-node bandwidth")
    latency = sec.quantity("latency", _LATENCY, "the per-hop intra-node latency",
                           _nonnegative, ">= 0")
    eff_sec = sec.mapping("collective_efficiency", "collective efficiency per operation")
    assert eff_sec is not None
    efficiency = _parse_collective_efficiency(eff_sec)
    links = []
    for i, raw in enumerate(sec.listing("links", "direct links (mesh topologies)", required=False)):
        link_sec = _Section(raw, sec.file, f"{sec.at('links')}[{i}]", "a mesh link")
        pair = link_sec.listing("devices", "two local device indices")
        if len(pair) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) for d in pair):
            raise link_sec.error("devices", f"expected two local device indices, got {pair!r}")
        link_bw = _intra_bw(link_sec, "the link bandwidth")
        link_sec.finish()
        links.append(_build(MeshLink, link_sec, devices=(pair[0], pair[1]),
                            bw_unidir_bytes_per_s=link_bw))
    source = sec.text("source", "where the topology and bandwidth come from")
    latency_source = sec.text("latency_source", "where the latency comes from")
    sec.finish()
    return _build(NodeSpec, sec, devices_per_node=devices, topology=topology,
                  bw_unidir_bytes_per_s=bw, latency_s=latency, collective_efficiency=efficiency,
                  source=source, latency_source=latency_source, links=tuple(links))


def _parse_network(sec: _Section) -> NetworkSpec:
    nics = sec.integer("nics_per_node", "the number of NICs per node")
    bw = sec.quantity("bw_per_nic", _BW_BITS, "the bandwidth of one NIC (one direction)",
                      _positive, "> 0")
    latency = sec.quantity("latency", _LATENCY, "the inter-node latency", _nonnegative, ">= 0")
    topology = sec.choice("topology", NetworkTopology, "the network topology")
    oversub = sec.number("oversubscription", "the oversubscription ratio", lambda x: x >= 1,
                         ">= 1 (1 = non-blocking)")
    eff_sec = sec.mapping("collective_efficiency", "collective efficiency per operation")
    assert eff_sec is not None
    efficiency = _parse_collective_efficiency(eff_sec)
    source = sec.text("source", "where the NIC figures come from")
    latency_source = sec.text("latency_source", "where the latency comes from")
    sec.finish()
    return _build(NetworkSpec, sec, nics_per_node=nics, bw_per_nic_bytes_per_s=bw,
                  latency_s=latency, topology=topology, oversubscription=oversub,
                  collective_efficiency=efficiency, source=source, latency_source=latency_source)


def _parse_site_link(sec: _Section) -> SiteLink:
    sites = sec.listing("sites", "the two site names")
    if len(sites) != 2 or not all(isinstance(s, str) and s.strip() for s in sites):
        raise sec.error("sites", f"expected two site names, got {sites!r}")
    bw = sec.quantity("bw", _BW_BITS, "the link bandwidth (one direction)", _positive, "> 0")
    latency = sec.quantity("latency", _LATENCY, "the link latency", _nonnegative, ">= 0")
    eff_sec = sec.mapping("collective_efficiency", "collective efficiency per operation")
    assert eff_sec is not None
    efficiency = _parse_collective_efficiency(eff_sec)
    source = sec.text("source", "where the link figures come from")
    sec.finish()
    return _build(SiteLink, sec, sites=(sites[0], sites[1]), bw_bytes_per_s=bw, latency_s=latency,
                  collective_efficiency=efficiency, source=source)


def parse_profile(data: Any, file: str | None = None) -> Profile | CompositeProfile:
    """Build a profile from parsed YAML ``data`` (``file`` only names it in errors).

    Raises
    ------
    ProfileError
        Naming ``file``, the field path and what was expected.
    """
    top = _Section(data, file, "", "a profile")
    kind = top.text("kind", "'node' or 'composite'")
    if kind not in ("node", "composite"):
        raise top.error("kind", f"expected 'node' or 'composite', got {kind!r}")
    name = top.text("name", "the profile name")
    description = top.text("description", "a one-line description")
    if kind == "node":
        device_sec = top.mapping("device", "the device type")
        node_sec = top.mapping("node", "the intra-node fabric")
        network_sec = top.mapping("network", "the inter-node network", required=False)
        assert device_sec is not None and node_sec is not None
        device = _parse_device(device_sec)
        node = _parse_node(node_sec)
        network = _parse_network(network_sec) if network_sec is not None else None
        top.finish()
        return _build(Profile, top, name=name, description=description, device=device,
                      node=node, network=network)
    groups = []
    for i, raw in enumerate(top.listing("groups", "node groups")):
        sec = _Section(raw, file, f"groups[{i}]", "a node group")
        profile = sec.text("profile", "a profile name")
        nodes = sec.integer("nodes", "the number of nodes")
        site = sec.text("site", "a site name")
        sec.finish()
        groups.append(_build(NodeGroup, sec, profile=profile, nodes=nodes, site=site))
    links = [_parse_site_link(_Section(raw, file, f"site_links[{i}]", "a site link"))
             for i, raw in enumerate(top.listing("site_links", "links between sites", required=False))]
    top.finish()
    return _build(CompositeProfile, top, name=name, description=description,
                  groups=tuple(groups), site_links=tuple(links))


# --------------------------------------------------------------------------- dumping


class _Dumper(yaml.SafeDumper):
    """Writes short lists of numbers (``[flops, efficiency]``, ``devices``) on one line."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(isinstance(x, (int, float, str)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _represent_list)


def _collective_efficiency_yaml(eff: CollectiveEfficiency) -> dict[str, Any]:
    return {**{op: getattr(eff, op) for op in COLLECTIVE_OPS}, "source": eff.source}


def profile_to_yaml(profile: Profile | CompositeProfile) -> str:
    """YAML text for ``profile`` in SI-suffixed keys; :func:`parse_profile` reads it back exactly."""
    if isinstance(profile, CompositeProfile):
        data: dict[str, Any] = {
            "kind": "composite", "name": profile.name, "description": profile.description,
            "groups": [{"profile": g.profile_name, "nodes": g.nodes, "site": g.site}
                       for g in profile.groups],
            "site_links": [{"sites": list(l.sites), "bw_bytes_per_s": l.bw_bytes_per_s,
                            "latency_s": l.latency_s,
                            "collective_efficiency": _collective_efficiency_yaml(l.collective_efficiency),
                            "source": l.source} for l in profile.site_links],
        }
        return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100)
    d, n, w = profile.device, profile.node, profile.network
    device = {
        "name": d.name,
        "peak_flops_per_s": {k: d.peak_flops_per_s[k] for k in DTYPES if k in d.peak_flops_per_s},
        "memory_bytes": d.memory_bytes,
        "memory_bw_bytes_per_s": d.memory_bw_bytes_per_s,
        "matmul_efficiency": {k: {"points": [list(p) for p in t.points], "source": t.source}
                              for k, t in d.matmul_efficiency.items()},
        "source": d.source,
    }
    node: dict[str, Any] = {
        "devices_per_node": n.devices_per_node, "topology": n.topology.value,
        "bw_unidir_bytes_per_s": n.bw_unidir_bytes_per_s, "latency_s": n.latency_s,
        "collective_efficiency": _collective_efficiency_yaml(n.collective_efficiency),
        "source": n.source, "latency_source": n.latency_source,
    }
    if n.links:
        node["links"] = [{"devices": list(l.devices), "bw_unidir_bytes_per_s": l.bw_unidir_bytes_per_s}
                         for l in n.links]
    data = {"kind": "node", "name": profile.name, "description": profile.description,
            "device": device, "node": node}
    if w is not None:
        data["network"] = {
            "nics_per_node": w.nics_per_node, "bw_per_nic_bytes_per_s": w.bw_per_nic_bytes_per_s,
            "latency_s": w.latency_s, "topology": w.topology.value,
            "oversubscription": w.oversubscription,
            "collective_efficiency": _collective_efficiency_yaml(w.collective_efficiency),
            "source": w.source, "latency_source": w.latency_source,
        }
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100)


# --------------------------------------------------------------------------- discovery


def shipped_profiles_dir() -> Path:
    """The shipped profiles: ``autoplan/_profiles`` in an installed wheel, else the
    checkout's top-level ``profiles/`` folder (an editable install or ``PYTHONPATH``).

    The wheel's folder is built from ``profiles/`` (``setup.py`` maps it), so the
    two are never separate copies to keep in step.
    """
    package = Path(__file__).resolve().parent.parent
    packaged = package / "_profiles"
    return packaged if packaged.is_dir() else package.parent / "profiles"


def user_profiles_dir() -> Path:
    """``$AUTOPLAN_HOME/profiles`` (default ``~/.autoplan/profiles``): the user's own profiles."""
    home = os.environ.get(HOME_ENV, "").strip()
    return (Path(home).expanduser() if home else Path.home() / ".autoplan") / "profiles"


def profile_dirs() -> list[Path]:
    """Folders searched for profiles, first match wins: ``$AUTOPLAN_PROFILES`` entries,
    the user's folder (:func:`user_profiles_dir`), then the shipped one."""
    extra = [Path(p) for p in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if p.strip()]
    return [*extra, user_profiles_dir(), shipped_profiles_dir()]


def _profile_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for directory in profile_dirs():
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.suffix in (".yaml", ".yml") and path.is_file() and not path.name.startswith("."):
                found.setdefault(path.stem, path)
    return found


def available_profiles() -> list[str]:
    """Names of every profile that :func:`load_profile` can find, sorted."""
    return sorted(_profile_files())


def _looks_like_path(name_or_path: str | os.PathLike[str]) -> bool:
    text = os.fspath(name_or_path)
    return (isinstance(name_or_path, os.PathLike) or os.sep in text or "/" in text
            or text.endswith((".yaml", ".yml")))


def find_profile_file(name_or_path: str | os.PathLike[str]) -> Path:
    """The file of a profile given by name or by path.

    Raises
    ------
    UnknownProfileError
        For an unknown name: lists the available profiles and suggests the closest.
    ProfileError
        For a path that does not exist.
    """
    if _looks_like_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise ProfileError("no such profile file", file=str(path))
        return path
    files = _profile_files()
    name = os.fspath(name_or_path)
    if name in files:
        return files[name]
    close = difflib.get_close_matches(name, list(files), n=3, cutoff=0.4)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    searched = ", ".join(str(d) for d in profile_dirs())
    raise UnknownProfileError(
        f"unknown profile {name!r}.{hint} Available: {', '.join(sorted(files)) or '(none)'} "
        f"(searched {searched}; add folders with ${PROFILES_ENV}, or pass a path to a .yaml file)")


@lru_cache(maxsize=128)
def _load_file(path: str, mtime_ns: int, size: int) -> Profile | CompositeProfile:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read the file ({exc.strerror})", file=path) from None
    except UnicodeDecodeError as exc:
        raise ProfileError(f"not a YAML profile: byte {exc.start} is not UTF-8 text", file=path) from None
    try:
        data = yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ProfileError(f"not valid YAML{where}: {problem}", file=path) from None
    return parse_profile(data, file=path)


def load_profile(name_or_path: str | os.PathLike[str]) -> Profile | CompositeProfile:
    """Load a profile by name (see :func:`available_profiles`) or from a YAML file.

    Loaded files are cached by path, modification time and size.

    Examples
    --------
    >>> load_profile("v100-sxm2-32gb").device.resolve_dtype("bf16")
    'fp16'
    """
    path = find_profile_file(name_or_path)
    stat = path.stat()
    profile = _load_file(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if not _looks_like_path(name_or_path) and profile.name != os.fspath(name_or_path):
        raise ProfileError(f"the file is found by the name {os.fspath(name_or_path)!r} but declares "
                           f"name {profile.name!r}; rename the file or the profile",
                           file=str(path), path="name")
    return profile
