"""The resource view of a cluster: devices, the links between them, collective costs.

A :class:`Cluster` is a list of nodes, each of one :class:`~autoplan.hardware.profiles.Profile`
and at one site, plus the links between sites.  Devices are numbered globally
in the order group, node, local rank.

Conventions
-----------
* Bandwidths are one direction, in bytes/s; latencies in seconds.
* **Inside a node** two devices communicate over the intra-node fabric: every
  pair gets the per-device bandwidth on switched topologies (NVSwitch); on a
  mesh (DGX-1 hybrid cube-mesh) a pair gets its direct link, or the widest
  route through other devices of the node.
* **Between nodes** each device gets an equal share of its node's NICs:
  ``nics_per_node * bw_per_nic / oversubscription / devices_per_node`` (on DGX
  A100/H100 exactly its own NIC).  The latency is the network's (the larger
  of the two nodes').
* **Between sites** the site link is the extra hop; latency adds up: network
  at one end, the link, network at the other end.
* :meth:`Cluster.path` is the view of one pair: raw bandwidths, no collective
  efficiency, and the *whole* site link.
* :meth:`Cluster.collective_time` costs a collective (see
  :mod:`autoplan.hardware.collectives`) and accounts for **concurrent groups**:
  in 3-D parallel training every device is busy with an equivalent collective
  at the same time (e.g. 8 data-parallel groups, one per local rank, under
  8-way tensor parallelism).  By default (``concurrent_groups=None``) shared
  resources are split in proportion to the members: a group with ``k``
  members on a node gets ``k`` per-device NIC shares, and a group with ``K``
  of the ``D`` devices of a site gets ``K/D`` of each site link it uses.  Pass
  ``concurrent_groups=c`` to say instead that exactly ``c`` groups (this one
  included) share every NIC and site link equally: each gets ``1/c``.

Examples
--------
>>> from autoplan.hardware import load_cluster
>>> c = load_cluster("a100-sxm4-80gb", nodes=2)
>>> c.num_devices, c.path(0, 1).kind, c.path(0, 8).kind
(16, 'intra_node', 'inter_node')
>>> c.path(0, 8).bw_bytes_per_s  # one 200 Gb/s HDR NIC per GPU
25000000000.0
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any, Iterable, Sequence

import networkx as nx

from ..errors import ConfigError, ProfileError
from ..records import Record
from .collectives import (
    CollectiveOp,
    CollectiveParams,
    GroupShape,
    NodePart,
    Segment,
    SiteLinkPart,
    SitePart,
    collective_candidates,
    parse_op,
)
from .hosts import ServerProfile
from .profiles import (
    CompositeProfile,
    DeviceType,
    NodeGroup,
    NodeSpec,
    Profile,
    SiteLink,
    find_profile_file,
    load_profile,
)

__all__ = ["Device", "ClusterNode", "ServerNode", "Link", "Cluster", "as_cluster",
           "compose_cluster", "load_cluster"]

#: The kinds of :class:`Link` (and of :class:`CollectiveLevel` resources).
LINK_KINDS = ("intra_node", "inter_node", "inter_site")


@dataclass(frozen=True)
class Device(Record):
    """One device: global ``index``, its ``node`` (index into :attr:`Cluster.nodes`),
    node ``group``, ``site``, device type name and physical ``local_rank`` on its node."""

    index: int
    node: int
    group: int
    site: str
    device_type: str
    local_rank: int


@dataclass(frozen=True)
class ClusterNode(Record):
    """One node: its name, group, profile name, site and the local devices present."""

    name: str
    group: int
    profile: str
    site: str
    local_ranks: tuple[int, ...]


@dataclass(frozen=True)
class ServerNode(Record):
    """One CPU-only server node (no device): its name, :class:`ServerProfile` name and site."""

    name: str
    profile: str
    site: str


@dataclass(frozen=True)
class Link(Record):
    """The path between two devices: bottleneck bandwidth (one direction), latency, kind."""

    bw_bytes_per_s: float
    latency_s: float
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ConfigError(f"link kind must be one of {list(LINK_KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class _Index:
    devices: tuple[Device, ...]
    node_devices: tuple[tuple[int, ...], ...]
    sites: tuple[str, ...]
    site_devices: dict[str, int]


@dataclass(frozen=True)
class Cluster(Record):
    """Devices, nodes, sites and links; costs of paths and collectives.

    Build one with :func:`load_cluster` or :func:`compose_cluster`.  The record
    is frozen and round-trips through JSON (:meth:`to_json`,
    :meth:`from_json`); derived views are computed on first use and cached.

    Parameters
    ----------
    name : str
    profiles : dict of str to Profile
        Every profile a node uses, by name.
    nodes : tuple of ClusterNode
        In global order (group, node).
    site_links : tuple of SiteLink
        One link for every pair of sites.
    servers : tuple of ServerNode
        CPU-only server nodes (parameter servers) beside the devices: no layer is placed
        on them; the sparse planner (:mod:`autoplan.sparse`) may keep embedding tables
        there.  Add them with :meth:`with_servers`.
    server_profiles : dict of str to ServerProfile
        Every profile a server uses, by name.
    """

    name: str
    profiles: dict[str, Profile] = field(repr=False)
    nodes: tuple[ClusterNode, ...] = field(repr=False)
    site_links: tuple[SiteLink, ...] = field(default=(), repr=False)
    servers: tuple[ServerNode, ...] = field(default=(), repr=False)
    server_profiles: dict[str, ServerProfile] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"a cluster's name must be a string, got {self.name!r}")
        if not self.nodes:
            raise ConfigError("a cluster needs at least one node")
        for name, profile in self.profiles.items():
            if profile.name != name:
                raise ConfigError(f"profiles[{name!r}] holds profile {profile.name!r}")
        names = set()
        for i, node in enumerate(self.nodes):
            where = f"nodes[{i}] ({node.name!r})"
            if node.name in names:
                raise ConfigError(f"{where}: duplicate node name")
            names.add(node.name)
            profile = self.profiles.get(node.profile)
            if profile is None:
                raise ConfigError(f"{where}: profile {node.profile!r} is not among the cluster's "
                                  f"profiles {sorted(self.profiles)}")
            ranks = node.local_ranks
            if not ranks or list(ranks) != sorted(set(ranks)) or ranks[0] < 0 \
                    or ranks[-1] >= profile.node.devices_per_node:
                raise ConfigError(f"{where}: local_ranks must be distinct, sorted and in "
                                  f"[0, {profile.node.devices_per_node}), got {list(ranks)}")
        if len(self.nodes) > 1:
            for profile in self.profiles.values():
                if profile.network is None:
                    raise ConfigError(
                        f"profile {profile.name!r} has no 'network' section, so its nodes cannot "
                        f"talk to other nodes; use one node or add a network to the profile")
        sites = list(dict.fromkeys(node.site for node in self.nodes))
        seen: dict[frozenset[str], SiteLink] = {}
        for link in self.site_links:
            pair = frozenset(link.sites)
            for s in link.sites:
                if s not in sites:
                    raise ConfigError(f"site link {list(link.sites)} names site {s!r}, which has no "
                                      f"nodes; sites are {sites}")
            if pair in seen:
                raise ConfigError(f"two links between sites {sorted(pair)}")
            seen[pair] = link
        missing = [(a, b) for i, a in enumerate(sites) for b in sites[i + 1:]
                   if frozenset((a, b)) not in seen]
        if missing:
            raise ConfigError(f"no site link between {', '.join(f'{a!r} and {b!r}' for a, b in missing)}; "
                              f"every pair of sites needs one (SiteLink(sites=(a, b), ...))")
        self._check_servers(names, sites)

    def _check_servers(self, names: set[str], sites: list[str]) -> None:
        for name, profile in self.server_profiles.items():
            if profile.name != name:
                raise ConfigError(f"server_profiles[{name!r}] holds profile {profile.name!r}")
        for i, server in enumerate(self.servers):
            where = f"servers[{i}] ({server.name!r})"
            if server.name in names:
                raise ConfigError(f"{where}: duplicate node name")
            names.add(server.name)
            if server.profile not in self.server_profiles:
                raise ConfigError(f"{where}: server profile {server.profile!r} is not among the "
                                  f"cluster's server profiles {sorted(self.server_profiles)}")
            if server.site not in sites:
                raise ConfigError(f"{where}: site {server.site!r} has no devices; servers sit at "
                                  f"one of the cluster's sites {sites}")

    def __hash__(self) -> int:
        return hash((self.name, self.nodes, self.site_links, self.servers))

    def __repr__(self) -> str:
        kinds = {}
        for d in self.devices:
            kinds[d.device_type] = kinds.get(d.device_type, 0) + 1
        devs = ", ".join(f"{n}x {k}" for k, n in kinds.items())
        servers = f", {len(self.servers)} servers" if self.servers else ""
        return (f"Cluster({self.name!r}: {self.num_nodes} nodes, {self.num_devices} devices "
                f"[{devs}]{servers}, sites {list(self.sites)})")

    # ------------------------------------------------------------------ structure

    @cached_property
    def _index(self) -> _Index:
        devices, node_devices = [], []
        for j, node in enumerate(self.nodes):
            dtype = self.profiles[node.profile].device.name
            ids = []
            for local in node.local_ranks:
                ids.append(len(devices))
                devices.append(Device(len(devices), j, node.group, node.site, dtype, local))
            node_devices.append(tuple(ids))
        sites = tuple(dict.fromkeys(node.site for node in self.nodes))
        site_devices = {s: 0 for s in sites}
        for d in devices:
            site_devices[d.site] += 1
        return _Index(tuple(devices), tuple(node_devices), sites, site_devices)

    @property
    def devices(self) -> tuple[Device, ...]:
        """Every device, in global order (group, node, local rank)."""
        return self._index.devices

    @property
    def num_devices(self) -> int:
        return len(self._index.devices)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def sites(self) -> tuple[str, ...]:
        """Site names in order of first appearance (the ring order between sites)."""
        return self._index.sites

    @property
    def groups(self) -> tuple[NodeGroup, ...]:
        """One :class:`NodeGroup` (with its :class:`Profile`) per node group."""
        out: dict[int, list[ClusterNode]] = {}
        for node in self.nodes:
            out.setdefault(node.group, []).append(node)
        return tuple(NodeGroup(self.profiles[ns[0].profile], len(ns), ns[0].site)
                     for _, ns in sorted(out.items()))

    @property
    def device_types(self) -> tuple[DeviceType, ...]:
        """The distinct :class:`DeviceType` records, in order of first appearance."""
        seen: dict[str, DeviceType] = {}
        for node in self.nodes:
            device = self.profiles[node.profile].device
            seen.setdefault(device.name, device)
        return tuple(seen.values())

    def _device(self, i: int) -> Device:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_devices:
            raise ConfigError(f"device index {i!r} out of range [0, {self.num_devices})")
        return self._index.devices[i]

    def node_of(self, i: int) -> ClusterNode:
        """The node holding device ``i``."""
        return self.nodes[self._device(i).node]

    def profile_of(self, i: int) -> Profile:
        """The profile of device ``i``'s node."""
        return self.profiles[self.node_of(i).profile]

    def device_type_of(self, i: int) -> DeviceType:
        """The :class:`DeviceType` of device ``i``."""
        return self.profile_of(i).device

    def devices_of_node(self, node: int) -> tuple[int, ...]:
        """Global indices of the devices on node ``node``."""
        return self._index.node_devices[node]

    def _site_link(self, a: str, b: str) -> SiteLink:
        for link in self.site_links:
            if set(link.sites) == {a, b}:
                return link
        raise ConfigError(f"no link between sites {a!r} and {b!r}")

    # ------------------------------------------------------------------ paths

    def _nic_share(self, profile: Profile) -> float:
        """One device's share of its node's NICs, under full load."""
        assert profile.network is not None
        return profile.network.effective_bw_per_node_bytes_per_s / profile.node.devices_per_node

    def path(self, a: int, b: int) -> Link:
        """Bottleneck bandwidth and summed latency between devices ``a`` and ``b``.

        Raw figures (no collective efficiency); see the module docstring for
        the conventions.

        Raises
        ------
        ConfigError
            For ``a == b``, an index out of range, or a mesh pair with no route.
        """
        da, db = self._device(a), self._device(b)
        if a == b:
            raise ConfigError(f"no path from device {a} to itself")
        pa, pb = self.profile_of(a), self.profile_of(b)
        if da.node == db.node:
            node = self.nodes[da.node]
            bw, hops = _widest(pa.node, node.local_ranks)[(da.local_rank, db.local_rank)]
            if bw <= 0:
                raise ConfigError(f"no intra-node route between devices {a} and {b} "
                                  f"(local ranks {da.local_rank}, {db.local_rank}) on node {node.name!r}")
            return Link(bw, hops * pa.node.latency_s, "intra_node")
        assert pa.network is not None and pb.network is not None
        bw = min(self._nic_share(pa), self._nic_share(pb))
        if da.site == db.site:
            return Link(bw, max(pa.network.latency_s, pb.network.latency_s), "inter_node")
        link = self._site_link(da.site, db.site)
        return Link(min(bw, link.bw_bytes_per_s),
                    pa.network.latency_s + link.latency_s + pb.network.latency_s, "inter_site")

    @cached_property
    def graph(self) -> nx.Graph:
        """Devices and the path between every pair, as a :class:`networkx.Graph`.

        Vertices are device indices with attributes ``node``, ``group``,
        ``site``, ``device_type`` and ``local_rank``; every pair is an edge
        with the :meth:`path` attributes ``bw_bytes_per_s``, ``latency_s`` and
        ``kind`` (``"intra_node"``, ``"inter_node"`` or ``"inter_site"``).
        Built on first use: O(devices^2) edges, meant for inspection and
        drawing; the cost methods do not need it.
        """
        g = nx.Graph(name=self.name)
        for d in self.devices:
            g.add_node(d.index, node=d.node, group=d.group, site=d.site,
                       device_type=d.device_type, local_rank=d.local_rank)
        n = self.num_devices
        for a in range(n):
            for b in range(a + 1, n):
                link = self.path(a, b)
                g.add_edge(a, b, bw_bytes_per_s=link.bw_bytes_per_s, latency_s=link.latency_s,
                           kind=link.kind)
        return g

    # ------------------------------------------------------------------ collectives

    @cached_property
    def _collective_cache(self) -> dict[Any, tuple[CollectiveParams, ...]]:
        return {}

    @cached_property
    def _signature_cache(self) -> dict[tuple[int, ...], tuple[Any, ...]]:
        return {}

    def _group_signature(self, group: Sequence[int]) -> tuple[Any, ...]:
        """:meth:`_signature` of a checked group, cached per group (a search prices the
        same groups, of up to thousands of devices, many times)."""
        cache = self._signature_cache
        try:
            hit = cache.get(tuple(group))
        except TypeError:
            hit = None
        if hit is not None:
            return hit
        members = self._check_group(group)
        hit = self._signature(members)
        if len(cache) > 65536:
            cache.clear()
        cache[members] = hit
        return hit

    def _check_group(self, group: Sequence[int]) -> tuple[int, ...]:
        try:
            members = tuple(group)
        except TypeError:
            raise ConfigError(f"a device group must be a sequence of device indices, got {group!r}") from None
        for i in members:
            self._device(i)
        if len(set(members)) != len(members):
            raise ConfigError(f"device group {list(members)} lists a device twice")
        if not members:
            raise ConfigError("empty device group")
        return members

    def _signature(self, members: tuple[int, ...]) -> tuple[Any, ...]:
        """What a group's cost depends on: per site, per node (profile, members, mesh layout)."""
        by_node: dict[int, list[int]] = {}
        for i in members:
            d = self._index.devices[i]
            by_node.setdefault(d.node, []).append(d.local_rank)
        by_site: dict[str, list[tuple[Any, ...]]] = {}
        for j, ranks in by_node.items():
            node = self.nodes[j]
            mesh = self.profiles[node.profile].node.topology.is_mesh
            by_site.setdefault(node.site, []).append(
                (node.profile, len(ranks),
                 (tuple(sorted(ranks)), node.local_ranks) if mesh and len(ranks) > 1 else ()))
        return tuple((s, tuple(sorted(by_site[s]))) for s in self.sites if s in by_site)

    def placement(self, group: Sequence[int]) -> tuple[Any, ...]:
        """Where a group's members sit, as far as its collectives' cost goes: per site and
        node, the node's profile and how many members it holds (and on mesh nodes which).
        Two groups with the same placement cost the same; a group straddling two nodes
        (NVLink domains) differs from one inside a node.

        >>> from autoplan.hardware import load_cluster
        >>> c = load_cluster("gb200-nvl72", nodes=2)
        >>> c.placement(range(0, 16)) == c.placement(range(16, 32))
        True
        >>> c.placement(range(64, 80)) == c.placement(range(0, 16))   # 8 + 8 over two racks
        False
        """
        return self._group_signature(group)

    def _shape(self, signature: tuple[Any, ...], concurrent_groups: int | None) -> GroupShape:
        spans_nodes = sum(len(nodes) for _, nodes in signature) > 1
        sites = []
        for site, nodes in signature:
            parts = []
            for profile_name, k, mesh in nodes:
                profile = self.profiles[profile_name]
                intra = None
                if k >= 2:
                    bw = (_mesh_group_bw(profile.node, *mesh) if mesh
                          else profile.node.bw_unidir_bytes_per_s)
                    intra = Segment(bw, profile.node.latency_s, profile.node.collective_efficiency,
                                    profile.node.collective_latency)
                nic = None
                if spans_nodes:
                    assert profile.network is not None
                    node_bw = profile.network.effective_bw_per_node_bytes_per_s
                    share = (k * self._nic_share(profile) if concurrent_groups is None
                             else node_bw / concurrent_groups)
                    nic = Segment(share, profile.network.latency_s,
                                  profile.network.collective_efficiency)
                parts.append(NodePart(k, intra, nic))
            sites.append(SitePart(site, tuple(parts)))
        links = []
        for a in range(len(sites)):
            for b in range(a + 1, len(sites)):
                sa, sb = sites[a], sites[b]
                link = self._site_link(sa.name, sb.name)
                share = (min(sa.members / self._index.site_devices[sa.name],
                             sb.members / self._index.site_devices[sb.name])
                         if concurrent_groups is None else 1 / concurrent_groups)
                links.append(SiteLinkPart(a, b, Segment(link.bw_bytes_per_s * share, link.latency_s,
                                                        link.collective_efficiency)))
        return GroupShape(tuple(sites), tuple(links))

    def collective_candidates(self, op: str, group: Sequence[int], *,
                              concurrent_groups: int | None = None,
                              after_compute: bool = True) -> tuple[CollectiveParams, ...]:
        """Every modelled algorithm for ``op`` over ``group`` (cached per group signature).
        ``after_compute=False`` leaves out the node's arrival cost (:meth:`_arrival_s`), for
        a caller whose own figure holds the wait (see :meth:`collective_time`)."""
        op_ = parse_op(op)
        signature = self._group_signature(group)
        if concurrent_groups is not None and (isinstance(concurrent_groups, bool)
                                              or not isinstance(concurrent_groups, int)
                                              or concurrent_groups < 1):
            raise ConfigError(f"concurrent_groups must be an integer >= 1 or None, "
                              f"got {concurrent_groups!r}")
        key = (op_, concurrent_groups, signature, after_compute)
        cached = self._collective_cache.get(key)
        if cached is None:
            cached = collective_candidates(op_, self._shape(signature, concurrent_groups))
            arrival = self._arrival_s(op_, signature) if after_compute else 0.0
            if arrival:
                cached = tuple(replace(c, latency_s=c.latency_s + arrival) for c in cached)
            self._collective_cache[key] = cached
        return cached

    def _arrival_s(self, op: CollectiveOp, signature: tuple[Any, ...]) -> float:
        """What a call of ``op`` costs more after compute than back to back
        (``NodeSpec.arrival_s``: ranks that share a node's cores), for a group inside one
        node; 0 for p2p (its profile figure is timed after compute already) and for groups
        across nodes."""
        if op is CollectiveOp.P2P or len(signature) != 1 or len(signature[0][1]) != 1:
            return 0.0
        profile_name, members, _ = signature[0][1][0]
        return self.profiles[profile_name].node.arrival_s if members >= 2 else 0.0

    def collective_params(self, op: str, group: Sequence[int], *, nbytes: float | None = None,
                          concurrent_groups: int | None = None) -> CollectiveParams:
        """Alpha-beta parameters of ``op`` over ``group``.

        With ``nbytes``: the algorithm that is fastest at that size.  Without:
        the one with the highest bandwidth (ties: lowest latency), i.e. the one
        that wins for large messages.  ``.bottleneck`` names the binding level.
        """
        candidates = self.collective_candidates(op, group, concurrent_groups=concurrent_groups)
        if nbytes is None:
            return min(candidates, key=lambda c: (-c.bw_bytes_per_s, c.latency_s))
        _check_nbytes(nbytes)
        return min(candidates, key=lambda c: c.time(nbytes))

    def collective_time(self, op: str, group: Sequence[int], nbytes: float, *,
                        concurrent_groups: int | None = None,
                        after_compute: bool = True) -> float:
        """Seconds for collective ``op`` over ``group`` on ``nbytes`` (full buffer per rank).

        ``op`` is one of ``all_reduce``, ``all_gather`` (``nbytes`` = gathered
        size), ``reduce_scatter`` (``nbytes`` = input size), ``all_to_all``
        (``nbytes`` = each rank's whole send buffer), ``broadcast``, ``p2p``
        (group of two).  The fastest modelled algorithm; see
        :mod:`autoplan.hardware.collectives` for the formulas and the module
        docstring for ``concurrent_groups``.  Zero for one device or zero bytes.
        Where ranks share a node's cores, a call after compute costs the node's
        ``arrival_s`` more (:meth:`_arrival_s`); ``after_compute=False`` leaves it out.

        Examples
        --------
        >>> from autoplan.hardware import load_cluster
        >>> c = load_cluster("a100-sxm4-80gb")
        >>> t = c.collective_time("all_reduce", range(8), 1e9)  # 1 GB over NVSwitch
        >>> round(t * 1e3, 3)  # 2*7/8 * 1e9 / (300e9 * 0.75) s + 14 * 2 us
        7.806
        """
        _check_nbytes(nbytes)
        candidates = self.collective_candidates(op, group, concurrent_groups=concurrent_groups,
                                                after_compute=after_compute)
        return min(c.time(nbytes) for c in candidates)

    # ------------------------------------------------------------------ sub-clusters

    def subset(self, devices: Iterable[int]) -> "Cluster":
        """A cluster of only ``devices`` (renumbered in global order); empty nodes are dropped."""
        keep = {self._device(i).index for i in devices}
        if not keep:
            raise ConfigError("subset() needs at least one device")
        nodes = []
        for j, node in enumerate(self.nodes):
            ranks = tuple(self._index.devices[i].local_rank
                          for i in self._index.node_devices[j] if i in keep)
            if ranks:
                nodes.append(ClusterNode(node.name, node.group, node.profile, node.site, ranks))
        sites = {n.site for n in nodes}
        profiles = {n.profile: self.profiles[n.profile] for n in nodes}
        links = tuple(l for l in self.site_links if set(l.sites) <= sites)
        servers = tuple(s for s in self.servers if s.site in sites)
        return Cluster(self.name, profiles, tuple(nodes), links, servers,
                       {s.profile: self.server_profiles[s.profile] for s in servers})

    def without(self, devices: Iterable[int]) -> "Cluster":
        """A cluster without ``devices`` (e.g. after a failure); see :meth:`subset`."""
        drop = {self._device(i).index for i in devices}
        return self.subset(i for i in range(self.num_devices) if i not in drop)

    # ------------------------------------------------------------------ servers

    def with_servers(self, profile: "str | os.PathLike[str] | ServerProfile", count: int, *,
                     site: str | None = None) -> "Cluster":
        """This cluster with ``count`` more CPU-only servers of ``profile`` (a server
        profile's name, path or record) at ``site`` (default: the first site).

        Examples
        --------
        >>> c = load_cluster("a100-sxm4-80gb", nodes=2).with_servers("cpu-server-2s-epyc", 2)
        >>> len(c.servers), c.num_devices, c.server_profile_of(0).host.memory_bytes // 2**30
        (2, 16, 2048)
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"count must be an integer >= 1, got {count!r}")
        server = _resolve_server(profile)
        site = self.sites[0] if site is None else site
        have = self.server_profiles.get(server.name)
        if have is not None and have != server:
            raise ConfigError(f"two different server profiles are named {server.name!r}")
        start = len(self.servers)
        added = tuple(ServerNode(f"s{start + i}", server.name, site) for i in range(count))
        return replace(self, servers=self.servers + added,
                       server_profiles={**self.server_profiles, server.name: server})

    def server_profile_of(self, s: int) -> ServerProfile:
        """The :class:`ServerProfile` of server ``s``."""
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < len(self.servers):
            raise ConfigError(f"server index {s!r} out of range [0, {len(self.servers)})")
        return self.server_profiles[self.servers[s].profile]

    def server_link(self, s: int, device: int) -> Link:
        """The path between server ``s`` and device ``device``: the device's NIC share (a
        server's NICs serve every device at once, :meth:`server_nic_bytes_per_s`) and the
        larger network latency; across sites, the site link's too."""
        server = self.server_profile_of(s)
        d = self._device(device)
        profile = self.profile_of(device)
        if profile.network is None:
            raise ConfigError(f"profile {profile.name!r} has no 'network' section, so its devices "
                              "cannot reach a server; add a network to the profile")
        bw = min(self._nic_share(profile), self.server_nic_bytes_per_s(s))
        latency = max(profile.network.latency_s, server.network.latency_s)
        site = self.servers[s].site
        if site == d.site:
            return Link(bw, latency, "inter_node")
        link = self._site_link(site, d.site)
        return Link(min(bw, link.bw_bytes_per_s), latency + link.latency_s, "inter_site")

    def server_nic_bytes_per_s(self, s: int) -> float:
        """All NICs of server ``s``, one direction, under full load (its oversubscription)."""
        return self.server_profile_of(s).network.effective_bw_per_node_bytes_per_s


