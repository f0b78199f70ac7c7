"""trainprobes.numerics.gemm_impact: the loss gap a low-precision weight-gradient GEMM causes."""
import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.gemm_impact import _emulated, gemm_impact, label
from trainprobes.numerics.impact import least_squares
from trainprobes.reference.gemm import get_preset
from trainprobes.reference.recipes import get_recipe


def test_a_truncating_wgrad_gemm_lags_fp64():
    r = gemm_impact(recipes=("bf16",), presets=("h200-scaled-mm", "fp32"), tokens=1024, steps=6,
                    seed=0, tol=0.001)
    trunc, fp32 = (r.metrics[f"loss_gap[{label('bf16', p)}]"] for p in ("h200-scaled-mm", "fp32"))
    assert trunc > 0.002 and abs(fp32) < trunc / 10, r.message
    assert r.verdict == "fail" and r.evidence["over_tol"] == ["bf16 x h200-scaled-mm"]


@pytest.mark.slow
def test_truncation_slows_training_and_promotion_removes_it():
    r = gemm_impact(recipes=("bf16",), tokens=2048, steps=15, seed=0, tol=0.005)
    m = r.metrics
    trunc, promoted, fp32 = (m[f"loss_gap[{label('bf16', p)}]"] for p in
                             ("h200-scaled-mm", "deepseek-v3", "fp32"))
    # truncated products make every gradient too small: the loss lags fp64's (~+1.1% here);
    # promotion to fp32 every 128 removes nearly all of it, fp32 accumulation all of it
    assert trunc > 0.005 and promoted < trunc / 10 and abs(fp32) < 5e-4, r.message
    assert r.verdict == "fail" and r.codes == ["TP-B1"] and r.evidence["over_tol"] == ["bf16 x h200-scaled-mm"]
    assert m[f"accumulator_gap[{label('bf16', 'h200-scaled-mm')}]"] == pytest.approx(trunc - fp32)
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
