"""Grouped GEMMs (MoE experts): measured by the profiler, kept in the profile, priced from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from autoplan import Strategy, estimate, trace
from autoplan.cost import CostOptions
from autoplan.cost.summary import summarize
from autoplan.cost.toy import toy_profile
from autoplan.hardware import EfficiencyTable, NodeGroup, compose_cluster
from autoplan.hardware.grouped_gemm import grouped_gemm_call, grouped_gemm_table
from autoplan.hardware.profile_yaml import parse_profile, profile_to_yaml

transformers = pytest.importorskip("transformers")

SEQ, EXPERTS, TOP_K = 16, 4, 2
PEAK, EFF = 1e12, 0.5          # the toy's peak and flat matmul efficiency


@pytest.fixture(scope="module")
def moe():
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                     num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    return trace(transformers.MixtralForCausalLM(cfg), seq_len=SEQ)


def _cluster(grouped: dict | None):
    profile = toy_profile(devices_per_node=1)
    device = dataclasses.replace(profile.device, grouped_matmul_efficiency=grouped)
    return compose_cluster([NodeGroup(dataclasses.replace(profile, device=device), 1)],
                           name="toy")


def test_a_grouped_gemm_runs_what_the_experts_run():
    # (torch's CPU kernel wants rows of a multiple of 16 bytes: n = 8 fp32)
    call = grouped_gemm_call(torch, experts=3, rows=4, k=8, n=8, dtype=torch.float32,
                             device="cpu")
    out = call()
    assert out.shape == (12, 8) and torch.isfinite(out).all()


def test_the_table_is_keyed_by_one_experts_gemm_and_capped_at_the_peak():
    t = grouped_gemm_table([(8, 4, 16, 16, 1e-3), (8, 64, 16, 16, 2e-3), (8, 64, 16, 16, 1e-9)],
                           1e9, "example")
    assert [p[0] for p in t.points] == [2 * 4 * 16 * 16, 2 * 64 * 16 * 16]
    assert t.points[0][1] == pytest.approx(8 * 2 * 4 * 16 * 16 / 1e-3 / 1e9)
    assert t.points[1][1] == 1.0          # the fastest repeat of a point, at most the peak


def test_grouped_tables_round_trip_through_a_profile_file(tmp_path):
    table = EfficiencyTable(((1e3, 0.05), (1e6, 0.4)), source="measured: example")
    profile = toy_profile()
    device = dataclasses.replace(profile.device, grouped_matmul_efficiency={"bf16": table})
    profile = dataclasses.replace(profile, device=device)
    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(profile))
    again = parse_profile(yaml.safe_load(path.read_text()), file=str(path))
    assert again.device.grouped_matmul_efficiency == {"bf16": table}
    assert again.device.grouped_efficiency(1e3, "bf16") == pytest.approx(0.05)
    assert toy_profile().device.grouped_efficiency(1e3, "bf16") is None


@pytest.mark.parametrize("eff", [0.05, 0.25])
def test_expert_gemms_are_priced_at_the_measured_grouped_speed(moe, eff):
    """With a measured table the expert banks' GEMMs run at its efficiency (looked up by one
    expert's share of the rows); everything else as before."""
    s = Strategy(global_batch=1, precision="bf16")
    opts = CostOptions(expert_grouped_gemm=True)
    flat = estimate(moe, _cluster(None), s, options=opts, calibration=None)
    table = EfficiencyTable(((1.0, eff),), source="example: flat")
    measured = estimate(moe, _cluster({"bf16": table}), s, options=opts, calibration=None)
    summary = summarize(moe)
    experts = [n for l in summary.layers for n in summary.templates[l.template] if n.expert]
    flops = sum(n.fwd_flops + n.bwd_flops for n in experts)
    assert measured.breakdown["compute_s"] - flat.breakdown["compute_s"] == pytest.approx(
        flops / (PEAK * eff) - flops / (PEAK * EFF), rel=1e-9)
    # per-expert GEMMs (a stack without grouped GEMMs) ignore the table
    eager = CostOptions(expert_grouped_gemm=False)
    assert (estimate(moe, _cluster({"bf16": table}), s, options=eager,
                     calibration=None).step_time_s
            == estimate(moe, _cluster(None), s, options=eager, calibration=None).step_time_s)


def test_the_profiler_times_grouped_gemms_and_tables_them():
    from types import SimpleNamespace

    from autoplan.profiling import MeasurementPlan, grouped_gemm

    plan = MeasurementPlan.for_machine(cuda=False, quick=True)
    said = []
    dist = SimpleNamespace(barrier=lambda: None)

    def timed(fn, target_s, local=True):
        import time
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    grouped = grouped_gemm.measure_grouped_gemms(
        torch, dist, "cpu", {"fp32": torch.float32, "bf16": torch.bfloat16}, plan, False,
        lambda: None, timed, said.append)
    assert set(grouped) <= {"fp32", "bf16"} and "fp32" in grouped
    assert [p[1] for p in grouped["fp32"]] == [4, 16, 64, 256]
    tables = grouped_gemm.tabulate_grouped_gemms([{"grouped": grouped}, {"grouped": grouped}],
                                                 {"fp32": 1e12, "bf16": 1e12}, "measured")
    assert list(tables["fp32"].points)[0][0] == 2 * 4 * 256 * 256
    assert all(0 < e <= 1 for _, e in tables["fp32"].points)
    assert any("grouped GEMM fp32" in line for line in said)