def _check_nbytes(nbytes: float) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) \
            or not math.isfinite(nbytes) or nbytes < 0:
        raise ConfigError(f"nbytes must be a finite number >= 0, got {nbytes!r}")


@lru_cache(maxsize=256)
def _widest(node: NodeSpec, present: tuple[int, ...]) -> dict[tuple[int, int], tuple[float, int]]:
    """Route between present local devices: fewest hops, then the widest such route.

    Returns ``{(a, b): (bottleneck bw, hops)}``; ``(0.0, 0)`` when unreachable.
    Direct links always win (NCCL uses a direct NVLink when there is one).
    """
    best: dict[tuple[int, int], tuple[float, int]] = {}
    for a in present:
        hops = {a: 0}
        width = {a: math.inf}
        frontier = [a]
        while frontier:  # breadth-first, layer by layer
            layer: dict[int, float] = {}
            for k in frontier:
                for b in present:
                    if b in hops:
                        continue
                    bw = node.link_bw_bytes_per_s(k, b) if b != k else 0.0
                    if bw > 0:
                        layer[b] = max(layer.get(b, 0.0), min(width[k], bw))
            for b, bw in layer.items():
                hops[b] = hops[frontier[0]] + 1
                width[b] = bw
            frontier = sorted(layer)
        for b in present:
            if b != a:
                best[(a, b)] = (width[b], hops[b]) if b in hops else (0.0, 0)
    return best


