"""Measured kernel tables (autoplan.cost.kernels): where they come from, how they carry from
the GPU measured to the others of its architecture, and when they apply."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

from autoplan.cost import CostOptions
from autoplan.cost.kernels import apply_kernel_tables, load_kernel_tables
from autoplan.errors import ConfigError
from autoplan.hardware import load_cluster, load_profile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import stack_kernels  # noqa: E402


@functools.lru_cache(maxsize=None)
def _graph():
    from autoplan import trace
    from autoplan.models import GPT, GPTConfig
    return trace(GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=2, layers=2)),
                 seq_len=16)


def _engine(profile: str, **options):
    from autoplan.cost import engine_for
    return engine_for(_graph(), load_cluster(profile), options=CostOptions(**options))


def test_the_shipped_tables_are_the_committed_measurement():
    """profiles/cost/kernels-torch-eager.yaml is what benchmarks/stack_kernels.py makes of the
    committed H100 profile: nothing in it was edited by hand."""
    assert stack_kernels.build(stack_kernels.MEASURED) == load_kernel_tables("torch-eager")


def test_the_tables_carry_by_the_datasheet():
    """On the H100 measured, a large bf16 matmul runs at the measured FLOP/s; on an H200 (the
    same 989 TFLOP/s datasheet peak) at the same speed; memory-bound operators at the
    measured bytes per second, scaled on the H200 by its datasheet bandwidth (4.8 / 3.35)."""
    measured = load_profile(REPO / stack_kernels.MEASURED["hopper"][0]).device
    tables = load_kernel_tables("torch-eager")
    h100 = apply_kernel_tables(load_cluster("h100-sxm5-80gb"), tables).device_type_of(0)
    h200 = apply_kernel_tables(load_cluster("h200-sxm-141gb"), tables).device_type_of(0)
    big = measured.matmul_efficiency["bf16"].points[-2][0]
    assert h100.achieved_flops_per_s(big, "bf16") == pytest.approx(
        measured.achieved_flops_per_s(big, "bf16"), rel=1e-9)
    assert h200.achieved_flops_per_s(big, "bf16") == pytest.approx(
        h100.achieved_flops_per_s(big, "bf16"), rel=1e-9)
    assert h100.elementwise_rates.forward_bytes_per_s["gelu"] == pytest.approx(
        measured.elementwise_rates.forward_bytes_per_s["gelu"], rel=1e-9)
    ratio = h200.memory_bw_bytes_per_s / h100.memory_bw_bytes_per_s
    assert ratio == pytest.approx(4.8 / 3.35, rel=0.01)
    assert h200.elementwise_rates.backward_bytes_per_s["softmax"] == pytest.approx(
        ratio * h100.elementwise_rates.backward_bytes_per_s["softmax"], rel=1e-9)
    assert h200.attention_efficiency == h100.attention_efficiency
    assert "h100-sxm5-80gb-2026-11-27" in h200.matmul_efficiency["bf16"].source


def test_they_apply_where_asked_and_measured():
    """Asked for (``kernel_tables``), Hopper runs the measured tables under any stack; by
    default every stack keeps the published-run fit; Ampere, with no measurement, keeps the
    fit either way; so does calibration=None (the profiles as they are)."""
    from autoplan.cost import CostEngine
    for stack in ("autoplan", "megatron-core", "fsdp", "megatron-2021"):
        dev = _engine("h100-sxm5-80gb", stack=stack).cluster.device_type_of(0)
        assert "bf16" not in dev.matmul_efficiency, stack
        assert dev.matmul_efficiency["default"].source.startswith("fitted"), stack
        assert dev.attention_efficiency is None and dev.elementwise_rates is None, stack
        dev = _engine("h100-sxm5-80gb", stack=stack,
                      kernel_tables="torch-eager").cluster.device_type_of(0)
        assert dev.matmul_efficiency["bf16"].source.startswith("measured"), stack
        assert dev.attention_efficiency is not None and dev.elementwise_rates is not None
    a100 = _engine("a100-sxm4-80gb", kernel_tables="torch-eager").cluster.device_type_of(0)
    assert a100.matmul_efficiency["default"].source.startswith("fitted")
    assert a100.attention_efficiency is None
    e = _engine("h100-sxm5-80gb", kernel_tables="torch-eager")
    raw = CostEngine(e.summary, load_cluster("h100-sxm5-80gb"), calibration=None,
                     options=e.options)
    assert raw.cluster.device_type_of(0) == load_profile("h100-sxm5-80gb").device


def test_a_measured_profile_keeps_its_own_tables():
    measured = load_cluster(str(REPO / stack_kernels.MEASURED["hopper"][0]))
    assert apply_kernel_tables(measured, load_kernel_tables("torch-eager")) is measured


def test_the_measured_kernels_price_hopper_faster():
    """The measured matmuls (76% of the H100's datasheet peak when large) against the fit's
    (57%, plus 41 us a kernel): the same layout of GPT-3 1.3B prices more than 15% faster
    on 8 H100 with the tables, and the same on 8 A100."""
    from autoplan import Strategy, estimate, trace
    from autoplan.zoo import build_model
    model, seq = build_model("zoo:gpt3-1.3b")
    g = trace(model, seq_len=seq)
    s = Strategy(dp=8, global_batch=64, micro_batch=4)
    for profile, faster in (("h100-sxm5-80gb", True), ("a100-sxm4-80gb", False)):
        c = load_cluster(profile)
        fit = estimate(g, c, s).step_time_s
        tables = estimate(g, c, s, options=CostOptions(kernel_tables="torch-eager")).step_time_s
        if faster:
            assert tables < 0.85 * fit, profile
        else:
            assert tables == fit, profile


def test_unknown_tables_say_which_exist(tmp_path):
    with pytest.raises(ConfigError, match="known: torch-eager"):
        _engine("h100-sxm5-80gb", kernel_tables="torch-eagre")
    # an architecture without tables: nothing to apply, and nothing read
    a100 = _engine("a100-sxm4-80gb", kernel_tables="").cluster.device_type_of(0)
    assert a100.attention_efficiency is None
    bad = tmp_path / "kernels-bad.yaml"
    bad.write_text("name: bad\ndescription: x\narchitectures: {hopper: {measured_on: x}}\n")
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        load_kernel_tables(bad)


def test_the_script_writes_tables_from_another_measurement(tmp_path, capsys):
    """The H200's committed profile makes tables of its own (atomically written, loadable);
    a datasheet profile given as the measurement is refused in one line."""
    out = tmp_path / "kernels-h200.yaml"
    assert stack_kernels.main(["--measured", "profiles/measured/h200-sxm-141gb-2026-11-27.yaml",
                               "--datasheet", "h200-sxm-141gb", "--out", str(out)]) == 0
    t = load_kernel_tables(out)
    assert "H200" in t.architectures["hopper"].measured_on
    assert stack_kernels.main(["--measured", str(REPO / "profiles/h100-sxm5-80gb.yaml"),
                               "--datasheet", "h100-sxm5-80gb", "--out", str(out)]) == 2
    assert "not a measured profile" in capsys.readouterr().err
