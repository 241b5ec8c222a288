"""benchmarks/gpu_truth.py: the committed H100 and H200 runs against the cost model, and the
script's own paths (its measuring half rehearsed on the CPU; CI has no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_truth  # noqa: E402


def _report(run: Path, profile: Path | None = None, **extra):
    results = json.loads((run / "results.json").read_text())
    profile = profile or gpu_truth._measured_profile(run, results)
    assert profile is not None and profile.is_file()
    shipped = gpu_truth._device_cluster(gpu_truth.shipped_profile(results["gpu"]))
    clusters = {"shipped": shipped, "kernels": shipped,
                "measured": gpu_truth._device_cluster(str(profile)), **extra}
    return results, gpu_truth.report_rows(results, clusters, gpu_truth.MODELS,
                                          kernel_tables={"kernels": gpu_truth.KERNEL_TABLES})


def _without_layout_rates(profile: Path):
    """The one-device cluster of ``profile`` with its layout kinds' rates dropped."""
    import dataclasses

    import yaml

    from autoplan.hardware import ElementwiseRates, NodeGroup, compose_cluster
    from autoplan.hardware.profile_records import ELEMENTWISE_KINDS
    from autoplan.hardware.profiles import parse_profile

    p = parse_profile(yaml.safe_load(profile.read_text()))
    r = p.device.elementwise_rates
    ops = ElementwiseRates({k: v for k, v in r.forward_bytes_per_s.items() if k in ELEMENTWISE_KINDS},
                           {k: v for k, v in r.backward_bytes_per_s.items() if k in ELEMENTWISE_KINDS},
                           r.source)
    return compose_cluster([NodeGroup(dataclasses.replace(
        p, device=dataclasses.replace(p.device, elementwise_rates=ops)), 1)], name="ops-only")


@pytest.fixture(scope="module")
def first():
    return _report(gpu_truth.FIRST)


@pytest.fixture(scope="module")
def host():
    return _report(gpu_truth.LATEST)


def test_every_committed_case_is_reported(first, host):
    results, rows = first
    assert results["gpu"].startswith("NVIDIA H100")
    assert len(rows) == len(results["cases"]) == 12
    measured = [r for r in rows if r["measured_s"]]
    assert len(measured) == 10            # the 3B at micro-batch 2 without full recompute: OOM
    assert all("out of memory" in r["error"] for r in rows if not r["measured_s"])
    results, rows = host
    assert len(rows) == 6 and all(r["measured_s"] for r in rows)


def test_the_device_figures_price_the_gpu_work_within_10_percent(first):
    """On the first run's own profile (device figures only), the cost model's step is within
    10% of the time the GPU was busy (kernel time under torch.profiler) in every case; the
    wall step is above that where the host cannot keep up."""
    _, rows = first
    for r in rows:
        if r["measured_s"]:
            assert r["pred_measured_s"] == pytest.approx(r["gpu_busy_s"], rel=0.10), r


def test_with_the_hosts_time_the_wall_step_is_priced(host):
    """With the host's time per operator (measured on the run's machine), the larger of the
    host's and the device's work per layer: selective recompute's Python dispatch, which made
    steps 1.7-3.5x the GPU's busy time, priced within 5%; every case within 17%."""
    _, rows = host
    errors = [r["pred_measured_s"] / r["measured_s"] - 1 for r in rows]
    assert all(abs(e) < 0.17 for e in errors), errors
    assert sum(abs(e) for e in errors) / len(errors) < 0.10
    for r in rows:
        if r["recompute"] == "selective":
            assert r["measured_s"] > 1.6 * r["gpu_busy_s"]
            assert r["pred_measured_s"] == pytest.approx(r["measured_s"], rel=0.05), r


@pytest.mark.parametrize("run", ["first", "host"])
def test_peak_memory_is_predicted_within_10_percent(run, request):
    _, rows = request.getfixturevalue(run)
    for r in rows:
        if r["measured_bytes"]:
            for label in ("shipped", "measured"):
                assert r[f"pred_{label}_bytes"] == pytest.approx(r["measured_bytes"], rel=0.10), r


@pytest.fixture(scope="module")
def h200():
    return _report(gpu_truth.H200)


@pytest.fixture(scope="module", params=[0, 1], ids=["h200", "h100"])
def layout(request):
    run = gpu_truth.LAYOUT[request.param]
    results = json.loads((run / "results.json").read_text())
    profile = gpu_truth._measured_profile(run, results)
    return _report(run, ops_only=_without_layout_rates(profile))


