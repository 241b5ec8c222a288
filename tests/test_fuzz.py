"""Property-based fuzzing of what a user hands autoplan: command lines, profile YAML and
plan JSON, corrupted at random.  No case may end in a traceback (only a clean exit or a
one-line autoplan error), and a second run prints the same.

A few hundred cases here; ``python benchmarks/fuzz.py`` runs thousands.
"""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings

import fuzz_cases as fc
from autoplan.errors import AutoplanError
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
