"""Fast, exact rounding on torch's native dtypes: Format.round's bits in a few vector ops.

Format.round (reference/formats.py) is the definition: one correct rounding of the exact
value. The functions here give the same bits with fewer passes, for the collectives' hot
loops; tests/test_fastround.py checks them against Format.round on random inputs, ties
and specials, and on every pair of fp8 values.

round_nearest(x, fmt): round-to-nearest-even by the magic-number add. With x of a work
type W (float32 or float64; p = its precision) and e = max(floor(log2|x|), emin) the
exponent x rounds at, the spacing of fmt there is q = 2^(e - m). Let
    M = 1.5 * 2^(e + p - 1 - m)            (so ulp_W(M) = q, and |x| < 2^(e+1) << M/4),
then (x + M) is ONE correctly rounded W add of the exact x + M: x's bits below q are
rounded to nearest-even, and M's leading 1.5 keeps x + M in M's binade for either sign of
x; (x + M) - M is exact. M comes from x's exponent field by integer adds (no log2):
    bits(M) = max(bits(|x|) & exponent field, bits(2^emin)) + (p - 1 - m) << mb + 2^(mb-1)
(mb = p - 1 stored mantissa bits of W). Steps:
  1. clamp x to +-(max_finite if saturating, else a bound past the overflow threshold):
     inf and huge values then round past max (overflow) or to max (saturate), never
     through an overflowing M; NaN stays NaN through every step. Without saturation a
     min/max pass first tells when all of x lies within +-max_finite, the common case,
     where neither the clamp nor step 3 is needed;
  2. r = (x + M) - M, then x's sign bit OR-ed into r: a result rounded to 0 keeps x's
     sign, as Format.round's copysign does (fnuz formats have no -0: the +0 is kept);
  3. overflow (only without saturation): |r| > max_finite becomes inf or NaN as the format
     does.
Requirements (checked): W has at least m + 2 more bits than fmt (p - 1 - m >= 2) and M
fits in W's range: e_max + p - m < W's max exponent (fp8/fp6/fp4 in float32; fp16, bf16
and tf32 in float64).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import Format, get_format

# work type -> (integer view, stored mantissa bits, exponent bias, largest exponent)
_WORK = {torch.float32: (torch.int32, 23, 127, 127), torch.float64: (torch.int64, 52, 1023, 1023)}


def _max_exponent(fmt: Format) -> int:
    return math.frexp(fmt.max_finite)[1] - 1


def fits(fmt, work: torch.dtype) -> bool:
    """Whether round_nearest can round to fmt in `work` arithmetic (module docstring)."""
    fmt = get_format(fmt, "fmt")
    if work not in _WORK or fmt.name == "fp64":
        return False
    _, mb, _, emax = _WORK[work]
    return mb - fmt.mantissa_bits >= 2 and _max_exponent(fmt) + 2 + mb - fmt.mantissa_bits < emax


@dataclass(frozen=True)
class NearestRounder:
    """round_nearest for one (format, work dtype, saturate), its constants computed once:
    the collectives call it once per hop, where Python overhead counts."""

    fmt: Format
    dtype: torch.dtype
    saturate: bool

    def __post_init__(self):
        if not fits(self.fmt, self.dtype):
            raise InvalidArgument(f"fmt={self.fmt.name!r} cannot be rounded in {self.dtype} "
                                  f"arithmetic; use Format.round")
        as_int, mb, bias, _ = _WORK[self.dtype]
        sign = -(1 << (63 if as_int == torch.int64 else 31))
        big = self.fmt.max_finite
        clamps = self.saturate or self.fmt.overflow == "saturate"
        top = big if clamps else 2.0 ** (_max_exponent(self.fmt) + 2)  # past every overflow
        for name, value in (("as_int", as_int), ("sign", sign), ("field", ~sign ^ ((1 << mb) - 1)),
                            ("emin", (self.fmt.min_exponent + bias) << mb), ("top", top),
                            ("shift", ((mb - self.fmt.mantissa_bits) << mb) + (1 << (mb - 1))),
                            ("overflow", None if clamps else math.inf if self.fmt.overflow == "inf"
                             else math.nan)):
            object.__setattr__(self, name, value)

    def __call__(self, x: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
        big = self.fmt.max_finite
        # 1. a saturating rounding clamps (in place when allowed); otherwise one min/max pass
        # tells whether all of x lies within +-max_finite, where nothing can overflow (NaN
        # fails that test and stays NaN through the clamp)
        if self.overflow is None:
            inside = False
        else:
            lo, hi = torch.aminmax(x) if x.numel() else (torch.zeros(()), torch.zeros(()))
            inside = -big <= float(lo) and float(hi) <= big
        if not inside:
            x = x.clamp_(-self.top, self.top) if overwrite else x.clamp(-self.top, self.top)
        e = (x.view(self.as_int) & self.field).clamp_(min=self.emin).add_(self.shift)
        magic = e.view(x.dtype)
        r = (x + magic).sub_(magic)  # 2.
        if self.fmt.negative_zero:  # a result rounded to 0 gets x's sign back
            r.view(self.as_int).bitwise_or_(torch.bitwise_and(x.view(self.as_int), self.sign,
                                                              out=e))
        if not inside and self.overflow is not None:  # 3. overflow as the type does
            over = r.abs() > big  # NaN compares False: it stays
            r = torch.where(over, torch.full_like(r, self.overflow).copysign_(r), r)
        return r


@functools.lru_cache(maxsize=None)
def rounder(fmt, dtype: torch.dtype, saturate: bool = False) -> NearestRounder:
    """The cached NearestRounder for get_format(fmt) in `dtype` arithmetic."""
    return NearestRounder(get_format(fmt, "fmt"), dtype, bool(saturate))


def round_nearest(x: torch.Tensor, fmt, *, saturate: bool = False,
                  overwrite: bool = False) -> torch.Tensor:
    """Format.round(x, "nearest", saturate=saturate) in x's own dtype (float32 or float64),
    bit for bit (module docstring). Returns a new tensor; x is left as it was unless
    overwrite=True (then x may be clamped in place: one temporary less)."""
    return rounder(get_format(fmt, "fmt"), x.dtype, saturate)(x, overwrite)
