"""The cluster resource view on tiny hand-built topologies, with exact expected answers.

Every expected value is written out from the formulas in
``autoplan/hardware/collectives.py`` with the round numbers of the test
profiles below; comparisons are to float rounding (rel=1e-12).
"""

from __future__ import annotations

import math
from dataclasses import replace

import networkx as nx
import pytest

from autoplan.errors import ConfigError, ProfileError, RecordError
from autoplan.hardware import (
    Cluster,
    CollectiveEfficiency,
    CollectiveLatency,
    DeviceType,
    EfficiencyTable,
    IntraNodeTopology,
    Link,
    MeshLink,
    NetworkSpec,
    NetworkTopology,
    NodeGroup,
    NodeSpec,
    Profile,
    SiteLink,
    compose_cluster,
    load_cluster,
)

S = 1e8  # bytes


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=0.0)


def _device(name: str) -> DeviceType:
    table = EfficiencyTable(((1e9, 0.5),), "test")
    return DeviceType(name, {"bf16": 100e12}, 2**30, 1e12, {"default": table}, "test")


def _profile(name: str, *, devices: int, intra_bw: float, intra_lat: float, nics: int,
             nic_bw: float, net_lat: float, intra_eff: float = 1.0, net_eff: float = 1.0,
             topology=IntraNodeTopology.NVSWITCH, links=()) -> Profile:
    node = NodeSpec(devices, topology, intra_bw, intra_lat,
                    CollectiveEfficiency.uniform(intra_eff, "test"), "test", "test", tuple(links))
    network = NetworkSpec(nics, nic_bw, net_lat, NetworkTopology.FAT_TREE, 1.0,
                          CollectiveEfficiency.uniform(net_eff, "test"), "test", "test")
    return Profile(name, "test", _device(name.upper()), node, network)


# 4 devices per node at 100e9 B/s, 1 us; 2 NICs x 50e9 B/s (25e9 per device), 10 us
FAST = _profile("fast", devices=4, intra_bw=100e9, intra_lat=1e-6, nics=2, nic_bw=50e9,
                net_lat=10e-6)
# 2 devices per node at 40e9 B/s, 2 us; 1 NIC x 20e9 B/s (10e9 per device), 20 us
SLOW = _profile("slow", devices=2, intra_bw=40e9, intra_lat=2e-6, nics=1, nic_bw=20e9,
                net_lat=20e-6)
LINK = SiteLink(("a", "b"), 1e9, 1e-3, CollectiveEfficiency.uniform(1.0, "test"), "test")


def fast(nodes: int) -> Cluster:
    return compose_cluster([NodeGroup(FAST, nodes)], name="fast")


# ----------------------------------------------------------------- structure

def test_device_numbering_is_group_node_local_rank():
    c = compose_cluster([NodeGroup(FAST, 2, site="a"), NodeGroup(SLOW, 1, site="b")], [LINK])
    assert c.num_devices == 10 and c.num_nodes == 3
    assert [(d.node, d.group, d.site, d.local_rank) for d in c.devices] == [
        (0, 0, "a", 0), (0, 0, "a", 1), (0, 0, "a", 2), (0, 0, "a", 3),
        (1, 0, "a", 0), (1, 0, "a", 1), (1, 0, "a", 2), (1, 0, "a", 3),
        (2, 1, "b", 0), (2, 1, "b", 1)]
    assert [d.index for d in c.devices] == list(range(10))
    assert c.device_type_of(3).name == "FAST" and c.device_type_of(8).name == "SLOW"
    assert [t.name for t in c.device_types] == ["FAST", "SLOW"]
    assert c.sites == ("a", "b")
    assert [(g.profile.name, g.nodes, g.site) for g in c.groups] == [("fast", 2, "a"), ("slow", 1, "b")]
    assert c.devices_of_node(1) == (4, 5, 6, 7)