def _mesh_group_bw(node: NodeSpec, members: tuple[int, ...], present: tuple[int, ...]) -> float:
    """Per-member bandwidth of a group on a mesh node.

    NCCL spreads its channels over every link, so a member can use all its
    direct links to other members: the group gets the smallest such sum.  A
    member with no direct link to the others uses its widest route to one.
    """
    routes = _widest(node, present)
    per_member = []
    for m in members:
        direct = sum(node.link_bw_bytes_per_s(m, o) for o in members if o != m)
        if direct <= 0:
            direct = max(routes[(m, o)][0] for o in members if o != m)
        per_member.append(direct)
    bw = min(per_member)
    if bw <= 0:
        raise ConfigError(f"no intra-node route among local devices {list(members)}")
    return bw


def _resolve(profile: str | os.PathLike[str] | Profile, where: str) -> Profile:
    if isinstance(profile, Profile):
        return profile
    loaded = load_profile(profile)
    if isinstance(loaded, CompositeProfile):
        raise ProfileError(f"{where}: {os.fspath(profile)!r} is a composite profile; a node group "
                           f"needs a node profile")
    if isinstance(loaded, ServerProfile):
        raise ProfileError(f"{where}: {os.fspath(profile)!r} is a server profile (CPU-only, no "
                           "device); add servers with Cluster.with_servers(profile, count)")
    return loaded


