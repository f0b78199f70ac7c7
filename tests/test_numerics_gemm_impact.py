"""trainprobes.numerics.gemm_impact: the loss gap a low-precision weight-gradient GEMM causes."""
import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.gemm_impact import _emulated, gemm_impact, label
from trainprobes.numerics.impact import least_squares
from trainprobes.reference.gemm import get_preset
from trainprobes.reference.recipes import get_recipe


def test_a_truncating_wgrad_gemm_lags_fp64():
    # fp8 row-wise operands (what the H200's fp8 tensor core multiplies), K = 4096 tokens
    r = gemm_impact(recipes=("fp8-rowwise",), presets=("h200-scaled-mm", "fp32"), tokens=4096,
                    steps=6, seed=0, tol=0.002)
    m = r.metrics
    trunc, fp32 = (m[f"loss_gap[{label('fp8-rowwise', p)}]"] for p in ("h200-scaled-mm", "fp32"))
    share = m[f"accumulator_gap[{label('fp8-rowwise', 'h200-scaled-mm')}]"]
    assert share > 0.005 and share == pytest.approx(trunc - fp32), r.message
    assert r.verdict == "fail" and r.evidence["over_tol"] == ["fp8-rowwise x h200-scaled-mm"]


def test_pairs_no_hardware_runs_are_left_out_or_named_what_if():
    # bf16 products (and block scales) under an fp8 tensor core's accumulator: the old table
    # judged them as if a machine ran them
    r = gemm_impact(recipes=("bf16", "mxfp8"), presets=("h200-scaled-mm", "fp32"), tokens=256,
                    steps=2, seed=0)
    assert [(w["recipe"], w["preset"]) for w in r.evidence["not_run"]] == [
        ("bf16", "h200-scaled-mm"), ("mxfp8", "h200-scaled-mm")]
    assert "loss_gap[bf16 x h200-scaled-mm]" not in r.metrics and "loss_gap[bf16 x fp32]" in r.metrics
    assert "not run (2 pairs no hardware runs)" in r.message
    w = gemm_impact(recipes=("bf16",), presets=("h200-scaled-mm",), tokens=256, steps=2, what_if=True)
    assert "loss_gap[bf16 x h200-scaled-mm]" in w.metrics and "WHAT-IF" in w.message
    with pytest.raises(InvalidArgument, match="no recipe x preset named was measured"):
        gemm_impact(recipes=("bf16",), presets=("h200-scaled-mm",), tokens=256, steps=2)


@pytest.mark.slow
def test_truncation_slows_training_and_promotion_removes_it():
    r = gemm_impact(recipes=("fp8-rowwise",), presets=("h200-scaled-mm", "deepseek-v3", "fp32"),
                    tokens=4096, steps=15, seed=0, tol=0.005)
    m = r.metrics
    trunc, promoted = (m[f"accumulator_gap[{label('fp8-rowwise', p)}]"] for p in
                       ("h200-scaled-mm", "deepseek-v3"))
    # truncated products make every gradient too small: the loss lags fp64's beyond the
    # recipe's own gap; promotion to fp32 every 128 removes nearly all of that share
    assert trunc > 0.005 and abs(promoted) < trunc / 10, r.message
    assert r.verdict == "fail" and r.codes == ["TP-B1"]
    assert "fp8-rowwise x h200-scaled-mm" in r.evidence["over_tol"]
    curves = r.evidence["curves"]
    assert len(curves["fp64"]) == 16 and curves["fp64"][-1] < curves["fp64"][0]


def test_the_emulated_gradient_is_the_wgrad_gemm():
    # under fp32 accumulation and bf16 operands it is mean X^T r up to bf16's rounding of the
    # operands, and every one of the features is computed, in its own place
    X, y = least_squares(1, 256, 8, 0.1, torch.Generator().manual_seed(1), 1.0)
    r = X[0] @ torch.randn(8, dtype=torch.float64) - y[0]
    got = _emulated(get_recipe("bf16"), get_preset("fp32"), 0)(0, X, r.reshape(1, -1))
    want = X[0].t() @ r / 256
    assert torch.allclose(got, want, rtol=2e-2, atol=1e-3 * want.abs().max().item())
    xb, rb = X[0].to(torch.bfloat16).double(), r.to(torch.bfloat16).double()
    assert torch.allclose(got, xb.t() @ rb / 256, rtol=1e-6)


def test_bad_input_is_named():
    with pytest.raises(InvalidArgument, match="quantises nothing"):
        gemm_impact(recipes=("exact",), tokens=64, steps=1)
    with pytest.raises(InvalidArgument, match="multiple of 32"):
        gemm_impact(recipes=("mxfp8",), tokens=100, steps=1)
    with pytest.raises(InvalidArgument, match="nvfp4"):
        gemm_impact(recipes=("nvfp5",), tokens=64, steps=1)
    with pytest.raises(InvalidArgument, match="h200-scaled-mm"):
        gemm_impact(presets=("h100",), tokens=64, steps=1)
