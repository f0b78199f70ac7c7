"""Stall points: where a running sum stops moving, analytically and by actually summing.

A sequential sum acc <- round(acc + d) in a format with m mantissa bits stops moving at
the first accumulator value whose spacing q has q/2 >= d (ties go to the even value, and
the first value of a binade has an even mantissa). `Format.stall_point` gives that value;
this module sums n copies of d in the format and explains the figure it gets.
"""
from __future__ import annotations

import math

import torch
from trainprobes.display import format_number
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import FORMAT_NAMES, ROUNDING_MODES, get_format
from trainprobes.result import Result
from trainprobes.validation import check_bool, check_choice, check_int, check_number, check_seed

DEFAULT_FORMATS = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz",
                   "fp8_e5m2fnuz", "fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn")


def _num(x: float) -> str:
    """A number as a person writes it: 2048, 0.001, 1.5e-05, inf (the one number format)."""
    return format_number(x, digits=6)


def sequential_sums(fmt, increments, n: int, *, rounding: str = "nearest",
                    saturate: bool = False, seed: int | None = None):
    """Sum n copies of each increment in `fmt`, rounding after every add.

    Vectorised across increments; the loop runs over additions and stops as soon as no
    accumulator moved (with deterministic rounding a stuck sum stays stuck).
    Returns (sums, steps_moved): the final sums and, per increment, how many adds changed
    the accumulator (n when it never stalled).
    """
    f = get_format(fmt, "fmt")
    check_choice(rounding, "rounding", ROUNDING_MODES)
    check_int(n, "n", min=1, hint="the number of additions")
    check_bool(saturate, "saturate")
    gen = None
    if rounding == "stochastic":
        if seed is None:
            raise InvalidArgument("rounding='stochastic' needs seed=<int>")
        gen = torch.Generator().manual_seed(check_seed(seed))
    d = f.round(torch.as_tensor(increments, dtype=torch.float64).reshape(-1), saturate=saturate)
    acc = torch.zeros_like(d)
    moved = torch.zeros(d.shape, dtype=torch.int64)
    for _ in range(n):
        new = f.round(acc + d, rounding, saturate=saturate, generator=gen)
        changed = ~((new == acc) | (new.isnan() & acc.isnan()))
        moved += changed
        acc = new
        if gen is None and not changed.any():
            break
    return acc, moved


def explain(fmt, increment: float, n: int, sequential_sum: float, *, stalled: bool,
            saturate: bool = False) -> str:
    """Why the sum of n copies of `increment` in `fmt` ends where it does, in one paragraph.

    stalled: whether the accumulator stopped moving before the n-th add.
    """
    f = get_format(fmt)
    d = f.round(torch.tensor([float(increment)], dtype=torch.float64), saturate=saturate).item()
    true = n * float(increment)
    if d == 0.0:
        return (f"the increment {_num(increment)} itself rounds to 0 in {f.name} (below half the "
                f"smallest subnormal {_num(f.smallest_subnormal)}), so nothing is ever added")
    note = "" if d == increment else f"{increment:.9g} is stored as {d:.9g} in {f.name}; "
    s = f.stall_point(d)
    if math.isinf(s):
        point = 2.0 ** (math.ceil(math.log2(abs(d))) + f.mantissa_bits + 1)
        if saturate or f.overflow == "saturate":
            verb = f"saturate{{s}} at {_num(math.copysign(f.max_finite, d))}"
            why = "saturate=True" if saturate else f"{f.name} has neither inf nor NaN"
        elif f.overflow == "nan":
            verb, why = "overflow{s} to NaN", f"{f.name} has no infinity"
        else:
            verb, why = "overflow{s} to inf", ""
        reached = not (abs(true) <= f.max_finite and math.isfinite(sequential_sum)
                       and abs(sequential_sum) < f.max_finite)
        what = (verb.format(s="s") + (f" ({why})" if why else "") + (" and stays there" if
                "saturate" in verb else "")) if reached else \
            f"would {verb.format(s='')} if it ran long enough"
        return (f"{note}the stall point {_num(point)} lies past the largest finite {f.name} value "
                f"{_num(f.max_finite)}: the sum never stalls, it {what}")
    if not stalled:
        off = "" if sequential_sum == true else (
            f" (not {_num(true)}: each add rounds" + (" and the increment is stored inexactly)"
                                                      if d != increment else ")"))
        return (f"{note}{_num(n)} additions reach {_num(sequential_sum)}{off}, still below the "
                f"stall point {_num(s)} (where the spacing {_num(f.ulp(s).item())} is at least "
                f"twice {_num(abs(d))})")
    q = f.ulp(s).item()
    below = s / 2
    qb = f.ulp(below).item()
    ad = abs(d)
    if ad == q / 2:
        at = (f"at {_num(s)} the spacing is {_num(q)}, so {_num(s)} + {_num(d)} = "
              f"{_num(s + d)} is a tie and ties go to the even {_num(s)}")
        if ad % qb == 0:
            # The usual guess is where the spacing first equals the increment (fp16 + 1:
            # "1024"); one binade later is where ties to even start to hold the sum.
            story = (f"not {_num(below)}, the usual guess: at {_num(below)} the spacing is "
                     f"{_num(qb)} and {_num(below)} + {_num(d)} is exact; ")
        else:
            story = ""
    else:
        story = ""
        at = (f"at {_num(s)} the spacing is {_num(q)}, so {_num(s)} + {_num(d)} is less than half "
              f"a spacing above {_num(s)} and rounds back to it")
    tail = ""
    if sequential_sum != s:
        tail = (f"; the walk landed on {_num(sequential_sum)}, inside the stuck binade"
                if abs(sequential_sum) > abs(s) else f"; it ended at {_num(sequential_sum)}")
    return f"{note}{story}{at}{tail}"


