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
K comes from 64-bit words cut into 16-bit lanes (d <= 16) or 32-bit lanes (d <= 22, masked
to d bits): one word serves 4 (or 2) roundings, where Format.round spends one 53-bit draw on
each. The words come from a Source: on CPU numpy's SFC64 seeded with the collective's seed
(about half the time per word of torch's mt19937, which was a third of a bf16 all-reduce),
elsewhere the torch.Generator itself. Same seed, same bits; the bits differ from
Format.round's (other random numbers), not the distribution.

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

import numpy as np
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.fastround import fits, rounder
from trainprobes.reference.formats import Format
from trainprobes.reference.scratch import Scratch, any_nonzero, float32_copy

_SIGN32 = -(1 << 31)
_ROW = 256  # inexact_sums searches rows of this many elements
_SMALL = 16 * _ROW  # and below this many, all of them at once


@dataclass(frozen=True)
class Source:
    """The random numbers of one stochastic rounding: `generator` draws Format.round's
    uniforms (the slow paths), `lanes` the fast path's 64-bit words (a numpy BitGenerator
    or the same torch.Generator)."""

    generator: torch.Generator
    lanes: object


def source(seed: int, device) -> Source:
    """The Source of a seed: numpy's SFC64 for the lanes on CPU, torch's generator (Philox
    on CUDA) on other devices, where numpy's words would have to be copied over."""
    generator = torch.Generator(device=device).manual_seed(seed)
    cpu = torch.device(device).type == "cpu"
    # torch reads a seed modulo 2^64 (manual_seed(-1) is 2^64 - 1); numpy refuses negatives
    return Source(generator, np.random.SFC64(seed % (1 << 64)) if cpu else generator)


def as_source(generator) -> Source:
    """A Source, from a Source or a torch.Generator (then used for everything)."""
    return generator if isinstance(generator, Source) else Source(generator, generator)


def random_bits(n: int, bits: int, lanes, device, out: torch.Tensor | None = None) \
        -> torch.Tensor:
    """n uniform integers of `bits` bits (int32; written into `out` when given), from full
    64-bit words of `lanes` (a numpy BitGenerator, CPU only, or a torch.Generator): 16-bit
    lanes for bits <= 16, 32-bit lanes otherwise (each lane of a uniform word is uniform
    and independent of the others)."""
    lanes_per_word = 4 if bits <= 16 else 2
    count = -(-n // lanes_per_word)
    if isinstance(lanes, np.random.BitGenerator):
        words = torch.from_numpy(lanes.random_raw(count).view(np.int64)).to(device)
    else:
        words = torch.empty(count, dtype=torch.int64, device=device)
        words.random_(-(1 << 63), None, generator=lanes)  # the full 64-bit range
    out = torch.empty(n, dtype=torch.int32, device=device) if out is None else out.view(-1)
    if lanes_per_word == 4:  # unsigned 16-bit lanes widen without sign: no mask at 16 bits
        out.copy_(words.view(torch.uint16)[:n])
        return out if bits == 16 else out.bitwise_and_((1 << bits) - 1)
    return out.copy_(words.view(torch.int32)[:n]).bitwise_and_((1 << bits) - 1)


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

    def __call__(self, s: torch.Tensor, generator,
                 fix: tuple[torch.Tensor, torch.Tensor] | None = None,
                 scratch: Scratch | None = None) -> torch.Tensor:
        """s (float32) rounded to fmt, as float32, with a Source (or a torch.Generator).
        fix = (indices into s flattened, their float64 values): elements whose true value
        float32 could not hold. With `scratch` the result may live in its buffers."""
        src = as_source(generator)
        generator = src.generator
        flat = s.reshape(-1)
        k = None if scratch is None else scratch.get("k", flat.shape, torch.int32, s.device)
        out = self.round_with(flat, random_bits(flat.numel(), self.d, src.lanes, s.device, k))
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
        if not self.fmt.negative_zero:  # fnuz: no -0 (its code is NaN); only -0 gives -0
            out.add_(0.0)  # -0 + 0 = +0, any other value + 0 is itself: one pass
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


def inexact_sums(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor,
                 scratch: Scratch) -> torch.Tensor | None:
    """Flat indices of the sums s = fl(a + b) that are not exact (NaN and inf included),
    or None when all are, in fewer passes than two_sum. When fl(a + b) = a + b + err with
    err != 0, the subtraction of the larger operand is exact (Fast2Sum: |a| >= |b| gives
    fl(s - a) = s - a = b + err), so (s - a) - b and (s - b) - a are both 0 only when
    err = 0. A min and max per row of 256 find the few rows to search (no nonzero() over
    all)."""
    n = s.numel()
    if n <= _SMALL:  # a few elements: the fewest ops (two_sum), then a plain search
        err = two_sum(a, b)[1].reshape(-1)
        return err.nonzero().reshape(-1) if any_nonzero(err) else None  # NaN is nonzero
    body = n - n % _ROW
    diffs = [torch.sub(s, x, out=scratch.get(name, s.shape, s.dtype, s.device)).sub_(y)
             .reshape(-1) for x, y, name in ((a, b, "d1"), (b, a, "d2"))]
    dirty = torch.zeros(body // _ROW, dtype=torch.bool, device=s.device)
    for d in diffs:  # body > 0: n > _SMALL
        rows = d[:body].view(-1, _ROW)  # (aminmax with dim= is ~20x slower)
        dirty.logical_or_(rows.amax(1) != 0).logical_or_(rows.amin(1) != 0)  # NaN != 0
    rows = dirty.nonzero().reshape(-1)
    last = ((diffs[0][body:] != 0) | (diffs[1][body:] != 0)).nonzero().reshape(-1) + body
    if not rows.numel() and not last.numel():
        return None
    idx = (rows[:, None] * _ROW + torch.arange(_ROW, device=s.device)).reshape(-1)
    d1, d2 = (d.index_select(0, idx) for d in diffs)
    return torch.cat([idx[(d1 != 0) | (d2 != 0)], last])


def add_then_round(a: torch.Tensor, b: torch.Tensor, wire: StochasticRounder,
                   accum: Format | None, generator, scratch: Scratch | None = None) \
        -> torch.Tensor:
    """wire(accum(a + b)) for tensors a, b holding wire values: the exact sum rounded to
    nearest in `accum` (None: no accumulator rounding), then stochastically to the wire
    format. float32 result, which may live in `scratch` (a new Scratch when None)."""
    scratch = Scratch() if scratch is None else scratch
    shape, device = a.shape, a.device
    a = scratch.get("a", shape, torch.float32, device).copy_(a)
    b = scratch.get("b", shape, torch.float32, device).copy_(b)
    s = torch.add(a, b, out=scratch.get("s", shape, torch.float32, device))
    fix = None
    idx = inexact_sums(a, b, s, scratch)
    if idx is not None:  # float32 lost bits of some sums: float64 holds them exactly
        exact = (a.reshape(-1).index_select(0, idx).to(torch.float64)
                 + b.reshape(-1).index_select(0, idx).to(torch.float64))
        fix = (idx, exact if accum is None else rounder(accum, torch.float64)(exact))
    if accum is not None:
        s = rounder(accum, torch.float32)(s, overwrite=True)
    return wire(s, generator, fix, scratch)


def round_input(x: torch.Tensor, wire: StochasticRounder, generator,
                scratch: Scratch | None = None) -> torch.Tensor:
    """A flat input (any real dtype) rounded once, stochastically, to the wire format, as
    float32 (which may live in `scratch`): values float32 cannot hold exactly are rounded
    from float64."""
    if x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return wire(x.to(torch.float32), generator, None, scratch)
    scratch = Scratch() if scratch is None else scratch
    x64 = x.to(torch.float64)
    s, lost = float32_copy(x64, scratch)
    fix = None
    if any_nonzero(lost):  # float32 cannot hold some of x (NaN: NaN - NaN)
        lost = lost.ne_(0).logical_and_(~torch.isnan(x64))
        idx = lost.nonzero().reshape(-1)
        fix = (idx, x64.index_select(0, idx))
    return wire(s, generator, fix, scratch)
