"""A GEMM accumulator from crafted inputs: the accumulator reveal (numerics.reveal) read as the
parameters of trainprobes.reference.gemm.Accumulator, plus two crafted tests it lacks.

fn takes a 1-D tensor of n values and returns their dot product with ones (any adapter of
numerics.reveal: matmul_reduction, scaled_mm_reduction, or the emulator itself).
  1. reveal(): mantissa bits, rounding, the summation tree.
  2. Fused width F: a consistent tree whose nodes join F leaves and the running sum reads
     F = fan_in - 1 (a sequential chain: F = 1). An exact fused sum cancels +M and -M inside
     one group exactly, so pairs in one group join at size 2 and the tree is inconsistent;
     a pair across the first two groups then loses the F - 1 tiny terms of the first group:
     F = (that size) - 1.
  3. Alignment (F > 1): x = 2^E, 0.75 Q, 0.75 Q in one group (Q = 2^(E - m) the grid of
     2^E) and -2^E in a later one. Aligned terms are each truncated to 0 (result 0); an
     exact fused sum keeps 1.5 Q, which rounds to Q or 2 Q (result != 0).
  4. Sign (the reveal's rounding test uses positive terms only, where truncation toward
     zero and toward -inf agree): the sum's rounding: -2^E, -2^E, -Q in the first inputs
     (their sum -(2^(E+1) + Q) lies halfway between two points of the grid 2Q above 2^(E+1))
     and +2^(E+1) last: toward zero (or nearest, ties to even) gives 0, toward -inf -2Q;
     and with "terms" alignment the cut of each aligned term: 2^E, -0.75 Q in one group and
     -2^E in a later one: truncation gives 0, a sign-fill shift (floor) -Q. Under "terms"
     the aligned terms already sit on the grid, so the reveal's rounding test reads toward
     zero whatever the sum does; the sum rounds only where it carries: 2^E, 2^E, 3Q in one
     group and -2^(E+1) later: toward zero 2Q, round to nearest (a tie, to even) 4Q.
  5. Promotion (reveal_promotion): 2^(m + 12) then ones. The narrow sum absorbs every one
     after the big value until it restarts: the ones lost are N_C - 1.
"""
from __future__ import annotations

import math

import torch
from trainprobes.errors import TargetError
from trainprobes.numerics.reveal import reveal
from trainprobes.reference.gemm import Accumulator

# bf16 holds powers of two 2^-133 .. 2^127; the emulator's exact fused sum takes up to 92
# binades in one add, so the crafted values stay below 2^-53 (80 binades above 2^-133)
DTYPE, MAX_EXPONENT = "bf16", -53


def _call(fn, values: dict, n: int) -> float:
    x = torch.zeros(n, dtype=torch.float64)
    for i, v in values.items():
        x[i] = v
    return torch.as_tensor(fn(x.to(torch.bfloat16))).reshape(-1)[0].double().item()


def fused_width(r, n: int) -> int:
    """F from a reveal Result over n inputs (step 2 of the module docstring)."""
    sizes = r.evidence["sizes"]
    shape = r.metrics["order_shape"]
    if shape.startswith("sequential"):
        return 1
    if shape.startswith("fused") or (r.metrics["fan_in"] or 2) > 2 and shape != "inconsistent":
        return r.metrics["fan_in"] - 1 if r.metrics["fan_in"] < n else n
    bigger = [s for row in sizes for s in row if s > 2]
    return (min(bigger) - 1) if bigger else n


def reveal_accumulator(fn, n: int = 64, *, name: str = "revealed", dtype=DTYPE,
                       max_exponent=MAX_EXPONENT) -> Accumulator:
    """The Accumulator fn behaves as (steps 1-3 of the module docstring); n must exceed F
    for F to be seen (a single fused group reads as F >= n, reported as n)."""
    r = reveal(fn, n=n, dtype=dtype, max_exponent=max_exponent, output_dtype="fp64",
               target=name)
    m, rounding = r.metrics["accumulator_mantissa_bits"], r.metrics["rounding"]
    if r.metrics["accumulator_bits_lower_bound"] or rounding not in ("toward_zero", "nearest"):
        raise TargetError(f"{name}: the reveal found {r.message!r}: no finite accumulator to model "
                          "(raise the range with max_exponent, or the accumulator is wider)")
    F = fused_width(r, n)
    alignment, cut = "sum", "toward_zero"
    t = -133 + 8  # a d that bf16 holds with room below
    E = t + m + 2
    Q = 2.0 ** (E - m)
    if rounding == "toward_zero":  # step 4: or toward -inf (the same on positive sums)
        out = _call(fn, {0: -(2.0 ** E), 1: -(2.0 ** E), 2: -Q, n - 1: 2.0 ** (E + 1)}, n)
        rounding = "down" if out == -2 * Q else "toward_zero" if out == 0 else _odd(name, "sum", out, Q)
    if F > 2 and F < n:
        out = _call(fn, {0: 2.0 ** E, 1: 0.75 * Q, 2: 0.75 * Q, n - 1: -(2.0 ** E)}, n)
        alignment = "terms" if out == 0 else "sum"
        if alignment == "terms":  # step 4: each term's cut
            out = _call(fn, {0: 2.0 ** E, 1: -0.75 * Q, n - 1: -(2.0 ** E)}, n)
            cut = "down" if out == -Q else "toward_zero" if out == 0 else _odd(name, "term", out, Q)
            if rounding == "toward_zero":  # step 4b: the aligned terms sit on the grid, so
                # the sum rounds only on a carry: 2^E + 2^E + 3Q needs the grid 2Q of 2^(E+1)
                out = _call(fn, {0: 2.0 ** E, 1: 2.0 ** E, 2: 3 * Q, n - 1: -(2.0 ** (E + 1))}, n)
                rounding = "nearest" if out == 4 * Q else "toward_zero" if out == 2 * Q else \
                    _odd(name, "carry", out, Q)
    return Accumulator(name, m, F, rounding, alignment, None,
                       f"revealed from crafted inputs (n={n}): {r.message}; the sum rounds "
                       f"{rounding.replace('_', ' ')}"
                       + (f", aligned terms cut {cut.replace('_', ' ')}" if alignment == "terms" else ""),
                       term_rounding=cut)


def _odd(name: str, what: str, out: float, Q: float):
    raise TargetError(f"{name}: the {what} sign test gave {out!r} ({out / Q:g} grid steps): neither "
                      "truncation toward zero (0) nor toward -inf: no model here fits it")


def reveal_promotion(fn, n: int, mantissa_bits: int, *, dtype=DTYPE) -> int | None:
    """N_C (step 4), or None when the narrow sum never restarts within n inputs."""
    M = 2.0 ** (mantissa_bits + 12)
    x = {0: M, **{i: 1.0 for i in range(1, n)}}
    out = _call(fn, x, n)
    if not math.isfinite(out):
        raise TargetError(f"fn returned {out!r} for 2^{mantissa_bits + 12} followed by ones")
    lost = (n - 1) - round(out - M)
    return None if lost >= n - 1 else lost + 1
