import math

import ml_dtypes
import numpy as np
import pytest
import torch
from trainprobes.reference.formats import FORMATS, get_format

NARROW = [n for n in FORMATS if n not in ("fp64",)]
ML = [n for n, f in FORMATS.items() if f.ml_dtype is not None]


def _random_fp32_values(n=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(n, generator=g, dtype=torch.float64)
    scale = torch.exp2(torch.randint(-30, 30, (n,), generator=g).double())
    return (mant * scale).float().double()


@pytest.mark.parametrize("name", ML)
def test_nearest_matches_ml_dtypes_on_fp32_input(name):
    # From fp32 input ml_dtypes rounds once, so it is a correct oracle there.
    f = FORMATS[name]
    x = _random_fp32_values()
    ref = x.numpy().astype(np.float32).astype(f.ml_dtype).astype(np.float64)
    got = f.round(x).numpy()
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    assert same.all(), f"{(~same).sum()} of {x.numel()} differ; first x={x[~torch.from_numpy(same)][:3]}"


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_nearest_matches_torch_cast_from_fp32(name):
    f = FORMATS[name]
    x = _random_fp32_values(seed=1)
    ref = x.float().to(f.torch_dtype).double()
    assert torch.equal(f.round(x), ref)


def test_single_rounding_from_fp64_where_fp32_path_double_rounds():
    # 1 + 2^-8 + 2^-40: above the bf16 midpoint 1 + 2^-8, so it rounds up to 1 + 2^-7.
    # Through fp32 the 2^-40 is lost, leaving an exact tie that rounds to even (1.0).
    x = torch.tensor([1 + 2**-8 + 2**-40, 1 + 2**-11 + 2**-40], dtype=torch.float64)
    bf16, fp16 = FORMATS["bf16"], FORMATS["fp16"]
    assert bf16.round(x[:1]).item() == 1 + 2**-7
    assert x[:1].float().bfloat16().item() == 1.0  # the fp32 path: double rounding
    assert fp16.round(x[1:]).item() == 1 + 2**-10
    assert x[1:].float().half().item() == 1.0


@pytest.mark.parametrize("name,overflow", [("fp16", math.inf), ("bf16", math.inf),
                                           ("fp8_e5m2", math.inf), ("fp8_e4m3fn", math.nan),
                                           ("fp8_e4m3fnuz", math.nan), ("fp4_e2m1fn", 6.0)])
def test_overflow_as_the_real_type_and_saturate_option(name, overflow):
    f = FORMATS[name]
    big = torch.tensor([f.max_finite * 4], dtype=torch.float64)
    got = f.round(big).item()
    assert (math.isnan(got) and math.isnan(overflow)) or got == overflow
    assert f.round(big, saturate=True).item() == f.max_finite
    assert f.round(-big, saturate=True).item() == -f.max_finite
    # Just below the overflow threshold (max + ulp/2) stays at max.
    edge = torch.tensor([f.max_finite + 0.49 * f.ulp(f.max_finite).item()], dtype=torch.float64)
    assert f.round(edge).item() == f.max_finite


def test_e4m3fn_inf_input_is_nan_unless_saturated():
    f = FORMATS["fp8_e4m3fn"]
    x = torch.tensor([math.inf, -math.inf], dtype=torch.float64)
    assert f.round(x).isnan().all()
    assert f.round(x, saturate=True).tolist() == [448.0, -448.0]


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3fn"])
def test_stochastic_rounding_is_unbiased_and_seeded(name):
    f = FORMATS[name]
    x = torch.full((400_000,), 1.0 + 0.3 * f.eps, dtype=torch.float64)
    r = f.round(x, "stochastic", seed=3)
    assert set(r.unique().tolist()) == {1.0, 1.0 + f.eps}
    frac_up = (r > 1).double().mean().item()
    assert abs(frac_up - 0.3) < 5 * math.sqrt(0.3 * 0.7 / x.numel())
    assert torch.equal(r, f.round(x, "stochastic", seed=3))
    assert not torch.equal(r, f.round(x, "stochastic", seed=4))


def test_toward_zero_truncates_both_signs():
    f = FORMATS["bf16"]
    x = torch.tensor([1 + 0.9 * f.eps, -(1 + 0.9 * f.eps)], dtype=torch.float64)
    assert f.round(x, "toward_zero").tolist() == [1.0, -1.0]


@pytest.mark.parametrize("name,expected", [("fp16", 2048.0), ("bf16", 256.0), ("fp8_e4m3fn", 16.0),
                                           ("fp8_e5m2", 8.0), ("fp32", 2.0**24), ("tf32", 2048.0)])
def test_stall_point_of_one(name, expected):
    assert FORMATS[name].stall_point(1.0) == expected


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"])
@pytest.mark.parametrize("d", [1.0, 0.75, 1e-3, 3.0, 0.1])
def test_stall_point_is_the_smallest_stuck_value(name, d):
    f = FORMATS[name]
    s = f.stall_point(d)
    if math.isinf(s):
        pytest.skip("overflows before it stalls")
    # every representable value at or above s (within its binade) is stuck, the one below is not
    vals = torch.tensor([s, s + f.ulp(s).item() * 2], dtype=torch.float64)
    assert torch.equal(f.round(vals + d), vals)
    if s > 0:
        below = s - f.ulp(s / 2).item()
        assert f.round(torch.tensor([below + d], dtype=torch.float64)).item() != below


def test_ulp_and_fnuz_zero():
    assert FORMATS["fp16"].ulp(1024.0).item() == 1.0
    assert FORMATS["fp16"].ulp(2048.0).item() == 2.0
    assert FORMATS["fp16"].ulp(0.0).item() == 2.0**-24
    z = FORMATS["fp8_e4m3fnuz"].round(torch.tensor([-1e-9], dtype=torch.float64))
    assert z.item() == 0 and not torch.signbit(z).item()


def test_unknown_format_names_the_choices():
    with pytest.raises(ValueError, match="fp16"):
        get_format("fp17")


# Every spelling a user types, as torch, ml_dtypes, NVIDIA and the OCP specs write them.
SPELLINGS = [
    ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("torch.float16", "fp16"),
    ("torch.half", "fp16"), (torch.float16, "fp16"), (torch.half, "fp16"),
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), (torch.bfloat16, "bf16"),
    ("fp32", "fp32"), ("float32", "fp32"), ("float", "fp32"), ("single", "fp32"),
    ("torch.float32", "fp32"), (torch.float32, "fp32"),
    ("fp64", "fp64"), ("float64", "fp64"), ("double", "fp64"), ("torch.double", "fp64"),
    (torch.float64, "fp64"),
    ("tf32", "tf32"), ("tensorfloat32", "tf32"), ("TensorFloat-32", "tf32"),
    ("fp8_e4m3fn", "fp8_e4m3fn"), ("float8_e4m3fn", "fp8_e4m3fn"), ("e4m3fn", "fp8_e4m3fn"),
    ("e4m3", "fp8_e4m3fn"), ("fp8e4m3", "fp8_e4m3fn"), ("fp8e4m3fn", "fp8_e4m3fn"),
    ("fp8_e4m3", "fp8_e4m3fn"), ("torch.float8_e4m3fn", "fp8_e4m3fn"),
    (torch.float8_e4m3fn, "fp8_e4m3fn"),
    ("fp8_e5m2", "fp8_e5m2"), ("float8_e5m2", "fp8_e5m2"), ("e5m2", "fp8_e5m2"),
    ("fp8e5m2", "fp8_e5m2"), (torch.float8_e5m2, "fp8_e5m2"),
    ("float8_e4m3fnuz", "fp8_e4m3fnuz"), ("e4m3fnuz", "fp8_e4m3fnuz"),
    ("fp8e4m3fnuz", "fp8_e4m3fnuz"), (torch.float8_e4m3fnuz, "fp8_e4m3fnuz"),
    ("float8_e5m2fnuz", "fp8_e5m2fnuz"), ("e5m2fnuz", "fp8_e5m2fnuz"),
    (torch.float8_e5m2fnuz, "fp8_e5m2fnuz"),
    ("float6_e2m3fn", "fp6_e2m3fn"), ("e2m3fn", "fp6_e2m3fn"), ("fp6_e2m3", "fp6_e2m3fn"),
    ("float6_e3m2fn", "fp6_e3m2fn"), ("e3m2fn", "fp6_e3m2fn"), ("fp6e3m2", "fp6_e3m2fn"),
    ("float4_e2m1fn", "fp4_e2m1fn"), ("e2m1fn", "fp4_e2m1fn"), ("fp4", "fp4_e2m1fn"),
    ("fp4_e2m1", "fp4_e2m1fn"), ("e2m1", "fp4_e2m1fn"), ("fp4_e2m1fn", "fp4_e2m1fn"),
    ("e2m3", "fp6_e2m3fn"), ("fp6_e2m3fn", "fp6_e2m3fn"), ("e3m2", "fp6_e3m2fn"),
    ("fp6_e3m2fn", "fp6_e3m2fn"), ("fp8_e5m2fnuz", "fp8_e5m2fnuz"),
    ("f16", "fp16"), ("f32", "fp32"), ("f64", "fp64"),
    # numpy and ml_dtypes dtypes and their scalar types
    (np.float16, "fp16"), (np.dtype("float32"), "fp32"), (ml_dtypes.bfloat16, "bf16"),
    (np.dtype(ml_dtypes.float8_e4m3fn), "fp8_e4m3fn"), (ml_dtypes.float4_e2m1fn, "fp4_e2m1fn"),
]


