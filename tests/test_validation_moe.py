"""validation/published_moe.csv: published mixture-of-experts training runs, checked for
internal consistency (layout degrees, expert parallelism, the derived step time)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

VALIDATION = Path(__file__).resolve().parent.parent / "validation"
MOE_COLUMNS = ["num_experts", "experts_per_token", "moe_ffn_hidden_size", "num_shared_experts",
               "shared_expert_ffn_hidden_size", "first_dense_layers", "ep", "etp", "moe_router",
               "attention"]


def _rows(name: str) -> list[dict[str, str]]:
    with open(VALIDATION / name, newline="") as f:
        return list(csv.DictReader(f))


ROWS = _rows("published_moe.csv")


def _int(row: dict[str, str], key: str) -> int:
    return int(row[key])


def test_columns_are_the_public_ones_plus_the_moe_ones():
    with open(VALIDATION / "published_public.csv", newline="") as f:
        public = next(csv.reader(f))
    with open(VALIDATION / "published_moe.csv", newline="") as f:
        moe = next(csv.reader(f))
    assert moe == public + MOE_COLUMNS


def test_rows_are_unique_and_sourced():
    assert len(ROWS) >= 10
    ids = [r["run_id"] for r in ROWS]
    assert len(ids) == len(set(ids))
    for r in ROWS:
        assert r["source"].strip(), r["run_id"]
        assert r["source_group"] in ("megatron_bridge_moe", "nemo_framework_moe"), r["run_id"]
        assert r["precision"].strip() and r["gpu_type"].strip(), r["run_id"]


@pytest.mark.parametrize("row", ROWS, ids=[r["run_id"] for r in ROWS])
def test_layout_degrees_and_expert_parallelism(row):
    tp, pp, cp, dp = (_int(row, k) for k in ("tp", "pp", "cp", "dp"))
    gpus, ep, experts = _int(row, "num_gpus"), _int(row, "ep"), _int(row, "num_experts")
    assert dp == gpus // (tp * pp * cp) and dp * tp * pp * cp == gpus
    assert experts % ep == 0, "EP must divide the number of experts"
    assert _int(row, "experts_per_token") <= experts
    # Megatron: an MoE layer's ranks (TP x CP x DP of a pipeline stage) are re-split into
    # expert-TP x EP x expert-DP; with expert TP = TP (the default when not stated) this is
    # "EP divides DP x CP"; with expert TP 1 EP may also span the TP ranks ("folding")
    etp = _int(row, "etp") if row["etp"] else tp
    assert (tp * dp * cp) % (ep * etp) == 0
    if etp == tp:
        assert (dp * cp) % ep == 0
    else:
        assert ep <= dp * cp or "folded" in row["notes"]
    mbs, gbs = _int(row, "micro_batch_size"), _int(row, "global_batch_size")
    assert gbs % (mbs * dp) == 0
    if "inconsisten" not in row["confidence"]:   # a misprint its notes name
        assert _int(row, "grad_accum_steps") == gbs // (mbs * dp)


@pytest.mark.parametrize("row", ROWS, ids=[r["run_id"] for r in ROWS])
def test_measured_step_time_matches_its_basis(row):
    assert row["tokens_per_sec_per_gpu"] or row["measured_step_time_s"]
    step = float(row["measured_step_time_s"])
    assert step > 0
    basis = row["step_time_basis"]
    if basis == "global_batch*seq/(tokens_per_sec_per_gpu*num_gpus)":
        expected = (_int(row, "global_batch_size") * _int(row, "seq_length")
                    / (float(row["tokens_per_sec_per_gpu"]) * _int(row, "num_gpus")))
    elif basis.startswith("iteration_time"):
        expected = float(row["iteration_time_s"])
    else:
        pytest.fail(f"unknown step_time_basis {basis!r}")
    assert step == pytest.approx(expected, rel=0.005)


def test_model_tflops_and_tokens_agree_within_a_release():
    """Per model and release the model FLOPs per token (TFLOP/s / tokens/s) is one number:
    a row far off it has a misread cell."""
    by_key: dict[tuple[str, str, str], list[float]] = {}
    for r in ROWS:
        if not r["measured_tflops_per_gpu"]:
            continue
        flops_per_token = float(r["measured_tflops_per_gpu"]) * 1e12 / float(r["tokens_per_sec_per_gpu"])
        by_key.setdefault((r["model_name"], r["framework"], r["seq_length"]), []).append(flops_per_token)
    for key, values in by_key.items():
        assert max(values) / min(values) < 1.06, (key, values)