def test_the_h200_holds_every_case_and_its_memory_is_predicted(h200):
    """139 GiB hold the 3B at micro-batch 2 without full recompute (out of memory on the
    H100's 80); every case's peak within 10%, on the shipped H200 profile and the
    measured one."""
    results, rows = h200
    assert results["gpu"] == "NVIDIA H200" and len(rows) == 12
    assert all(r["measured_s"] for r in rows)
    for r in rows:
        for label in ("shipped", "measured"):
            assert r[f"pred_{label}_bytes"] == pytest.approx(r["measured_bytes"], rel=0.10), r


def test_the_layout_kinds_price_the_gpu_bound_steps(layout):
    """On an H200 and an H100 whose profiles time broadcasts and layout copies on the GPU,
    every step the GPU bounds is priced within 7% of its wall time and within 10% of the
    GPU's busy time, the Llamas' within 5% of it; without the layout kinds' rates (at the
    copy bandwidth) the Llamas' are priced 4% or more below what they were with them."""
    results, rows = layout
    bound = [r for r in rows if gpu_truth.gpu_bound(r)]
    assert len(bound) >= 4 and {r["model"] for r in bound} >= {"llama-1b", "gpt-1.3b"}
    for r in bound:
        assert r["pred_measured_s"] == pytest.approx(r["measured_s"], rel=0.07), r
        assert r["pred_measured_s"] == pytest.approx(r["gpu_busy_s"], rel=0.10), r
        if r["model"].startswith("llama"):
            assert r["pred_measured_s"] == pytest.approx(r["gpu_busy_s"], rel=0.05), r
            assert r["pred_ops_only_s"] < 0.96 * r["pred_measured_s"], r


def test_the_layout_rates_carry_to_another_machines_run():
    """The layout run's H200 profile, measured on another machine, prices the first H200
    run's Llama steps that the GPU bounds within 5% of the GPU's busy time."""
    results, rows = _report(gpu_truth.H200, gpu_truth._measured_profile(
        gpu_truth.LAYOUT[0], json.loads((gpu_truth.LAYOUT[0] / "results.json").read_text())))
    llama = [r for r in rows if r["model"].startswith("llama") and gpu_truth.gpu_bound(r)]
    assert len(llama) >= 3
    for r in llama:
        assert r["pred_measured_s"] == pytest.approx(r["gpu_busy_s"], rel=0.05), r


def test_the_shipped_profile_is_the_runs_gpus():
    assert gpu_truth.shipped_profile("NVIDIA H200") == "h200-sxm-141gb"
    assert gpu_truth.shipped_profile("NVIDIA H100 80GB HBM3") == "h100-sxm5-80gb"
    assert gpu_truth.shipped_profile("NVIDIA A100-SXM4-40GB") == "a100-sxm4-40gb"
    assert gpu_truth.shipped_profile("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    assert gpu_truth.shipped_profile(None) == "h100-sxm5-80gb"


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


def test_report_of_a_missing_or_broken_run_is_a_usage_error(tmp_path, capsys):
    assert gpu_truth.main(["--results", str(tmp_path / "none")]) == 2
    assert "measure with --run" in capsys.readouterr().err
    (tmp_path / "results.json").write_text("{not json")
    assert gpu_truth.main(["--results", str(tmp_path)]) == 2
    assert "not a gpu_truth results file" in capsys.readouterr().err


def test_an_unknown_model_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    assert gpu_truth.main(["--run", "--device", "cpu", "--out", str(out),
                           "--model", "gpt-tin"]) == 2
    assert "unknown model 'gpt-tin'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.distributed
@pytest.mark.slow   # a CPU rehearsal of the whole GPU run: a profile and training steps, ~1 min
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


@pytest.mark.parametrize("run", [gpu_truth.LATEST, gpu_truth.H200, *gpu_truth.LAYOUT],
                         ids=lambda p: p.name)
def test_the_measured_kernels_price_the_gpu_bound_steps_within_10_percent(run):
    """The shipped H100 and H200 profiles with torch's kernels measured on one H100
    (``CostOptions.kernel_tables="torch-eager"``, :mod:`autoplan.cost.kernels`) price the
    steps the GPU bounds within 10% on average in every committed run, where the
    published-run fit alone is 12-19% slow.  The H200 runs are held out from the tables;
    the H100 run of 2026-11-26 was measured on another machine and day."""
    _, rows = _report(run)
    bound = [r for r in rows if gpu_truth.gpu_bound(r)]
    assert len(bound) >= 3
    kernels = [abs(r["pred_kernels_s"] / r["measured_s"] - 1) for r in bound]
    fit = [abs(r["pred_shipped_s"] / r["measured_s"] - 1) for r in bound]
    assert sum(kernels) / len(kernels) <= 0.10, [(r["model"], r["recompute"], e)
                                                  for r, e in zip(bound, kernels)]
    assert sum(fit) / len(fit) > 0.12
