"""Inputs at a decision boundary, for targets that return decisions only.

On random inputs a router's margins are rarely small, so a leak that moves its scores a
little (a router subtracting 0.001 x the sequence-mean logit) never flips a choice, and a
target that returns expert ids alone gives the probe nothing else to see. This search makes
the margin small by construction:

  1. For a position t (t = a cut c, so every later position is future) take two values of
     x[b, t], the input's own and another, with different decisions at t.
  2. Bisect the segment between them (every candidate in one call, one call per step) until
     the two ends are ~2^-20 apart, or adjacent floats: a bracket [lo, hi] around the tie.
  3. Run both ends with the future replaced, and unchanged (twice), in calls of the same
     layout (row for row: rounding that depends on a row's place or the batch size is the
     same in each). Two unchanged calls that disagree are nondeterminism (TP-C2): at a tie any
     run-to-run noise flips a choice. A causal target cannot move either decision; a leak
     that shifts the boundary by more than the bracket moves exactly one of them.
  4. A flip is a leak (structural) if it persists farther from the tie than reordered
     reductions could reach, max(32, T) ulps of relative input distance (the bound classify
     uses for a score gap),
     tested at distances 2^k x the bracket in one more call (which also re-runs the flip:
     one that does not repeat is nondeterminism, not a leak). Flips that stop nearer go to
     the fp64 twin (does the twin's decision at the same point move too?), else they stay
     unverified: never a pass.

The segment's relative distance stands in for the score gap: reduction noise of
max(32, T) ulps of the scores' magnitude moves a tie by about that many ulps of the segment
when the scores are of the order of their spread along it (the assumption is named in the
Result's evidence). Runs only on float inputs of a batch-isolated target (copies share a
call), in perturb mode.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trainprobes.causality.classify import Judge, Kind, Nondeterministic, Outputs, reduction_ulps
from trainprobes.causality.target import Target, differs

__all__ = ["NearTies", "search", "skipped"]

STEPS = 20          # bisection steps: brackets of 2^-20 of the segment, or adjacent floats
REACH_FACTOR = 1    # beyond reduction noise from the tie (as classify judges a score gap): a leak
MAX_REACH = 20      # distances 2^1 .. 2^20 brackets from the tie


@dataclass
class NearTies:
    """What the near-tie search did: brackets reached, flips and how they were judged."""
    tried: int = 0                 # positions for which a bracket was sought
    reached: int = 0               # brackets around a tie (ends with different decisions)
    width: float | None = None     # the widest bracket, relative to its segment
    noise_reach: float = 0.0       # relative distance reordered reductions may move a tie
    flips: int = 0
    kinds: list = field(default_factory=lambda: [0] * len(Kind))
    records: list = field(default_factory=list)  # the first flips: batch, position, reach, kind
    evaluations: int = 0
    reason: str | None = None      # why no bracket was sought or reached

    @property
    def leaks(self) -> int:
        return self.kinds[Kind.STRUCTURAL]

    @property
    def unverified(self) -> int:
        return self.kinds[Kind.UNVERIFIED]


def skipped(reason: str) -> NearTies:
    return NearTies(reason=reason)


def search(judge: Judge, tgt: Target, R: torch.Tensor, cuts: list, *, points: int,
           max_batch_tokens: int, max_records: int = 20) -> NearTies:
    """Bracket up to `points` decisions at the cuts and perturb their futures (see module)."""
    x = judge.x
    B, T = x.shape[:2]
    out = NearTies(noise_reach=reduction_ulps(T) * torch.finfo(x.dtype).eps)
    rows = max(1, max_batch_tokens // T)  # sequences per call
    calls = _Caller(tgt, rows, out)
    # 1. candidates (b, t = c), spread over cuts and rows
    pairs = torch.tensor([(b, c) for c in cuts for b in range(B)], dtype=torch.long)
    if len(pairs) > points:
        pairs = pairs[torch.linspace(0, len(pairs) - 1, points).round().long()]
    b, t = pairs[:, 0], pairs[:, 1]
    out.tried = len(b)
    lo_v = x[b, t]
    d_lo = judge.base.decision[b, t]
    hi_v, d_hi, ok = _other_end(calls, x, R, b, t, d_lo, judge.atol)
    if not ok.any():
        out.reason = (f"no second input value changed any of {len(b)} decisions at the cuts "
                      f"(the decision may not depend on the token's own value)")
        return out
    b, t, lo_v, hi_v, d_lo, d_hi = b[ok], t[ok], lo_v[ok], hi_v[ok], d_lo[ok], d_hi[ok]
    # 2. bisection in float64 along each segment, points cast to the input's dtype
    a0, a1 = torch.zeros(len(b), dtype=torch.float64), torch.ones(len(b), dtype=torch.float64)
    seg = (hi_v.double() - lo_v.double())
    at = lambda a: (lo_v.double() + a.view(-1, *[1] * (lo_v.dim() - 1)) * seg).to(x.dtype)
    for _ in range(STEPS):
        mid = (a0 + a1) / 2
        pm = at(mid)
        live = ~((pm == at(a0)).flatten(1).all(1) | (pm == at(a1)).flatten(1).all(1))
        if not live.any():
            break
        dm = calls(_place(x, b, t, pm))[torch.arange(len(b)), t]
        same = ~differs(d_lo[:, None], dm[:, None], judge.atol)[:, 0]
        a0 = torch.where(live & same, mid, a0)
        a1 = torch.where(live & ~same, mid, a1)
        d_hi = torch.where(_bcast(live & ~same, dm), dm, d_hi)
    out.reached = len(b)
    out.width = float((a1 - a0).max())
    # 3. both ends, unchanged and with the future replaced, in one call
    ends = [(a0, d_lo), (a1, d_hi)]
    trial = R[0].to(x.device)
    tt, bb = t.repeat(2), b.repeat(2)
    base_x = torch.cat([_place(x, b, t, at(a)) for a, _ in ends])
    # base and perturbed copies in two calls of the same layout, row for row: rounding that
    # depends on a row's place in the batch or the batch's size is then the same in both
    dec = torch.cat([calls(base_x), calls(_future(base_x, tt, trial[bb]))])
    n = 2 * len(b)
    idx = torch.arange(n)
    # the unchanged ends once more, same layout: at a tie any nondeterminism flips a decision,
    # and a flip that two identical calls disagree on is TP-C2, never a leak (nor a pass)
    again = differs(dec[:n], calls(base_x), judge.atol)
    if again.any():
        where = again.nonzero()
        raise Nondeterministic([[int(bb[i]), int(p)] for i, p in where[:10].tolist()],
                               int(again.sum()))
    held = ~differs(torch.cat([d for _, d in ends])[:, None], dec[idx, tt][:, None], judge.atol)[:, 0]
    moved = differs(dec[idx, tt][:, None], dec[n + idx, tt][:, None], judge.atol)[:, 0] & held
    alpha = torch.cat([a for a, _ in ends])
    side = torch.cat([-torch.ones(len(b)), torch.ones(len(b))]).double()
    j = moved.nonzero().flatten()
    out.flips = len(j)
    if not len(j):
        return out
    # 4. how far from the tie each flip persists (k = 0 re-runs the flip itself)
    width = (a1 - a0).repeat(2)[j]
    dist = width[:, None] * (2.0 ** torch.arange(MAX_REACH + 1, dtype=torch.float64))[None]
    aj = (alpha[j][:, None] + side[j][:, None] * (dist - dist[:, :1])).clamp(0, 1)  # [n, K]
    K = aj.shape[1]
    rb, rt = bb[j].repeat_interleave(K), tt[j].repeat_interleave(K)
    seg_j = seg.repeat(2, *[1] * (seg.dim() - 1))[j].repeat_interleave(K, 0)
    lo_j = lo_v.repeat(2, *[1] * (lo_v.dim() - 1))[j].repeat_interleave(K, 0)
    pts = (lo_j.double() + aj.reshape(-1).view(-1, *[1] * (lo_v.dim() - 1)) * seg_j).to(x.dtype)
    bx = _place(x, rb, rt, pts)
    dec2 = torch.cat([calls(bx), calls(_future(bx, rt, trial[rb]))])
    m = len(rb)
    k_idx = torch.arange(m)
    want = torch.cat([d for _, d in ends])[j].repeat_interleave(K, 0)
    same_side = ~differs(want[:, None], dec2[k_idx, rt][:, None], judge.atol)[:, 0]
    flipped = differs(dec2[k_idx, rt][:, None], dec2[m + k_idx, rt][:, None], judge.atol)[:, 0]
    persists = (same_side & flipped).view(len(j), K)
    # the contiguous run from k = 0: how far the boundary moved, in relative input distance
    run = persists.long().cumprod(1)
    repeated = run[:, 0].bool()
    reach = torch.where(repeated, (dist * run).amax(1), torch.zeros(len(j), dtype=torch.float64))
    kind = torch.full((len(j),), int(Kind.UNVERIFIED), dtype=torch.long)
    kind[repeated & (reach >= REACH_FACTOR * out.noise_reach)] = int(Kind.STRUCTURAL)
    # the rest (near the tie, or not repeated in another call's layout: rounding that moved
    # with the batch) go to the twin, at the farthest point the flip reached
    ask = kind == Kind.UNVERIFIED
    if ask.any():
        far = (run.sum(1) - 1).clamp_min(0)[ask]
        kind[ask] = _twin(judge, x, bb[j][ask], tt[j][ask],
                          pts.view(len(j), K, *pts.shape[1:])[ask, far], trial)
    out.kinds = torch.bincount(kind, minlength=len(Kind)).tolist()
    for r in range(min(len(j), max_records)):
        out.records.append({"batch": int(bb[j][r]), "position": int(tt[j][r]),
                            "cut": int(tt[j][r]), "width": float(width[r]),
                            "reach": float(reach[r]), "kind": Kind(int(kind[r])).label,
                            "before": dec[int(j[r]), int(tt[j][r])].tolist(),
                            "after": dec[n + int(j[r]), int(tt[j][r])].tolist()})
    return out


def _twin(judge: Judge, x, b, t, pts, trial) -> torch.Tensor:
    """Kinds of near-tie flips the distance test could not settle, by the fp64 twin: its
    decision at the same point moves with the future too (structural) or not (numerical);
    no twin: unverified."""
    base = _place(x, b, t, pts)
    got = [judge.fp64(xc) for xc in (base, _future(base, t, trial[b]))]
    if None in got:
        return torch.full((len(b),), int(Kind.UNVERIFIED), dtype=torch.long)
    i = torch.arange(len(b))
    moved = differs(got[0].decision[i, t][:, None], got[1].decision[i, t][:, None], judge.atol)[:, 0]
    return torch.where(moved, int(Kind.STRUCTURAL), int(Kind.NUMERICAL))


class _Caller:
    """The target on many copies, max `rows` sequences a call; decisions only."""

    def __init__(self, tgt: Target, rows: int, out: NearTies):
        self.tgt, self.rows, self.out = tgt, rows, out

    def __call__(self, xs: torch.Tensor) -> torch.Tensor:
        parts = []
        for k in range(0, len(xs), self.rows):
            parts.append(Outputs(*self.tgt(xs[k:k + self.rows])).decision)
            self.out.evaluations += 1
        return torch.cat(parts)


def _place(x, b, t, values):
    """Copies of rows b of x with position t (one per copy) set to values."""
    xs = x[b].clone()
    xs[torch.arange(len(b)), t] = values.to(x.device)
    return xs


def _future(xs, t, rep):
    """xs with every position after t (per copy) taken from rep (same rows)."""
    late = torch.arange(xs.shape[1], device=xs.device)[None, :] > t.to(xs.device)[:, None]
    return torch.where(late.view(*late.shape, *[1] * (xs.dim() - 2)), rep.to(xs.device), xs)


def _bcast(mask, like):
    return mask.view(-1, *[1] * (like.dim() - 1))


def _other_end(calls, x, R, b, t, d_lo, atol):
    """A second value for each x[b, t] whose decision differs: a replacement value, or the
    value at another row or position. Returns (values, decisions, found)."""
    B, T = x.shape[:2]
    sources = [R[i, b, t] for i in range(len(R))] + [x[(b + 1) % B, t], x[b, (t + 1) % T],
                                                     2 * x[b, t] - x[(b + 1) % B, t]]
    val = x[b, t].clone()
    dec = d_lo.clone()
    found = torch.zeros(len(b), dtype=torch.bool)
    for src in sources:
        if found.all():
            break
        need = ~found
        d = calls(_place(x, b[need], t[need], src[need].to(x.dtype)))[torch.arange(int(need.sum())), t[need]]
        new = differs(d_lo[need][:, None], d[:, None], atol)[:, 0]
        idx = need.nonzero().flatten()[new]
        val[idx] = src[need][new].to(x.dtype)
        dec[idx] = d[new]
        found[idx] = True
    return val, dec, found
