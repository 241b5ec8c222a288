"""Shared pytest configuration."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# keep torch to one thread per process: tests spawn several ranks on two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _private_autoplan_home(tmp_path_factory: pytest.TempPathFactory):
    """Tests (and the CLI processes they start) neither read nor write the user's
    ``~/.autoplan``: ``$AUTOPLAN_HOME`` points at an empty folder for the session."""
    saved = os.environ.get("AUTOPLAN_HOME")
    os.environ["AUTOPLAN_HOME"] = str(tmp_path_factory.mktemp("autoplan-home"))
    yield
    if saved is None:
        os.environ.pop("AUTOPLAN_HOME", None)
    else:
        os.environ["AUTOPLAN_HOME"] = saved


def pytest_configure(config: pytest.Config) -> None:
    # `-n auto` (pytest-xdist) without --dist: hand each worker whole test files, so that a
    # module's fixtures (traced models, searched plans) are built once, not once per worker
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadfile"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.json from today's plans instead of comparing")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(scope="session")
def small_plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan of a small GPT for one a100-sxm4-80gb node, written as ``plan --out`` would
    (shared by the CLI tests and the plan-file fuzzing)."""
    import autoplan
    from autoplan.models import GPT, GPTConfig
    graph = autoplan.trace(GPT(GPTConfig(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=4)),
                           seq_len=64)
    plan = autoplan.plan(graph, autoplan.load_cluster("a100-sxm4-80gb"), global_batch=16)
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    path.write_text(plan.to_json())
    return path


@pytest.fixture(scope="session")
def a100_x4(tmp_path_factory: pytest.TempPathFactory):
    """``a100_x4(name, **node)``: the shipped A100 node profile with 4 devices (and 4
    NICs), the given ``node`` keys set on top (``shared_cores=2``), written to a file; its
    path.  For what needs some 4-device cluster (the confirm pass's 4 ranks), not this
    machine's."""
    import yaml

    from autoplan.hardware.profiles import shipped_profiles_dir

    def make(name: str, **node) -> Path:
        data = yaml.safe_load((shipped_profiles_dir() / "a100-sxm4-80gb.yaml").read_text())
        data["name"] = name
        data["node"]["devices_per_node"] = 4
        data["node"].update(node)
        data["network"]["nics_per_node"] = 4
        path = tmp_path_factory.mktemp("profile") / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path
    return make
