"""The search's budget: counted in steps, so the same inputs give the same plan on a busy
machine as on an idle one; a wall-clock cap only when asked for.

* the same search twice, and once while another thread burns the CPU, gives
  byte-identical plan JSON;
* a small work limit binds the same way on every run, and the statistics say so;
* a wall-clock cap binds only when given, and says so;
* bad limits are one-line ``ConfigError`` messages (the command line's: code 2);
* the cyclic garbage collector is paused while a search runs and left as it was after.
"""

from __future__ import annotations

import gc
import sys
import threading

import pytest

import autoplan
from autoplan.errors import ConfigError, InfeasiblePlan
from autoplan.models import GPT, GPTConfig
from autoplan.search import SearchLimit, search
from autoplan.search.search import WORK_LIMIT


@pytest.fixture(scope="module")
def graph():
    return autoplan.trace(GPT(GPTConfig(vocab_size=512, seq_len=256, hidden=256, heads=8,
                                        layers=8)), seq_len=256)


@pytest.fixture(scope="module")
def cluster():
    return autoplan.load_cluster("a100-sxm4-80gb", nodes=2)


@pytest.fixture(scope="module")
def full(graph, cluster):
    """The search with the default budget: its plan, with the steps it took in its stats."""
    return autoplan.plan(graph, cluster, global_batch=48)


def _burning():
    """A thread that keeps the interpreter busy (the GIL, a core) until stopped."""
    stop = threading.Event()

    def burn() -> None:
        x = 0
        while not stop.is_set():
            x = (x * 31 + 7) % 1_000_003

    thread = threading.Thread(target=burn, daemon=True)
    thread.start()
    return stop, thread


def test_default_search_is_not_cut_and_is_the_same_under_load(graph, cluster, full):
    stats = full.search_stats
    assert stats.limit is None and not stats.time_limit_hit and not stats.work_limit_hit
    assert 0 < stats.steps < WORK_LIMIT
    again = autoplan.plan(graph, cluster, global_batch=48)
    stop, thread = _burning()
    try:
        loaded = autoplan.plan(graph, cluster, global_batch=48)
    finally:
        stop.set()
        thread.join()
    assert again.search_stats.steps == loaded.search_stats.steps == stats.steps
    assert full.to_json() == again.to_json() == loaded.to_json()


def test_a_small_work_limit_binds_deterministically(graph, cluster, full):
    limit = full.search_stats.steps - 1       # the last step left out
    a = search(graph, cluster, global_batch=48, work_limit=limit)
    stop, thread = _burning()
    try:
        b = search(graph, cluster, global_batch=48, work_limit=limit)
    finally:
        stop.set()
        thread.join()
    assert a.limit is b.limit is SearchLimit.WORK and a.work_limit_hit
    assert a.steps == b.steps == limit
    assert a.best.to_json() == b.best.to_json()
    assert a.best.estimate.step_time_s >= full.estimate.step_time_s
    assert "work limit hit" in repr(a)
    # plan() shares it between recipes; the stats travel with the plan
    p = autoplan.plan(graph, cluster, global_batch=48, work_limit=limit)
    assert p.search_stats.limit is SearchLimit.WORK
    assert p.to_json() == autoplan.plan(graph, cluster, global_batch=48, work_limit=limit).to_json()


def test_a_wall_clock_cap_only_when_asked(graph, cluster):
    with pytest.raises(InfeasiblePlan, match="time limit .* ran out before it priced"):
        search(graph, cluster, global_batch=48, time_limit_s=1e-9)
    with pytest.raises(InfeasiblePlan, match="work limit .1 steps. ran out before it priced"):
        search(graph, cluster, global_batch=48, work_limit=1)


@pytest.mark.parametrize("kw,match", [
    (dict(work_limit=0), "work_limit must be a positive whole number"),
    (dict(work_limit=2.5), "work_limit must be"),
    (dict(work_limit=True), "work_limit must be"),
    (dict(time_limit_s=0), "time_limit_s must be positive seconds"),
    (dict(time_limit_s=-3.0), "time_limit_s must be"),
    (dict(time_limit_s="60"), "time_limit_s must be"),
    (dict(time_limit_s=float("nan")), "time_limit_s must be"),
])
def test_bad_limits_are_one_line_errors(graph, cluster, kw, match):
    with pytest.raises(ConfigError, match=match) as info:
        autoplan.plan(graph, cluster, global_batch=48, **kw)
    assert "\n" not in str(info.value)


def test_replan_takes_the_same_limits(graph, cluster, full):
    one = autoplan.load_cluster("a100-sxm4-80gb")
    old = autoplan.plan(graph, cluster, global_batch=48)
    a = autoplan.replan(old, one)
    assert a.search_stats.limit is None
    assert a.to_json() == autoplan.replan(old, one).to_json()
    steps = a.search_stats.steps
    small = autoplan.replan(old, one, work_limit=steps - 1)
    assert small.search_stats.limit is SearchLimit.WORK and small.search_stats.steps == steps - 1
    with pytest.raises(ConfigError, match="work_limit"):
        autoplan.replan(old, one, work_limit=-1)


def test_command_line_limits():
    import re

    from test_cli import GPT as MODEL, run
    out = run("plan", *MODEL, "--cluster", "a100-sxm4-80gb", "--global-batch", "16")
    assert "limit reached" not in out.stdout
    steps = int(re.search(r"in (\d+) steps", out.stdout).group(1))
    out = run("plan", *MODEL, "--cluster", "a100-sxm4-80gb", "--global-batch", "16",
              "--work-limit", str(steps - 1))
    assert "work limit reached" in out.stdout
    for flag, value in (("--work-limit", "0"), ("--time-limit", "-1")):
        bad = run("plan", *MODEL, "--cluster", "a100-sxm4-80gb", "--global-batch", "16",
                  flag, value, check_rc=2)
        assert f"{flag} must be" in bad.stderr and "Traceback" not in bad.stderr
    # --time-limit is still accepted, as an opt-in cap
    capped = run("plan", *MODEL, "--cluster", "a100-sxm4-80gb", "--global-batch", "16",
                 "--time-limit", "600")
    assert "limit reached" not in capped.stdout


def test_the_collector_is_paused_during_a_search_and_left_as_it_was(graph, cluster,
                                                                     monkeypatch):
    frontier = sys.modules["autoplan.search.frontier"]
    seen = []
    run = frontier._Search.run

    def spy(self):
        seen.append(gc.isenabled())
        return run(self)

    monkeypatch.setattr(frontier._Search, "run", spy)
    gc.enable()
    search(graph, cluster, global_batch=48)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ConfigError):
        search(graph, cluster, global_batch=0)
    assert gc.isenabled()                       # resumed after an error too
    gc.disable()
    try:
        search(graph, cluster, global_batch=48)
        assert seen == [False, False] and not gc.isenabled()   # the caller's choice kept
    finally:
        gc.enable()
