"""Alpha-beta cost of collectives over a group of devices.

A collective of ``nbytes`` (the full, unsharded buffer per rank) over a group is
modelled by the algorithms NCCL chooses between; its time is that of the
fastest modelled algorithm at that size:

``ring``
    Flat ring over all ranks (Thakur, Rabenseifner & Gropp 2005, "Optimization
    of Collective Communication Operations in MPICH"; NCCL performance notes,
    ``doc/PERFORMANCE.md`` of nccl-tests).  With ``n`` ranks, ``S`` bytes,
    bottleneck bandwidth ``B`` and per-step latency ``a``::

        all_reduce       2(n-1)/n * S/B + 2(n-1) a
        all_gather       (n-1)/n * S/B + (n-1) a      (S = gathered output size)
        reduce_scatter   (n-1)/n * S/B + (n-1) a      (S = input size)
        broadcast        S/B + (n-1) a                (pipelined ring)

    NCCL runs one ring per channel and spreads the channels over all links, so
    the ring is as fast as the slowest resource: ``B`` is the smallest of the
    members' intra-node bandwidth, the group's share of each node's NICs and
    the group's share of each site link, and ``a`` the largest hop latency.

``hierarchical``
    For groups that span nodes: reduce-scatter inside each node (``k`` ranks),
    the collective between nodes on the ``1/k`` shard (each of the ``k`` local
    ranks over its own NIC share: node traffic ``2(N-1)/N * S`` for ``N``
    nodes), all-gather inside each node.  Groups that span sites add one more
    level: reduce-scatter between the nodes of a site, all-reduce of the shard
    between sites, all-gather back.  Levels run one after another: their
    times add.  Fewer latency steps than the flat ring; less traffic through
    the site link (``2(s-1)/s * S`` per site instead of ``2(n-1)/n * S``).

``tree`` (all-reduce, groups spanning nodes of one site)
    NCCL's double binary tree (Sanders, Speck & Träff 2009, "Two-tree
    algorithms for full bandwidth broadcast, reduction and scan"; NVIDIA
    blog "Massively Scale Your Deep Learning Training with NCCL 2.4", 2019):
    a chain inside each node and a tree between nodes, pipelined:
    ``2 S/B + 2 ((k-1) a_intra + ceil(log2 N) a_net)``.

``pairwise`` (all-to-all)
    Pairwise exchange (Thakur et al. 2005): ``n-1`` steps; each rank sends
    ``S/n`` to every other rank, all levels at once, so the most loaded
    resource decides: ``max(per-rank intra traffic (k-1)/n * S / B_intra,
    per-node NIC traffic k(n-k)/n * S / B_nic, per-site-pair traffic
    K_i K_j / n * S / B_link) + (n-1) a_max``.

``direct`` (p2p): ``S/B + a`` over the path between the two devices.

Bandwidths here are *effective*: the raw bandwidth a group gets (see
:class:`Segment`) times the collective efficiency of the operation that runs
on that level.  Inside the hierarchical algorithm each phase uses its own
operation's efficiency (an all-reduce's intra-node reduce-scatter phase uses
the intra-node ``reduce_scatter`` efficiency).

A level's per-step latency ``a`` is its resource's hop latency, or, where a
measured profile fitted one per operation (``NodeSpec.collective_latency``), that
operation's own: gloo on a CPU host pays several times more per all-reduce step
than per send.

Where the nodes of a level differ (heterogeneous groups), the level's latency
and per-byte time are each the worst over its nodes: exact for alike nodes,
an upper bound otherwise.

Everything here is pure arithmetic on a :class:`GroupShape`;
:class:`~autoplan.hardware.cluster.Cluster` builds the shape of a device group.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError
from .profiles import CollectiveEfficiency, CollectiveLatency

__all__ = [
    "CollectiveOp",
    "Segment",
    "NodePart",
    "SitePart",
    "SiteLinkPart",
    "GroupShape",
    "CollectiveLevel",
    "CollectiveParams",
    "ring_coefficients",
    "collective_candidates",
    "parse_op",
]


class CollectiveOp(str, enum.Enum):
    """Operations :func:`collective_candidates` can cost."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    P2P = "p2p"


