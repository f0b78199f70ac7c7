"""Fast stochastic rounding for the collectives: exact probabilities, few random bits.

Format.round(x, "stochastic") (reference/formats.py) draws a 53-bit uniform u per element
and rounds |x| up when u < frac, frac = the part of |x| below the format's spacing q, as a
fraction of q. Here, for a value s that float32 holds exactly and whose exponent is in the
format's normal range, frac has exactly d = 23 - m bits: frac = L / 2^d with L the low d
bits of s's float32 pattern. So one uniform d-bit integer K decides exactly: add it below the kept bits and truncate,
    bits(result) = (bits(s) + K) with the low d bits cleared,
which carries one spacing up exactly when L + K >= 2^d, with probability L / 2^d = frac
(the same distribution, unbiased); sign-magnitude bits make it work for either sign, and
a carry into the exponent is the right next value.
K comes from 64-bit words of the torch.Generator (mt19937), cut into 16-bit lanes (d <= 16)
or 32-bit lanes (d <= 22, masked to d bits): one word serves 4 (or 2) roundings, where
Format.round spends one 53-bit draw on each. Same generator and seed, same bits; the bits
differ from Format.round's (other random numbers), not the distribution.

Elements outside that case take Format.round itself, on just those elements, with the same
generator: values below the format's smallest normal when its exponent range is narrower
than float32's (fp16, fp8, fp6, fp4: d grows there), and sums that float32 cannot hold
exactly (a two-sum error is not 0: float64 then holds the exact sum, as before). Overflow
and non-finite values are mapped as Format.round maps them (checked on a min/max pass).
The accumulator rounding (accum != wire, round to nearest) is exact in float32 through
reference/fastround.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.fastround import fits, rounder
from trainprobes.reference.formats import Format

_SIGN32 = -(1 << 31)


def random_bits(n: int, bits: int, generator: torch.Generator, device) -> torch.Tensor:
    """n uniform integers of `bits` bits (int32), from full 64-bit words of the generator:
    16-bit lanes for bits <= 16, 32-bit lanes otherwise (each lane of a uniform word is
    uniform and independent of the others)."""
    lanes = 4 if bits <= 16 else 2
    words = torch.empty(-(-n // lanes), dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)  # the full 64-bit range
    if lanes == 4:  # unsigned 16-bit lanes widen without sign: no mask needed at 16 bits
        k = words.view(torch.uint16)[:n].to(torch.int32)
        return k if bits == 16 else k.bitwise_and_((1 << bits) - 1)
    return words.view(torch.int32)[:n].bitwise_and((1 << bits) - 1)


@dataclass(frozen=True)
class StochasticRounder:
    """Stochastic rounding to `fmt` of float32-held values (module docstring)."""

    fmt: Format
    saturate: bool

    def __post_init__(self):
        if not supported(self.fmt):
            raise InvalidArgument(f"fmt={self.fmt.name!r} has no float32 stochastic rounding")
        object.__setattr__(self, "d", 23 - self.fmt.mantissa_bits)
        # smallest normal of fmt as float32 bits, when fmt's range is narrower than float32's
        object.__setattr__(self, "normal_bits", None if self.fmt.min_exponent <= -126
                           else (self.fmt.min_exponent + 127) << 23)

    def __call__(self, s: torch.Tensor, generator: torch.Generator,
                 fix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """s (float32) rounded to fmt, as float32. fix = (indices into s flattened, their
        float64 values): elements whose true value float32 could not hold."""
        flat = s.reshape(-1)
        out = self.round_with(flat, random_bits(flat.numel(), self.d, generator, s.device))
        if self.normal_bits is not None:  # below fmt's smallest normal: d grows, slow path
            mag = flat.view(torch.int32) & ~_SIGN32
            low = (mag < self.normal_bits).logical_and_(mag != 0)
            if bool(low.any()):
                idx = low.nonzero().reshape(-1)
                out[idx] = self._slow(flat.index_select(0, idx).to(torch.float64), generator)
        if fix is not None:
            out[fix[0]] = self._slow(fix[1], generator)
        return out.reshape(s.shape)

    def _slow(self, values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.fmt.round(values, "stochastic", saturate=self.saturate,
                              generator=generator).to(torch.float32)

    def round_with(self, s: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The rounding of float32 s given uniform d-bit integers k (int32, same shape;
        overwritten): Format.round(s, "stochastic", uniform=(2^d - 1 - k) / 2^d) wherever s
        lies in fmt's normal range (elsewhere __call__ takes Format.round itself)."""
        mask = (1 << self.d) - 1
        out = k.add_(s.view(torch.int32)).bitwise_and_(~mask).view(torch.float32)
        return self._specials(s, out)

    def _specials(self, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Overflow, inf and NaN as Format.round does; nothing to do when all of s lies in
        +-max_finite (then no rounding passes max either)."""
        big = self.fmt.max_finite
        if not s.numel():
            return out
        lo, hi = torch.aminmax(s)
        if -big <= float(lo) and float(hi) <= big:
            return out
        if self.saturate or self.fmt.overflow == "saturate":
            over_to = big
        else:
            over_to = math.inf if self.fmt.overflow == "inf" else math.nan
        over = (out.abs() > big) | torch.isinf(s)
        out = torch.where(over, torch.full_like(out, over_to).copysign_(s), out)
        return torch.where(torch.isnan(s), s, out)


def supported(fmt: Format) -> bool:
    """Formats float32 holds exactly, with at least 2 bits below their mantissa: every
    format here but fp64 and fp32 (tf32, fp16, bf16, fp8, fp6, fp4)."""
    return fmt.name not in ("fp64", "fp32") and fmt.mantissa_bits <= 21 and \
        fmt.min_exponent >= -126 and fits(fmt, torch.float64)


def _any_nonzero(t: torch.Tensor) -> bool:
    """Whether t has an element that is not 0 (NaN counts), in one min/max pass (faster
    than Tensor.any on floats)."""
    if not t.numel():
        return False
    lo, hi = torch.aminmax(t)
    return not (float(lo) == 0.0 and float(hi) == 0.0)


def sr_storage(fmt: Format) -> torch.dtype:
    """The narrowest torch dtype that holds every value of fmt: the collectives store the
    stochastically rounded values in it (half the memory of float32 for 16-bit formats)."""
    if fmt.torch_dtype in (torch.float16, torch.bfloat16):
        return fmt.torch_dtype
    if fmt.min_exponent >= -14 and fmt.mantissa_bits <= 10 and fmt.max_finite <= 65504:
        return torch.float16  # fp8, fp6, fp4: their values are fp16 values
    return torch.float32


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, e) with s = fl(a + b) and a + b = s + e exactly (Knuth's TwoSum, any order)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)).add_(b - bb)
    return s, e


def add_then_round(a: torch.Tensor, b: torch.Tensor, wire: StochasticRounder,
                   accum: Format | None, generator: torch.Generator) -> torch.Tensor:
    """wire(accum(a + b)) for float32 tensors a, b holding wire values: the exact sum
    rounded to nearest in `accum` (None: no accumulator rounding), then stochastically to
    the wire format. float32 result."""
    s, err = two_sum(a, b)
    fix = None
    if _any_nonzero(err):  # float32 lost bits of some sums: float64 holds them exactly
        idx = err.reshape(-1).nonzero().reshape(-1)
        exact = (a.reshape(-1).index_select(0, idx).to(torch.float64)
                 + b.reshape(-1).index_select(0, idx).to(torch.float64))
        fix = (idx, exact if accum is None else rounder(accum, torch.float64)(exact))
    if accum is not None:
        s = rounder(accum, torch.float32)(s, overwrite=True)
    return wire(s, generator, fix)


def round_input(x: torch.Tensor, wire: StochasticRounder,
                generator: torch.Generator) -> torch.Tensor:
    """A flat input (any real dtype) rounded once, stochastically, to the wire format, as
    float32: values float32 cannot hold exactly are rounded from float64."""
    if x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return wire(x.to(torch.float32), generator)
    x64 = x.to(torch.float64)
    s = x64.to(torch.float32)
    fix = None
    lost = s.to(torch.float64).sub_(x64)  # 0 where float32 holds x (NaN: NaN - NaN)
    if _any_nonzero(lost):
        lost = lost.ne_(0).logical_and_(~torch.isnan(x64))
        idx = lost.nonzero().reshape(-1)
        fix = (idx, x64.index_select(0, idx))
    return wire(s, generator, fix)
