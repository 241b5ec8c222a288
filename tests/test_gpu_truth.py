"""benchmarks/gpu_truth.py: the committed H100 run against the cost model, and the script's
own paths (its measuring half rehearsed on the CPU; CI has no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_truth  # noqa: E402


@pytest.fixture(scope="module")
def committed():
    results = json.loads((gpu_truth.LATEST / "results.json").read_text())
    profile = gpu_truth._measured_profile(gpu_truth.LATEST, results)
    assert profile is not None and profile.is_file()
    clusters = {"shipped": gpu_truth._device_cluster("h100-sxm5-80gb"),
                "measured": gpu_truth._device_cluster(str(profile))}
    return results, gpu_truth.report_rows(results, clusters, gpu_truth.MODELS)


def test_every_committed_case_is_reported(committed):
    results, rows = committed
    assert results["gpu"].startswith("NVIDIA H100")
    assert len(rows) == len(results["cases"]) == 12
    measured = [r for r in rows if r["measured_s"]]
    assert len(measured) == 10            # the 3B at micro-batch 2 without full recompute: OOM
    assert all("out of memory" in r["error"] for r in rows if not r["measured_s"])


def test_the_measured_profile_prices_the_gpu_work_within_10_percent(committed):
    """On its own measured profile, the cost model's step is within 10% of the time the GPU
    was busy (kernel time under torch.profiler) in every case; the wall step is above that
    where the host cannot keep up (selective recompute's Python dispatch, one-sequence
    micro-batches), which the model does not price on a GPU."""
    _, rows = committed
    for r in rows:
        if r["measured_s"]:
            assert r["pred_measured_s"] == pytest.approx(r["gpu_busy_s"], rel=0.10), r


def test_peak_memory_is_predicted_within_10_percent(committed):
    _, rows = committed
    for r in rows:
        if r["measured_bytes"]:
            for label in ("shipped", "measured"):
                assert r[f"pred_{label}_bytes"] == pytest.approx(r["measured_bytes"], rel=0.10), r


def test_kernel_kinds():
    assert gpu_truth.kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT") == "matmul"
    assert gpu_truth.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert gpu_truth.kernel_kind("multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert gpu_truth.kernel_kind("vectorized_elementwise_kernel<4, CUDAFunctor_add>") == "other"


def test_run_without_cuda_is_a_usage_error(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_truth.main(["--run", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_report_of_a_missing_run_is_a_usage_error(tmp_path, capsys):
    assert gpu_truth.main(["--results", str(tmp_path / "none")]) == 2
    assert "measure with --run" in capsys.readouterr().err


@pytest.mark.distributed
def test_cpu_rehearsal_measures_and_reports(tmp_path, capsys):
    """The measuring half on tiny shapes: a one-rank profile, one model's three recompute
    modes in their own process, results written, then reported."""
    out = tmp_path / "run"
    assert gpu_truth.main(["--run", "--device", "cpu", "--out", str(out),
                           "--model", "gpt-tiny"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert "profile_error" not in results and not results.get("worker_errors")
    assert [c["recompute"] for c in results["cases"]] == list(gpu_truth.RECOMPUTE)
    assert all(c["step_s"] > 0 and "error" not in c for c in results["cases"])
    capsys.readouterr()
    assert gpu_truth.main(["--results", str(out)]) == 0
    assert "gpt-tiny" in capsys.readouterr().out