def test_path_intra_inter_site_and_mixed():
    c = compose_cluster([NodeGroup(FAST, 2, site="a"), NodeGroup(SLOW, 1, site="a"),
                         NodeGroup(FAST, 1, site="b")], [LINK])
    assert c.path(0, 1) == Link(100e9, 1e-6, "intra_node")
    assert c.path(0, 4) == Link(25e9, 10e-6, "inter_node")  # 2 x 50e9 / 4 devices
    assert c.path(8, 9) == Link(40e9, 2e-6, "intra_node")
    assert c.path(0, 8) == Link(10e9, 20e-6, "inter_node")  # slower side: 20e9 / 2, 20 us
    # across sites: min(NIC shares, whole site link); network + link + network latency
    assert c.path(0, 10) == Link(1e9, approx(10e-6 + 1e-3 + 10e-6), "inter_site")
    assert c.path(8, 10).latency_s == approx(20e-6 + 1e-3 + 10e-6)
    assert c.path(4, 0) == c.path(0, 4)
    with pytest.raises(ConfigError):
        c.path(0, 0)
    with pytest.raises(ConfigError, match="out of range"):
        c.path(0, 14)


def test_graph_has_every_pair_with_path_attributes():
    c = compose_cluster([NodeGroup(FAST, 1, site="a"), NodeGroup(SLOW, 1, site="b")], [LINK])
    g = c.graph
    assert isinstance(g, nx.Graph)
    assert g.number_of_nodes() == 6 and g.number_of_edges() == 15
    assert g.nodes[4] == {"node": 1, "group": 1, "site": "b", "device_type": "SLOW", "local_rank": 0}
    for a, b, attrs in g.edges(data=True):
        link = c.path(a, b)
        assert attrs == {"bw_bytes_per_s": link.bw_bytes_per_s, "latency_s": link.latency_s,
                         "kind": link.kind}
    assert {k for _, _, k in g.edges(data="kind")} == {"intra_node", "inter_site"}
    assert c.graph is g  # cached


# ----------------------------------------------------------------- one node

def test_ring_collectives_inside_a_node():
    c = fast(1)
    g = range(4)
    # ring: all_reduce 2(n-1)/n S/B + 2(n-1) a; all_gather / reduce_scatter (n-1)/n S/B + (n-1) a
    assert c.collective_time("all_reduce", g, S) == approx(1.5 * S / 100e9 + 6 * 1e-6)
    assert c.collective_time("all_gather", g, S) == approx(0.75 * S / 100e9 + 3 * 1e-6)
    assert c.collective_time("reduce_scatter", g, S) == approx(0.75 * S / 100e9 + 3 * 1e-6)
    assert c.collective_time("broadcast", g, S) == approx(S / 100e9 + 3 * 1e-6)
    assert c.collective_time("all_to_all", g, S) == approx(0.75 * S / 100e9 + 3 * 1e-6)
    assert c.collective_time("p2p", [1, 2], S) == approx(S / 100e9 + 1e-6)
    assert c.collective_time("all_reduce", [0, 2], S) == approx(1.0 * S / 100e9 + 2 * 1e-6)
    p = c.collective_params("all_reduce", g)
    assert (p.algorithm, p.num_ranks, p.bottleneck) == ("ring", 4, "intra_node")
    assert p.latency_s == approx(6e-6)
    assert p.bw_bytes_per_s == approx(100e9 / 1.5)


def test_collective_efficiency_scales_bandwidth_only():
    slow_links = _profile("half", devices=4, intra_bw=100e9, intra_lat=1e-6, nics=2, nic_bw=50e9,
                          net_lat=10e-6, intra_eff=0.5)
    c = compose_cluster([NodeGroup(slow_links, 1)])
    assert c.collective_time("all_reduce", range(4), S) == approx(1.5 * S / 50e9 + 6e-6)
    assert c.path(0, 1).bw_bytes_per_s == 100e9  # path is raw


