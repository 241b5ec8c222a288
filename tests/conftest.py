"""Shared pytest configuration."""

from __future__ import annotations

import os

import pytest

# keep torch to one thread per process: tests spawn several ranks on two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.json from today's plans instead of comparing")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))
