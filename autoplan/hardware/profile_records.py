"""Hardware profile records: devices, nodes, networks, composite clusters.

The device's own records (:class:`DeviceType` and what it holds) are
:mod:`.device_records`; they are re-exported here.

Every record field name carries its SI unit (bytes, bytes/s, seconds, FLOP/s);
records check their own values (:class:`~autoplan.errors.ProfileError` names the
field).  Reading and writing them as YAML is :mod:`.profile_yaml`; finding them
by name is :mod:`.profile_discovery`; :mod:`.profiles` gathers all three.
"""

from __future__ import annotations

import enum
import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, ClassVar

from ..errors import ConfigError
from ..records import Record
# the device records, re-exported: this module is where the hardware records are imported from
from .device_records import (ARCHITECTURES, DTYPE_FALLBACK, DTYPES, ELEMENTWISE_KINDS,
                             LAYOUT_KINDS, RATE_KINDS, VARIANT_TABLES, DeviceType,
                             EfficiencyTable, ElementwiseRates, OpOverhead, _finite_nonnegative,
                             _finite_positive, _is_fraction, _require, _text, cuda_architecture,
                             elementwise_kind)

__all__ = ["DTYPES", "VARIANT_TABLES", "DTYPE_FALLBACK", "ARCHITECTURES", "cuda_architecture", "COLLECTIVE_OPS", "IntraNodeTopology", "NetworkTopology",
           "EfficiencyTable", "OpOverhead", "DeviceType", "CollectiveEfficiency", "CollectiveLatency", "MeshLink", "NodeSpec",
           "NetworkSpec", "Profile", "NodeGroup", "SiteLink", "CompositeProfile",
           "ELEMENTWISE_KINDS", "LAYOUT_KINDS", "RATE_KINDS", "ElementwiseRates",
           "elementwise_kind"]

#: Operations a :class:`CollectiveEfficiency` gives a figure for.
COLLECTIVE_OPS: tuple[str, ...] = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")



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


@dataclass(frozen=True)
class _PerCollective(Record):
    """One figure per collective operation (:data:`COLLECTIVE_OPS`), with its source."""

    all_reduce: float
    all_gather: float
    reduce_scatter: float
    all_to_all: float
    broadcast: float
    p2p: float
    source: str

    #: the test every figure passes, and what it says otherwise
    _check: ClassVar[tuple[Callable[[float], bool], str]]

    def __post_init__(self) -> None:
        check, expectation = self._check
        for op in COLLECTIVE_OPS:
            value = getattr(self, op)
            _require(check(value), op, f"expected {expectation}, got {value!r}")
        _require(_text(self.source), "source", "expected a non-empty source")

    def of(self, op: str) -> float:
        """The figure of ``op`` (one of :data:`COLLECTIVE_OPS`)."""
        if op not in COLLECTIVE_OPS:
            raise ConfigError(f"unknown collective {op!r}; expected one of {list(COLLECTIVE_OPS)}")
        return float(getattr(self, op))


@dataclass(frozen=True)
class CollectiveEfficiency(_PerCollective):
    """Achievable fraction of link bandwidth per collective operation.

    Each field is the bus bandwidth a collective reaches (NCCL's "busbw")
    divided by the raw link bandwidth it runs over, in (0, 1].
    """

    _check = (_is_fraction, "an efficiency in (0, 1]")

    @classmethod
    def uniform(cls, value: float, source: str) -> "CollectiveEfficiency":
        """The same efficiency for every operation (``1.0``: the raw link)."""
        return cls(**{op: value for op in COLLECTIVE_OPS}, source=source)


