"""Profiles: the shipped files, the schema, and what loading rejects."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from autoplan.errors import ConfigError, ProfileError, RecordError, UnknownProfileError
from autoplan.hardware import (
    CollectiveEfficiency,
    CompositeProfile,
    DeviceType,
    EfficiencyTable,
    IntraNodeTopology,
    MeshLink,
    NodeSpec,
    Profile,
    ServerProfile,
    available_profiles,
    load_cluster,
    load_profile,
    profile_to_yaml,
)
from autoplan.cost.constants import cost_profiles_dir
from autoplan.hardware.profiles import (
    find_profile_file,
    parse_profile,
    profile_dirs,
    shipped_profiles_dir,
    user_profiles_dir,
)

REQUIRED = ("a100-sxm4-80gb", "a100-sxm4-40gb", "h100-sxm5-80gb", "h200-sxm-141gb",
            "b200-sxm-180gb", "gb200-nvl72", "v100-sxm2-32gb", "mixed-a100-v100", "two-sites")
SHIPPED = sorted(p.stem for p in shipped_profiles_dir().glob("*.yaml"))


def test_required_profiles_are_shipped():
    assert set(REQUIRED) <= set(SHIPPED)
    assert set(REQUIRED) <= set(available_profiles())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_round_trips(name):
    profile = load_profile(name)
    assert profile.name == name
    # JSON, exactly
    assert type(profile).from_json(profile.to_json()) == profile
    # YAML (SI keys), exactly
    assert parse_profile(yaml.safe_load(profile_to_yaml(profile))) == profile
    # and it builds a cluster (a CPU server joins one: it has no device of its own)
    if isinstance(profile, ServerProfile):
        assert load_cluster("a100-sxm4-80gb").with_servers(name, 1).servers
        return
    cluster = load_cluster(name)
    assert cluster.num_devices >= 1


@pytest.mark.parametrize("name", [n for n in SHIPPED if not n.startswith("local-")])
def test_shipped_figures_carry_sources(name):
    profile = load_profile(name)
    if isinstance(profile, CompositeProfile):
        texts = [l.source for l in profile.site_links]
        texts += [l.collective_efficiency.source for l in profile.site_links]
    elif isinstance(profile, ServerProfile):
        texts = [profile.host.source, profile.network.source, profile.network.latency_source,
                 profile.network.collective_efficiency.source]
    else:
        texts = [profile.device.source, profile.node.source, profile.node.latency_source,
                 profile.node.collective_efficiency.source]
        texts += [t.source for t in profile.device.matmul_efficiency.values()]
        if profile.network is not None:
            texts += [profile.network.source, profile.network.latency_source,
                      profile.network.collective_efficiency.source]
    assert all(len(t) > 10 for t in texts)


def test_datasheet_values_converted_to_si():
    a100 = load_profile("a100-sxm4-80gb")
    assert a100.device.peak_flops_per_s == {"fp64": 9.7e12, "fp32": 19.5e12, "tf32": 156e12,
                                             "bf16": 312e12, "fp16": 312e12}
    assert a100.device.memory_bytes == 80 * 2**30
    assert a100.device.memory_bw_bytes_per_s == 2039e9
    assert a100.node.devices_per_node == 8
    assert a100.node.topology is IntraNodeTopology.NVSWITCH
    assert a100.node.bw_unidir_bytes_per_s == 300e9  # 600 GB/s bidirectional
    assert a100.node.latency_s == pytest.approx(2e-6, rel=1e-15)
    assert a100.network.nics_per_node == 8
    assert a100.network.bw_per_nic_bytes_per_s == 25e9  # 200 Gb/s
    assert a100.network.bw_per_node_bytes_per_s == 200e9
    assert load_profile("a100-sxm4-40gb").device.memory_bytes == 40 * 2**30
    assert load_profile("a100-sxm4-40gb").device.memory_bw_bytes_per_s == 1555e9
    h100 = load_profile("h100-sxm5-80gb")
    assert h100.device.peak_flops_per_s["bf16"] == 989e12
    assert h100.node.bw_unidir_bytes_per_s == 450e9
    assert h100.network.bw_per_node_bytes_per_s == 400e9  # 8x 400 Gb/s
    h200 = load_profile("h200-sxm-141gb")
    # the same Hopper compute as H100, FP8 included (3,958 sparse on both datasheets)
    assert h200.device.peak_flops_per_s == h100.device.peak_flops_per_s
    assert h100.device.architecture == h200.device.architecture == "hopper"
    assert h200.device.peak_flops_per_s["fp8"] == 1979e12  # 3,958 with sparsity, halved
    assert h200.device.memory_bytes == 141 * 2**30
    assert h200.device.memory_bw_bytes_per_s == 4.8e12
    v100 = load_profile("v100-sxm2-32gb")
    assert "bf16" not in v100.device.peak_flops_per_s
    assert v100.node.topology is IntraNodeTopology.HYBRID_CUBE_MESH
    assert v100.network.bw_per_node_bytes_per_s == 50e9  # 4x 100 Gb/s
    assert v100.node.link_bw_bytes_per_s(0, 3) == 50e9
    assert v100.node.link_bw_bytes_per_s(0, 5) == 0.0
    two = load_profile("two-sites")
    assert two.site_links[0].bw_bytes_per_s == 12.5e9 and two.site_links[0].latency_s == 0.01


def test_blackwell_peaks_are_dense():
    """NVIDIA quotes Blackwell tensor-core peaks with 2:4 sparsity (and GB200 NVL72 per
    rack); the profiles hold dense per-GPU figures, where FP8 is twice BF16."""
    b200 = load_profile("b200-sxm-180gb")
    gb200 = load_profile("gb200-nvl72")
    assert b200.device.peak_flops_per_s == {"fp64": 37e12, "fp32": 75e12, "tf32": 1100e12,
                                             "bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12}
    assert gb200.device.peak_flops_per_s["bf16"] == 2500e12
    assert gb200.device.peak_flops_per_s["fp8"] == 720e15 / 72 / 2  # rack total, sparse
    for p in (b200, gb200):
        peaks = p.device.peak_flops_per_s
        assert peaks["fp8"] == 2 * peaks["bf16"] == 2 * peaks["fp16"]
        assert peaks["tf32"] <= peaks["bf16"] / 2 and peaks["fp32"] < peaks["tf32"] / 10
        assert p.device.peak("fp8") > load_profile("h200-sxm-141gb").device.peak("fp8")
    assert b200.device.memory_bytes == 180 * 2**30   # 1,440 GB / 8
    assert gb200.device.memory_bytes == 186 * 2**30   # 13.4 TB / 72
    assert b200.device.memory_bw_bytes_per_s == 7.7e12
    assert gb200.device.memory_bw_bytes_per_s == 8e12  # 576 TB/s / 72
    # NVLink 5: 1.8 TB/s per GPU bidirectional, in an 8-GPU node and in the 72-GPU rack
    assert b200.node.devices_per_node == 8 and gb200.node.devices_per_node == 72
    assert b200.node.bw_unidir_bytes_per_s == gb200.node.bw_unidir_bytes_per_s == 900e9
    # one 400 Gb/s ConnectX-7 per GPU in both
    assert b200.network.bw_per_node_bytes_per_s == 8 * 50e9
    assert gb200.network.bw_per_node_bytes_per_s == 72 * 50e9


def test_gb200_nvl72_plans_a_70b_model_in_one_rack():
    pytest.importorskip("transformers")
    import autoplan
    cluster = load_cluster("gb200-nvl72", nodes=1)
    graph = autoplan.trace("zoo:llama3-70b", seq_len=4096)
    plan = autoplan.plan(graph, cluster, global_batch=576)
    assert plan.num_devices == 72 and sorted(plan.mesh.devices) == list(range(72))
    tp, cp = plan.mesh.degree("tp"), plan.cp
    assert 72 % (tp * cp) == 0        # tensor and context groups inside the NVLink domain
    assert 0 < plan.estimate.step_time_s < 3600


def test_dtype_fallback():
    v100 = load_profile("v100-sxm2-32gb").device
    assert v100.resolve_dtype("bf16") == "fp16"
    assert v100.resolve_dtype("tf32") == "fp32"
    assert v100.peak("bf16") == 125e12
    with pytest.raises(ConfigError, match="supports"):
        v100.resolve_dtype("fp8")


def _table(source="test"):
    return EfficiencyTable(((1e9, 0.2), (1e11, 0.8)), source=source)


def test_efficiency_table_interpolates_in_log_size():
    t = _table()
    assert t.efficiency(1e9) == 0.2
    assert t.efficiency(1e10) == pytest.approx(0.5, rel=1e-15)
    assert t.efficiency(10 ** 9.5) == pytest.approx(0.35, rel=1e-15)
    assert t.efficiency(1.0) == 0.2 and t.efficiency(1e20) == 0.8
    with pytest.raises(ConfigError):
        t.efficiency(0.0)
    dev = DeviceType("X", {"bf16": 100e12, "fp32": 10e12}, 2**30, 1e12,
                     {"default": t, "fp32": EfficiencyTable(((1.0, 1.0),), "test")}, "test")
    assert dev.efficiency(1e10, "bf16") == pytest.approx(0.5, rel=1e-15)
    assert dev.achieved_flops_per_s(1e10, "bf16") == pytest.approx(50e12, rel=1e-15)
    assert dev.matmul_time_s(1e10, "bf16") == pytest.approx(2e-4, rel=1e-15)
    assert dev.efficiency(1e10, "fp32") == 1.0
    assert dev.efficiency(1e10, "tf32") == 1.0  # falls back to fp32


def test_records_reject_impossible_values():
    t = _table()
    with pytest.raises(ProfileError, match="memory_bytes"):
        DeviceType("X", {"bf16": 1e12}, 0, 1e12, {"default": t}, "test")
    with pytest.raises(ProfileError, match="memory_bw_bytes_per_s"):
        DeviceType("X", {"bf16": 1e12}, 1, -1.0, {"default": t}, "test")
    with pytest.raises(ProfileError, match="no efficiency table"):
        DeviceType("X", {"bf16": 1e12}, 1, 1.0, {"fp32": t}, "test")
    with pytest.raises(ProfileError, match="strictly increasing"):
        EfficiencyTable(((1e9, 0.2), (1e9, 0.3)), "test")
    eff = CollectiveEfficiency.uniform(1.0, "test")
    with pytest.raises(ProfileError, match="bw_unidir_bytes_per_s"):
        NodeSpec(4, IntraNodeTopology.NVSWITCH, -1.0, 0.0, eff, "s", "s")
    with pytest.raises(ProfileError, match="in \\(0, 1\\]"):
        CollectiveEfficiency.uniform(1.5, "test")
    with pytest.raises(ProfileError, match="sum to"):
        NodeSpec(2, IntraNodeTopology.HYBRID_CUBE_MESH, 10.0, 0.0, eff, "s", "s",
                 (MeshLink((0, 1), 20.0),))


def test_json_rejects_missing_and_unknown_keys():
    profile = load_profile("a100-sxm4-80gb")
    data = json.loads(profile.to_json())
    bad = copy.deepcopy(data)
    bad["device"]["colour"] = "green"
    with pytest.raises(RecordError, match="Profile.device: unknown key"):
        Profile.from_dict(bad)
    bad = copy.deepcopy(data)
    del bad["node"]["latency_s"]
    with pytest.raises(RecordError, match="Profile.node: missing key 'latency_s'"):
        Profile.from_dict(bad)
    bad = copy.deepcopy(data)
    bad["network"]["bw_per_nic_bytes_per_s"] = -1.0
    with pytest.raises(RecordError, match="bw_per_nic_bytes_per_s"):
        Profile.from_dict(bad)


# ----------------------------------------------------------------- YAML errors

def _a100_yaml() -> dict:
    return yaml.safe_load(find_profile_file("a100-sxm4-80gb").read_text())


def _write(tmp_path: Path, data: dict | str, name: str = "bad.yaml") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _error(tmp_path, data, name="bad.yaml") -> ProfileError:
    path = _write(tmp_path, data, name)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert info.value.file is not None and info.value.file.endswith(name)
    assert name in str(info.value)
    return info.value


def test_yaml_missing_key(tmp_path):
    data = _a100_yaml()
    del data["device"]["memory_GiB"]
    err = _error(tmp_path, data)
    assert err.path == "device.memory"
    assert "memory_GiB" in str(err) and "memory_bytes" in str(err)

    data = _a100_yaml()
    del data["node"]["collective_efficiency"]["p2p"]
    err = _error(tmp_path, data)
    assert err.path == "node.collective_efficiency.p2p"
    assert "missing key 'p2p'" in str(err)

    data = _a100_yaml()
    del data["kind"]
    assert _error(tmp_path, data).path == "kind"


def test_yaml_unknown_key(tmp_path):
    data = _a100_yaml()
    data["device"]["colour"] = "green"
    err = _error(tmp_path, data)
    assert err.path == "device.colour"
    assert "unknown key(s) ['colour']" in str(err) and "memory_GiB" in str(err)

    data = _a100_yaml()
    data["network"]["collective_efficiency"]["allreduce"] = 0.9
    assert _error(tmp_path, data).path == "network.collective_efficiency.allreduce"


@pytest.mark.parametrize("section, key, value, expectation", [
    ("node", "bw_bidir_GBps", -600, "> 0"),
    ("node", "bw_bidir_GBps", 0, "> 0"),
    ("device", "memory_GiB", 0, "> 0"),
    ("network", "bw_per_nic_Gbps", -200, "> 0"),
    ("network", "latency_us", -1, ">= 0"),
    ("network", "oversubscription", 0.5, ">= 1"),
    ("node", "devices_per_node", 0, "integer >= 1"),
    ("node", "devices_per_node", "eight", "integer >= 1"),
    ("node", "topology", "torus", "one of"),
    ("device", "memory_bw_GBps", True, "a number"),
    ("device", "memory_bw_GBps", ".inf", "a number"),
])
def test_yaml_rejects_impossible_values(tmp_path, section, key, value, expectation):
    data = _a100_yaml()
    data[section][key] = value
    text = yaml.safe_dump(data, sort_keys=False)
    if value == ".inf":
        text = text.replace("'.inf'", ".inf")
    err = _error(tmp_path, text)
    assert err.path == f"{section}.{key}"
    assert expectation in str(err)


def test_yaml_collective_latency_is_optional_and_checked(tmp_path):
    """``node.collective_latency`` (measured profiles): every operation's per-step latency with
    a unit, and a source; absent, the node's hop latency prices every operation."""
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
    data = _a100_yaml()
    data["node"]["collective_latency"] = {**{f"{op}_us": 10.0 * (i + 1) for i, op in enumerate(ops)},
                                          "source": "test"}
    profile = load_profile(_write(tmp_path, data, "ok.yaml"))
    lat = profile.node.collective_latency
    assert lat is not None and lat.all_reduce == pytest.approx(10e-6) and lat.p2p == pytest.approx(60e-6)
    assert parse_profile(yaml.safe_load(profile_to_yaml(profile))) == profile
    assert load_profile(_write(tmp_path, _a100_yaml(), "plain.yaml")).node.collective_latency is None

    bad = copy.deepcopy(data)
    bad["node"]["collective_latency"]["p2p_us"] = -1
    err = _error(tmp_path, bad)
    assert err.path == "node.collective_latency.p2p_us" and ">= 0" in str(err)
    bad = copy.deepcopy(data)
    del bad["node"]["collective_latency"]["broadcast_us"]
    err = _error(tmp_path, bad)
    assert err.path == "node.collective_latency.broadcast" and "broadcast_us" in str(err)
    bad = copy.deepcopy(data)
    bad["node"]["collective_latency"]["allreduce_us"] = 5
    assert _error(tmp_path, bad).path == "node.collective_latency.allreduce_us"


