"""Brackets around a decision boundary on each tie's input segment (near_tie.py's steps 2-3).

`bisect` halves every tie's bracket in one call per step, on whatever rows it is given: the
inputs' rows, or their prefix up to the last tie when that is much cheaper (attention costs
T x T: a row of half the length costs 1/6 to 1/3 of a full one on a CPU). A causal target
decides a tie from its prefix alone (near_tie.py uses the prefix only where it decides every
position it holds as the inputs do: a decision whose shape or value follows the length is
bracketed at the inputs' length from the start), but the bracket must hold where the test
runs: at the inputs' length, with each window's own future. `confirm` checks that in the
rows the test runs (one call, the test's unchanged rows) and moves every end that decides
otherwise at the inputs' length: a length-dependent rounding, or a leak reading the future
the prefix lacked, shifts the boundary, and a leak moves exactly the ends that would show
it. Such an end steps outward, 2^k brackets at a time, until it decides as an end of its
side must, then is bisected back to its bracket's width from the last point that did not: it
is again an end at the boundary, now at the inputs' length, and the test perturbs its future
as before. An end that has not turned within 2^GALLOP brackets is lost, and then the caller
brackets every tie again at the inputs' length: never a pass bought with a length change.
Ends that do not hold at the prefix's length either (the other ties, sitting at their ends,
moved them: as at the inputs' length) are left as they are: the test does not use them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from trainprobes.causality.target import differs_each

__all__ = ["STEPS", "GALLOP", "Ends", "bisect", "confirm"]

STEPS = 20       # bisection steps: brackets of 2^-20 of the segment, or adjacent floats
GALLOP = 6       # an end moved by up to 2^6 brackets at the inputs' length is found again


@dataclass
class Ends:
    """Both ends of every tie's bracket: positions along the segment (a0 < a1), the
    decisions recorded there, and the width each end is from a point deciding the other way."""
    a0: torch.Tensor
    a1: torch.Tensor
    d_lo: torch.Tensor
    d_hi: torch.Tensor
    width: torch.Tensor  # [2, n]: low ends, high ends


def _same(d: torch.Tensor, ref: torch.Tensor, atol: float) -> torch.Tensor:
    """[n] bool: d[i] decides as ref[i] (within atol)."""
    return ~differs_each(ref, d, atol)


def _bcast(mask, like):
    return mask.view(*mask.shape, *[1] * (like.dim() - mask.dim()))


def bisect(decide: Callable, at: Callable, n: int, d_lo, d_hi, atol: float,
           steps: int = STEPS) -> Ends:
    """Halve [0, 1] for n ties at once: decide(values [n, ...]) -> decisions [n, ...] at the
    ties; at(alphas [n]) -> values. A midpoint deciding d_lo moves the low end, any other
    decision the high end (recorded as d_hi). Ties whose midpoint rounds to an end stop and
    sit at their low end while the rest go on."""
    a0, a1 = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
    p0, p1 = at(a0), at(a1)  # the ends' values, kept as they move (one cast per step)
    for _ in range(steps):
        mid = (a0 + a1) / 2
        pm = at(mid)
        live = ~((pm == p0).flatten(1).all(1) | (pm == p1).flatten(1).all(1))
        if not live.any():
            break
        dm = decide(torch.where(_bcast(live, pm), pm, p0))
        same = _same(dm, d_lo, atol)
        up, down = live & same, live & ~same
        a0, p0 = torch.where(up, mid, a0), torch.where(_bcast(up, pm), pm, p0)
        a1, p1 = torch.where(down, mid, a1), torch.where(_bcast(down, pm), pm, p1)
        d_hi = torch.where(_bcast(down, dm), dm, d_hi)
    width = (a1 - a0).expand(2, n).clone()
    return Ends(a0, a1, d_lo, d_hi, width)


def _held(d, ends: Ends, atol: float) -> torch.Tensor:
    """[2, n]: each end decides as recorded (low ends d_lo, high ends d_hi)."""
    return torch.stack([_same(d[0], ends.d_lo, atol), _same(d[1], ends.d_hi, atol)])


def confirm(run: Callable, run_short: Callable, at: Callable, ends: Ends, atol: float,
            gallop: int = GALLOP, noise: Callable | None = None):
    """Make the ends found on the prefix hold at the inputs' length (see the module).
    run(a0, a1) -> decisions [2, n, ...] of the low ends (each in its row of low ends) and the
    high ends, in one call of the rows the test runs; run_short: the same rows cut to the
    prefix's length. Returns (ends, decisions of the last unchanged call [2, n, ...], calls
    spent beyond the first, ends moved, ends lost: a length-moved end not found again, or
    one that turned to a third decision; the caller then brackets at the inputs' length).
    noise(mask [2, n]) is told of ends that two identical calls decided differently."""
    al = torch.stack([ends.a0, ends.a1])  # [2, n]
    d = run(al[0], al[1])
    held = _held(d, ends, atol)
    if held.all():
        return ends, d, 0, 0, 0
    # ends that do not hold in these rows at the prefix's length either: the other ties at
    # their ends moved them (as they do at the inputs' length: those the test does not use);
    # the rest the length moved: the future the prefix lacked, or rounding that follows T
    by_length = _held(run_short(al[0], al[1]), ends, atol) & ~held
    if not by_length.any():
        return ends, d, 1, 0, 0
    # at a tie run-to-run noise flips an end too, and would pass for a length move (and be
    # moved away from the boundary, where noise shows less): the same rows once more first
    again = run(al[0], al[1])
    flipped = torch.stack([~_same(again[s], d[s], atol) for s in (0, 1)])
    if flipped.any() and noise is not None:
        noise(flipped)

    def ok(dec):  # on its own side: low ends decide d_lo, high ends anything else
        e = torch.stack([_same(dec[0], ends.d_lo, atol), _same(dec[1], ends.d_lo, atol)])
        return torch.stack([e[0], ~e[1]])

    # a low end off the low side: the boundary lies below it; a high end on the low side:
    # above it. A high end turned to a third decision is neither, and so is a tie whose both
    # ends moved (the boundary is not where either says): lost
    bad = by_length & ~ok(d)
    bad &= ~bad.all(0, keepdim=True)
    third = int((by_length & ~bad).sum())
    side = torch.tensor([-1.0, 1.0], dtype=torch.float64)[:, None]
    width = ends.width
    good_pt, bad_pt = al.clone(), al.clone()
    good_dec, bad_dec = torch.stack([ends.d_lo, ends.d_hi]), d.clone()
    found = torch.zeros_like(bad)
    open_ = bad.clone()
    calls = 2

    for k in range(gallop + 1):
        q = (al + side * width * 2.0 ** k).clamp(0, 1)
        cur = torch.where(open_, q, torch.where(found, good_pt, al))
        dec = run(cur[0], cur[1])
        calls += 1
        g = ok(dec)
        new = open_ & g
        good_pt = torch.where(new, q, good_pt)
        good_dec = torch.where(_bcast(new, good_dec), dec, good_dec)
        bad_pt = torch.where(open_ & ~g, q, bad_pt)
        bad_dec = torch.where(_bcast(open_ & ~g, bad_dec), dec, bad_dec)
        found |= new
        open_ &= ~g & (q > 0) & (q < 1)  # an end that reached its segment's end is lost
        if not open_.any():
            break
    lost = int((bad & ~found).sum()) + third
    if lost:
        return ends, d, calls, 0, lost
    # back towards the boundary: halve [good_pt, bad_pt] to the bracket's width
    for _ in range(gallop + 1):
        mid = (good_pt + bad_pt) / 2
        apart = torch.stack([~((at(mid[s]) == at(good_pt[s])).flatten(1).all(1)
                               | (at(mid[s]) == at(bad_pt[s])).flatten(1).all(1)) for s in (0, 1)])
        live = found & ((bad_pt - good_pt).abs() > width) & apart
        if not live.any():
            break
        cur = torch.where(live, mid, torch.where(found, good_pt, al))
        dec = run(cur[0], cur[1])
        calls += 1
        g = ok(dec)
        good_pt = torch.where(live & g, mid, good_pt)
        good_dec = torch.where(_bcast(live & g, good_dec), dec, good_dec)
        bad_pt = torch.where(live & ~g, mid, bad_pt)
        bad_dec = torch.where(_bcast(live & ~g, bad_dec), dec, bad_dec)
    # a tie one of whose ends moved takes the new bracket for both: the end that held is now
    # as far from the boundary as the length moved it, and would test nothing nearer
    lo, hi = found[0], found[1]
    a0 = torch.where(lo, good_pt[0], torch.where(hi, bad_pt[1], ends.a0))
    a1 = torch.where(lo, bad_pt[0], torch.where(hi, good_pt[1], ends.a1))
    d_hi = torch.where(_bcast(lo, ends.d_hi), bad_dec[0], torch.where(_bcast(hi, ends.d_hi), good_dec[1], ends.d_hi))
    w_new = torch.where(lo | hi, (a1 - a0).abs(), width)
    moved = Ends(a0, a1, ends.d_lo, d_hi, torch.where(lo | hi, w_new, width))
    return moved, run(a0, a1), calls + 1, int(found.sum()), 0