def _resolve_server(profile: "str | os.PathLike[str] | ServerProfile") -> ServerProfile:
    if isinstance(profile, ServerProfile):
        return profile
    if not isinstance(profile, (str, os.PathLike)):
        raise ConfigError(f"expected a server profile name, path or ServerProfile, got "
                          f"{type(profile).__name__}")
    loaded = load_profile(profile)
    if not isinstance(loaded, ServerProfile):
        raise ProfileError(f"{os.fspath(profile)!r} is a {'composite' if isinstance(loaded, CompositeProfile) else 'node'} "
                           "profile; servers need a server profile (kind: server), e.g. "
                           "'cpu-server-2s-epyc'")
    return loaded


def compose_cluster(groups: Sequence[NodeGroup], links: Sequence[SiteLink] = (), *,
                    name: str = "composite") -> Cluster:
    """A (possibly heterogeneous) cluster from node groups and the links between sites.

    Parameters
    ----------
    groups : sequence of NodeGroup
        Each ``NodeGroup(profile, nodes, site=...)``; ``profile`` a name, a
        path or a :class:`Profile`.  Devices are numbered group by group.
    links : sequence of SiteLink
        One for every pair of distinct sites.
    name : str

    Examples
    --------
    >>> from autoplan.hardware import NodeGroup, compose_cluster
    >>> c = compose_cluster([NodeGroup("a100-sxm4-80gb", 1), NodeGroup("v100-sxm2-32gb", 1)])
    >>> [t.name for t in c.device_types]
    ['A100-SXM4-80GB', 'V100-SXM2-32GB']
    >>> c.path(0, 8).bw_bytes_per_s  # the V100 node's NIC share: 4x 100 Gb/s over 8 GPUs
    6250000000.0
    """
    if not groups:
        raise ConfigError("compose_cluster() needs at least one node group")
    profiles: dict[str, Profile] = {}
    nodes = []
    for gi, group in enumerate(groups):
        if not isinstance(group, NodeGroup):
            raise ConfigError(f"groups[{gi}] must be a NodeGroup, got {type(group).__name__}")
        profile = _resolve(group.profile, f"groups[{gi}]")
        if profiles.setdefault(profile.name, profile) != profile:
            raise ConfigError(f"groups[{gi}]: two different profiles are named {profile.name!r}")
        ranks = tuple(range(profile.node.devices_per_node))
        nodes.extend(ClusterNode(f"g{gi}n{ni}", gi, profile.name, group.site, ranks)
                     for ni in range(group.nodes))
    return Cluster(name, profiles, tuple(nodes), tuple(links))