def stall_table(formats=DEFAULT_FORMATS, increments=(1.0,), n: int = 10_000, *,
                rounding: str = "nearest", saturate: bool = False, seed: int | None = None) -> list[dict]:
    """One row per (format, increment): the analytic stall point and the real sum of n adds.

    Row keys: format, increment, increment_stored, n, stall_at (analytic; inf when past
    max_finite, 0 when the increment rounds to 0), sequential_sum, true_sum,
    relative_error ((sequential - true) / true), adds_that_moved, stalled, reason.
    """
    if isinstance(formats, str):
        formats = [formats]
    fmts = [get_format(f, f"formats[{i}]") for i, f in enumerate(formats)]
    if not fmts:
        raise InvalidArgument(f"formats={formats!r} is empty; pass at least one of {FORMAT_NAMES}")
    incs = [check_number(x, f"increments[{i}]", hint="finite and non-zero, e.g. 1e-3")
            for i, x in enumerate(increments)]
    if not incs or 0.0 in incs:
        raise InvalidArgument(f"increments={increments!r}: need finite non-zero values, e.g. [1.0, 1e-3]")
    rows = []
    for f in fmts:
        sums, moved = sequential_sums(f, incs, n, rounding=rounding, saturate=saturate, seed=seed)
        stored = f.round(torch.tensor(incs, dtype=torch.float64), saturate=saturate)
        for i, inc in enumerate(incs):
            d = stored[i].item()
            stall_at = 0.0 if d == 0 else f.stall_point(d)
            total = sums[i].item()
            true = n * inc
            rows.append({
                "format": f.name, "increment": inc, "increment_stored": d, "n": n,
                "stall_at": stall_at, "sequential_sum": total, "true_sum": true,
                "relative_error": (total - true) / true if true else math.nan,
                "adds_that_moved": int(moved[i]), "stalled": int(moved[i]) < n,
                "reason": explain(f, inc, n, total, stalled=int(moved[i]) < n, saturate=saturate) if rounding == "nearest"
                else f"{rounding} rounding: no fixed stall point, the sum moves by chance",
            })
    return rows


def stall(formats=DEFAULT_FORMATS, increments=(1.0,), n: int = 10_000, *, rounding: str = "nearest",
          saturate: bool = False, seed: int | None = None, rel_tol: float = 1e-2) -> Result:
    """The stall table as a Result: warn (TP-B2) when any sum lost more than rel_tol."""
    rows = stall_table(formats, increments, n, rounding=rounding, saturate=saturate, seed=seed)
    errs = [abs(r["relative_error"]) for r in rows if r["relative_error"] == r["relative_error"]]
    worst = max(rows, key=lambda r: -1 if r["relative_error"] != r["relative_error"]
                else abs(r["relative_error"]))
    lossy = [r for r in rows if not (abs(r["relative_error"]) <= rel_tol)]
    metrics = {"rows": len(rows), "rows_over_tolerance": len(lossy),
               "max_abs_relative_error": max(errs) if errs else math.nan, "rel_tol": rel_tol}
    for r in rows:
        metrics[f"sequential_sum[{r['format']},{_num(r['increment'])}]"] = r["sequential_sum"]
    msg = (f"{len(lossy)} of {len(rows)} sums of {n} adds are off by more than {rel_tol:.0%}; worst "
           f"{worst['format']} + {_num(worst['increment'])}: {_num(worst['sequential_sum'])} "
           f"instead of {_num(worst['true_sum'])}" if lossy else
           f"all {len(rows)} sums of {n} adds within {rel_tol:.0%}")
    return Result(probe="numerics.stall", target=f"sequential_sum[{rounding}]",
                  verdict="warn" if lossy else "pass", metrics=metrics,
                  evidence={"rows": rows}, seed=seed, codes=["TP-B2"] if lossy else [], message=msg)
