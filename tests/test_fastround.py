"""reference/fastround.py: the magic-number round-to-nearest gives Format.round's bits."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.errors import InvalidArgument
from trainprobes.reference.fastround import fits, round_nearest
from trainprobes.reference.formats import FORMATS
from trainprobes.strategies import format_tensors, ties

CASES = [(name, work) for name in FORMATS for work in (torch.float32, torch.float64)
         if fits(name, work)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Equal values with equal signs (so -0 is not +0); NaN equals NaN."""
    return ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (a.isnan() & b.isnan())


def test_every_format_but_fp64_rounds_in_float64_and_the_narrow_ones_in_float32():
    assert {n for n, w in CASES if w == torch.float64} == set(FORMATS) - {"fp64"}
    assert {n for n, w in CASES if w == torch.float32} == {
        "fp16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp6_e2m3fn",
        "fp6_e3m2fn", "fp4_e2m1fn"}  # bf16/tf32 need float32's whole range above them
    with pytest.raises(InvalidArgument, match="cannot be rounded in torch.float32"):
        round_nearest(torch.ones(2), "bf16")


@pytest.mark.parametrize("name, work", CASES)
@settings(max_examples=12)  # 20 cases; the large sample below carries the volume
@given(data=st.data(), saturate=st.booleans())
def test_round_nearest_is_format_round_bit_for_bit(name, work, data, saturate):
    # the work type's own values (subnormals, inf, NaN included) and the format's ties
    src = "fp32" if work == torch.float32 else "fp64"
    x = data.draw(format_tensors(src, shape=(24,), allow_nan=True, allow_infinity=True))
    t = data.draw(st.lists(ties(name), min_size=4, max_size=4))
    x = torch.cat([x, torch.tensor(t, dtype=torch.float64)]).to(work)
    want = FORMATS[name].round(x.double(), saturate=saturate)
    got = round_nearest(x, name, saturate=saturate).double()
    assert bool(same_bits(got, want).all()), x[~same_bits(got, want)]


@pytest.mark.parametrize("name, work", CASES)
@pytest.mark.parametrize("saturate", [False, True])
def test_edges_and_a_large_random_sample(name, work, saturate):
    f = FORMATS[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20_000, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-40, 40, x.shape, generator=g).double())
    q = f.ulp(f.max_finite).item()
    edges = [0.0, -0.0, math.inf, -math.inf, math.nan, f.max_finite, -f.max_finite,
             f.max_finite + q / 2, f.max_finite + q / 4, -(f.max_finite + q), 1e300, -1e-300,
             f.smallest_subnormal / 2, -f.smallest_subnormal / 2, -f.smallest_subnormal / 3]
    x = torch.cat([x, torch.tensor(edges, dtype=torch.float64)]).to(work)
    for inside in (x, x[x.abs() <= f.max_finite]):  # the clamp-free and the clamped route
        want = f.round(inside.double(), saturate=saturate)
        got = round_nearest(inside, f, saturate=saturate).double()
        assert bool(same_bits(got, want).all()), inside[~same_bits(got, want)][:5]


def test_input_is_left_alone_unless_overwrite():
    x = torch.tensor([1000.0, 1.06, -0.0], dtype=torch.float32)
    before = x.clone()
    round_nearest(x, "fp8_e4m3fn")
    assert torch.equal(x, before)
    y = round_nearest(x, "fp8_e4m3fn", saturate=True, overwrite=True)
    assert y.tolist() == [448.0, 1.0, 0.0] and torch.signbit(y[2])