def parse_op(op: str | CollectiveOp) -> CollectiveOp:
    """``op`` as a :class:`CollectiveOp`; :class:`ConfigError` listing the choices if unknown."""
    try:
        return CollectiveOp(op)
    except ValueError:
        raise ConfigError(f"unknown collective {op!r}; expected one of "
                          f"{[o.value for o in CollectiveOp]}") from None


@dataclass(frozen=True)
class Segment:
    """A resource a group communicates over: raw bandwidth it gets, latency, efficiency.

    ``bw_bytes_per_s`` is one direction, after sharing with concurrent groups
    and before the collective efficiency.  ``op_latency``: each operation's own
    per-step latency where the profile measured it (``None``: ``latency_s`` for all).
    """

    bw_bytes_per_s: float
    latency_s: float
    efficiency: CollectiveEfficiency
    op_latency: CollectiveLatency | None = None

    def bw(self, op: CollectiveOp) -> float:
        """Effective bandwidth for ``op``: raw bandwidth times its efficiency."""
        return self.bw_bytes_per_s * self.efficiency.of(op.value)

    def latency(self, op: CollectiveOp) -> float:
        """Per-step latency of ``op``: its own where measured, else the hop latency."""
        return self.latency_s if self.op_latency is None else self.op_latency.of(op.value)


@dataclass(frozen=True)
class NodePart:
    """The members of a group on one node.

    ``intra`` is the per-member intra-node bandwidth to the other members
    (``None`` for a single member); ``nic`` the group's share of this node's
    NICs (``None`` when the whole group is on this node).
    """

    members: int
    intra: Segment | None
    nic: Segment | None


@dataclass(frozen=True)
class SitePart:
    """The nodes of a group at one site."""

    name: str
    nodes: tuple[NodePart, ...]

    @property
    def members(self) -> int:
        return sum(n.members for n in self.nodes)

    @property
    def net_latency_s(self) -> float:
        """Largest NIC latency among the site's nodes (0.0 without NICs)."""
        return max((n.nic.latency_s for n in self.nodes if n.nic is not None), default=0.0)


@dataclass(frozen=True)
class SiteLinkPart:
    """The group's share of the link between sites ``a`` and ``b`` (indices into the sites)."""

    a: int
    b: int
    segment: Segment


@dataclass(frozen=True)
class GroupShape:
    """Where the members of a group are: sites (in ring order), nodes, links.

    ``site_links`` holds one entry per pair of sites the group spans.
    """

    sites: tuple[SitePart, ...]
    site_links: tuple[SiteLinkPart, ...] = ()

    @property
    def num_ranks(self) -> int:
        return sum(s.members for s in self.sites)

    @property
    def nodes(self) -> tuple[NodePart, ...]:
        return tuple(n for s in self.sites for n in s.nodes)

    def link(self, a: int, b: int) -> SiteLinkPart:
        for part in self.site_links:
            if {part.a, part.b} == {a, b}:
                return part
        raise ConfigError(f"no link between sites {self.sites[a].name!r} and {self.sites[b].name!r}")

    def site_hop_latency_s(self, a: int, b: int) -> float:
        """Device to device across sites: network at ``a``, the site link, network at ``b``."""
        return (self.sites[a].net_latency_s + self.link(a, b).segment.latency_s
                + self.sites[b].net_latency_s)


@dataclass(frozen=True)
class CollectiveLevel:
    """One part of an algorithm, for inspection: which resource, how much, how fast.

    Its bandwidth time is ``bytes_factor * nbytes / bw_bytes_per_s`` and its
    latency ``steps * latency_s``.  How the parts combine depends on the
    algorithm (they add for ``hierarchical``; for pipelined algorithms the
    slowest decides): :class:`CollectiveParams` holds the combined figures.
    """

    kind: str
    phase: str
    ranks: int
    bytes_factor: float
    bw_bytes_per_s: float
    steps: int
    latency_s: float

    @property
    def time_per_byte_s(self) -> float:
        return self.bytes_factor / self.bw_bytes_per_s