def test_yaml_rejects_bad_efficiency_points(tmp_path):
    data = _a100_yaml()
    data["device"]["matmul_efficiency"]["default"]["points"][2] = [1e9, 1.5]
    err = _error(tmp_path, data)
    assert err.path == "device.matmul_efficiency.default.points[2]"
    assert "(0, 1]" in str(err)
    data = _a100_yaml()
    data["device"]["matmul_efficiency"]["default"]["points"][2] = [1e6, 0.3]
    err = _error(tmp_path, data)
    assert err.path == "device.matmul_efficiency.default.points[2][0]"
    assert "strictly increasing" in str(err)


def test_yaml_rejects_the_same_quantity_twice(tmp_path):
    data = _a100_yaml()
    data["device"]["memory_GB"] = 80
    err = _error(tmp_path, data)
    assert "given twice" in str(err)


def test_yaml_syntax_and_duplicate_keys(tmp_path):
    err = _error(tmp_path, "kind: node\nname: [unclosed\n")
    assert "not valid YAML" in str(err) and "line" in str(err)
    err = _error(tmp_path, "kind: node\nkind: node\n")
    assert "duplicate key 'kind'" in str(err)
    err = _error(tmp_path, "- just\n- a list\n")
    assert "expected a mapping" in str(err)


def test_a_file_that_is_not_a_profile_is_named_not_quoted_whole(tmp_path):
    """A CSV (or any text YAML reads as one string) given for a profile: the error says
    what it got and how it begins, not the whole file."""
    text = "model,label,measured_s\n" + "gpt,dp2 tp1 pp2 mb4x1 gpipe,0.133\n" * 200
    err = _error(tmp_path, text)
    message = str(err)
    assert "expected a mapping (a profile)" in message
    assert re.search(r"got str of \d{4} characters beginning 'model,label,measured_s gpt,",
                     message), message
    assert len(message) < 300