@pytest.mark.parametrize("spelling, name", SPELLINGS, ids=[str(s) for s, _ in SPELLINGS])
def test_every_spelling_resolves(spelling, name):
    assert get_format(spelling).name == name
    if isinstance(spelling, str):  # case and surrounding whitespace do not matter
        assert get_format(f"  {spelling.upper()}\t").name == name
        assert get_format(spelling.title()).name == name


def test_every_alias_is_tested_and_names_a_format():
    from trainprobes.reference.formats import ALIASES, FORMAT_NAMES, _spelling
    assert FORMAT_NAMES == tuple(FORMATS)
    tested = {_spelling(s) for s, _ in SPELLINGS if isinstance(s, str)}
    assert set(ALIASES) <= tested, sorted(set(ALIASES) - tested)
    assert set(ALIASES.values()) == set(FORMAT_NAMES)


@pytest.mark.parametrize("value, msg", [
    ("fp17", r"^dtype='fp17' must be one of \('fp64', 'fp32', .*'fp4_e2m1fn'\); did you mean"),
    ("flaot16", r"did you mean 'fp16'\?$"),
    ("bfloat61", r"did you mean 'bf16'\?$"),
    ("float8_e4m3", r"^dtype='float8_e4m3': ml_dtypes.float8_e4m3 is IEEE-like .*not e4m3fn; "
                    r"expected one of \('fp64'"),
    (ml_dtypes.float8_e4m3, r"^dtype=.*float8_e4m3.* is IEEE-like"),
    (torch.int32, r"^dtype=torch.int32 is not a floating-point format"),
])
def test_unknown_spellings_are_refused_with_the_names(value, msg):
    from trainprobes.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match=msg):
        get_format(value)