@dataclass(frozen=True)
class CollectiveParams:
    """Alpha-beta parameters of one algorithm for one collective over one group.

    ``time(nbytes) = latency_s + nbytes / bw_bytes_per_s`` for a group of two
    or more ranks and ``nbytes > 0``; zero otherwise.  ``bw_bytes_per_s`` is
    the *algorithm* bandwidth (bytes of the full buffer per second), so for a
    ring all-reduce it is ``B * n / (2(n-1))``.  ``bottleneck`` is the kind of
    resource whose bandwidth term is largest: ``"intra_node"``,
    ``"inter_node"`` or ``"inter_site"`` (``"none"`` for a single rank).
    """

    op: str
    algorithm: str
    num_ranks: int
    latency_s: float
    bw_bytes_per_s: float
    levels: tuple[CollectiveLevel, ...]
    bottleneck: str

    def time(self, nbytes: float) -> float:
        """Seconds for ``nbytes`` (the full, unsharded buffer per rank)."""
        if self.num_ranks <= 1 or nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bw_bytes_per_s


def ring_coefficients(op: CollectiveOp, n: int) -> tuple[float, int]:
    """``(bytes_factor, steps)`` of the ring algorithm for ``op`` over ``n`` ranks.

    Thakur et al. 2005; ring all-reduce is ``2(n-1)/n`` bytes per byte of
    buffer in ``2(n-1)`` steps.

    Examples
    --------
    >>> ring_coefficients(CollectiveOp.ALL_REDUCE, 4)
    (1.5, 6)
    """
    if n <= 1:
        return 0.0, 0
    if op is CollectiveOp.ALL_REDUCE:
        return 2 * (n - 1) / n, 2 * (n - 1)
    if op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_TO_ALL):
        return (n - 1) / n, n - 1
    if op is CollectiveOp.BROADCAST:
        return 1.0, n - 1
    return 1.0, 1


def _none(op: CollectiveOp, n: int) -> CollectiveParams:
    return CollectiveParams(op.value, "none", n, 0.0, math.inf, (), "none")


def _combine(op: CollectiveOp, algorithm: str, n: int, levels: Sequence[CollectiveLevel],
             latency_s: float, time_per_byte_s: float) -> CollectiveParams:
    bottleneck = max(levels, key=lambda lv: lv.time_per_byte_s).kind if levels else "none"
    bw = 1.0 / time_per_byte_s if time_per_byte_s > 0 else math.inf
    return CollectiveParams(op.value, algorithm, n, latency_s, bw, tuple(levels), bottleneck)


def _resources(shape: GroupShape, op: CollectiveOp) -> list[tuple[str, float, float]]:
    """Every resource a flat algorithm crosses: (kind, effective bw, hop latency)."""
    out: list[tuple[str, float, float]] = []
    for node in shape.nodes:
        if node.members >= 2 and node.intra is not None:
            out.append(("intra_node", node.intra.bw(op), node.intra.latency(op)))
    if len(shape.nodes) >= 2:
        hop = max(n.nic.latency(op) for n in shape.nodes if n.nic is not None)
        for node in shape.nodes:
            assert node.nic is not None
            out.append(("inter_node", node.nic.bw(op), hop))
    s = len(shape.sites)
    if s >= 2:
        for i in range(s):
            j = (i + 1) % s
            if s == 2 and i == 1:
                break
            out.append(("inter_site", shape.link(i, j).segment.bw(op), shape.site_hop_latency_s(i, j)))
    return out


def _flat_ring(op: CollectiveOp, shape: GroupShape) -> CollectiveParams:
    n = shape.num_ranks
    factor, steps = ring_coefficients(op, n)
    resources = _resources(shape, op)
    alpha = max(r[2] for r in resources)
    bw = min(r[1] for r in resources)
    levels = []
    for kind in ("intra_node", "inter_node", "inter_site"):
        of_kind = [r for r in resources if r[0] == kind]
        if of_kind:
            levels.append(CollectiveLevel(kind, op.value, n, factor, min(r[1] for r in of_kind),
                                          steps, max(r[2] for r in of_kind)))
    return _combine(op, "ring", n, levels, steps * alpha, factor / bw)


