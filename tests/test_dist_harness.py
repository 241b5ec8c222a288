"""The multi-process test harness itself: what it reports when a rank crashes."""

from __future__ import annotations

import os

import pytest

from dist_harness import DistributedFailure, _tail, run


def test_the_tail_of_a_crashed_ranks_output_is_faulthandlers_report(tmp_path):
    """After a native crash the report (signal, stacks) is kept from its start and the
    list of extension modules it ends with is left out; otherwise the output's tail."""
    log = tmp_path / "rank0.log"
    stacks = ("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n"
              '  File "x.py", line 3 in step\n')
    died = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
            "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes\n")
    log.write_text("x" * 5000 + "\n" + died + stacks + "\nExtension modules: " + "m, " * 2000
                   + "\n")
    got = _tail(str(log))
    # the lines before it, their last 750 characters (a quarter of the tail) at most
    assert got.startswith("x") and (died + "Fatal Python error: Aborted") in got
    assert got.index(died) == 750 - len(died.rstrip("\n")) and len(got) <= 3000
    assert "Fatal Python error: Aborted" in got and 'line 3 in step' in got
    assert "Extension modules" not in got and got.endswith("left out)")
    log.write_text(stacks)          # nothing printed before the report
    assert _tail(str(log)).startswith("Fatal Python error: Aborted")
    log.write_text("a" * 5000 + "the end")
    assert _tail(str(log), 100) == ("a" * 5000 + "the end")[-100:]
    assert _tail(str(tmp_path / "missing.log")) == ""


# The tests below make rank 1 fail; rank 0 then waits in teardown until the harness kills it
# ``grace`` seconds later (10 s by default): 2 s here, the reports are what is checked.
def _abort_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()      # a native crash: SIGABRT, no Python traceback
    return rank


def test_a_rank_that_aborts_is_reported_with_its_stack():
    with pytest.raises(DistributedFailure) as failure:
        run(_abort_on_rank_1, 2, timeout=120, pg_timeout=30, grace=2)
    text = str(failure.value)
    assert "rank 1: died of SIGABRT" in text
    assert "Fatal Python error: Aborted" in text and "_abort_on_rank_1" in text


def _abort_once_on_rank_1(rank: int, world: int, marker: str) -> int:
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()      # the first run only: a native crash that does not repeat
    return rank


def test_a_native_crash_that_does_not_repeat_is_run_again(tmp_path, capsys):
    marker = str(tmp_path / "crashed")
    assert run(_abort_once_on_rank_1, 2, marker, timeout=120, pg_timeout=30, grace=2) == [0, 1]
    err = capsys.readouterr().err
    assert "crashed natively; running _abort_once_on_rank_1 again" in err
    assert "rank 1: died of SIGABRT" in err


def _unformed_once_on_rank_1(rank: int, world: int, marker: str) -> int:
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()       # the first run only, as gloo's own failures go
        raise RuntimeError("Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc:553] "
                           "Connection closed by peer [127.0.0.1]:15251")
    return rank


def test_a_group_that_fails_to_form_in_gloo_is_run_again(tmp_path, capsys):
    marker = str(tmp_path / "unformed")
    assert run(_unformed_once_on_rank_1, 2, marker, timeout=120, pg_timeout=30,
               grace=2) == [0, 1]
    err = capsys.readouterr().err
    assert "process group failed to form in gloo; running _unformed_once_on_rank_1 again" in err


def _raise_on_rank_1(rank: int, world: int, marker: str) -> int:
    if rank == 1:
        with open(marker, "a") as f:
            f.write("x")
        raise ValueError("an error of the test's own")
    return rank


def test_a_python_error_is_not_run_again(tmp_path):
    marker = tmp_path / "runs"
    with pytest.raises(DistributedFailure, match="an error of the test's own"):
        run(_raise_on_rank_1, 2, str(marker), timeout=120, pg_timeout=30, grace=2)
    assert marker.read_text() == "x"   # one run
