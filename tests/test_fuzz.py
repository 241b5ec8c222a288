"""Property-based fuzzing of what a user hands autoplan: command lines, profile YAML and
plan JSON, corrupted at random.  No case may end in a traceback (only a clean exit or a
one-line autoplan error), and a second run prints the same.

A few hundred cases here; ``python benchmarks/fuzz.py`` runs thousands.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import fuzz_cases as fc
from autoplan.errors import AutoplanError, CheckpointError, ConfigError, ProfileError, TraceError
from autoplan.hardware import load_cluster
from autoplan.hardware.profiles import find_profile_file

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])
PROFILE_TEXT = find_profile_file("a100-sxm4-80gb").read_text()


@settings(max_examples=200, **SETTINGS)
@given(data=fc.corrupted_texts(PROFILE_TEXT, fc._YAML_NOISE))
def test_corrupted_profiles_load_or_say_why(tmp_path_factory, data):
    path = fc.write(tmp_path_factory.mktemp("yaml") / "a100-sxm4-80gb.yaml", data)
    outcomes = []
    for _ in range(2):
        try:
            outcomes.append(("ok", load_cluster(path, nodes=2).num_devices))
        except AutoplanError as exc:
            outcomes.append(("error", str(exc)))
    assert outcomes[0] == outcomes[1]
    if outcomes[0][0] == "error":
        message = outcomes[0][1]                        # names the file or the profile
        assert str(path) in message or "'a100-sxm4-80gb'" in message, message


def test_fuzz_plan_corruptions(small_plan_file, tmp_path):
    import json

    from hypothesis import given as given_

    doc = json.loads(small_plan_file.read_text())

    @settings(max_examples=100, **SETTINGS)
    @given_(data=fc.corrupted_json_values(doc))
    def case(data):
        bad = fc.write(tmp_path / "plan.json", data)
        assert fc.check_case(["report", "--plan", str(bad), "--cluster", "a100-sxm4-80gb"]) is None

    case()


@pytest.mark.slow
@settings(max_examples=60, **SETTINGS)
@given(argv=fc.command_lines())
def test_command_lines_exit_cleanly_and_repeat(argv):
    assert fc.check_case(argv) is None


# ---------------------------------------------------------------------- found by fuzzing
@pytest.mark.parametrize("kwargs,field", [
    (dict(profile="a100-sxm4-80gb", nodes=1, site=None), "site"),
    (dict(profile="a100-sxm4-80gb", nodes=1, site=3), "site"),
    (dict(profile="a100-sxm4-80gb", nodes=True), "nodes"),
    (dict(profile=3, nodes=1), "profile"),
    (dict(profile=None, nodes=1), "profile"),
])
def test_a_node_group_of_the_wrong_types_is_a_profile_error(kwargs, field):
    from autoplan.hardware import NodeGroup
    with pytest.raises(ProfileError) as err:       # was AttributeError / TypeError
        NodeGroup(**kwargs)
    assert err.value.path == field


@pytest.mark.parametrize("sites", [("", "west"), (None, "west"), ("east",)])
def test_a_site_link_without_two_site_names_is_a_profile_error(sites):
    from autoplan.hardware import SiteLink
    from autoplan.hardware.profiles import COLLECTIVE_OPS, CollectiveEfficiency
    efficiency = CollectiveEfficiency(**dict.fromkeys(COLLECTIVE_OPS, 0.8), source="x")
    with pytest.raises(ProfileError, match="expected two site names"):   # was AttributeError
        SiteLink(sites=sites, bw_bytes_per_s=1e9, latency_s=0.0,
                 collective_efficiency=efficiency, source="x")


def test_a_cluster_name_that_is_no_string_is_refused():
    import autoplan
    from autoplan.hardware import NodeGroup
    with pytest.raises(ConfigError, match="name must be a string, got 7"):
        autoplan.compose_cluster([NodeGroup("a100-sxm4-80gb", 1)], name=7)   # did not round-trip


@pytest.mark.parametrize("group,expect", [
    ("two-sites", "'two-sites' is a composite profile"),
    ("a100-sxm4-8gb", "unknown profile 'a100-sxm4-8gb'"),
])
def test_a_composite_file_whose_group_fails_is_named(tmp_path, group, expect):
    path = tmp_path / "mine.yaml"
    path.write_text(f"kind: composite\nname: mine\ndescription: one group\n"
                    f"groups:\n  - {{profile: {group}, nodes: 1, site: east}}\n")
    with pytest.raises(ProfileError) as err:
        load_cluster(path)
    assert str(err.value).startswith(f"{path}: ") and expect in str(err.value)


def test_an_hf_config_the_model_code_refuses_is_a_config_error():
    from autoplan.zoo import build_model
    with pytest.raises(ConfigError, match="embed_dim` must be divisible by num_heads"):
        build_model("hf:gpt2", dict(n_embd=20, n_head=3, n_layer=1))     # was a raw ValueError


class _MisfitStack(nn.Module):
    """The second Linear expects 5 features, the first gives 8."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(5, 2)

    def forward(self, x):
        return self.b(self.a(x))


def test_a_model_whose_shapes_do_not_fit_says_so_without_torch_logs(caplog):
    import autoplan
    with caplog.at_level(logging.ERROR), pytest.raises(TraceError) as err:
        autoplan.trace(_MisfitStack(), example_inputs=torch.randn(2, 4))
    message = str(err.value)
    assert "same reduction dim" in message and "in module: b (Linear)" in message
    assert "two shapes there do not fit together" in message and "traceable" not in message
    # torch logged the fake-tensor failure, with its traceback, at ERROR level
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]


def _manifest_step_dir(root: Path, manifest: dict) -> Path:
    step = root / "step-3"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"x")
    (step / "manifest.json").write_text(json.dumps({"version": 1, **manifest}))
    return step


@pytest.mark.parametrize("manifest,expect", [
    (dict(step=3, files={".metadata": "x"}), "files['.metadata'] is 'x'"),
    (dict(step=3, files={".metadata": {"size_bytes": 1}}), "files['.metadata']"),
    (dict(step=3, files={".metadata": None}), "files['.metadata'] is None"),
    (dict(step="three", files={".metadata": {"size_bytes": 1, "sha256": "0"}}), "step 'three'"),
    (dict(step=3, files={".metadata": {"size_bytes": 1, "sha256": "0"},
                         "../../outside": {"size_bytes": 1, "sha256": "0"}}),
     "outside the checkpoint directory"),
])
def test_a_malformed_manifest_is_a_checkpoint_error(tmp_path, manifest, expect):
    """Was a TypeError / KeyError / ValueError out of verify() and latest_good(), or (a
    path outside the checkpoint) a file elsewhere read and hashed."""
    from autoplan.elastic import latest_good, verify
    step = _manifest_step_dir(tmp_path, manifest)
    with pytest.raises(CheckpointError, match="malformed") as err:
        verify(step)
    assert expect in str(err.value) and str(step) in str(err.value)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert latest_good(tmp_path) is None
