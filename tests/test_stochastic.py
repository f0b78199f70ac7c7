"""reference/stochastic.py: stochastic rounding on float32 bits, the same decisions as
Format.round given the same uniforms, the same distribution, Format.round where it must."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.reference.formats import FORMATS
from trainprobes.reference.scratch import Scratch
from trainprobes.reference.stochastic import (
    StochasticRounder,
    add_then_round,
    as_source,
    inexact_sums,
    random_bits,
    round_input,
    source,
    sr_storage,
    supported,
    two_sum,
)
from trainprobes.strategies import format_tensors

NAMES = [n for n, f in FORMATS.items() if supported(f)]


def same_bits(a, b):
    return ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (a.isnan() & b.isnan())


def test_supported_formats():
    assert NAMES == ["tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz",
                     "fp8_e5m2fnuz", "fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn"]


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15)
@given(data=st.data(), saturate=st.booleans())
def test_the_bit_rounding_is_format_round_given_the_same_uniforms(name, data, saturate):
    # In the format's normal range (and zero, inf, NaN, overflow) round_with(s, k) must be
    # Format.round(s, "stochastic", uniform=(2^d - 1 - k) / 2^d) bit for bit, whatever k is.
    f, w = FORMATS[name], StochasticRounder(FORMATS[name], saturate)
    s = data.draw(format_tensors("fp32", shape=(32,), allow_nan=True, allow_infinity=True))
    s = torch.where(s.abs() < f.smallest_normal, torch.zeros_like(s).copysign(s), s)  # +-0
    s = s.to(torch.float32)
    k = torch.tensor(data.draw(st.lists(st.integers(0, 2 ** w.d - 1), min_size=32,
                                        max_size=32)), dtype=torch.int32)
    want = f.round(s.double(), "stochastic", saturate=saturate,
                   uniform=(2 ** w.d - 1 - k.double()) / 2 ** w.d)
    got = w.round_with(s, k.clone()).double()
    assert bool(same_bits(got, want).all()), s[~same_bits(got, want)]


@pytest.mark.parametrize("name", ["fp16", "fp8_e4m3fn", "fp4_e2m1fn"])
def test_below_the_smallest_normal_it_is_format_round_with_the_generator(name):
    # narrow-range formats: subnormal-range values go to Format.round, which draws after
    # the lanes; replaying the same draws reproduces them bit for bit
    f = FORMATS[name]
    w = StochasticRounder(f, False)
    s = (torch.rand(500, generator=torch.Generator().manual_seed(2)) * f.smallest_normal)
    s = torch.cat([s, -s]).to(torch.float32)
    got = w(s, torch.Generator().manual_seed(9)).double()
    g = torch.Generator().manual_seed(9)
    random_bits(s.numel(), w.d, g, "cpu")  # the lanes the fast path drew first
    want = f.round(s.double(), "stochastic", generator=g)
    assert bool(same_bits(got, want).all())


@pytest.mark.parametrize("name", NAMES)
def test_zero_is_format_rounds_zero_and_fnuz_has_no_minus_zero(name):
    # the bit arithmetic keeps -0's sign bit; the fnuz formats have no -0 (its code is
    # their NaN), Format.round gives +0 there: so must the input rounding and every add
    f, w = FORMATS[name], StochasticRounder(FORMATS[name], False)
    s = torch.tensor([-0.0, 0.0, -0.0, 1.0], dtype=torch.float32)
    want = f.round(s.double(), "stochastic", seed=1)
    assert bool(same_bits(w(s, torch.Generator().manual_seed(1)).double(), want).all())
    assert bool(same_bits(round_input(s.double(), w, torch.Generator().manual_seed(1)).double(),
                          want).all())
    got = add_then_round(s, s, w, None, torch.Generator().manual_seed(1)).double()
    assert bool(same_bits(got, f.round(s.double() * 2, "stochastic", seed=1)).all())


def test_sums_float32_cannot_hold_are_rounded_from_float64():
    f = FORMATS["bf16"]
    w = StochasticRounder(f, False)
    a = torch.tensor([1.0, 3.0, -2.0, 1.0], dtype=torch.float32)
    b = torch.tensor([2.0 ** -30, 2.0 ** -40, 0.5, -(2.0 ** -30)], dtype=torch.float32)
    s, err = two_sum(a, b)
    assert (err != 0).tolist() == [True, True, False, True]  # and a + b = s + err exactly
    assert torch.equal(s.double() + err.double(), a.double() + b.double())
    got = add_then_round(a, b, w, None, torch.Generator().manual_seed(4)).double()
    g = torch.Generator().manual_seed(4)
    k = random_bits(4, w.d, g, "cpu")
    want = f.round(s.double(), "stochastic", uniform=(2 ** w.d - 1 - k.double()) / 2 ** w.d)
    bad = torch.tensor([0, 1, 3])
    want[bad] = f.round((a.double() + b.double())[bad], "stochastic", generator=g)
    assert bool(same_bits(got, want).all())


@pytest.mark.parametrize("name, value", [("bf16", 1 + 0.3 * 2 ** -7), ("fp16", -(1 + 0.7 * 2 ** -10)),
                                         ("fp8_e4m3fn", 1.1), ("fp8_e4m3fn", 0.0123)])
def test_unbiased_and_seeded(name, value):
    f = FORMATS[name]
    x = torch.full((100_000,), value, dtype=torch.float64)
    r = round_input(x, StochasticRounder(f, False), torch.Generator().manual_seed(3)).double()
    lo = f.round(x[:1], "toward_zero").item()
    hi = lo + math.copysign(f.ulp(value).item() if abs(value) >= f.smallest_normal
                            else f.smallest_subnormal, value)
    assert set(r.unique().tolist()) == {lo, hi}
    p = (value - lo) / (hi - lo)
    assert abs((r == hi).double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / x.numel())
    again = round_input(x, StochasticRounder(f, False), torch.Generator().manual_seed(3))
    assert torch.equal(r, again.double())


def test_float64_inputs_float32_cannot_hold_keep_their_low_bits():
    # 1 + 2^-40 rounds up to 1 + 2^-7 in bf16 with probability 2^-33: never in 10^5 draws;
    # float32 would see exactly 1.0 and still never round up. 1 + 2^-8 + 2^-40 must round
    # up with probability 1/2 + 2^-33, not 1/2 from a tie seen through float32.
    x = torch.tensor([1 + 2 ** -8 + 2 ** -40] * 100_000, dtype=torch.float64)
    r = round_input(x, StochasticRounder(FORMATS["bf16"], False), torch.Generator().manual_seed(0))
    assert set(r.double().unique().tolist()) == {1.0, 1 + 2 ** -7}
    assert abs((r > 1).double().mean().item() - 0.5) < 0.01


@pytest.mark.parametrize("make", [lambda seed: torch.Generator().manual_seed(seed),
                                  lambda seed: source(seed, "cpu").lanes])
def test_lanes_are_uniform_and_seeded(make):
    g = make(5)
    k16 = random_bits(100_000, 16, g, "cpu")
    k21 = random_bits(100_000, 21, g, "cpu")
    assert k16.dtype == torch.int32 and int(k16.min()) >= 0 and int(k16.max()) < 2 ** 16
    assert int(k21.max()) < 2 ** 21 and int(k21.max()) >= 2 ** 20
    for k, d in ((k16, 16), (k21, 21)):
        for bit in (0, d - 1):  # every bit of a lane is a fair coin
            assert abs(((k >> bit) & 1).double().mean().item() - 0.5) < 0.01
    assert torch.equal(random_bits(1000, 16, make(5), "cpu"), k16[:1000])
    out = torch.full((1000,), -1, dtype=torch.int32)  # into a given buffer: the same bits
    assert random_bits(1000, 16, make(5), "cpu", out) is not None and torch.equal(out, k16[:1000])


def test_cpu_sources_draw_lanes_from_numpy_and_uniforms_from_torch():
    src = source(3, "cpu")
    assert isinstance(src.lanes, np.random.SFC64) and isinstance(src.generator, torch.Generator)
    assert torch.equal(src.generator.get_state(), torch.Generator().manual_seed(3).get_state())
    plain = as_source(torch.Generator().manual_seed(3))
    assert plain.lanes is plain.generator and as_source(src) is src


def test_inexact_sums_are_the_ones_two_sum_finds():
    # bf16 values of every size, so float32 loses the low bits of some sums; a length that
    # is not a multiple of the 256-element rows, and NaN / inf, which count as inexact
    g = torch.Generator().manual_seed(7)
    n = 256 * 40 + 77
    a = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g)
                                                   .float())).bfloat16().float()
    b = torch.randn(n, generator=g).bfloat16().float()
    a[[5, 300, n - 3]] = torch.tensor([math.nan, math.inf, -math.inf])
    err = two_sum(a, b)[1]
    want = (err != 0) | err.isnan()
    got = inexact_sums(a, b, a + b, Scratch())
    assert got is not None and want[: 256 * 40].any() and want[256 * 40:].any()
    assert sorted(got.tolist()) == want.nonzero().reshape(-1).tolist()
    exact = torch.tensor([1.0, 3.0, -0.5], dtype=torch.float32)
    assert inexact_sums(exact, exact, exact + exact, Scratch()) is None


@pytest.mark.parametrize("name", NAMES)
def test_storage_dtype_holds_every_value_of_the_format(name):
    # the collectives keep stochastically rounded values in sr_storage(fmt): it must hold
    # every value exactly (all fp16 bit patterns cover every fp8/fp6/fp4 value)
    f = FORMATS[name]
    pool = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
    pool = torch.cat([pool, torch.randn(10_000, generator=torch.Generator().manual_seed(1),
                                        dtype=torch.float64) * 1e30])
    values = f.round(pool[torch.isfinite(pool)], saturate=True)
    assert torch.equal(values.to(sr_storage(f)).double(), values)
