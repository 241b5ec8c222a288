"""Host memory, host links and CPU-only servers in profiles and clusters."""

from __future__ import annotations

import copy

import pytest
import yaml

from autoplan.errors import ConfigError, ProfileError
from autoplan.hardware import (Cluster, HostSpec, ServerProfile, load_cluster, load_profile,
                               profile_to_yaml)
from autoplan.hardware.profile_yaml import _YamlLoader
from autoplan.hardware.profiles import find_profile_file, parse_profile


def _read(name):
    return yaml.load(find_profile_file(name).read_text(), Loader=_YamlLoader)  # noqa: S506


def _node(**host):
    data = _read("a100-sxm4-80gb")
    data["host"] = {**data["host"], **host}
    return data


def test_every_gpu_profile_states_its_host_with_a_source():
    for name in ("a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm5-80gb", "h200-sxm-141gb",
                 "b200-sxm-180gb", "v100-sxm2-32gb", "gb200-nvl72"):
        host = load_profile(name).host
        assert host is not None and host.pcie_bw_bytes_per_s > 0 and len(host.source) > 40
    assert load_profile("a100-sxm4-80gb").host.memory_bytes == 2048 * 2**30


def test_host_and_server_sections_are_checked_by_name():
    with pytest.raises(ProfileError, match=r"host.memory_bw.*missing key"):
        parse_profile({k: v for k, v in _node().items()} | {"host": {"memory_GiB": 1, "cores": 2,
                                                                     "source": "x"}})
    with pytest.raises(ProfileError, match="host.cores: expected"):
        parse_profile(_node(cores=0))
    server = _read("cpu-server-2s-epyc")
    bad = copy.deepcopy(server)
    bad["host"]["pcie_bw_GBps"] = 16
    with pytest.raises(ProfileError, match=r"unknown key\(s\) \['pcie_bw_GBps'\]"):
        parse_profile(bad)
    p = parse_profile(server)
    assert isinstance(p, ServerProfile) and p.host.pcie_bw_bytes_per_s is None
    assert parse_profile(yaml.load(profile_to_yaml(p), Loader=_YamlLoader)) == p  # noqa: S506


def test_servers_join_a_cluster_and_round_trip():
    c = load_cluster("a100-sxm4-80gb", nodes=2).with_servers("cpu-server-2s-epyc", 2)
    assert [s.name for s in c.servers] == ["s0", "s1"] and c.num_devices == 16
    assert Cluster.from_json(c.to_json()) == c
    link = c.server_link(1, 9)
    assert link.bw_bytes_per_s == 25e9 and link.kind == "inter_node"   # the GPU's NIC share
    assert c.server_nic_bytes_per_s(0) == 2 * 100e9 / 8
    assert len(c.without([0]).servers) == 2
    assert "2 servers" in repr(c)
    with pytest.raises(ProfileError, match="is a server profile"):
        load_cluster("cpu-server-2s-epyc")
    with pytest.raises(ProfileError, match="servers need a server profile"):
        c.with_servers("a100-sxm4-80gb", 1)
    with pytest.raises(ConfigError, match="count must be an integer >= 1"):
        c.with_servers("cpu-server-2s-epyc", 0)
    with pytest.raises(ConfigError, match="site 'mars' has no devices"):
        c.with_servers("cpu-server-2s-epyc", 1, site="mars")
    with pytest.raises(ConfigError, match="server index 5 out of range"):
        c.server_profile_of(5)


def test_host_records_refuse_impossible_values():
    with pytest.raises(ProfileError, match="memory_bytes"):
        HostSpec(memory_bytes=0, memory_bw_bytes_per_s=1.0, cores=1, source="x")
    with pytest.raises(ProfileError, match="pcie_bw_bytes_per_s"):
        HostSpec(memory_bytes=1, memory_bw_bytes_per_s=1.0, cores=1, source="x",
                 pcie_bw_bytes_per_s=-1.0)


def test_the_profiler_measures_this_host():
    from autoplan.hardware.profiler import measure_host

    host = measure_host(cuda=False, quick=True)
    assert host.memory_bytes > 2**30 and host.memory_bw_bytes_per_s > 1e8 and host.cores >= 1
    assert host.pcie_bw_bytes_per_s is None and "tensor copy" in host.source