def _worst_level(kind: str, phase: CollectiveOp, items: Sequence[tuple[int, float, float]],
                 ring_op: CollectiveOp) -> CollectiveLevel | None:
    """One ring level over several independent rings: (ranks, effective bw, latency) each."""
    parts = []
    for ranks, bw, latency in items:
        if ranks < 2:
            continue
        factor, steps = ring_coefficients(ring_op, ranks)
        parts.append((factor / bw, steps * latency, ranks, factor, bw, steps, latency))
    if not parts:
        return None
    slow = max(parts, key=lambda p: p[0])
    late = max(parts, key=lambda p: p[1])
    # per-byte time of the slowest ring, latency of the latest: see the module docstring
    return CollectiveLevel(kind, phase.value, max(p[2] for p in parts), slow[3], slow[4],
                           late[5], late[6])


def _hierarchical(op: CollectiveOp, shape: GroupShape) -> CollectiveParams:
    """Intra-node, inter-node (per site), inter-site levels, one after another."""
    n = shape.num_ranks
    AR, RS, AG, BC = (CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER,
                      CollectiveOp.ALL_GATHER, CollectiveOp.BROADCAST)
    multi_site = len(shape.sites) >= 2

    def intra(phase: CollectiveOp) -> CollectiveLevel | None:
        return _worst_level("intra_node", phase, [
            (nd.members, nd.intra.bw(phase), nd.intra.latency(phase))
            for nd in shape.nodes if nd.intra is not None], phase)

    def inter(phase: CollectiveOp) -> CollectiveLevel | None:
        items = []
        for site in shape.sites:
            nics = [nd.nic for nd in site.nodes if nd.nic is not None]
            if len(site.nodes) >= 2:
                items.append((len(site.nodes), min(c.bw(phase) for c in nics),
                              max(c.latency(phase) for c in nics)))
        return _worst_level("inter_node", phase, items, phase)

    def across_sites(phase: CollectiveOp) -> CollectiveLevel | None:
        s = len(shape.sites)
        pairs = [(0, 1)] if s == 2 else [(i, (i + 1) % s) for i in range(s)]
        # the site link, and all NICs of a site together, carry the site's traffic
        link_bw = min(shape.link(a, b).segment.bw(phase) for a, b in pairs)
        nic_bw = min(len(site.nodes) * min(nd.nic.bw(phase) for nd in site.nodes
                                           if nd.nic is not None)
                     for site in shape.sites)
        latency = max(shape.site_hop_latency_s(a, b) for a, b in pairs)
        return _worst_level("inter_site", phase, [(s, min(link_bw, nic_bw), latency)], phase)

    if op is AR:
        middle = [inter(RS), across_sites(AR), inter(AG)] if multi_site else [inter(AR)]
        phases = [intra(RS), *middle, intra(AG)]
    elif op in (RS, AG):
        phases = [intra(op), inter(op), across_sites(op) if multi_site else None]
    elif op is BC:
        phases = [across_sites(BC) if multi_site else None, inter(BC), intra(BC)]
    else:
        raise AssertionError(op)
    levels = [lv for lv in phases if lv is not None]
    latency = sum(lv.steps * lv.latency_s for lv in levels)
    per_byte = sum(lv.time_per_byte_s for lv in levels)
    return _combine(op, "hierarchical", n, levels, latency, per_byte)


def _tree(shape: GroupShape) -> CollectiveParams:
    """NCCL double binary tree all-reduce: chain inside nodes, tree between nodes, pipelined."""
    op = CollectiveOp.ALL_REDUCE
    n = shape.num_ranks
    nodes = shape.nodes
    nics = [nd.nic for nd in nodes if nd.nic is not None]
    chains = [nd for nd in nodes if nd.intra is not None and nd.members >= 2]
    depth = math.ceil(math.log2(len(nodes)))
    levels = [CollectiveLevel("inter_node", op.value, len(nodes), 2.0, min(c.bw(op) for c in nics),
                              2 * depth, max(c.latency(op) for c in nics))]
    if chains:
        k = max(nd.members for nd in chains)
        levels.insert(0, CollectiveLevel("intra_node", op.value, k, 2.0,
                                         min(nd.intra.bw(op) for nd in chains), 2 * (k - 1),
                                         max(nd.intra.latency(op) for nd in chains)))
    latency = sum(lv.steps * lv.latency_s for lv in levels)
    per_byte = max(lv.time_per_byte_s for lv in levels)
    return _combine(op, "tree", n, levels, latency, per_byte)