def test_a_value_of_the_wrong_kind_is_a_type_error_naming_the_argument():
    from trainprobes.errors import InvalidType
    with pytest.raises(InvalidType, match=r"^accum_dtype=16 must be str"):
        get_format(16, "accum_dtype")
    with pytest.raises(ValueError, match="stochastic"):
        FORMATS["fp16"].round(torch.zeros(1), "up")
    with pytest.raises(ValueError, match="seed"):
        FORMATS["fp16"].round(torch.zeros(1), "stochastic")


# Property tests drawn from bit patterns (trainprobes.strategies): every format, edges included.
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from trainprobes.strategies import format_tensors, format_values, ties  # noqa: E402


@pytest.mark.parametrize("name", NARROW)
@given(data=st.data())
def test_round_is_idempotent_on_format_values(name, data):
    f = FORMATS[name]
    x = data.draw(format_tensors(name, shape=(16,), allow_nan=True, allow_infinity=True))
    for mode in ("nearest", "toward_zero"):
        y = f.round(x, mode)
        assert torch.equal(y.isnan(), x.isnan())
        assert torch.equal(y[~x.isnan()], x[~x.isnan()])


@pytest.mark.parametrize("name", NARROW)
@given(a=format_values("fp64", allow_negative=True, max_magnitude=1e6),
       b=format_values("fp64", allow_negative=True, max_magnitude=1e6))
