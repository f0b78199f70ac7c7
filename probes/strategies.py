"""Hypothesis strategies for the number formats hypothesis lacks.

hypothesis only draws floats of width 16, 32 and 64 (hypothesis#3959); bf16, tf32, fp8,
fp6 and fp4 are drawn here from BIT PATTERNS and decoded, so that zeros, subnormals, the
largest finite values and (when asked) infinities and NaNs turn up as often as the search
needs them, and every drawn value is exactly a value of its format.

Bit layout (IEEE 754-2019 3.4; OCP FP8 2023; OCP MX 2023): sign | exponent (E bits) |
mantissa (m bits), bias = 1 - min_exponent. Exponent field 0 is subnormal:
mant * 2^(emin - m). Special codes by family:
  IEEE (fp16/bf16/fp32/tf32/fp8_e5m2): exponent all ones -> inf (mant 0) or NaN.
  fp8_e4m3fn: only S.1111.111 is NaN; no inf.
  fnuz: only 1.0000.000 (the "-0" code) is NaN; no inf, no -0.
  fp6/fp4 (saturating): every code is finite.

Values come back as float64 (Format.round's convention). Usage:
    @given(format_tensors("bf16", shape=(8,)))
    @given(rank_inputs(world=4, numel=16, fmt="fp8_e4m3fn"))
"""
from __future__ import annotations

import math
import re

import torch
from hypothesis import strategies as st
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import FORMATS, Format, get_format
from trainprobes.validation import check_int, check_number

_EXPONENT_BITS = {"fp64": 11, "fp32": 8, "tf32": 8, "fp16": 5, "bf16": 8}


def exponent_bits(fmt) -> int:
    """Width of the exponent field of `fmt`."""
    f = get_format(fmt)
    if f.name in _EXPONENT_BITS:
        return _EXPONENT_BITS[f.name]
    m = re.search(r"e(\d+)m(\d+)", f.name)
    if m is None:
        raise InvalidArgument(f"fmt={f.name!r}: cannot tell its exponent width; add it to "
                              f"_EXPONENT_BITS")
    return int(m.group(1))


def total_bits(fmt) -> int:
    f = get_format(fmt)
    return 1 + exponent_bits(f) + f.mantissa_bits


def decode_bits(bits, fmt) -> torch.Tensor:
    """Decode integer bit patterns of `fmt` (sign in the top bit) to float64 values."""
    f = get_format(fmt)
    b = torch.as_tensor(bits, dtype=torch.int64)
    if f.name == "fp64":
        return b.view(torch.float64).clone()
    m, E = f.mantissa_bits, exponent_bits(f)
    mant = b & ((1 << m) - 1)
    ex = (b >> m) & ((1 << E) - 1)
    neg = ((b >> (m + E)) & 1).bool()
    emin = f.min_exponent
    # 1. subnormal (exponent field 0): mant * 2^(emin - m); normal: (2^m + mant) * 2^(e - bias - m)
    sig = torch.where(ex == 0, mant, mant + (1 << m)).to(torch.float64)
    scale = torch.where(ex == 0, torch.full_like(ex, emin), ex - (1 - emin)) - m
    val = torch.ldexp(sig, scale)
    # 2. special codes, by family (see the module docstring)
    all_ones_e = ex == (1 << E) - 1
    if f.overflow == "inf":
        val = torch.where(all_ones_e & (mant == 0), torch.full_like(val, math.inf), val)
        val = torch.where(all_ones_e & (mant != 0), torch.full_like(val, math.nan), val)
    elif f.overflow == "nan" and f.negative_zero:  # e4m3fn: S.1111.111 only
        val = torch.where(all_ones_e & (mant == (1 << m) - 1), torch.full_like(val, math.nan), val)
    elif f.overflow == "nan":  # fnuz: the -0 code is the NaN
        val = torch.where(neg & (ex == 0) & (mant == 0), torch.full_like(val, math.nan), val)
    return torch.where(neg, -val, val)


def _largest_pattern_at_most(f: Format, limit: float) -> int:
    """Largest non-negative pattern whose value is finite and <= limit (values rise with the
    pattern for sign 0: exponent above mantissa makes the code monotone)."""
    lo, hi = 0, (1 << (total_bits(f) - 1)) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        v = decode_bits(mid, f).item()
        if math.isfinite(v) and v <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _special_patterns(f: Format, top: int) -> list[int]:
    """Edges worth drawing often: 0, the smallest subnormal, the largest subnormal, the
    smallest normal, 1.0, and the largest allowed magnitude."""
    m = f.mantissa_bits
    one = (1 - f.min_exponent) << m  # exponent field = bias, mantissa 0
    cands = [0, 1, (1 << m) - 1, 1 << m, one, top, max(top - 1, 0)]
    return sorted({c for c in cands if 0 <= c <= top})


