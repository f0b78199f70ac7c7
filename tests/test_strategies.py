import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.reference.formats import FORMATS
from trainprobes.strategies import (
    decode_bits,
    format_bit_patterns,
    format_tensors,
    format_values,
    rank_inputs,
    ties,
    total_bits,
)

ML = [n for n, f in FORMATS.items() if f.ml_dtype is not None and total_bits(f) <= 8]
NARROW = [n for n in FORMATS if n != "fp64"]


def _same(a, b):
    return ((a == b) | (np.isnan(a) & np.isnan(b))).all()


@pytest.mark.parametrize("name", ML)
def test_decode_matches_ml_dtypes_on_every_pattern(name):
    f = FORMATS[name]
    pats = np.arange(1 << total_bits(f), dtype=np.uint8)
    ref = pats.view(f.ml_dtype).astype(np.float64)
    got = decode_bits(torch.from_numpy(pats.astype(np.int64)), f).numpy()
    assert _same(ref, got)
    assert (np.signbit(ref) == np.signbit(got))[~np.isnan(ref)].all()


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_decode_matches_torch_on_every_pattern(name, dtype):
    p = torch.arange(1 << 16)
    ref = p.to(torch.int16).view(dtype).double().numpy()
    assert _same(decode_bits(p, name).numpy(), ref)


def test_decode_fp32_and_tf32():
    p = torch.tensor([0x3F800000, 0x00000001, 0x7F800000, 0xFF7FFFFF], dtype=torch.int64)
    ref = p.to(torch.int32).view(torch.float32).double()
    assert torch.equal(decode_bits(p, "fp32"), ref)
    # tf32 is fp32's top 19 bits: 1.0 = 0 01111111 0000000000
    assert decode_bits(127 << 10, "tf32").item() == 1.0
    assert decode_bits((1 << 10) - 1, "tf32").item() == (2**10 - 1) * 2.0**-136


@pytest.mark.parametrize("name", NARROW)
@given(data=st.data())
def test_values_are_exact_format_values(name, data):
    f = FORMATS[name]
    x = data.draw(format_tensors(name, shape=(16,)))
    assert torch.isfinite(x).all() and x.abs().max() <= f.max_finite
    assert torch.equal(f.round(x), x)


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3fn", "fp8_e4m3fnuz"])
def test_edges_and_specials_occur(name):
    f = FORMATS[name]
    seen = set()

    @settings(max_examples=250, derandomize=True, database=None)
    @given(format_values(name, allow_nan=True, allow_infinity=True))
    def collect(v):
        seen.add("nan" if math.isnan(v) else "inf" if math.isinf(v) else
                 "max" if abs(v) == f.max_finite else
                 "sub" if 0 < abs(v) < f.smallest_normal else "zero" if v == 0 else "normal")

    collect()
    want = {"max", "sub", "zero", "normal", "nan"} | ({"inf"} if f.has_inf else set())
    assert want <= seen, f"never drew {want - seen}"


@given(format_values("bf16", max_magnitude=3.0, allow_negative=False))
def test_max_magnitude_and_sign_constraints(v):
    assert 0 <= v <= 3.0


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e5m2", "fp4_e2m1fn"])
@given(data=st.data())
def test_ties_are_midpoints(name, data):
    f = FORMATS[name]
    t = data.draw(ties(name))
    x = torch.tensor([t])
    lo, hi = f.round(x, "toward_zero").item(), None
    assert f.round(x).item() != t  # not a format value
    hi = lo + math.copysign(f.ulp(lo).item(), t) if lo != 0 else math.copysign(f.smallest_subnormal, t)
    assert (lo + hi) / 2 == t


@given(rank_inputs(world=st.integers(1, 6), numel=st.integers(0, 5), fmt="fp8_e4m3fn"))
def test_rank_inputs_shapes_and_values(inputs):
    assert 1 <= len(inputs) <= 6
    assert len({t.shape for t in inputs}) == 1 and inputs[0].ndim == 1
    f = FORMATS["fp8_e4m3fn"]
    for t in inputs:
        assert t.dtype == torch.float64 and torch.equal(f.round(t), t)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_magnitude"):
        format_bit_patterns("bf16", max_magnitude=-1.0)
    with pytest.raises(ValueError, match="fp17"):
        format_values("fp17")
    with pytest.raises(ValueError, match="fp64"):
        ties("fp64")