def _pairwise(shape: GroupShape) -> CollectiveParams:
    """All-to-all by pairwise exchange: the most loaded resource decides."""
    op = CollectiveOp.ALL_TO_ALL
    n = shape.num_ranks
    levels = []
    for nd in shape.nodes:
        if nd.intra is not None and nd.members >= 2:
            levels.append(CollectiveLevel("intra_node", op.value, nd.members,
                                          (nd.members - 1) / n, nd.intra.bw(op), n - 1,
                                          nd.intra.latency(op)))
    if len(shape.nodes) >= 2:
        hop = max(nd.nic.latency(op) for nd in shape.nodes if nd.nic is not None)
        for nd in shape.nodes:
            assert nd.nic is not None
            levels.append(CollectiveLevel("inter_node", op.value, nd.members,
                                          nd.members * (n - nd.members) / n, nd.nic.bw(op),
                                          n - 1, hop))
    for part in shape.site_links:
        ka, kb = shape.sites[part.a].members, shape.sites[part.b].members
        levels.append(CollectiveLevel("inter_site", op.value, ka + kb, ka * kb / n,
                                      part.segment.bw(op), n - 1,
                                      shape.site_hop_latency_s(part.a, part.b)))
    latency = max(lv.steps * lv.latency_s for lv in levels)
    per_byte = max(lv.time_per_byte_s for lv in levels)
    slowest = max(levels, key=lambda lv: lv.time_per_byte_s)
    return _combine(op, "pairwise", n, [slowest, *[lv for lv in levels if lv is not slowest]],
                    latency, per_byte)


def _direct(shape: GroupShape) -> CollectiveParams:
    """Point-to-point between the two members of the group."""
    op = CollectiveOp.P2P
    if len(shape.nodes) == 1:
        intra = shape.nodes[0].intra
        assert intra is not None
        level = CollectiveLevel("intra_node", op.value, 2, 1.0, intra.bw(op), 1, intra.latency(op))
    else:
        nics = [nd.nic for nd in shape.nodes if nd.nic is not None]
        bw = min(c.bw(op) for c in nics)
        if len(shape.sites) == 1:
            level = CollectiveLevel("inter_node", op.value, 2, 1.0, bw, 1,
                                    max(c.latency(op) for c in nics))
        else:
            link = shape.link(0, 1).segment
            level = CollectiveLevel("inter_site", op.value, 2, 1.0, min(bw, link.bw(op)), 1,
                                    shape.site_hop_latency_s(0, 1))
    return _combine(op, "direct", 2, [level], level.latency_s, level.time_per_byte_s)


def collective_candidates(op: str | CollectiveOp, shape: GroupShape) -> tuple[CollectiveParams, ...]:
    """Every modelled algorithm for ``op`` over the group ``shape``.

    The time of the collective is the minimum over the candidates (NCCL picks
    its algorithm per message size).

    Raises
    ------
    ConfigError
        For an unknown operation, or p2p over a group that is not two ranks.
    """
    op = parse_op(op)
    n = shape.num_ranks
    if op is CollectiveOp.P2P:
        if n != 2:
            raise ConfigError(f"p2p needs a group of exactly 2 devices, got {n}")
        return (_direct(shape),)
    if n <= 1:
        return (_none(op, n),)
    if op is CollectiveOp.ALL_TO_ALL:
        return (_pairwise(shape),)
    candidates = [_flat_ring(op, shape)]
    if len(shape.nodes) >= 2:
        candidates.append(_hierarchical(op, shape))
        if op is CollectiveOp.ALL_REDUCE and len(shape.sites) == 1:
            candidates.append(_tree(shape))
    return tuple(candidates)