def test_each_collective_steps_at_its_own_latency_where_measured():
    """A node with ``collective_latency`` (measured profiles) prices each operation's ring
    steps at that operation's latency; a path (and a node without it) keeps the hop latency."""
    own = CollectiveLatency(all_reduce=50e-6, all_gather=20e-6, reduce_scatter=30e-6,
                            all_to_all=5e-6, broadcast=8e-6, p2p=2e-6, source="test")
    measured = replace(FAST, name="measured", node=replace(FAST.node, collective_latency=own))
    c = compose_cluster([NodeGroup(measured, 1)])
    g = range(4)
    assert c.collective_time("all_reduce", g, S) == approx(1.5 * S / 100e9 + 6 * 50e-6)
    assert c.collective_time("all_gather", g, S) == approx(0.75 * S / 100e9 + 3 * 20e-6)
    assert c.collective_time("reduce_scatter", g, S) == approx(0.75 * S / 100e9 + 3 * 30e-6)
    assert c.collective_time("all_to_all", g, S) == approx(0.75 * S / 100e9 + 3 * 5e-6)
    assert c.collective_time("broadcast", g, S) == approx(S / 100e9 + 3 * 8e-6)
    assert c.collective_time("p2p", [1, 2], S) == approx(S / 100e9 + 2e-6)
    assert c.path(1, 2).latency_s == 1e-6
    # across nodes, the intra-node phases of the hierarchical all-reduce use their own
    two = compose_cluster([NodeGroup(measured, 2)])
    hier = next(c for c in two.collective_candidates("all_reduce", range(8))
                if c.algorithm == "hierarchical")
    intra = [lv for lv in hier.levels if lv.kind == "intra_node"]
    assert [lv.latency_s for lv in intra] == [30e-6, 20e-6]    # reduce-scatter, all-gather
    with pytest.raises(ProfileError, match="per-step latency >= 0"):
        replace(own, p2p=-1e-6)


def test_degenerate_groups_and_bad_input():
    c = fast(2)
    assert c.collective_time("all_reduce", [3], S) == 0.0
    assert c.collective_time("all_reduce", range(8), 0) == 0.0
    assert c.collective_params("all_gather", [5]).algorithm == "none"
    with pytest.raises(ConfigError, match="exactly 2"):
        c.collective_time("p2p", [0, 1, 2], S)
    with pytest.raises(ConfigError, match="unknown collective"):
        c.collective_time("allreduce", [0, 1], S)
    with pytest.raises(ConfigError, match="twice"):
        c.collective_time("all_reduce", [0, 0], S)
    with pytest.raises(ConfigError, match="out of range"):
        c.collective_time("all_reduce", [0, 8], S)
    with pytest.raises(ConfigError, match="empty"):
        c.collective_time("all_reduce", [], S)
    with pytest.raises(ConfigError, match="nbytes"):
        c.collective_time("all_reduce", [0, 1], -1.0)
    with pytest.raises(ConfigError, match="concurrent_groups"):
        c.collective_time("all_reduce", [0, 4], S, concurrent_groups=0)


# ----------------------------------------------------------------- across nodes

def test_one_rank_per_node_uses_its_own_nic_share():
    c = fast(4)
    g = [0, 4, 8, 12]  # e.g. a data-parallel group under 4-way tensor parallelism
    ring = 1.5 * S / 25e9 + 6 * 10e-6
    tree = 2 * S / 25e9 + 2 * 2 * 10e-6  # depth ceil(log2 4) = 2
    algos = {p.algorithm: p for p in c.collective_candidates("all_reduce", g)}
    assert algos["ring"].time(S) == approx(ring)
    assert algos["tree"].time(S) == approx(tree)
    assert c.collective_time("all_reduce", g, S) == approx(min(ring, tree))
    # small messages: the tree's shorter latency wins
    assert c.collective_time("all_reduce", g, 1.0) == approx(1.0 * 2 / 25e9 + 40e-6)
    assert c.collective_params("all_reduce", g, nbytes=1.0).algorithm == "tree"
    assert c.collective_params("all_reduce", g).algorithm == "ring"
    assert c.collective_params("all_reduce", g).bottleneck == "inter_node"
    # one group alone on the nodes may use all of each node's NICs
    assert c.collective_time("all_reduce", g, S, concurrent_groups=1) == approx(
        1.5 * S / 100e9 + 60e-6)
    assert c.collective_time("all_reduce", g, S, concurrent_groups=2) == approx(
        1.5 * S / 50e9 + 60e-6)
    assert c.collective_time("p2p", [0, 4], S) == approx(S / 25e9 + 10e-6)