@dataclass(frozen=True)
class CollectiveLatency(_PerCollective):
    """Per-step latency of each collective operation, where it differs by operation.

    A hop latency (``NodeSpec.latency_s``) prices every operation's ring steps alike:
    right for NCCL's figures, wrong for a host where the operations' fixed costs differ
    several times over (gloo on a CPU host: an all-reduce's rounds of reduction and
    hand-off cost far more than one send).  A measured profile fits ``t(S) = a + b S``
    per operation; each field here is that operation's ``a`` over its ring steps
    (:func:`~autoplan.hardware.collectives.ring_coefficients`), in seconds, >= 0.
    """

    _check = (_finite_nonnegative, "a per-step latency >= 0 in seconds")


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
    shared_cores : int or None
        CPU nodes whose devices (ranks) outnumber their cores: the cores they share.
        The device's figures are measured with every rank busy at once, so a rank
        runs faster while others wait (a pipeline's bubbles).  ``None``: each device
        computes on its own (GPUs; CPUs with a core or more per rank).
    collective_latency : CollectiveLatency or None
        Each operation's own per-step latency (measured profiles); ``None``: every
        operation steps at ``latency_s``.
    arrival_s : float
        Seconds every collective call but p2p costs more after compute than back to
        back, on top of its ring-model time: ranks that share cores (``shared_cores``)
        reach a collective a scheduler slice apart and wait for the last one to get a
        core.  Measured by ``autoplan profile`` where ranks share cores (their
        collectives are timed back to back there); 0 elsewhere.
    arrival_source : str or None
        Where ``arrival_s`` comes from (required when it is not 0).
    """

    devices_per_node: int
    topology: IntraNodeTopology
    bw_unidir_bytes_per_s: float
    latency_s: float
    collective_efficiency: CollectiveEfficiency
    source: str
    latency_source: str
    links: tuple[MeshLink, ...] = ()
    shared_cores: int | None = None
    collective_latency: CollectiveLatency | None = None
    arrival_s: float = 0.0
    arrival_source: str | None = None

    def __post_init__(self) -> None:
        _require(_finite_nonnegative(self.arrival_s), "arrival_s",
                 f"expected seconds >= 0, got {self.arrival_s!r}")
        _require(self.arrival_s == 0 or _text(self.arrival_source), "arrival_source",
                 "expected where arrival_s comes from (a non-empty source)")
        _require(isinstance(self.devices_per_node, int) and self.devices_per_node >= 1,
                 "devices_per_node", f"expected an integer >= 1, got {self.devices_per_node!r}")
        _require(self.shared_cores is None or (
                     isinstance(self.shared_cores, int) and not isinstance(self.shared_cores, bool)
                     and 1 <= self.shared_cores < self.devices_per_node), "shared_cores",
                 f"expected None or a core count from 1 to devices_per_node - 1 "
                 f"({self.devices_per_node - 1}), got {self.shared_cores!r}")
        _require(_finite_positive(self.bw_unidir_bytes_per_s), "bw_unidir_bytes_per_s",
                 f"expected a bandwidth > 0, got {self.bw_unidir_bytes_per_s!r}")
        _require(_finite_nonnegative(self.latency_s), "latency_s",
                 f"expected a latency >= 0, got {self.latency_s!r}")
        _require(_text(self.source), "source", "expected a non-empty source")
        _require(_text(self.latency_source), "latency_source", "expected a non-empty source")
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
        _require(_text(self.source), "source", "expected a non-empty source")
        _require(_text(self.latency_source), "latency_source", "expected a non-empty source")

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
    #: The node's DRAM, cores and each device's host link (:mod:`.hosts`); ``None`` in
    #: profiles that do not state them (embedding tables then stay in device memory).
    host: "HostSpec | None" = None

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(_NAME_RE.fullmatch(self.name)), "name",
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
        _require(isinstance(self.nodes, int) and not isinstance(self.nodes, bool) and self.nodes >= 1,
                 "nodes",
                 f"expected a node count >= 1, got {self.nodes!r}")
        _require(_text(self.site), "site", "expected a non-empty site name")
        _require(isinstance(self.profile, Profile) or _text(self.profile)
                 or isinstance(self.profile, os.PathLike), "profile",
                 f"expected a profile name, a path or a Profile, got {self.profile!r}")

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
        _require(isinstance(self.sites, (tuple, list)) and len(self.sites) == 2
                 and all(_text(site) for site in self.sites), "sites",
                 f"expected two site names, got {self.sites!r}")
        _require(self.sites[0] != self.sites[1], "sites",
                 f"expected two different sites, got {list(self.sites)}")
        _require(_finite_positive(self.bw_bytes_per_s), "bw_bytes_per_s",
                 f"expected a bandwidth > 0, got {self.bw_bytes_per_s!r}")
        _require(_finite_nonnegative(self.latency_s), "latency_s",
                 f"expected a latency >= 0, got {self.latency_s!r}")
        _require(_text(self.source), "source", "expected a non-empty source")


@dataclass(frozen=True)
class CompositeProfile(Record):
    """A heterogeneous cluster: node groups (by profile name) and site links."""

    name: str
    description: str
    groups: tuple[NodeGroup, ...]
    site_links: tuple[SiteLink, ...] = ()

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(_NAME_RE.fullmatch(self.name)), "name",
                 f"expected a profile name of lowercase letters, digits, '-', '_' and '.', "
                 f"got {self.name!r}")
        _require(bool(self.groups), "groups", "expected at least one node group")

    @property
    def total_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)


_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")

# the host records name NetworkSpec, _require and _NAME_RE above; Profile names HostSpec
from .hosts import HostSpec  # noqa: E402