def as_cluster(cluster: "Cluster | str | os.PathLike[str]") -> Cluster:
    """``cluster`` itself, or the one-node cluster of the profile it names (a name or a
    path, as :func:`load_cluster` takes it), for the functions that take a cluster.

    Raises
    ------
    ConfigError
        For anything else (says what to pass).
    UnknownProfileError, ProfileError
        As :func:`load_cluster`.

    >>> as_cluster("a100-sxm4-80gb").num_devices
    8
    """
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, (str, os.PathLike)):
        return load_cluster(cluster)
    raise ConfigError(f"expected a Cluster (autoplan.load_cluster(name, nodes=...)) or a "
                      f"profile name or path, got {type(cluster).__name__}")


def load_cluster(name_or_path: str | os.PathLike[str], nodes: int | None = None, *,
                 devices_per_node: int | None = None) -> Cluster:
    """The cluster of a profile (by name or path).

    A node profile gives a homogeneous cluster of ``nodes`` nodes (default 1);
    a composite profile gives its own groups (``nodes`` must then be ``None``
    or its total node count).  ``devices_per_node`` uses only the first that many
    devices of each node of a node profile (default: all of them), e.g. 64 of the 72
    GPUs of each GB200 NVL72 rack, so that tensor-, context- and expert-parallel
    groups of 16, 32 or 64 tile every rack's NVLink domain (the search places no
    group across two domains; :func:`autoplan.plan`).

    Examples
    --------
    >>> c = load_cluster("gb200-nvl72", nodes=2, devices_per_node=64)
    >>> c.num_devices, [len(n.local_ranks) for n in c.nodes], c.path(0, 63).kind
    (128, [64, 64], 'intra_node')

    Raises
    ------
    UnknownProfileError
        For an unknown name (lists the available profiles).
    ProfileError
        For a malformed profile file, or a composite one whose groups or site links
        do not make a cluster (an unknown or composite profile in a group, a missing
        link); the message names the file.
    ConfigError
        For a bad node count, or a ``devices_per_node`` that is not in
        ``[1, the profile's devices_per_node]`` or is given for a composite profile.
    """
    profile = load_profile(name_or_path)
    if isinstance(profile, ServerProfile):
        raise ProfileError(f"{os.fspath(name_or_path)!r} is a server profile (CPU-only, no device): "
                           "a cluster needs devices; add servers to one with "
                           f"load_cluster(<node profile>, nodes=N).with_servers({profile.name!r}, count)")
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
        raise ConfigError(f"nodes must be an integer >= 1, got {nodes!r}")
    if devices_per_node is not None:
        if isinstance(profile, CompositeProfile):
            raise ConfigError(f"devices_per_node applies to a node profile; {profile.name!r} is a "
                              "composite: use compose_cluster() or Cluster.subset()")
        most = profile.node.devices_per_node
        if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, int) \
                or not 1 <= devices_per_node <= most:
            raise ConfigError(f"devices_per_node must be an integer in [1, {most}] (the devices "
                              f"of a {profile.name} node), got {devices_per_node!r}")
    if isinstance(profile, CompositeProfile):
        if nodes is not None and nodes != profile.total_nodes:
            raise ConfigError(
                f"profile {profile.name!r} is a composite of {profile.total_nodes} nodes "
                f"({', '.join(f'{g.nodes}x {g.profile_name} at {g.site}' for g in profile.groups)}); "
                f"got nodes={nodes}. Use compose_cluster() for other sizes")
        try:
            return compose_cluster(profile.groups, profile.site_links, name=profile.name)
        except (ProfileError, ConfigError) as exc:   # name the file whose groups or links fail
            kind = type(exc) if isinstance(exc, ProfileError) else ProfileError
            raise kind(str(exc), file=str(find_profile_file(name_or_path))) from None
    cluster = compose_cluster([NodeGroup(profile, nodes or 1)], name=profile.name)
    if devices_per_node is None or devices_per_node == profile.node.devices_per_node:
        return cluster
    size = profile.node.devices_per_node
    return cluster.subset(k * size + i for k in range(cluster.num_nodes)
                          for i in range(devices_per_node))