def test_yaml_reads_exponent_floats(tmp_path):
    text = find_profile_file("a100-sxm4-80gb").read_text().replace("[1.0e8, 0.05]", "[1e8, 0.05]")
    assert "[1e8, 0.05]" in text
    profile = load_profile(_write(tmp_path, text, "ok.yaml"))
    assert profile.device.matmul_efficiency["default"].points[1] == (1e8, 0.05)


def test_unknown_profile_lists_available_and_suggests():
    with pytest.raises(UnknownProfileError) as info:
        load_cluster("a100-sxm4-80g")
    message = str(info.value)
    assert "Did you mean 'a100-sxm4-80gb'" in message
    for name in REQUIRED:
        assert name in message
    assert isinstance(info.value, KeyError) and isinstance(info.value, ProfileError)


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "nope.yaml")


def test_extra_profile_dirs_and_name_check(tmp_path, monkeypatch):
    data = _a100_yaml()
    data["name"] = "my-a100"
    _write(tmp_path, data, "my-a100.yaml")
    data["name"] = "other-name"
    _write(tmp_path, data, "mismatch.yaml")
    monkeypatch.setenv("AUTOPLAN_PROFILES", str(tmp_path))
    assert {"my-a100", "mismatch", "a100-sxm4-80gb"} <= set(available_profiles())
    assert load_cluster("my-a100", nodes=2).num_devices == 16
    with pytest.raises(ProfileError, match="declares name 'other-name'"):
        load_profile("mismatch")


