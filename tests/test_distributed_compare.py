"""probes/distributed/compare.py: bitwise agreement and error against fp64."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from trainprobes.distributed.compare import bitwise_agreement, error_vs_reference, mismatch_report
from trainprobes.reference.formats import get_format


@given(st.integers(1, 5), st.integers(1, 200), st.integers(0, 2**31))
def test_identical_outputs_agree_fully(ranks, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(torch.bfloat16)
    a = bitwise_agreement([x] * ranks, x.double(), "bf16")
    assert a["bitwise_match_fraction"] == 1.0 and a["mismatched"] == 0
    assert a["compared"] == ranks * n and mismatch_report(a) == ""


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_mismatches_are_counted_located_and_measured_in_ulps(dtype):
    fmt = get_format(dtype)
    pred = torch.ones(10, dtype=torch.float64)
    real1 = pred.clone()
    real1[3] = 1 + 2 * fmt.eps  # 2 ulp off at rank 1, index 3
    real1[7] = 1 + fmt.eps
    a = bitwise_agreement([pred.clone(), real1, None], pred, dtype)
    assert a["mismatched"] == 2 and a["compared"] == 20
    assert a["bitwise_match_fraction"] == pytest.approx(18 / 20)
    assert a["ranks_compared"] == [0, 1]
    assert [(m["rank"], m["index"]) for m in a["first_mismatches"]] == [(1, 3), (1, 7)]
    assert a["worst_mismatch"]["index"] == 3 and a["worst_mismatch"]["ulp_diff"] == 2.0
    text = mismatch_report(a)
    assert "Mismatched elements: 2 / 20 (10.0%)" in text
    assert "Greatest difference: 2 ulp at rank 1 index (3,)" in text


def test_bits_not_values_nan_equal_signed_zero_distinct():
    real = torch.tensor([math.nan, -0.0, 1.0])
    pred = torch.tensor([math.nan, 0.0, 1.0])
    a = bitwise_agreement([real], pred, "fp32")
    assert a["mismatched"] == 1 and a["first_mismatches"][0]["index"] == 1


def test_per_rank_predictions_are_compared_rank_by_rank():
    p = [torch.zeros(4), torch.ones(4)]
    assert bitwise_agreement([torch.zeros(4), torch.ones(4)], p, "fp32")["mismatched"] == 0
    assert bitwise_agreement([torch.ones(4), torch.zeros(4)], p, "fp32")["mismatched"] == 8


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="predicted has shape"):
        bitwise_agreement([torch.zeros(4)], [torch.zeros(5)], "fp32")
    with pytest.raises(ValueError, match="no tensor on any rank"):
        bitwise_agreement([None, None], torch.zeros(4), "fp32")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("sign", [1, -1])
def test_a_systematic_error_is_a_significant_bias(dtype, sign):
    fmt = get_format(dtype)
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(5000, generator=g, dtype=torch.float64) + 1  # in [1, 2): ulp = eps
    noise = torch.randint(-1, 2, (5000,), generator=g).double()
    real = ref + (noise + sign * 0.5) * fmt.eps
    e = error_vs_reference([real], ref, dtype)
    assert e["bias"] == pytest.approx(sign * 0.5 + float(noise.mean()), abs=1e-9)
    assert e["bias_p"] < 1e-6 and math.copysign(1, e["bias_z"]) == sign
    assert e["max_ulp_error"] == pytest.approx(1.5)


def test_exact_results_have_no_error_and_no_bias():
    ref = torch.linspace(-3, 3, 101, dtype=torch.float64)
    e = error_vs_reference([ref.clone(), ref.clone()], ref, "bf16")
    assert (e["max_ulp_error"], e["bias"], e["bias_p"], e["n"]) == (0.0, 0.0, 1.0, 202)


def test_unbiased_noise_is_not_significant():
    g = torch.Generator().manual_seed(3)
    ref = torch.rand(4000, generator=g, dtype=torch.float64) + 1
    real = ref + torch.randint(-2, 3, (4000,), generator=g).double() * get_format("fp16").eps
    assert error_vs_reference([real], ref, "fp16")["bias_p"] > 1e-3


def test_nonfinite_outputs_are_counted_not_averaged():
    ref = torch.ones(4, dtype=torch.float64)
    real = torch.tensor([1.0, math.inf, math.nan, 1.0], dtype=torch.float64)
    e = error_vs_reference([real], ref, "fp16")
    assert e["nonfinite"] == 2 and e["n"] == 2 and e["max_ulp_error"] == 0.0


def test_cancellation_is_measured_at_the_scale_before_it():
    # ranks cancel to 0 but rounded partial sums near 1: ulp(0) would make 2^-8 ~ 1e38 ulps
    ref = torch.zeros(3, dtype=torch.float64)
    real = torch.tensor([2.0 ** -8, 0.0, -(2.0 ** -7)], dtype=torch.float64)
    e = error_vs_reference([real], ref, "bf16", scale=torch.ones(3, dtype=torch.float64))
    assert e["max_ulp_error"] == 1.0 and e["mean_ulp_error"] == pytest.approx(0.5)
    assert error_vs_reference([real], ref, "bf16")["max_ulp_error"] > 1e30
    with pytest.raises(ValueError, match="scale has shape"):
        error_vs_reference([real], ref, "bf16", scale=torch.ones(4))