def _sized_cluster(grouped: dict | None = None):
    """The toy device with an efficiency that grows with the matmul's size (so the size a
    GEMM is priced at shows), and an FP8 peak twice the 16-bit one."""
    profile = toy_profile(devices_per_node=1)
    curve = EfficiencyTable(((1e3, 0.1), (1e7, 0.5)), source="example: by size")
    device = dataclasses.replace(profile.device, grouped_matmul_efficiency=grouped,
                                 peak_flops_per_s={**profile.device.peak_flops_per_s,
                                                   "fp8": 2 * PEAK},
                                 matmul_efficiency={"default": curve})
    return compose_cluster([NodeGroup(dataclasses.replace(profile, device=device), 1)],
                           name="toy")


def _expert_nodes(moe):
    summary = summarize(moe)
    return [n for l in summary.layers for n in summary.templates[l.template] if n.expert]


@pytest.mark.parametrize("streams", [1, 2])
def test_per_expert_kernels_on_streams_are_priced_at_the_concurrent_experts_size(moe, streams):
    """Transformer Engine's GroupedLinear (``expert_gemm_streams``): one GEMM per local
    expert, ``streams`` at a time, priced as one GEMM of the concurrent experts' rows; as
    many streams as local experts prices the bank as one kernel; a measured grouped table
    (torch's kernel) is not what runs."""
    s = Strategy(global_batch=1, precision="bf16")
    c = _sized_cluster({"bf16": EfficiencyTable(((1.0, 0.05),), source="example: flat")})
    whole = estimate(moe, _sized_cluster(), s, calibration=None,
                     options=CostOptions(expert_grouped_gemm=True))
    te = estimate(moe, c, s, calibration=None,
                  options=CostOptions(expert_grouped_gemm=True, expert_gemm_streams=streams))
    device = c.device_types[0]
    share = streams / EXPERTS
    expected = sum((n.fwd_flops + n.bwd_flops)
                   * (1 / (PEAK * device.efficiency(n.fwd_flops * share, "bf16"))
                      - 1 / (PEAK * device.efficiency(n.fwd_flops, "bf16")))
                   for n in _expert_nodes(moe))
    assert expected > 0
    assert te.breakdown["compute_s"] - whole.breakdown["compute_s"] == pytest.approx(
        expected, rel=1e-9)
    every = estimate(moe, c, s, calibration=None,
                     options=CostOptions(expert_grouped_gemm=True, expert_gemm_streams=EXPERTS))
    assert every.step_time_s == whole.step_time_s


def test_fp8_expert_gemms_keep_the_measured_grouped_speed(moe):
    """An FP8 bank run as one grouped kernel: the measured (bf16) grouped efficiency times
    the FP8/bf16 speed of a GEMM of the bank's size (here twice the peak, same fraction)."""
    s = Strategy(global_batch=1, precision="fp8")
    opts = CostOptions(expert_grouped_gemm=True, fp8_library="transformer-engine")
    eff = 0.05
    flat = estimate(moe, _sized_cluster(), s, options=opts, calibration=None)
    table = EfficiencyTable(((1.0, eff),), source="example: flat")
    c = _sized_cluster({"bf16": table})
    measured = estimate(moe, c, s, options=opts, calibration=None)
    device = c.device_types[0]
    expected = sum((n.fwd_flops + n.bwd_flops)
                   * (1 / (2 * PEAK * eff) - 1 / (2 * PEAK * device.efficiency(n.fwd_flops, "fp8")))
                   for n in _expert_nodes(moe))
    assert measured.breakdown["compute_s"] - flat.breakdown["compute_s"] == pytest.approx(
        expected, rel=1e-9)


def test_expert_gemm_streams_of_the_stacks_and_bad_values():
    from autoplan.cost.compute import expert_kernel_fraction
    from autoplan.cost.constants import TE_GEMM_STREAMS
    from autoplan.errors import ConfigError

    assert CostOptions(stack="megatron-core").expert_gemm_streams == TE_GEMM_STREAMS == 4
    assert CostOptions().expert_gemm_streams == 0           # torch's grouped_mm: one kernel
    te = CostOptions(stack="megatron-core")
    assert expert_kernel_fraction(te, experts=128, ep=8) == 4 / 16
    assert expert_kernel_fraction(te, experts=8, ep=2) == 1.0
    assert expert_kernel_fraction(CostOptions(), experts=128, ep=1) == 1.0
    assert expert_kernel_fraction(CostOptions(expert_grouped_gemm=False), 128, 8) == 1 / 16
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ConfigError, match="expert_gemm_streams"):
            CostOptions(expert_gemm_streams=bad)
