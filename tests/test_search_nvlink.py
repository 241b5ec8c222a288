"""Tensor-, context- and expert-parallel groups in large NVLink domains (GB200 NVL72).

A GB200 NVL72 rack is one node of 72 GPUs: groups of 16, 32 or 64 GPUs run over NVLink
when they fit one rack.  The search lays ranks over consecutive devices, so a group
size is allowed when it tiles every node's devices (no group straddles two racks); the
cost model prices a group that does straddle (a layout given to ``estimate``) over the
network.  Exact answers on small hand-built graphs.
"""

from __future__ import annotations

import pytest

import autoplan
from autoplan import Strategy
from autoplan.errors import ConfigError
from autoplan.models import GPT, GPTConfig
from autoplan.search import SearchSpace
from autoplan.search.search import _combos, _domain_size

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt16():
    """16 heads: tensor parallel degrees up to 16."""
    return autoplan.trace(GPT(GPTConfig(vocab_size=256, seq_len=64, hidden=256, heads=16,
                                        layers=2)), seq_len=64)


@pytest.fixture(scope="module")
def gpt56():
    """56 heads: tensor parallel degrees 7, 14, 28 and 56 too (they tile a node of 56 but
    not one of 72)."""
    return autoplan.trace(GPT(GPTConfig(vocab_size=256, seq_len=64, hidden=448, heads=56,
                                        layers=2)), seq_len=64)


@pytest.fixture(scope="module")
def moe16():
    """A mixture of experts with 16 experts: ep up to 16."""
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                     num_local_experts=16, num_experts_per_tok=2)
    return autoplan.trace(transformers.MixtralForCausalLM(cfg), seq_len=16)


def _racks(nodes: int, **kw):
    return autoplan.load_cluster("gb200-nvl72", nodes=nodes, **kw)


def _nodes_of(cluster, devices) -> set[int]:
    return {cluster.devices[d].node for d in devices}


# ----------------------------------------------------------- the domain
def test_domain_is_what_tiles_every_node():
    assert _domain_size(_racks(1)) == 72
    assert _domain_size(_racks(2)) == 72
    assert _domain_size(_racks(2, devices_per_node=64)) == 64
    assert _domain_size(_racks(2).subset(range(128))) == 8          # 72 + 56
    assert _domain_size(autoplan.load_cluster("h100-sxm5-80gb", nodes=4)) == 8


def test_load_cluster_devices_per_node():
    c = _racks(2, devices_per_node=64)
    assert c.num_devices == 128 and [len(n.local_ranks) for n in c.nodes] == [64, 64]
    assert c.path(0, 63).kind == "intra_node" and c.path(63, 64).kind == "inter_node"
    assert c.path(0, 64).bw_bytes_per_s == 50e9     # each GPU keeps its own 400 Gb/s NIC
    assert _racks(2, devices_per_node=72) == _racks(2)
    for bad in (0, 73, True, 1.5):
        with pytest.raises(ConfigError, match="devices_per_node"):
            _racks(1, devices_per_node=bad)
    with pytest.raises(ConfigError, match="composite"):
        autoplan.load_cluster("two-sites", devices_per_node=4)


# ----------------------------------------------------------- what the search enumerates
def test_tp_cp_groups_never_straddle_two_racks(gpt56):
    """On the first 128 GPUs of two racks (72 + 56) a group of 7, 14, 28 or 56 tiles the
    second rack but not the first: the rack edge at device 72 would cut one."""
    cluster = _racks(2).subset(range(128))
    combos = list(_combos(gpt56, cluster, 128, SearchSpace(context_parallel=(1, 2, 4))))
    assert combos
    sizes = {c.tp * c.cp for c in combos}
    assert sizes <= {1, 2, 4, 8}, sizes
    for c in combos:
        for start in range(0, 128, c.tp * c.cp):
            assert len(_nodes_of(cluster, range(start, start + c.tp * c.cp))) == 1


def test_groups_of_16_32_64_on_racks_of_64(gpt16):
    """64 GPUs of each rack: tp = 16 and tp x cp = 32 stay inside a rack."""
    cluster = _racks(2, devices_per_node=64)
    space = SearchSpace(context_parallel=(1, 2, 4))
    sizes = {(c.tp, c.cp) for c in _combos(gpt16, cluster, 128, space)}
    assert {(16, 1), (16, 2), (16, 4), (8, 4)} <= sizes
    assert all(64 % (tp * cp) == 0 for tp, cp in sizes)


def test_expert_groups_inside_a_rack_or_over_whole_racks(moe16):
    """ep x tp consecutive devices: inside one rack (dividing 72) or whole racks; on two full
    racks ep = 16 would put devices 64-79 in one group, 8 on each rack."""
    cluster = _racks(2)
    eps = {c.ep for c in _combos(moe16, cluster, 144, SearchSpace())}
    assert eps == {1, 2, 4, 8}
    eps64 = {c.ep for c in _combos(moe16, _racks(2, devices_per_node=64), 128, SearchSpace())}
    assert eps64 == {1, 2, 4, 8, 16}
    # the first 128 GPUs (72 + 56): groups of 16 would put devices 64-79 in one
    first128 = _racks(2).subset(range(128))
    assert {c.ep for c in _combos(moe16, first128, 128, SearchSpace())} == {1, 2, 4, 8}