def test_user_profiles_dir_is_searched_before_the_shipped_one(tmp_path, monkeypatch):
    # $AUTOPLAN_HOME/profiles (where `autoplan profile` writes) is found by name, and a
    # profile there overrides a shipped one of the same name; $AUTOPLAN_PROFILES comes first
    monkeypatch.delenv("AUTOPLAN_PROFILES", raising=False)
    monkeypatch.setenv("AUTOPLAN_HOME", str(tmp_path / "home"))
    assert user_profiles_dir() == tmp_path / "home" / "profiles"
    assert profile_dirs() == [tmp_path / "home" / "profiles", shipped_profiles_dir()]
    data = _a100_yaml()
    data["name"] = "my-box"
    _write(tmp_path / "home" / "profiles", data, "my-box.yaml")
    assert "my-box" in available_profiles()
    assert load_cluster("my-box", nodes=1).num_devices == 8
    data["name"] = "a100-sxm4-80gb"
    data["device"]["memory_GiB"] = 40
    _write(tmp_path / "home" / "profiles", data, "a100-sxm4-80gb.yaml")
    assert load_profile("a100-sxm4-80gb").device.memory_bytes == 40 * 2**30
    monkeypatch.setenv("AUTOPLAN_PROFILES", str(tmp_path / "extra"))
    assert profile_dirs()[0] == tmp_path / "extra"


def test_default_user_dir_is_under_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOPLAN_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_profiles_dir() == tmp_path / ".autoplan" / "profiles"


def test_shipped_profiles_dir_holds_the_cost_data():
    # the checkout's profiles/ here; autoplan/_profiles in a wheel (the CI's wheel step)
    assert (shipped_profiles_dir() / "cost" / "cost-model.yaml").is_file()
    assert cost_profiles_dir() == shipped_profiles_dir() / "cost"


def test_composite_schema_errors(tmp_path):
    composite = yaml.safe_load(find_profile_file("two-sites").read_text())
    bad = copy.deepcopy(composite)
    bad["groups"][1]["nodes"] = 0
    assert _error(tmp_path, bad).path == "groups[1].nodes"
    bad = copy.deepcopy(composite)
    bad["site_links"][0]["bw_Gbps"] = -100
    assert _error(tmp_path, bad).path == "site_links[0].bw_Gbps"
    bad = copy.deepcopy(composite)
    bad["groups"][0]["profile"] = "a100-sxm4-8gb"
    path = _write(tmp_path, bad, "typo.yaml")
    with pytest.raises(UnknownProfileError, match="Did you mean 'a100-sxm4-80gb'"):
        load_cluster(path)