def test_whole_cluster_ring_vs_hierarchical():
    c = fast(2)
    g = range(8)
    # ring over 8 ranks: bottleneck min(intra 100e9, 4 NIC shares 4 x 25e9) = 100e9, 10 us hops
    ring = 2 * 7 / 8 * S / 100e9 + 14 * 10e-6
    # hierarchical: intra reduce-scatter, inter-node all-reduce (2 nodes), intra all-gather
    hier = (0.75 * S / 100e9 + 3e-6) + (1.0 * S / 100e9 + 2 * 10e-6) + (0.75 * S / 100e9 + 3e-6)
    # tree: chain in nodes, tree between 2 nodes (depth 1)
    tree = 2 * S / 100e9 + 2 * (3 * 1e-6 + 1 * 10e-6)
    algos = {p.algorithm: p for p in c.collective_candidates("all_reduce", g)}
    assert algos["ring"].time(S) == approx(ring)
    assert algos["hierarchical"].time(S) == approx(hier)
    assert algos["tree"].time(S) == approx(tree)
    assert c.collective_time("all_reduce", g, S) == approx(min(ring, hier, tree))
    levels = algos["hierarchical"].levels
    assert [(lv.kind, lv.phase, lv.ranks) for lv in levels] == [
        ("intra_node", "reduce_scatter", 4), ("inter_node", "all_reduce", 2),
        ("intra_node", "all_gather", 4)]
    # all_gather: ring 7/8 S/B + 7 a; hierarchical (inter-node then intra-node)
    ag = {p.algorithm: p.time(S) for p in c.collective_candidates("all_gather", g)}
    assert ag["ring"] == approx(7 / 8 * S / 100e9 + 7 * 10e-6)
    assert ag["hierarchical"] == approx((0.75 * S / 100e9 + 3e-6) + (0.5 * S / 100e9 + 10e-6))
    # all_to_all: per-node NIC traffic k(n-k)/n S = 2 S over 4 x 25e9; (n-1) steps of 10 us
    assert c.collective_time("all_to_all", g, S) == approx(4 * 4 / 8 * S / 100e9 + 7 * 10e-6)


def test_partial_nodes_share_nics_in_proportion():
    c = fast(2)
    g = [0, 1, 4, 5]  # 2 members on each node: 2 NIC shares = 50e9
    ring = 1.5 * S / 50e9 + 6 * 10e-6
    hier = (0.5 * S / 100e9 + 1e-6) + (1.0 * S / 50e9 + 20e-6) + (0.5 * S / 100e9 + 1e-6)
    algos = {p.algorithm: p.time(S) for p in c.collective_candidates("all_reduce", g)}
    assert algos["ring"] == approx(ring) and algos["hierarchical"] == approx(hier)


def test_heterogeneous_group_takes_the_slowest_side():
    c = compose_cluster([NodeGroup(FAST, 1), NodeGroup(SLOW, 1)])
    g = range(6)  # 4 fast + 2 slow devices
    # ring bottleneck: intra min(100e9, 40e9); NICs: fast 4 x 25e9, slow 2 x 10e9 -> 20e9
    # hop latency: the largest, 20 us (slow network)
    ring = 2 * 5 / 6 * S / 20e9 + 10 * 20e-6
    # hierarchical: intra levels are the worst node (fast: 3/4 S/100e9 + 3 us; slow: 1/2 S/40e9 + 2 us)
    intra = 0.5 * S / 40e9 + 3e-6
    hier = intra + (1.0 * S / 20e9 + 2 * 20e-6) + intra
    algos = {p.algorithm: p.time(S) for p in c.collective_candidates("all_reduce", g)}
    assert algos["ring"] == approx(ring)
    assert algos["hierarchical"] == approx(hier)
    ring_params = c.collective_candidates("all_reduce", g)[0]
    assert (ring_params.algorithm, ring_params.bottleneck) == ("ring", "inter_node")
    assert ring_params.latency_s == approx(10 * 20e-6)
    assert ring_params.bw_bytes_per_s == approx(20e9 / (2 * 5 / 6))
    assert c.collective_time("p2p", [0, 4], S) == approx(S / 10e9 + 20e-6)


# ----------------------------------------------------------------- across sites

def two_sites() -> Cluster:
    return compose_cluster([NodeGroup(FAST, 1, site="a"), NodeGroup(FAST, 1, site="b")], [LINK])


