"""Regression over the published runs: fails if the cost model's error rises above its limits.

In-sample (the default calibration, fitted to every row): MAPE <= 10% over every row with a
measured step time that the model expresses, no row off by more than 25%, every layout of
the sources whose memory settings are known fits in predicted memory.  Held out
(``validation/held_out_errors.csv``, written by ``published_runs.py --fit``: each source
predicted by a fit that never saw it): every fitted source within the issue's targets
(MAPE <= 10%, no row off by more than 30%); the never-fitted MoE sources against the limit
in :data:`HELD_OUT_LIMITS`, which records what the model reaches today (far from the
targets; docs/validation.md).

Captured graphs are cached per distinct (architecture, sequence length) in
``$AUTOPLAN_CACHE/traces`` (default ``~/.cache/autoplan/traces``, keyed by a
fingerprint of the capture code and library versions): the first run captures
55 models (a few minutes on 2 cores), later runs take a few seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import published_runs as pr  # noqa: E402

from autoplan.cost.calibration import load_calibration  # noqa: E402

MEMORY_KNOWN = pr.MEMORY_KNOWN_SOURCES

#: Held-out limits (regression guards at today's figures plus a margin; the issue's
#: targets are TARGET_HELD_OUT_MAPE / TARGET_HELD_OUT_MAX_ERROR in published_runs.py).
#: (refit of 2026-11-23 with FlashAttention-2 priced for the LLM Foundry rows: 14.6% MAPE,
#: worst Narayanan T1-04 +45.7% and MosaicML 1B at 64K -45.7%; MoE 23.9% over 52 rows;
#: refit with Blackwell's 16-bit fraction carried over and link floors at 0.5: 14.8%, worst
#: MosaicML 1B at 64K -45.7%, MoE 23.7%; refit with torchtitan's A100 rows as a fifth
#: source: 11.6%, Narayanan 9.7%, worst MosaicML 1B at 64K -45.7%, MoE 25.0%; refit with
#: Hopper's attention priced from Ampere's FlashAttention-2 fraction: 7.2%, every source
#: <= 9.8%, worst Narayanan T2-04 -32.2%, MoE 24.7%; with the recipes' token dispatchers:
#: MoE 23.6%; with DeepSpeed's gathers prefetched one module ahead: 6.8%, worst
#: Megatron-Bridge H100 Llama 3 8B +26.2%, MoE 23.9%; with the expert GEMMs and FP8 casts
#: priced as Transformer Engine runs them, issue 66: MoE 21.4%, its FP8 rows 24.8%)
HELD_OUT_LIMITS = {"mape": 0.09, "moe_mape": 0.23}
#: Fitted sources that miss the targets, held at today's figure so that they cannot get
#: worse unseen: Megatron-Bridge's FP8 rows since Transformer Engine's recipe came to be
#: priced as it runs (autoplan/cost/fp8.py, issue 66; refit of 2026-11-29: 12.9% MAPE,
#: worst H100 Llama 3 8B +30.9%; they were 9.8% and +26.2%; with TE's weights cast once a
#: step: 11.0%, worst +28.9%, inside issue 66's FP8 targets of 15% and 30% but above the
#: 10% every source is held to).  The target stands (docs/validation.md says it is missed).
KNOWN_MISSES = {"megatron_bridge_perf": {"mape": 0.115}}


@pytest.fixture(scope="module")
def results():
    specs = pr.load_specs()
    graphs = pr.load_graphs(specs)
    return specs, pr.evaluate(specs, load_calibration(), graphs=graphs)


def test_every_measured_row_is_evaluated_or_says_why(results):
    specs, df = results
    csv = pr._rows()
    measured = csv[csv["measured_step_time_s"].notna()]
    skipped = pr.not_evaluated()
    assert all("profile" in why or "modelled" in why or "expert parallelism" in why
               for why in skipped.values())
    # every measured row except those skipped and Megatron's strong-scaling points
    # (no layout given)
    assert len(df) >= len(measured) - len(skipped) - 2
    assert set(df["source"]) == {"narayanan2021", "megatron_readme_h100_2024",
                                 "mosaicml_llmfoundry", "megatron_bridge_perf",
                                 "megatron_bridge_moe", "nemo_framework_moe", "torchtitan"}
    fp8 = df[df["source"] == "megatron_bridge_perf"]
    assert len(fp8) == 11 and fp8["run_id"].str.contains("B200").any()
    # torchtitan: 5 of 8 rows; its op-level selective checkpointing is listed, not dropped
    assert (df["source"] == "torchtitan").sum() == 5
    assert sum("TORCHTITAN" in r for r in skipped) == 3


def test_every_second_block_recomputed_is_priced_between_none_and_full(results):
    # torchtitan's "selective layer" checkpointing: every 2nd block fully recomputed
    from dataclasses import replace
    from autoplan.cost import engine_for
    from autoplan.strategy import Recompute
    specs, df = results
    sp = next(s for s in specs if s.recompute_every == 2)
    engine = engine_for(pr.load_graphs([sp])[sp.model.key],
                        pr._cluster(sp.profile, sp.nodes, sp.strategy.world_size),
                        options=sp.options, calibration=load_calibration())
    plan = pr._layout(sp, engine)
    recomputes = [lp.recompute for lp in plan.layers
                  if lp.name in {l.name for l in engine.summary.layers if l.is_block}]
    assert recomputes[0::2] == [Recompute.NONE] * (len(recomputes) // 2)
    assert recomputes[1::2] == [Recompute.FULL] * (len(recomputes) // 2)
    times = {rc: engine.estimate(replace(sp.strategy, recompute=rc))
             for rc in (Recompute.NONE, Recompute.FULL)}
    mixed = engine.estimate(plan)
    assert times[Recompute.NONE].step_time_s < mixed.step_time_s < times[Recompute.FULL].step_time_s
    assert (times[Recompute.FULL].peak_memory_bytes < mixed.peak_memory_bytes
            < times[Recompute.NONE].peak_memory_bytes)
    row = df[df["run_id"] == sp.run_id].iloc[0]
    assert row["predicted_s"] == pytest.approx(mixed.step_time_s)
    assert "1/2 blocks" in row["layout"]


def test_mape_overall_and_per_row(results):
    _, df = results
    df = df[~df["source"].isin(pr.TEST_ONLY_SOURCES)]      # the fitted rows
    stats = pr.summarize_errors(df)
    worst = df.loc[df["error"].abs().idxmax()]
    assert stats["mape"] <= pr.TARGET_MAPE, f"MAPE {stats['mape']:.1%} > {pr.TARGET_MAPE:.0%}"
    assert stats["max_error"] <= pr.TARGET_MAX_ERROR, \
        f"{worst.run_id} off by {worst.error:+.1%} (limit {pr.TARGET_MAX_ERROR:.0%})"


def test_held_out_errors_are_recorded_for_every_row(results):
    _, df = results
    held = pd.read_csv(pr.HELD_OUT_CSV)
    assert set(held["run_id"]) == set(df["run_id"]), "rerun published_runs.py --fit"
    fitted = held[~held["source"].isin(pr.TEST_ONLY_SOURCES)]
    assert fitted["error"].abs().mean() <= HELD_OUT_LIMITS["mape"]
    for source, rows in fitted.groupby("source"):
        miss = KNOWN_MISSES.get(source, {})
        worst = rows.loc[rows["error"].abs().idxmax()]
        assert abs(worst["error"]) <= miss.get("worst", pr.TARGET_HELD_OUT_MAX_ERROR), \
            f"{worst.run_id} off by {worst.error:+.1%} held out"
        mape = rows["error"].abs().mean()
        assert mape <= miss.get("mape", pr.TARGET_HELD_OUT_MAPE), \
            f"{source}: held-out MAPE {mape:.1%}"
    # the MoE rows (never fitted): a guard at today's figure, far from the 15% target
    moe = held[held["source"].isin(pr.TEST_ONLY_SOURCES)]
    assert moe["error"].abs().mean() <= HELD_OUT_LIMITS["moe_mape"]


def test_every_layout_that_ran_fits(results):
    _, df = results
    unfit = df[~df["fits"] & df["source"].isin(MEMORY_KNOWN)]
    assert unfit.empty, f"predicted not to fit: {list(unfit['run_id'])}"


def test_fitted_values_name_their_source_and_carry_over():
    from autoplan.cost.calibration import apply_calibration, attention_tables
    from autoplan.hardware import load_cluster
    cal = load_calibration()
    assert cal.source.startswith("fitted to")
    assert set(cal.architectures) == {"ampere", "hopper", "blackwell"}
    for arch, fig in cal.architectures.items():
        assert fig.source.startswith("fitted to"), arch
    # every shipped GPU gets a fitted matmul curve and a fused-attention curve from its own
    # datasheet; Volta (no published run) gets the fitted architectures' mean
    for name in ("h200-sxm-141gb", "a100-sxm4-40gb", "v100-sxm2-32gb", "b200-sxm-180gb",
                 "gb200-nvl72"):
        c = apply_calibration(load_cluster(name), cal)
        dev = c.device_type_of(0)
        assert "fitted" in dev.matmul_efficiency["default"].source or \
            "carried over" in dev.matmul_efficiency["default"].source, name
        assert dev.name in attention_tables(c, cal), name
    v100 = apply_calibration(load_cluster("v100-sxm2-32gb"), cal).device_type_of(0)
    assert v100.matmul_efficiency["default"].source.startswith("carried over")


def test_a_figure_no_run_measures_is_carried_over_not_fitted():
    # every Blackwell run trains its matmuls in FP8: the fit leaves its 16-bit fraction
    # out, and the calibration gives it the geometric mean of the fitted architectures'
    import math
    cal = load_calibration()
    assert cal.architectures["blackwell"].matmul_peak_fraction is None
    fitted = [a.matmul_peak_fraction for a in cal.architectures.values()
              if a.matmul_peak_fraction is not None]
    mean = math.exp(sum(map(math.log, fitted)) / len(fitted))
    bw = cal.for_architecture("blackwell")
    assert bw.matmul_peak_fraction == pytest.approx(mean)
    assert bw.fp8_peak_fraction == cal.architectures["blackwell"].fp8_peak_fraction
    specs = [sp for sp in pr.load_specs() if sp.source not in pr.TEST_ONLY_SOURCES]  # fitted
    keys = pr._free_parameters(specs)
    assert ("blackwell", "fp8_peak_fraction") in keys
    assert ("blackwell", "matmul_peak_fraction") not in keys
    assert ("blackwell", "matmul_overhead_s") in keys
    assert ("hopper", "matmul_peak_fraction") in keys     # Hopper has 16-bit and FP8 runs
    # without the FP8 rows' architecture informing it, an all-16-bit subset fits the fraction
    bf16 = [sp for sp in specs if not pr._fp8(sp)]
    assert all(k[1] != "fp8_peak_fraction" for k in pr._free_parameters(bf16))


def test_measured_profiles_keep_their_tables_and_get_an_attention_curve():
    from autoplan.cost.calibration import apply_calibration, attention_tables
    from autoplan.cost.toy import toy_cluster
    cal = load_calibration()
    c = toy_cluster()                       # no architecture: as a measured profile
    assert apply_calibration(c, cal).device_type_of(0) == c.device_type_of(0)
    dev = c.device_type_of(0)
    table = attention_tables(c, cal)[dev.name]
    ratio = (cal.for_architecture("").attention_peak_fraction
             / cal.for_architecture("").matmul_peak_fraction)
    own = dev.matmul_efficiency["default"].points[0][1]
    assert table.points[0][1] == pytest.approx(min(1.0, own * ratio))


def test_a_missing_validation_file_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pr.main(["--csv", str(tmp_path / "published_moe.csv")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "published_moe.csv" in err and "Traceback" not in err
