"""Tensor-core accumulators: a dot-product / GEMM emulator whose accumulator is a parameter.

Products of fp8, fp4 and bf16 values (block scales that are powers of two or e4m3 folded in)
are exact in float64, so the only rounding in a low-precision GEMM is the accumulator's. An
Accumulator is five numbers and two choices (Fasi, Higham, Mikaitis and Pranesh 2021, "Numerical
behavior of NVIDIA tensor cores"; DeepSeek-V3 report, arXiv 2412.19437, section 3.3):

  mantissa_bits  m: explicit bits of the running sum (13: a 14-bit significand).
  fused_terms    F: products added in one fused step (1: an ordinary sequential sum).
  rounding       of each fused step's result to m bits: "toward_zero", "nearest" (even) or
                 "down" (toward -inf: a two's-complement sum whose low bits are dropped).
  alignment      "terms": every term of a fused step (the F products and the running sum) is
                 shifted to the largest exponent emax among them and cut to the grid
                 2^(emax - m) before an exact integer sum (what the hardware papers describe:
                 bits shifted out are dropped); "sum": the F products and the running sum are
                 added exactly and the result rounded once. The two disagree whenever small
                 terms are lost in the alignment; hardware reports disagree, so both exist.
  term_rounding  how "terms" cuts each aligned term: "toward_zero" (a sign-magnitude shift:
                 what this project's H200 reveal read, on positive terms only) or "down"
                 (toward -inf: a sign-fill right shift of a two's-complement term, as the
                 DeepSeek-V3 report, section 3.5.2, and DeepGEMM #37 describe Hopper's fixed-
                 point alignment: "the highest 14 bits of each mantissa product after
                 sign-fill right shifting"). The two agree on positive terms and differ on
                 every negative term that is not on the grid: "down" moves it by up to one
                 grid step away from zero, so every output shifts down whatever its sign (an
                 offset, not a shrinking toward zero). Unsettled until a GPU run saves
                 _scaled_mm outputs on crafted negative terms (numerics.gemm_pin).
  promote_every  N_C: every N_C elements of K the narrow partial sum is added to an fp32
                 accumulator (round to nearest, fp32) and restarted from 0: DeepSeek-V3's fix.

The accumulator's exponent range is unbounded (fp8 products lie within 2^-36 .. 2^32, far
inside fp32's). Step by step, for one dot product of the products p_0 .. p_{K-1}:
  1. acc = 0; for each group g of F consecutive products (the last may be shorter):
  2. "sum":   acc = round_m(acc + sum(g)), the sum exact (two-lane split, _exact_round);
     "terms": emax = max floor(log2 |x|) over x in g and acc; Q = 2^(emax - m);
              acc = round_m(sum(cut(x / Q) * Q)), cut = trunc ("toward_zero") or floor
              ("down"), the sum exact (integers of at most m + 1 bits);
  3. with N_C: after every N_C products, acc32 = round_23(acc32 + acc), acc = 0;
     the result is round_23(acc32 + acc) (the last, partial interval included).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_choice, check_int

__all__ = ["Accumulator", "PRESETS", "get_preset", "dot", "dot_products", "promotion_runs", "matmul",
           "ROUNDINGS", "ALIGNMENTS", "TERM_ROUNDINGS"]

ROUNDINGS = ("toward_zero", "nearest", "down")
ALIGNMENTS = ("terms", "sum")
TERM_ROUNDINGS = ("toward_zero", "down")
FP32_BITS = 23


@dataclass(frozen=True)
class Accumulator:
    """A tensor-core accumulator model (module docstring); `source` says where it was measured."""

    name: str
    mantissa_bits: int
    fused_terms: int
    rounding: str
    alignment: str
    promote_every: int | None = None
    source: str = ""
    term_rounding: str = "toward_zero"
    # the element formats whose products the model was measured on (None: any, e.g. the
    # IEEE fp32 adds of CUDA cores), and whether with block scales applied inside the MMA
    # (MXFP8, NVFP4: Blackwell's block-scaled kinds); numerics.gemm refuses what a preset was
    # not measured for (a setup no hardware runs) unless asked for a what-if
    inputs: tuple | None = None
    block_scales: bool = False

    def __post_init__(self):
        check_int(self.mantissa_bits, "mantissa_bits", min=1, max=45,
                  hint="the accumulator's explicit significand bits, e.g. 13 or 23")
        check_int(self.fused_terms, "fused_terms", min=1, max=4096, hint="e.g. 1, 16 or 32")
        check_choice(self.rounding, "rounding", ROUNDINGS)
        check_choice(self.alignment, "alignment", ALIGNMENTS)
        check_choice(self.term_rounding, "term_rounding", TERM_ROUNDINGS)
        if self.alignment == "sum" and self.term_rounding != "toward_zero":
            raise InvalidArgument(f"term_rounding={self.term_rounding!r} cuts aligned terms: it "
                                  "applies to alignment='terms' only (the 'sum' alignment adds "
                                  "the terms exactly); use alignment='terms'")
        if self.promote_every is not None:
            check_int(self.promote_every, "promote_every", min=1, hint="e.g. 128 (DeepSeek-V3)")
            if self.promote_every % self.fused_terms:
                raise InvalidArgument(f"promote_every={self.promote_every!r} is not a multiple of "
                                      f"fused_terms={self.fused_terms!r}: a fused add cannot be "
                                      "split; use a multiple, e.g. "
                                      f"{self.fused_terms * max(1, self.promote_every // self.fused_terms)}")

    def with_(self, **changes) -> Accumulator:
        """A copy with some parameters changed (named after the change)."""
        new = replace(self, **changes)
        if "name" not in changes:
            bits = ",".join(f"{k}={v}" for k, v in changes.items())
            new = replace(new, name=f"{self.name}[{bits}]")
        return new

    def describe(self) -> str:
        cut = (f" (each term cut {self.term_rounding.replace('_', ' ')})"
               if self.alignment == "terms" else "")
        s = (f"{self.mantissa_bits} mantissa bits, {self.fused_terms}-term fused adds, "
             f"{self.rounding.replace('_', ' ')}, {self.alignment} alignment{cut}")
        return s + (f", promoted to fp32 every {self.promote_every}" if self.promote_every else "")


_H200 = ("reports/gpu-check.md: torch._scaled_mm e4m3 -> bf16 on an H200 (sm90), the accumulator "
         "reveal at n=32: 13 mantissa bits, one consistent 32-term fused node, toward zero. A "
         "consistent fused node and a 13-bit precision are what the 'terms' alignment gives; an "
         "exact fused sum would cancel +M - M exactly and keep every small term (the reveal "
         "would see pairs of size 2 and no precision limit)")
# The products a tensor-core model was measured on: fp8 x fp8 (e4m3, e5m2, either pairing).
# Fed bf16 or fp32 products (24 or 48 significant bits) the same model judges a setup no
# hardware runs: Hopper's bf16 and tf32 MMAs accumulate differently (reports/gpu-check.md:
# 23-25 bits for bf16 matmul), and the alignment would cut bits fp8 products never have.
FP8_INPUTS = ("fp8_e4m3fn", "fp8_e5m2")
PRESETS: dict[str, Accumulator] = {p.name: p for p in (
    Accumulator("h200-scaled-mm", 13, 32, "toward_zero", "terms", None, _H200, inputs=FP8_INPUTS),
    Accumulator("h200-scaled-mm-signfill", 13, 32, "down", "terms", None,
                "the DeepSeek-V3 report's reading of Hopper's fp8 alignment (section 3.5.2; "
                "DeepGEMM #37): fixed-point accumulation of two's-complement terms, 'the highest "
                "14 bits of each mantissa product after sign-fill right shifting': each term "
                "and the sum cut toward -inf. Agrees with h200-scaled-mm on every positive term "
                "(the H200 reveal used only those); negative terms tell them apart "
                "(numerics.gemm_pin's crafted cases), unsettled until a GPU run saves them",
                term_rounding="down", inputs=FP8_INPUTS),
    Accumulator("h200-scaled-mm-sum", 13, 32, "toward_zero", "sum", None,
                "the other reading of the same measurements (FIELD_NOTES: an exact 32-term sum "
                "truncated to a 14-bit significand); the H200 reveal did not match it",
                inputs=FP8_INPUTS),
    Accumulator("deepseek-v3", 13, 32, "toward_zero", "terms", 128,
                "DeepSeek-V3 report (arXiv 2412.19437) section 3.3: ~14 bits of accumulation on "
                "Hopper, partial sums copied to fp32 CUDA-core registers every N_C = 128 "
                "elements; the narrow part is the h200-scaled-mm model", inputs=FP8_INPUTS),
    Accumulator("b200-25bit", 25, 32, "toward_zero", "terms", None,
                "DeepGEMM issue #176: 25 accumulator mantissa bits measured on B200 with "
                "tcgen05.mma kind::f8f6f4 (fp8/fp6/fp4 operands, no block scales; the "
                "block-scaled kinds mxf8f6f4 and mxf4nvf4 were left unsettled there); fused "
                "width and alignment not reported (32 and 'terms' assumed, as on Hopper)",
                inputs=FP8_INPUTS + ("fp4_e2m1fn",)),
    Accumulator("fp32", FP32_BITS, 1, "nearest", "sum", None,
                "IEEE 754 binary32, one correctly rounded add per product: CUDA-core FMA "
                "accumulation, and what torch._scaled_mm on the CPU (torch 2.13) reveals"),
)}


def get_preset(name) -> Accumulator:
    """An Accumulator by preset name (or the Accumulator itself)."""
    if isinstance(name, Accumulator):
        return name
    return PRESETS[check_choice(name, "preset", tuple(PRESETS), hint="an accumulator preset")]


# --- exact rounding helpers ----------------------------------------------------------------

def _exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) as int64 (0 for x == 0; callers mask zeros)."""
    _, e = torch.frexp(x)
    return e.to(torch.int64) - 1


