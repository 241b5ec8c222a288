"""``benchmarks/step_cpu.py`` without real runs: the layout argument, the core-time
accounting of a step from the ranks' figures, and the engine's stage work it prints
(the runs take a minute and are not part of the suite)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import step_cpu  # noqa: E402


def test_parse_layout():
    assert step_cpu.parse_layout("dp=2, pp=2,micro_batch=1,schedule=gpipe,") == {
        "dp": 2, "pp": 2, "micro_batch": 1, "schedule": "gpipe"}
    assert step_cpu.parse_layout("tp=2,sequence_parallel=true") == {
        "tp": 2, "sequence_parallel": True}
    for bad, says in [("dp", "key=value"), ("dp=", "key=value"), ("dp=two", "integer"),
                      ("precision=bf16", "unknown key"),
                      ("sequence_parallel=maybe", "true or false")]:
        with pytest.raises(ValueError, match=says):
            step_cpu.parse_layout(bad)


def test_thread_clocks_cover_this_thread():
    import threading
    clocks = step_cpu._threads_cpu()
    mine = clocks[str(threading.get_native_id())]
    assert 0 < mine and abs(mine - __import__("time").thread_time()) < 0.05


def test_main_rejects_bad_input_before_running(capsys):
    for argv, says in [(["--layout", "dp=3"], "not divisible"),
                       (["--layout", "dp=2"], "uses 2 devices"),
                       (["--layout", "dp=4,zero=7"], "--layout"),
                       (["--profile", "no-such.yaml"], "no such file"),
                       (["--steps", "0"], ">= 1")]:
        with pytest.raises(SystemExit) as exc:
            step_cpu.main(argv)
        assert exc.value.code == 2
        assert says in capsys.readouterr().err


def _row(start, end, process, main, stage, optimizer):
    return {"start": start, "end": end, "process": process, "main": main, "stage": stage,
            "optimizer": optimizer}


def test_account_sums_ranks_and_takes_the_median_step():
    # two ranks, three steps; the step spans the first start to the last end
    ranks = [[_row(0.0, 1.0, 0.9, 0.8, 0.5, 0.1), _row(0.0, 2.0, 1.0, 0.9, 0.6, 0.1),
              _row(0.0, 1.2, 1.0, 0.9, 0.6, 0.1)],
             [_row(0.1, 1.1, 0.7, 0.6, 0.4, 0.1), _row(0.0, 1.9, 0.8, 0.7, 0.5, 0.1),
              _row(0.0, 1.0, 0.8, 0.7, 0.5, 0.1)]]
    a = step_cpu.account(ranks, cores=2)
    assert a["step"] == pytest.approx(1.2)          # steps 1.1, 2.0, 1.2
    assert a["cores"] == pytest.approx(2.4)
    assert a["stage"] == pytest.approx(1.1)         # 0.9, 1.1, 1.1
    assert a["optimizer"] == pytest.approx(0.2)
    assert a["main_other"] == pytest.approx(0.3)    # main 1.4/1.6/1.6 less stage and optimizer
    assert a["other_threads"] == pytest.approx(0.2)
    assert a["idle"] == pytest.approx(0.6)          # 2 x step less process: 0.6, 2.2, 0.6
    # a process figure below the main thread's (coarser clock) never reads negative
    low = [[_row(0.0, 1.0, 0.5, 0.6, 0.3, 0.1)]]
    assert step_cpu.account(low, cores=1)["other_threads"] == 0.0


def test_priced_stage_work_is_core_time(a100_x4):
    """The engine's stage work for a 4-rank layout on a profile whose 4 devices share 2
    cores: every replica's micro-batches over every pipeline rank, times 2/4."""
    path = a100_x4("a100-x4-shared", shared_cores=2)
    from autoplan import estimate, load_cluster, trace
    graphs: dict = {}
    kw = {"dp": 2, "pp": 2, "micro_batch": 2, "schedule": "gpipe"}
    p = step_cpu.priced(path, "gpt", kw, graphs)
    est = estimate(graphs["gpt"], load_cluster(str(path)), step_cpu.strategy_of(kw),
                   calibration=None, options=step_cpu.GLOO_ON_CPU)
    m = 8 // (2 * 2)
    work = 2 * sum(m * (st.forward_s + st.backward_s) for st in est.stages)
    assert p["step"] == est.step_time_s
    assert p["stage"] == pytest.approx(work / 2)