def test_collectives_across_sites():
    c = two_sites()
    g = range(8)
    hop = 10e-6 + 1e-3 + 10e-6
    # ring: the site link (whole: the group has every device of both sites) is the bottleneck
    ring = 2 * 7 / 8 * S / 1e9 + 14 * hop
    # hierarchical: intra RS, all-reduce between the 2 sites over min(link, site NICs), intra AG
    hier = (0.75 * S / 100e9 + 3e-6) + (1.0 * S / 1e9 + 2 * hop) + (0.75 * S / 100e9 + 3e-6)
    algos = {p.algorithm: p for p in c.collective_candidates("all_reduce", g)}
    assert set(algos) == {"ring", "hierarchical"}  # no tree across sites
    assert algos["ring"].time(S) == approx(ring)
    assert algos["hierarchical"].time(S) == approx(hier)
    assert algos["hierarchical"].bottleneck == "inter_site"
    params = c.collective_params("all_reduce", g)  # the large-message choice
    assert params.algorithm == "hierarchical"
    assert params.latency_s == approx(3e-6 + 2 * hop + 3e-6)
    assert params.bw_bytes_per_s == approx(1 / (0.75 / 100e9 + 1.0 / 1e9 + 0.75 / 100e9))
    assert [lv.kind for lv in params.levels] == ["intra_node", "inter_site", "intra_node"]
    assert c.collective_time("all_reduce", g, S) == approx(hier)
    # all_to_all: the site pair carries K_a K_b / n S = 2 S
    assert c.collective_time("all_to_all", g, S) == approx(4 * 4 / 8 * S / 1e9 + 7 * hop)


def test_site_link_is_shared_by_concurrent_groups():
    c = two_sites()
    hop = 10e-6 + 1e-3 + 10e-6
    # one device per site: by default it gets 1/4 of the link (4 devices per site)
    assert c.collective_time("p2p", [0, 4], S) == approx(S / 0.25e9 + hop)
    assert c.collective_time("p2p", [0, 4], S, concurrent_groups=1) == approx(S / 1e9 + hop)
    assert c.collective_time("p2p", [0, 4], S, concurrent_groups=4) == approx(S / 0.25e9 + hop)
    # but path() is the pair alone on the link
    assert c.path(0, 4).bw_bytes_per_s == 1e9


def test_three_sites_hierarchical_with_nodes_inside_sites():
    links = [SiteLink(p, bw, 1e-3, CollectiveEfficiency.uniform(1.0, "test"), "test")
             for p, bw in ((("a", "b"), 4e9), (("b", "c"), 2e9), (("a", "c"), 8e9))]
    c = compose_cluster([NodeGroup(FAST, 2, site=s) for s in "abc"], links)
    g = list(range(24))
    hop = 10e-6 + 1e-3 + 10e-6
    # intra RS/AG (k=4), inter-node RS/AG inside each site (2 nodes, 4 NIC shares = 100e9),
    # all-reduce over 3 sites on the ring a-b-c-a: bottleneck link 2e9
    intra = 0.75 * S / 100e9 + 3e-6
    inter = 0.5 * S / 100e9 + 10e-6
    sites = 2 * 2 / 3 * S / 2e9 + 4 * hop
    hier = {p.algorithm: p.time(S) for p in c.collective_candidates("all_reduce", g)}["hierarchical"]
    assert hier == approx(intra + inter + sites + inter + intra)


# ----------------------------------------------------------------- mesh nodes

def mesh() -> Cluster:
    # a 4-cycle 0-1-2-3-0 of 10e9 links; 20e9 per device
    links = [MeshLink((0, 1), 10e9), MeshLink((1, 2), 10e9), MeshLink((2, 3), 10e9),
             MeshLink((0, 3), 10e9)]
    p = _profile("ring4", devices=4, intra_bw=20e9, intra_lat=1e-6, nics=1, nic_bw=40e9,
                 net_lat=10e-6, topology=IntraNodeTopology.HYBRID_CUBE_MESH, links=links)
    return compose_cluster([NodeGroup(p, 1)])


def test_mesh_paths_route_through_a_neighbour():
    c = mesh()
    assert c.path(0, 1) == Link(10e9, 1e-6, "intra_node")
    assert c.path(0, 2) == Link(10e9, 2e-6, "intra_node")  # two hops
    # a group gets each member's direct links to the other members
    assert c.collective_time("all_reduce", range(4), S) == approx(1.5 * S / 20e9 + 6e-6)
    assert c.collective_time("all_reduce", [0, 1], S) == approx(S / 10e9 + 2e-6)
    assert c.collective_time("all_reduce", [0, 2], S) == approx(S / 10e9 + 2e-6)  # routed
    assert c.collective_time("all_reduce", [0, 1, 2], S) == approx(4 / 3 * S / 10e9 + 4e-6)
    # without device 1, 0 and 2 still meet through 3; without 1 and 3 they cannot
    assert c.without([1]).path(0, 1) == Link(10e9, 2e-6, "intra_node")
    with pytest.raises(ConfigError, match="no intra-node route"):
        c.without([1, 3]).path(0, 1)


