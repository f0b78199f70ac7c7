"""Number formats, rounding modes, ulp and stall points.

Every format is described by three integers and an overflow rule, and rounding is done
in float64 arithmetic on exact values, so the result is ONE correctly rounded step from
the input whatever its dtype. Casting fp64 -> fp32 -> narrow format instead rounds twice
(ml_dtypes PR #401: 1 + 2^-8 + 2^-40 -> bf16 gives 1.0, the correct answer is 1.0078125).

Rounding of a magnitude a (a > 0) to a format with m explicit mantissa bits and smallest
normal exponent emin:
  1. e = floor(log2 a), clamped below at emin (the subnormal range shares emin's quantum)
  2. q = 2^(e - m), the spacing of representable values around a
  3. y = a / q is exact (a power-of-two scale of a float64)
  4. round y to an integer: half-to-even, toward zero, or stochastically with
     P(up) = frac(y), so that E[round(a)] = a
  5. result = round(y) * q, exact again; then the overflow rule of the format.
Every value of every format here embeds exactly in float64, so results are returned as
float64 tensors holding the rounded values.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_choice, check_number, check_seed, check_tensor, check_type

ROUNDING_MODES = ("nearest", "stochastic", "toward_zero")


@dataclass(frozen=True)
class Format:
    """A binary floating-point format.

    mantissa_bits: explicit fraction bits (precision p = mantissa_bits + 1).
    min_exponent: unbiased exponent of the smallest normal number.
    max_finite: the largest finite value.
    overflow: what the real type does with a value past max_finite: "inf" (IEEE),
        "nan" (fp8 e4m3fn and the fnuz types: no infinity) or "saturate" (fp4/fp6: no
        infinity and no NaN; ml_dtypes clamps).
    negative_zero: False for the fnuz types, whose -0 encoding is the NaN.
    """

    name: str
    mantissa_bits: int
    min_exponent: int
    max_finite: float
    overflow: str
    negative_zero: bool = True
    torch_dtype: torch.dtype | None = None
    ml_dtypes_name: str | None = None

    @property
    def precision(self) -> int:
        return self.mantissa_bits + 1

    @property
    def eps(self) -> float:
        """Gap between 1 and the next larger value: 2^-mantissa_bits."""
        return 2.0 ** -self.mantissa_bits

    @property
    def unit_roundoff(self) -> float:
        """u = eps / 2: the relative error bound of one round-to-nearest step."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** self.min_exponent

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def has_inf(self) -> bool:
        return self.overflow == "inf"

    @property
    def has_nan(self) -> bool:
        return self.overflow != "saturate"

    @property
    def ml_dtype(self):
        """The numpy dtype from ml_dtypes for this format, or None."""
        if self.ml_dtypes_name is None:
            return None
        import ml_dtypes

        return getattr(ml_dtypes, self.ml_dtypes_name, None)

    def _exponent_quantum(self, a: torch.Tensor) -> torch.Tensor:
        """q = 2^(max(floor(log2 a), emin) - m) for magnitudes a >= 0 (float64)."""
        _, ex = torch.frexp(a)  # a = frac * 2^ex, frac in [0.5, 1)
        e = torch.clamp(ex.to(torch.int64) - 1, min=self.min_exponent)
        e = torch.where(a == 0, torch.full_like(e, self.min_exponent), e)  # frexp(0) = (0, 0)
        return torch.ldexp(torch.ones_like(a), e - self.mantissa_bits)

    def round(
        self,
        x: torch.Tensor,
        mode: str = "nearest",
        *,
        saturate: bool = False,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        uniform: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Round x to this format in one step; returns float64 holding the exact values.

        mode: "nearest" (ties to even), "stochastic" (needs `seed` or `generator`, or the
        uniforms in [0, 1) to use, `uniform`, shaped like x: |x| rounds up where
        uniform < frac; unbiased) or "toward_zero".
        saturate: clamp values past max_finite (and infinities) to +-max_finite, as FP8
        training recipes do (NCCL's __NV_SATFINITE cast). Without it, overflow does what
        the real type does (see `overflow`). NaN stays NaN.
        """
        check_choice(mode, "mode", ROUNDING_MODES, hint="a rounding mode")
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x, dtype=torch.float64)
        check_tensor(x, "x", kind="floating")
        x = x.to(torch.float64)
        if self.name == "fp64":
            return x.clone()
        a = x.abs()
        finite = torch.isfinite(a)
        a_f = torch.where(finite, a, torch.zeros_like(a))
        q = self._exponent_quantum(a_f)
        y = a_f / q
        if mode == "nearest":
            r = torch.round(y)  # half to even
        elif mode == "toward_zero":
            r = torch.trunc(y)
        else:
            if uniform is not None:
                u = check_tensor(uniform, "uniform", kind="floating", shape=tuple(y.shape))
            else:
                if generator is None:
                    if seed is None:
                        raise InvalidArgument("mode='stochastic' needs seed=<int>, "
                                              "generator=<torch.Generator> or uniform=")
                    generator = torch.Generator().manual_seed(check_seed(seed))
                u = torch.rand(y.shape, generator=generator, dtype=torch.float64, device=y.device)
            fl = torch.floor(y)
            r = fl + (u < (y - fl)).to(torch.float64)
        mag = r * q
        over = mag > self.max_finite
        if saturate or self.overflow == "saturate" or mode == "toward_zero":
            # IEEE round-toward-zero never overflows to infinity either.
            mag = torch.where(over, torch.full_like(mag, self.max_finite), mag)
        elif self.overflow == "inf":
            mag = torch.where(over, torch.full_like(mag, math.inf), mag)
        else:
            mag = torch.where(over, torch.full_like(mag, math.nan), mag)
        # Infinite inputs: kept where the type has infinity, else NaN or the finite max.
        if saturate or self.overflow == "saturate":
            inf_to = self.max_finite
        elif self.overflow == "inf":
            inf_to = math.inf
        else:
            inf_to = math.nan
        mag = torch.where(torch.isinf(a), torch.full_like(mag, inf_to), mag)
        mag = torch.where(torch.isnan(a), a, mag)
        out = torch.copysign(mag, x)
        if not self.negative_zero:
            out = torch.where(out == 0, torch.zeros_like(out), out)
        return out

    def ulp(self, x) -> torch.Tensor:
        """Spacing of this format's values at |x|: 2^(max(floor(log2|x|), emin) - m).

        ulp(0) is the smallest subnormal; ulp of inf/NaN is NaN.
        """
        x = torch.as_tensor(x, dtype=torch.float64)
        a = x.abs()
        finite = torch.isfinite(a)
        q = self._exponent_quantum(torch.where(finite, a, torch.zeros_like(a)))
        return torch.where(finite, q, torch.full_like(q, math.nan))

    def stall_point(self, increment: float) -> float:
        """Smallest accumulator value a >= 0 at which round(a + increment) == a.

        For increment d > 0 an accumulator in a binade with spacing q stays put when
        d < q/2, or d == q/2 and its last mantissa bit is even (ties to even). The first
        value of a binade has an even mantissa (0), so the stall point is the start of
        the first binade with q/2 >= d: 2^e with e = ceil(log2 d) + m + 1.
        Example fp16 (m=10), d=1: e = 0 + 10 + 1 = 11, stall at 2048 (at 1024 the spacing
        is 1, 1024 + 1 = 1025 is exact; at 2048 the spacing is 2 and 2049 is a tie that
        rounds to the even 2048).
        Returns 0.0 if even 0 + d rounds to 0, math.inf if the stall point lies past
        max_finite (the sum overflows first). A negative increment gives the mirror image
        (a negative stall point).
        """
        d = check_number(increment, "increment", hint="a non-zero step; 0 never stalls")
        if d == 0.0:
            raise InvalidArgument(f"increment={increment!r} must be a finite non-zero number")
        sign = -1.0 if d < 0 else 1.0
        frac, ex = math.frexp(abs(d))  # d = frac * 2^ex, frac in [0.5, 1)
        ceil_log2 = ex - 1 if frac == 0.5 else ex
        e = ceil_log2 + self.mantissa_bits + 1
        if e <= self.min_exponent:
            return 0.0
        point = math.ldexp(1.0, e)
        if point > self.max_finite:
            return sign * math.inf
        return sign * point

    def __repr__(self) -> str:
        return (f"Format({self.name!r}, mantissa_bits={self.mantissa_bits}, "
                f"min_exponent={self.min_exponent}, max_finite={self.max_finite!r}, "
                f"overflow={self.overflow!r})")


def _ieee_max(mantissa_bits: int, max_exponent: int) -> float:
    return (2.0 - 2.0 ** -mantissa_bits) * 2.0 ** max_exponent


def _torch_dtype(name: str):
    return getattr(torch, name, None)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in [
        Format("fp64", 52, -1022, _ieee_max(52, 1023), "inf", torch_dtype=torch.float64),
        Format("fp32", 23, -126, _ieee_max(23, 127), "inf", torch_dtype=torch.float32),
        # TF32: fp32's range, 10 explicit mantissa bits (NVIDIA A100 whitepaper).
        Format("tf32", 10, -126, _ieee_max(10, 127), "inf"),
        Format("fp16", 10, -14, 65504.0, "inf", torch_dtype=torch.float16, ml_dtypes_name=None),
        Format("bf16", 7, -126, _ieee_max(7, 127), "inf", torch_dtype=torch.bfloat16,
               ml_dtypes_name="bfloat16"),
        # OCP FP8 (2023): e4m3fn has no inf, S.1111.111 is NaN, so max is 1.75 * 2^8.
        Format("fp8_e4m3fn", 3, -6, 448.0, "nan", torch_dtype=_torch_dtype("float8_e4m3fn"),
               ml_dtypes_name="float8_e4m3fn"),
        Format("fp8_e5m2", 2, -14, 57344.0, "inf", torch_dtype=_torch_dtype("float8_e5m2"),
               ml_dtypes_name="float8_e5m2"),
        # fnuz (Graphcore/AMD): exponent bias one larger, no inf, no -0 (its code is NaN).
        Format("fp8_e4m3fnuz", 3, -7, 240.0, "nan", negative_zero=False,
               torch_dtype=_torch_dtype("float8_e4m3fnuz"), ml_dtypes_name="float8_e4m3fnuz"),
        Format("fp8_e5m2fnuz", 2, -15, 57344.0, "nan", negative_zero=False,
               torch_dtype=_torch_dtype("float8_e5m2fnuz"), ml_dtypes_name="float8_e5m2fnuz"),
        # OCP MX (2023): fp6/fp4 have neither inf nor NaN; ml_dtypes saturates on overflow.
        Format("fp6_e2m3fn", 3, 0, 7.5, "saturate", ml_dtypes_name="float6_e2m3fn"),
        Format("fp6_e3m2fn", 2, -2, 28.0, "saturate", ml_dtypes_name="float6_e3m2fn"),
        Format("fp4_e2m1fn", 1, 0, 6.0, "saturate", ml_dtypes_name="float4_e2m1fn"),
    ]
}

FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)  # the canonical names, for help texts

# Every spelling a user types, keyed by its normal form (_spelling): lower case, no
# whitespace, "_" or "-", no "torch." prefix. torch spells fp8 as float8_e4m3fn, ml_dtypes
# as float8_e4m3fn / float6_e2m3fn / float4_e2m1fn; "e4m3" and "fp8e4m3" mean e4m3fn as in
# NVIDIA Transformer Engine and the OCP FP8 spec. ml_dtypes' float8_e4m3 (IEEE-like, with
# inf, max 240) is a different format, not modelled: it is refused, not aliased.
_SPELLINGS = {
    "fp64": ("float64", "double", "f64"),
    "fp32": ("float32", "float", "single", "f32"),
    "tf32": ("tensorfloat32",),
    "fp16": ("float16", "half", "f16"),
    "bf16": ("bfloat16",),
    "fp8_e4m3fn": ("float8_e4m3fn", "e4m3fn", "e4m3", "fp8_e4m3"),
    "fp8_e5m2": ("float8_e5m2", "e5m2"),
    "fp8_e4m3fnuz": ("float8_e4m3fnuz", "e4m3fnuz"),
    "fp8_e5m2fnuz": ("float8_e5m2fnuz", "e5m2fnuz"),
    "fp6_e2m3fn": ("float6_e2m3fn", "e2m3fn", "e2m3", "fp6_e2m3"),
    "fp6_e3m2fn": ("float6_e3m2fn", "e3m2fn", "e3m2", "fp6_e3m2"),
    "fp4_e2m1fn": ("float4_e2m1fn", "e2m1fn", "e2m1", "fp4_e2m1", "fp4"),
}


# Formats with names close to modelled ones that are NOT them: refused with the reason, so a
# did-you-mean never maps them onto a different format.
_NOT_MODELLED = {
    "float8e4m3": "ml_dtypes.float8_e4m3 is IEEE-like (it has inf, max 240), not e4m3fn",
    "float8e3m4": "ml_dtypes.float8_e3m4 is not modelled",
    "float8e4m3b11fnuz": "ml_dtypes.float8_e4m3b11fnuz (exponent bias 11) is not modelled",
    "float8e8m0fnu": "float8_e8m0fnu is an MX scale type (powers of two only), not a value format",
}


def _spelling(text: str) -> str:
    key = re.sub(r"[\s_\-]", "", text.lower())
    return key[len("torch."):] if key.startswith("torch.") else key


ALIASES: dict[str, str] = {_spelling(alias): name for name, more in _SPELLINGS.items()
                           for alias in (name,) + more}


def get_format(fmt, name: str = "dtype") -> Format:
    """The Format a user means: a Format, a torch dtype, a numpy/ml_dtypes dtype, or any
    spelling in ALIASES (case and surrounding whitespace ignored: "BF16", " torch.half ").

    name: the argument being resolved, for the error message (InvalidArgument, with the
    canonical names and a did-you-mean).
    """
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.torch_dtype == fmt:
                return f
        raise InvalidArgument(f"{name}={fmt!r} is not a floating-point format trainprobes "
                              f"models; expected one of {FORMAT_NAMES!r}")
    text = _numpy_name(fmt)
    if text is None:
        check_type(str, fmt, name, hint=f"a format name such as 'bf16', one of {FORMAT_NAMES!r}, "
                                        f"or a torch dtype")
        text = fmt
    key = _spelling(text)
    if key in ALIASES:
        return FORMATS[ALIASES[key]]
    if key in _NOT_MODELLED:
        raise InvalidArgument(f"{name}={fmt!r}: {_NOT_MODELLED[key]}; expected one of "
                              f"{FORMAT_NAMES!r}")
    return FORMATS[check_choice(text, name, FORMAT_NAMES, spellings=ALIASES,
                                normalise=_spelling)]


def _numpy_name(fmt) -> str | None:
    """The name of a numpy or ml_dtypes dtype (np.float16, ml_dtypes.bfloat16), else None."""
    import numpy as np
    try:
        if isinstance(fmt, np.dtype) or (isinstance(fmt, type) and issubclass(fmt, np.generic)):
            return np.dtype(fmt).name
    except TypeError:
        return None
    return None


def round_to(x: torch.Tensor, fmt, mode: str = "nearest", **kwargs) -> torch.Tensor:
    """`get_format(fmt).round(x, mode, ...)`."""
    return get_format(fmt).round(x, mode, **kwargs)