def _round_bits(x: torch.Tensor, m: int, mode: str) -> torch.Tensor:
    """x (float64, exact) rounded to an m-bit mantissa, unbounded exponent."""
    q = torch.ldexp(torch.ones_like(x), _exponent(x) - m)
    y = x / q  # exact: a power-of-two scale
    y = torch.round(y) if mode == "nearest" else torch.floor(y) if mode == "down" else torch.trunc(y)  # round: half to even
    return torch.where(x == 0, x, y * q)


def _two_sum(a, b):
    """s = fl(a + b) and the exact error r = (a + b) - s (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _round_pair(s, r, m: int, mode: str) -> torch.Tensor:
    """round_m(s + r) where s = fl(s + r) in float64 and r the exact remainder.

    m <= 45 < 52, so every m-bit grid point and midpoint is a float64 (a point of the m+1-bit
    grid), and none lies strictly between s and s + r (|r| is at most half of s's spacing).
    So s + r rounds as s does, unless s itself is a grid point or midpoint and r != 0; then
    the neighbour of s on r's side rounds as s + r does. Only then: where s is not on the
    grid, its neighbour may be, and would round differently from s + r."""
    on_grid = _round_bits(s, m + 1, "toward_zero") == s
    toward = torch.where(r > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    s = torch.where((r != 0) & on_grid, torch.nextafter(s, toward), s)
    return _round_bits(s, m, mode)


def _quantum(x: torch.Tensor) -> torch.Tensor:
    """The largest power of two every element of each row of x is a whole multiple of (rows
    of zeros: 1)."""
    mant, e = torch.frexp(x)
    M = torch.ldexp(mant, torch.full_like(e, 53)).to(torch.int64)  # exact integer significand
    low = (M & -M).to(torch.float64)  # its lowest set bit
    q = torch.ldexp(low, e.to(torch.int64) - 53)
    q = torch.where(x == 0, torch.full_like(q, math.inf), q)
    q = q.amin(dim=-1)
    return torch.where(torch.isinf(q), torch.ones_like(q), q)


LANE_BITS = 40


def _exact_round(terms: torch.Tensor, m: int, mode: str) -> torch.Tensor:
    """round_m of the exact sum of each row of `terms` (float64, (..., T), T <= 2^12).

    Two lanes: with q the row's quantum and B = 2^40 q, each term is H + L with H a multiple
    of B and |L| < B a multiple of q; the L sum (< 2^52 q) and the H sum (< 2^53 B when the
    row's magnitudes stay under 2^92 q, checked) are exact, and their sum is rounded through
    _round_pair. T == 2 needs no lanes: TwoSum is exact."""
    if terms.shape[-1] == 2:
        s, r = _two_sum(terms[..., 0], terms[..., 1])
        return _round_pair(s, r, m, mode)
    q = _quantum(terms).unsqueeze(-1)
    span = terms.abs().sum(-1, keepdim=True) / q
    if bool((span >= 2.0 ** 92).any()):
        raise InvalidArgument("operands span more than 92 binades within one fused add: the "
                              "emulator cannot sum them exactly; scale the operands as a recipe "
                              "does (fp8/fp4/bf16 products of scaled tensors stay far inside)")
    B = q * 2.0 ** LANE_BITS
    H = torch.trunc(terms / B) * B
    L = terms - H
    s, r = _two_sum(H.sum(-1), L.sum(-1))
    return _round_pair(s, r, m, mode)


def _aligned_round(terms: torch.Tensor, m: int, mode: str, cut: str = "toward_zero") -> torch.Tensor:
    """'terms' alignment: every term cut (truncated toward zero, or floored: `cut`) to the
    grid 2^(emax - m) of the row's largest exponent, summed exactly, then rounded. The T aligned terms are integers below 2^(m+1)
    in units of the grid: a float64 sum is exact while T 2^(m+1) <= 2^53; past it (a wide
    accumulator with a wide fused add, e.g. 45 bits and 256 terms) the lanes of
    _exact_round sum them."""
    nz = terms != 0
    e = torch.where(nz, _exponent(terms), torch.full_like(terms, -(2 ** 40), dtype=torch.int64))
    emax = e.amax(dim=-1, keepdim=True)
    emax = torch.where(emax < -(2 ** 39), torch.zeros_like(emax), emax)  # a row of zeros
    Q = torch.ldexp(torch.ones_like(terms[..., :1]), emax - m)
    aligned = (torch.floor(terms / Q) if cut == "down" else torch.trunc(terms / Q)) * Q
    if terms.shape[-1] << (m + 1) > 1 << 53:
        return _exact_round(aligned, m, mode)
    return _round_bits(aligned.sum(-1), m, mode)


def _significant_bits(x: torch.Tensor) -> int:
    """Most significant bits any element of x needs (0 for all zeros)."""
    nz = x[x != 0]
    if nz.numel() == 0:
        return 0
    mant, _ = torch.frexp(nz)
    M = torch.ldexp(mant.abs(), torch.full(mant.shape, 53, dtype=torch.int32)).to(torch.int64)
    low = (M & -M).to(torch.float64)
    return int(53 - torch.log2(low).amax().item())


def check_operands(a: torch.Tensor, b: torch.Tensor, what: str = "operands") -> None:
    """Finite, and narrow enough that every product is exact in float64."""
    for name, t in (("a", a), ("b", b)):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            idx = tuple(int(i) for i in torch.nonzero(bad)[0])
            raise InvalidArgument(f"{what}: {name} holds {int(bad.sum())} non-finite value(s), "
                                  f"the first {t[idx].item()!r} at index {idx}; a GEMM of them has "
                                  "no relative error to judge (look for the overflow upstream)")
    # fast path: both within 24 significant bits (fp32 and narrower: 23 bits of the float64
    # mantissa field and the implicit one), read off the low 52 - 23 = 29 bits of the field;
    # 24 + 24 <= 53 (with 26 bits free, 27-bit values would pass and their products not)
    low29 = (1 << 29) - 1
    if not bool((a.view(torch.int64) & low29).any()) and not bool((b.view(torch.int64) & low29).any()):
        return
    sa, sb = _significant_bits(a), _significant_bits(b)
    if sa + sb > 53:
        raise InvalidArgument(f"{what}: a needs {sa} significant bits and b {sb}: their products "
                              "are not exact in float64 (the emulator's premise); quantise them "
                              "first (fp8, fp4, bf16 and their block scales are exact)")


# --- the emulator -------------------------------------------------------------------------

def dot(a: torch.Tensor, b: torch.Tensor, acc, *, checkpoints=None, trace: dict | None = None):
    """Row-wise dot products sum_k a[..., k] * b[..., k] under the accumulator `acc` (a preset
    name or an Accumulator). a, b: float64 (or castable) tensors of one shape (..., K) holding
    values whose products are exact in float64.

    checkpoints: K values (multiples of F, <= K) at which to also return the partial result
    (what the accumulator would output for the first k products): then returns
    (result, {k: partial}).
    trace: a dict to fill with "first_absorbed" (int64 per dot product: the K after the first
    fused add that left the narrow sum unchanged although its products were not all zero, a
    stall; -1 if none) and "absorbed" (how many such adds).
    """
    acc = get_preset(acc)
    a = torch.as_tensor(a).to(torch.float64)
    b = torch.as_tensor(b).to(torch.float64)
    if a.shape != b.shape:
        raise InvalidArgument(f"a has shape {tuple(a.shape)}, b {tuple(b.shape)}: the dot products "
                              "pair them element by element")
    check_operands(a, b)
    return dot_products(a * b, acc, checkpoints, trace)


def dot_products(p: torch.Tensor, acc: Accumulator, checkpoints=None, trace=None):
    """dot() on products p (..., K) already formed (exact; check_operands was the caller's)."""
    K = p.shape[-1]
    F = acc.fused_terms
    marks = sorted(set(checkpoints or ()))
    for k in marks:
        if not (0 < k <= K and (k % F == 0 or k == K)):
            raise InvalidArgument(f"checkpoint {k!r}: must be a multiple of fused_terms={F} in 1..K={K}")
    fast = _fp32_sequential(p, acc, marks, trace)
    if fast is not None:
        return fast if checkpoints is not None else fast[0]
    if acc.promote_every and checkpoints is None and trace is None and K > acc.promote_every:
        return _promoted_in_chunks(p, acc)
    return _looped(p, acc, marks, checkpoints, trace)


def _looped(p, acc, marks, checkpoints, trace):
    """_loop, on one intra-op thread (_one_thread)."""
    if p.numel() < GRAIN:  # torch runs ops this small on one thread anyway
        return _loop(p, acc, marks, checkpoints, trace)
    with _one_thread():
        return _loop(p, acc, marks, checkpoints, trace)


GRAIN = 32768  # at::internal::GRAIN_SIZE: below it an op does not fork
# rows of intervals emulated together: a fused add's temporaries (rows x F float64) stay in
# cache (measured, 2,048 x 16,384 products at N_C = 128: 1.6 s in one block of 262,144 rows)
BLOCK_ROWS = 4096


def _promoted_in_chunks(p: torch.Tensor, acc: Accumulator, gexp=None, intervals=None) -> torch.Tensor:
    """Step 3 without the loop over all of K: the narrow sum restarts from 0 every N_C
    products, so each interval of N_C products is a dot product of its own under the narrow
    model (zero products pad the last one: a zero group leaves the narrow sum as it is), all
    run at once as rows of one (rows * K / N_C, N_C) emulation; the fp32 accumulator then
    adds the intervals' results in order, round to nearest: an fp32 sequential sum
    (_fp32_sequential, where every result is an fp32 value, else one _exact_round per
    interval). The result is _loop's bit for bit (tests/test_reference_gemm.py).
    intervals: promotion_runs' memo of the intervals' narrow results (None: run them here)."""
    N, K = acc.promote_every, p.shape[-1]
    C = -(-K // N)
    shape = p.shape[:-1]
    if intervals is None:
        narrow = replace(acc, promote_every=None)
        pp = torch.nn.functional.pad(p, (0, C * N - K)) if C * N != K else p
        g = _padded_exponents(p, acc, N, gexp)
        r = _run_narrow(pp.reshape(-1, N), narrow, None if g is None else g.reshape(-1, N // acc.fused_terms))
        r = r.reshape(*shape, C)
    else:
        r = intervals(N, torch.arange(C)).reshape(*shape, C)
    fast = _fp32_sequential(r, PRESETS["fp32"], [], None)
    if fast is not None:
        return fast[0]
    wide = torch.zeros(shape, dtype=torch.float64)
    for c in range(C):
        wide = _exact_round(torch.stack((wide, r[..., c]), -1), FP32_BITS, "nearest")
    return wide


def _padded_exponents(p: torch.Tensor, acc: Accumulator, N: int, gexp=None):
    """The groups' exponents (_group_exponents) padded with NONE to whole intervals of N
    products (None where the fast "terms" step does not apply)."""
    if not _fast_terms(acc):
        return None
    F, K = acc.fused_terms, p.shape[-1]
    gexp = _group_exponents(p, F) if gexp is None else gexp
    return torch.nn.functional.pad(gexp, (0, -(-K // N) * N // F - gexp.shape[-1]), value=NONE)


def _run_narrow(rows: torch.Tensor, narrow: Accumulator, gexp=None, start=None) -> torch.Tensor:
    """_loop over the rows of products (R, n) under a narrow model (no promotion), in blocks
    of BLOCK_ROWS rows on one thread; start: each row's running sum before its first product
    (None: 0)."""
    with _one_thread():
        return torch.cat([_loop(rows[i:i + BLOCK_ROWS], narrow, [], None, None,
                                None if gexp is None else gexp[i:i + BLOCK_ROWS],
                                None if start is None else start[i:i + BLOCK_ROWS])
                          for i in range(0, rows.shape[0], BLOCK_ROWS)])


@contextmanager
def _one_thread():
    """The loop below runs ~20 small torch ops per fused add; with intra-op threads each op
    pays a fork-join, which on a loaded machine costs more than the op (measured: a sampled
    1024 x 1024 x 4096 verdict took 26 s with 2 threads, 5 s with 1; the promotion intervals'
    blocks, 4096 x 33 per op, 0.67 s on one thread against 2.3 s on two). The previous
    setting is restored on the way out."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


NONE = -(2 ** 30)  # the exponent of 0 where a maximum is taken (int32; any real one is larger)
_ROUND = {"toward_zero": torch.trunc, "nearest": torch.round, "down": torch.floor}  # round: half to even


def _fast_terms(acc: Accumulator) -> bool:
    """_loop's fast "terms" path applies: the aligned integers of a fused add sum exactly."""
    return acc.alignment == "terms" and (acc.fused_terms + 1) << (acc.mantissa_bits + 1) <= 1 << 53


def _group_exponents(p: torch.Tensor, F: int) -> torch.Tensor:
    """floor(log2 max |p|) of each group of F consecutive products (..., ceil(K / F)), int32,
    NONE for a group of zeros (the last group padded with zeros)."""
    K = p.shape[-1]
    G = -(-K // F)
    pp = torch.nn.functional.pad(p, (0, G * F - K)) if G * F != K else p
    grouped = pp.reshape(*p.shape[:-1], G, F)
    # max |p| as max(max p, -min p): two reductions and no |p| temporary (3x faster)
    gmax = torch.maximum(grouped.amax(-1), grouped.amin(-1).neg_())
    _, e = torch.frexp(gmax)
    return torch.where(gmax > 0, e - 1, torch.full_like(e, NONE))


def promotion_runs(p: torch.Tensor, acc) -> Callable:
    """run(n) = dot_products(p, acc with promote_every=n), for the several n a promotion
    search tries on the same products. Two things do not depend on n and are done once:
    the groups' largest exponents (the fast "terms" step), and the narrow sums of interval
    prefixes: an interval of n products that starts at j n begins with the interval of n/2
    products that starts there, so its narrow sum continues from that one's result (the
    same recurrence, bit for bit) and only its second half is run. Each interval's result
    is kept (a few floats per interval), so a search over n = F 2^j, largest first, runs
    about 1 + (candidates - 1) / 2 passes over the products instead of one per candidate."""
    acc = get_preset(acc)
    F, K = acc.fused_terms, p.shape[-1]
    narrow = replace(acc, promote_every=None)
    gexp = _group_exponents(p, F) if _fast_terms(acc) else None
    R = p[..., :1].numel()
    padded: list = [p.reshape(R, K), None if gexp is None else gexp.reshape(R, -1)]
    memo: dict = {}  # n -> (results (R, C), done (C,)): the narrow sum of each interval of n

    def whole(n: int):
        """The products and the groups' exponents as (R, C, n) and (R, C, n / F) views,
        zero products (NONE exponents) padding the last interval; padded once for all n."""
        C = -(-K // n)
        if padded[0].shape[1] < C * n:
            padded[0] = torch.nn.functional.pad(p.reshape(R, K), (0, C * n - K))
            if gexp is not None:
                padded[1] = _padded_exponents(p, acc, n, gexp).reshape(R, -1)
        g = None if gexp is None else padded[1][:, :C * n // F].reshape(R, C, n // F)
        return padded[0][:, :C * n].reshape(R, C, n), g

    def intervals(n: int, js: torch.Tensor) -> torch.Tensor:
        """The narrow results (R, len(js)) of the intervals js (of n products, from 0)."""
        C = -(-K // n)
        if n not in memo:
            memo[n] = (torch.zeros(R, C, dtype=torch.float64), torch.zeros(C, dtype=torch.bool))
        res, done = memo[n]
        need = js[~done[js]]
        if need.numel():
            h = n // 2 if n % (2 * F) == 0 else 0  # a first half of whole groups to continue
            start = intervals(h, 2 * need).reshape(-1) if h else None
            prods, g = whole(n)
            pick = _as_slice(need)  # the search asks for every interval, then every other one
            rows = prods[:, pick, h:].reshape(-1, n - h)
            gs = None if g is None else g[:, pick, h // F:].reshape(-1, (n - h) // F)
            res[:, pick] = _run_narrow(rows, narrow, gs, start).reshape(R, -1)
            done[pick] = True
        return res[:, _as_slice(js)]

    def run(n: int) -> torch.Tensor:
        cand = acc.with_(promote_every=n)
        if K <= n:
            return dot_products(p, cand)
        return _promoted_in_chunks(p, cand, intervals=intervals)
    return run


def _as_slice(idx: torch.Tensor):
    """idx (sorted, distinct) as a slice where it is an arithmetic progression (indexing by
    a slice is a view; by a tensor, a gather), else idx itself."""
    first = int(idx[0])
    if idx.numel() == 1:
        return slice(first, first + 1)
    step = int(idx[1] - idx[0])
    if bool((idx[1:] - idx[:-1] == step).all()):
        return slice(first, int(idx[-1]) + 1, step)
    return idx


def _loop(p, acc, marks, checkpoints, trace, gexp=None, start=None):
    """Steps 1-3 of the module docstring, one fused add at a time.

    "terms" alignment, where the aligned integers sum exactly in float64 ((F + 1) 2^(m+1)
    <= 2^53): the largest exponent of each group of products is taken once for all groups
    (the exponent of the group's largest |p|), so each step only finds the running sum's,
    scales the group and the sum by 2^(m - emax) (exact: a power of two), cuts them to
    integers, sums, and rounds: _aligned_round's arithmetic without its per-term frexp and
    concatenation (the slow path, and the "sum" alignment, run _aligned_round and
    _exact_round on [sum, group]). start: the narrow sum before the first product (None: 0;
    a value the narrow model produced, for promotion_runs' continued intervals)."""
    K = p.shape[-1]
    F, m = acc.fused_terms, acc.mantissa_bits
    shape = p.shape[:-1]
    fast = _fast_terms(acc)
    if fast:
        G = -(-K // F)
        grouped = (torch.nn.functional.pad(p, (0, G * F - K)) if G * F != K else p).reshape(*shape, G, F)
        if gexp is None:
            gexp = _group_exponents(p, F)
        cut = torch.floor if acc.term_rounding == "down" else torch.trunc
        one = torch.ones(shape, dtype=torch.float64)
        nonzero = (gexp != NONE) if trace is not None else None
    elif acc.alignment == "terms":
        def step(t, m, mode):
            return _aligned_round(t, m, mode, acc.term_rounding)
    else:
        step = _exact_round
    narrow = torch.zeros(shape, dtype=torch.float64) if start is None else start
    wide = torch.zeros(shape, dtype=torch.float64) if acc.promote_every else None
    seen, out = 0, {}
    if trace is not None:
        first = torch.full(shape, -1, dtype=torch.int64)
        absorbed = torch.zeros(shape, dtype=torch.int64)

    def result():
        if wide is None:
            return narrow.clone()
        return _exact_round(torch.stack((wide, narrow), -1), FP32_BITS, "nearest")

    for t, start in enumerate(range(0, K, F)):
        before = narrow
        if fast:
            _, e = torch.frexp(narrow)  # floor(log2 |narrow|) + 1 (0 for 0)
            own = torch.where(narrow != 0, e - 1, torch.full_like(e, NONE))
            emax = torch.maximum(gexp[..., t], own)
            emax = torch.where(emax == NONE, torch.zeros_like(emax), emax)  # all zero: any grid
            scale = torch.ldexp(one, m - emax)  # 1 / Q: the grid becomes the integers
            s = cut(grouped[..., t, :] * scale.unsqueeze(-1)).sum(-1) + cut(narrow * scale)
            # round_m(s Q) = round_m(s) Q (Q a power of two): s's significand to m + 1 bits
            ms, es = torch.frexp(s)
            r = _ROUND[acc.rounding](torch.ldexp(ms, torch.full_like(es, m + 1)))
            narrow = torch.ldexp(r, es + emax - (2 * m + 1))
            gnz = nonzero[..., t] if trace is not None else None
        else:
            g = p[..., start:start + F]
            narrow = step(torch.cat((narrow.unsqueeze(-1), g), -1), m, acc.rounding)
            gnz = (g != 0).any(-1) if trace is not None else None
        seen = min(start + F, K)
        if trace is not None:
            lost = (narrow == before) & gnz
            absorbed += lost
            first = torch.where(lost & (first < 0), torch.full_like(first, seen), first)
        if wide is not None and seen % acc.promote_every == 0:
            wide = _exact_round(torch.stack((wide, narrow), -1), FP32_BITS, "nearest")
            narrow = torch.zeros_like(narrow)
        if seen in marks:
            out[seen] = result()
    final = result()
    if trace is not None:
        trace.update(first_absorbed=first, absorbed=absorbed)
    return (final, out) if checkpoints is not None else final


def _fp32_sequential(p: torch.Tensor, acc: Accumulator, marks: list, trace: dict | None):
    """The fp32 preset's model in one vectorised pass, where it is IEEE binary32 itself.

    F = 1, round to nearest even, 23 bits, exact-sum alignment, no promotion: acc =
    round_23(acc + p_k) is an fp32 add of two fp32 values, correctly rounded, when every
    product is an fp32 value (exact: the float32 cast changes none) and no partial sum
    overflows. fp32 subnormal sums need no exception: a sum of two fp32 values below 2^-126
    is a multiple of 2^-149 with at most 23 significant bits, exact in both. numpy's
    add.accumulate is strictly sequential in the output dtype (torch.cumsum on the CPU
    accumulates float32 in double), so it is the loop of step 2 in C. Returns (final,
    {k: partial}) with `trace` filled, or None where the conditions fail (the general path)."""
    if not (acc.fused_terms == 1 and acc.rounding == "nearest" and acc.mantissa_bits == FP32_BITS
            and acc.alignment == "sum" and acc.promote_every is None) or p.shape[-1] == 0:
        return None
    p32 = p.to(torch.float32)
    if not bool((p32.double() == p).all()):
        return None
    import numpy as np
    with np.errstate(over="ignore", invalid="ignore"):
        sums = torch.from_numpy(np.add.accumulate(p32.numpy(), axis=-1))
    # the products are finite, so a partial sum that overflowed stays infinite (inf plus a
    # finite value): the last one tells; only the partials returned become float64 (exact)
    if not bool(torch.isfinite(sums[..., -1]).all()):
        return None
    out = {k: sums[..., k - 1].double() for k in marks}
    if trace is not None:
        before = torch.cat((torch.zeros_like(sums[..., :1]), sums[..., :-1]), -1)
        lost = (sums == before) & (p != 0)
        K = p.shape[-1]
        first = torch.where(lost, torch.arange(1, K + 1), torch.full_like(lost, K + 1, dtype=torch.int64))
        first = first.amin(-1)
        trace.update(first_absorbed=torch.where(first > K, torch.full_like(first, -1), first),
                     absorbed=lost.sum(-1))
    return sums[..., -1].double(), out


def matmul(a: torch.Tensor, b: torch.Tensor, acc, *, block_rows: int = 64) -> torch.Tensor:
    """a (M, K) @ b (K, N) under the accumulator, every output element emulated (rows of a in
    blocks of block_rows, so the (rows, N, K) products stay bounded)."""
    a = torch.as_tensor(a).to(torch.float64)
    b = torch.as_tensor(b).to(torch.float64)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise InvalidArgument(f"matmul of shapes {tuple(a.shape)} and {tuple(b.shape)}: need "
                              "(M, K) and (K, N)")
    check_operands(a, b)
    acc = get_preset(acc)
    bt = b.t().contiguous()  # (N, K): each block's products read b along K, contiguously
    rows = [dot_products(a[i:i + block_rows, None, :] * bt[None], acc)
            for i in range(0, a.shape[0], block_rows)]
    return torch.cat(rows, 0) if rows else torch.zeros(0, b.shape[1], dtype=torch.float64)