def test_shipped_v100_cube_mesh():
    c = load_cluster("v100-sxm2-32gb")
    assert c.path(0, 3).bw_bytes_per_s == 50e9 and c.path(0, 1).bw_bytes_per_s == 25e9
    assert c.path(0, 5) == Link(25e9, 4e-6, "intra_node")
    p = c.collective_params("all_reduce", range(8))
    assert p.levels[0].bw_bytes_per_s == approx(150e9 * 0.7)  # six links of 25e9, efficiency 0.7


# ----------------------------------------------------------------- caching, records, subsets

def test_cost_is_cached_per_group_signature():
    c = fast(4)
    a = c.collective_candidates("all_reduce", [0, 4, 8, 12])
    b = c.collective_candidates("all_reduce", [13, 9, 5, 1])  # same shape: 1 per node
    assert a is b
    assert c.collective_candidates("all_reduce", [0, 1, 4, 5]) is not a


def test_cluster_round_trips_through_json():
    c = compose_cluster([NodeGroup(FAST, 2, site="a"), NodeGroup(SLOW, 1, site="b")], [LINK],
                        name="rt")
    back = Cluster.from_json(c.to_json())
    assert back == c
    assert back.collective_time("all_reduce", range(10), S) == c.collective_time(
        "all_reduce", range(10), S)
    data = c.to_dict()
    data["nodes"][0]["colour"] = "red"
    with pytest.raises(RecordError, match="unknown key"):
        Cluster.from_dict(data)


def test_subset_and_without():
    c = fast(3)
    w = c.without(c.devices_of_node(1))
    assert (w.num_nodes, w.num_devices) == (2, 8)
    assert [n.name for n in w.nodes] == ["g0n0", "g0n2"]
    assert w.path(0, 4) == c.path(0, 8)
    s = c.subset([9, 1, 2])
    assert s.num_devices == 3 and [d.local_rank for d in s.devices] == [1, 2, 1]
    assert s.nodes[1].local_ranks == (1,)
    # a device's NIC share is physical: it does not grow when neighbours drop out
    assert s.path(0, 2).bw_bytes_per_s == 25e9
    with pytest.raises(ConfigError):
        c.subset([])


def test_cluster_validation():
    with pytest.raises(ConfigError, match="no site link between 'a' and 'b'"):
        compose_cluster([NodeGroup(FAST, 1, site="a"), NodeGroup(FAST, 1, site="b")])
    lonely = Profile("lonely", "no network", FAST.device, FAST.node, None)
    assert compose_cluster([NodeGroup(lonely, 1)]).num_devices == 4
    with pytest.raises(ConfigError, match="no 'network' section"):
        compose_cluster([NodeGroup(lonely, 2)])
    with pytest.raises(ConfigError, match="has no nodes"):
        compose_cluster([NodeGroup(FAST, 1, site="a")], [LINK])


# ----------------------------------------------------------------- shipped clusters

def test_load_cluster_shipped():
    c = load_cluster("a100-sxm4-80gb", nodes=4)
    assert (c.num_nodes, c.num_devices) == (4, 32)
    assert load_cluster("a100-sxm4-80gb").num_devices == 8
    assert c.path(0, 8) == Link(25e9, approx(5e-6), "inter_node")
    # 1 GB all-reduce in a DGX A100: ring, 2*7/8 * 1e9 / (300e9 * 0.75) + 14 * 2 us
    assert c.collective_time("all_reduce", range(8), 1e9) == approx(
        1.75e9 / (300e9 * 0.75) + 14 * 2e-6)
    two = load_cluster("two-sites")
    assert (two.num_nodes, two.num_devices, two.sites) == (8, 64, ("east", "west"))
    assert two.path(0, 32).kind == "inter_site"
    assert two.path(0, 32).latency_s == approx(5e-6 + 10e-3 + 5e-6)
    mixed = load_cluster("mixed-a100-v100")
    assert [t.name for t in mixed.device_types] == ["A100-SXM4-80GB", "V100-SXM2-32GB"]
    assert mixed.num_devices == 64
    assert mixed.path(0, 32).bw_bytes_per_s == 6.25e9  # the V100 node's NIC share
    with pytest.raises(ConfigError, match="composite of 8 nodes"):
        load_cluster("two-sites", nodes=4)
    with pytest.raises(ConfigError, match="nodes must be"):
        load_cluster("a100-sxm4-80gb", nodes=0)