def test_round_is_monotone(name, a, b):
    f = FORMATS[name]
    lo, hi = sorted([a, b])
    r = f.round(torch.tensor([lo, hi], dtype=torch.float64), saturate=True)
    assert r[0] <= r[1]


@pytest.mark.parametrize("name", NARROW)
@given(data=st.data())
def test_ties_go_to_even(name, data):
    f = FORMATS[name]
    t = data.draw(ties(name))
    r = f.round(torch.tensor([t], dtype=torch.float64)).item()
    lo = f.round(torch.tensor([t], dtype=torch.float64), "toward_zero").item()
    assert r != t and abs(r - t) == abs(t - lo)  # a neighbour, the same distance away
    # even: the last mantissa bit of the result is 0, i.e. r / ulp(r) is an even integer
    # (in the subnormal range and at binade starts alike); zero counts as even.
    q = f.ulp(r).item() if abs(r) >= f.smallest_normal else f.smallest_subnormal
    assert r == 0 or (r / q) % 2 == 0 or (abs(r) == f.max_finite * 2 and f.overflow == "inf")


@pytest.mark.parametrize("name", [n for n in ML if n not in ("fp64",)])
@given(x=format_tensors("fp32", shape=(16,), max_magnitude=1e30))
def test_round_agrees_with_ml_dtypes_cast_from_fp32(name, x):
    f = FORMATS[name]
    ref = x.numpy().astype(np.float32).astype(f.ml_dtype).astype(np.float64)
    got = f.round(x).numpy()
    assert ((got == ref) | (np.isnan(got) & np.isnan(ref))).all()


# torch 2.13's CPU cast to float8_e4m3fn saturates (inf and overflow -> +-448, measured here),
# where ml_dtypes and the OCP spec's plain conversion give NaN: it matches saturate=True.
@pytest.mark.parametrize("name,saturate", [("fp16", False), ("bf16", False), ("fp8_e4m3fn", True),
                                           ("fp8_e5m2", False)])
@given(x=format_tensors("fp32", shape=(16,), allow_infinity=True))
def test_round_agrees_with_torch_cast_from_fp32(name, saturate, x):
    f = FORMATS[name]
    ref = x.float().to(f.torch_dtype).double()
    got = f.round(x, saturate=saturate)
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got[~got.isnan()], ref[~ref.isnan()])


def test_agrees_with_ml_dtypes_fp64_cast_either_way():
    # ml_dtypes up to 0.6 cast fp64 -> bf16 through fp32 (double rounding); 0.7 rounds once.
    # Our rounding is the single correct step; the installed ml_dtypes must give one of the
    # two known answers, and the single one where it rounds once.
    x = np.array([1 + 2**-8 + 2**-40], dtype=np.float64)
    got = x.astype(ml_dtypes.bfloat16).astype(np.float64)[0]
    single = FORMATS["bf16"].round(torch.from_numpy(x)).item()
    double = torch.from_numpy(x).float().bfloat16().item()
    assert (single, double) == (1 + 2**-7, 1.0)
    assert got in (single, double)
    if got == single:  # a fixed ml_dtypes agrees with us on every value of a random draw
        rng = np.random.default_rng(0)
        v = rng.standard_normal(20000) * np.exp2(rng.integers(-20, 20, 20000))
        ours = FORMATS["bf16"].round(torch.from_numpy(v)).numpy()
        np.testing.assert_array_equal(v.astype(ml_dtypes.bfloat16).astype(np.float64), ours)