@st.composite
def _one_pattern(draw, f, top, edges, negative, nan_inf):
    if nan_inf and draw(st.integers(0, 15)) == 0:
        return draw(st.sampled_from(nan_inf))
    mag = draw(st.one_of(st.sampled_from(edges), st.integers(0, top)))
    # fnuz formats: the "-0" code is their NaN, so zero is drawn with sign 0 only.
    sign = draw(st.booleans()) if negative and (mag or f.negative_zero) else False
    code = mag | (sign << (total_bits(f) - 1))
    return code - (1 << 64) if code >= 1 << 63 else code  # int64 two's complement for fp64


def format_bit_patterns(fmt, *, allow_nan: bool = False, allow_infinity: bool = False,
                        allow_negative: bool = True, max_magnitude: float | None = None):
    """Strategy for single bit patterns (ints) of `fmt` with the constraints given."""
    f = get_format(fmt)
    limit = f.max_finite if max_magnitude is None else check_number(
        max_magnitude, "max_magnitude", min=0, finite=False)
    top = _largest_pattern_at_most(f, limit)
    nbits = total_bits(f)
    specials = []
    if allow_infinity and f.has_inf:
        inf_code = ((1 << exponent_bits(f)) - 1) << f.mantissa_bits
        specials += [inf_code, inf_code | (1 << (nbits - 1))]
        if nbits == 64:
            specials[-1] -= 1 << 64
    if allow_nan and f.has_nan:
        if f.overflow == "inf":
            specials.append((((1 << exponent_bits(f)) - 1) << f.mantissa_bits) | 1)
        elif f.negative_zero:
            specials.append((1 << (nbits - 1)) - 1)
        else:
            specials.append(1 << (nbits - 1))
    return _one_pattern(f, top, _special_patterns(f, top), allow_negative, specials)


def format_values(fmt, **kwargs):
    """Strategy for Python floats that are exactly values of `fmt` (see format_bit_patterns)."""
    f = get_format(fmt)
    return format_bit_patterns(f, **kwargs).map(lambda b: decode_bits(b, f).item())


def format_tensors(fmt, shape=(8,), **kwargs):
    """Strategy for float64 tensors of `shape` whose elements are values of `fmt`.

    shape: a tuple, or a strategy for tuples. kwargs: see format_bit_patterns.
    """
    f = get_format(fmt)
    pat = format_bit_patterns(f, **kwargs)
    shapes = shape if isinstance(shape, st.SearchStrategy) else st.just(tuple(shape))

    @st.composite
    def tensors(draw):
        shp = tuple(draw(shapes))
        n = math.prod(shp)
        bits = draw(st.lists(pat, min_size=n, max_size=n))
        return decode_bits(torch.tensor(bits, dtype=torch.int64), f).reshape(shp)

    return tensors()


def ties(fmt, **kwargs):
    """Strategy for exact midpoints between two adjacent finite values of `fmt` (as float64),
    the inputs where round-to-nearest-even must pick the even neighbour."""
    f = get_format(fmt)
    if f.name == "fp64":
        raise InvalidArgument("fmt='fp64': its midpoints are not float64 values; pick a narrower format")
    kwargs = {**kwargs, "allow_nan": False, "allow_infinity": False, "allow_negative": False}
    top = _largest_pattern_at_most(f, f.max_finite if kwargs.get("max_magnitude") is None
                                   else kwargs["max_magnitude"])
    kwargs["max_magnitude"] = decode_bits(max(top - 1, 0), f).item()

    def mid(b):
        lo, hi = decode_bits(torch.tensor([b, b + 1]), f).tolist()
        return (lo + hi) / 2  # exact: one more bit than the format has

    return st.tuples(format_bit_patterns(f, **kwargs), st.booleans()).map(
        lambda t: mid(t[0]) * (-1 if t[1] else 1))


def rank_inputs(world=4, numel=8, fmt="bf16", **kwargs):
    """Strategy for per-rank input lists for collectives: `world` float64 tensors of shape
    (numel,), each element a value of `fmt`. world and numel: ints or strategies for ints.
    kwargs: see format_bit_patterns (default: finite values only)."""
    worlds = world if isinstance(world, st.SearchStrategy) else st.just(int(world))
    numels = numel if isinstance(numel, st.SearchStrategy) else st.just(int(numel))

    @st.composite
    def inputs(draw):
        w, n = draw(worlds), draw(numels)
        check_int(w, "world", min=1, hint="the number of ranks")
        check_int(n, "numel", min=0, hint="elements per rank")
        t = draw(format_tensors(fmt, shape=(w, n), **kwargs))
        return list(t.unbind(0))

    return inputs()


def format_names(exclude=("fp64",)):
    """Strategy for format names from the registry."""
    return st.sampled_from([n for n in FORMATS if n not in exclude])