def test_many_calls_are_cheap():
    c = load_cluster("h100-sxm5-80gb", nodes=64)
    groups = [list(range(r, 512, 8)) for r in range(8)]  # 8 DP groups of 64 under TP=8
    times = {c.collective_time("all_reduce", g, 1e9) for g in groups}
    assert len(times) == 1 and all(math.isfinite(t) and t > 0 for t in times)
    import time
    start = time.perf_counter()
    for _ in range(2000):
        c.collective_time("all_reduce", groups[3], 1e9)
    assert time.perf_counter() - start < 2.0


def test_gb200_nvl72_groups_of_up_to_72_stay_on_nvlink():
    """A GB200 NVL72 rack is one node of 72 devices: a tensor-parallel group of 16 or 32
    GPUs (devices 0 and 40 included) runs over NVLink, not the network; only groups that
    cross racks use the NICs.  On DGX B200 nodes of 8 the same groups leave the node."""
    nvl = load_cluster("gb200-nvl72", nodes=2)
    assert nvl.num_devices == 144 and nvl.num_nodes == 2
    link = nvl.path(0, 40)
    assert link.kind == "intra_node" and link.bw_bytes_per_s == 900e9
    assert nvl.path(0, 71).kind == "intra_node"
    assert nvl.path(0, 72).kind == "inter_node"
    assert nvl.path(0, 72).bw_bytes_per_s == 50e9  # one 400 Gb/s NIC per GPU
    for group in (range(16), range(32), range(8, 40), [0, 40], range(72)):
        params = nvl.collective_params("all_reduce", group, nbytes=1e9)
        assert {lv.kind for lv in params.levels} == {"intra_node"}
        assert params.bottleneck == "intra_node"
    # the same 32 ranks on four DGX B200 nodes go through the NICs and take longer
    dgx = load_cluster("b200-sxm-180gb", nodes=4)
    assert dgx.path(0, 8).kind == "inter_node"
    assert dgx.collective_params("all_reduce", range(32), nbytes=1e9).bottleneck != "intra_node"
    assert nvl.collective_time("all_reduce", range(32), 1e9) < \
        dgx.collective_time("all_reduce", range(32), 1e9)
    # a group split over two racks pays the network
    split = list(range(56, 88))
    assert nvl.collective_time("all_reduce", split, 1e9) > \
        nvl.collective_time("all_reduce", range(32), 1e9)
    assert "inter_node" in {lv.kind for lv in nvl.collective_params("all_reduce", split,
                                                                     nbytes=1e9).levels}


def test_estimate_and_plan_take_a_profile_name_for_the_cluster():
    """A new user passes the profile's name where a Cluster goes: one node of it (not an
    AttributeError); anything else is a ConfigError that says what to pass."""
    import autoplan
    from autoplan.errors import ConfigError, UnknownProfileError
    from autoplan.models import GPT, GPTConfig
    g = autoplan.trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=2)),
                       seq_len=16)
    s = autoplan.Strategy(dp=8, global_batch=8)
    by_name = autoplan.estimate(g, "h100-sxm5-80gb", s)
    assert by_name.to_dict() == autoplan.estimate(g, load_cluster("h100-sxm5-80gb"), s).to_dict()
    assert autoplan.plan(g, "h100-sxm5-80gb", global_batch=8).num_devices == 8
    with pytest.raises(UnknownProfileError, match="Did you mean 'h100-sxm5-80gb'"):
        autoplan.estimate(g, "h100-sxm5-80g", s)
    with pytest.raises(ConfigError, match="expected a Cluster"):
        autoplan.estimate(g, 42, s)