def test_plan_places_no_expert_group_across_racks(moe16):
    plan = autoplan.plan(moe16, _racks(2), global_batch=144,
                         space=SearchSpace(expert_parallel=(16,)), use_all_devices=True)
    assert plan.ep == 1        # ep = 16 cannot be placed on 72-GPU racks
    plan = autoplan.plan(moe16, _racks(2, devices_per_node=64), global_batch=128,
                         space=SearchSpace(expert_parallel=(16,)), use_all_devices=True)
    assert plan.ep == 16


def test_plan_tp16_on_128_gb200_is_priced_over_nvlink(gpt16):
    cluster = _racks(2, devices_per_node=64)
    plan = autoplan.plan(gpt16, cluster, global_batch=64,
                         space=SearchSpace(tensor_parallel=(16,), context_parallel=(2,)),
                         use_all_devices=True)
    assert plan.mesh.degree("tp") == 16 and plan.cp == 2
    devices = plan.mesh.devices
    for start in range(0, len(devices), 32):
        assert len(_nodes_of(cluster, devices[start:start + 32])) == 1
    # the same layout on one rack's 64 GPUs costs the same per replica: NVLink only
    one = _racks(1, devices_per_node=64)
    s = Strategy(dp=plan.dp // 2, tp=16, cp=2, pp=plan.pp, global_batch=32,
                 micro_batch=plan.micro_batch)
    s2 = Strategy(dp=plan.dp, tp=16, cp=2, pp=plan.pp, global_batch=64,
                  micro_batch=plan.micro_batch)
    on_one = autoplan.estimate(gpt16, one, s).breakdown
    on_two = autoplan.estimate(gpt16, cluster, s2).breakdown
    assert on_two["tp_comm_s"] == pytest.approx(on_one["tp_comm_s"], rel=1e-12)
    assert on_two["cp_comm_s"] == pytest.approx(on_one["cp_comm_s"], rel=1e-12)


def test_groups_that_cannot_tile_the_racks_are_refused_with_the_reason(gpt16):
    with pytest.raises(ConfigError, match=r"NVLink domain.*\[72\]"):
        autoplan.plan(gpt16, _racks(2), global_batch=144,
                      space=SearchSpace(tensor_parallel=(16,)), use_all_devices=True)
    # on 64 GPUs of a rack (or 128: 72 + 56, groups of 8 tile) groups of 16 fit a rack
    plan = autoplan.plan(gpt16, _racks(2), global_batch=144,
                         space=SearchSpace(tensor_parallel=(16,)))
    assert plan.mesh.degree("tp") == 16 and plan.idle_devices
    for start in range(0, plan.num_devices, 16):
        assert len(_nodes_of(_racks(2), plan.mesh.devices[start:start + 16])) == 1


# ----------------------------------------------------------- what estimate prices
def test_a_group_straddling_two_racks_is_priced_over_the_network(gpt16):
    """dp = 9 replicas of tp = 16 on two full racks: replica 4 is devices 64-79, 8 on each
    rack.  Its all-reduces cross the network, and the step waits for it."""
    racks = _racks(2)
    # 1024 sequences a micro-batch: all-reduces of 64 MiB, bandwidth-bound
    est = autoplan.estimate(gpt16, racks, Strategy(dp=9, tp=16, global_batch=9 * 1024,
                                                   micro_batch=1024))
    one = Strategy(tp=16, global_batch=1024, micro_batch=1024)
    inside = autoplan.estimate(gpt16, racks.subset(range(16)), one)
    split = autoplan.estimate(gpt16, racks.subset(range(64, 80)), one)
    assert split.breakdown["tp_comm_s"] > 1.2 * inside.breakdown["tp_comm_s"]
    assert est.breakdown["tp_comm_s"] == pytest.approx(split.breakdown["tp_comm_s"], rel=1e-12)
    assert any("straddle" in n for n in est.notes)
    # groups that tile the racks: one kind of replica, no note
    ok = autoplan.estimate(gpt16, racks, Strategy(dp=18, tp=8, global_batch=18 * 64,
                                                  micro_batch=64))
    assert not any("straddle" in n for n in ok.notes)


def test_straddling_expert_group_is_priced_over_the_network(moe16):
    racks = _racks(2)
    est = autoplan.estimate(moe16, racks, Strategy(dp=144, ep=16, global_batch=144 * 256,
                                                   micro_batch=256))
    tiled = autoplan.estimate(moe16, _racks(2, devices_per_node=64),
                              Strategy(dp=128, ep=16, global_batch=128 * 256, micro_batch=256))
    assert est.breakdown["ep_comm_s"] > 2 * tiled.breakdown["ep_comm_s"]
    assert any("straddle" in n for n in est.notes)


def test_plans_are_deterministic_on_racks(gpt16):
    cluster = _racks(2, devices_per_node=64)
    a = autoplan.plan(gpt16, cluster, global_batch=64)
    b = autoplan.plan(gpt16, cluster, global_batch=64)
    assert a.to_json() == b.to_json()
