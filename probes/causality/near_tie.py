"""Inputs at a decision boundary, for targets that return decisions only.

On random inputs a router's margins are rarely small, so a leak that moves its scores a
little (a router subtracting 0.001 x the sequence-mean logit) never flips a choice, and a
target that returns expert ids alone gives the probe nothing else to see. This search makes
the margin small by construction:

  1. Windows: min(B, points) runs of consecutive positions (ties), each ending at a cut c
     (cuts spread evenly), up to `points` in all; everything after c is the future of
     every tie in the window. Windows that share no position are copies of row 0 and are
     bisected in one row; overlapping ones (few cuts) are copies of rows in turn, one row
     each. For each tie take two values of x[b, t], the input's own and another, with
     different decisions at t.
  2. Bisect the segment between them (every tie of every window in one call, one call per
     step) until the two ends are ~2^-20 apart, or adjacent floats: a bracket [lo, hi]
     around the tie (brackets.py). A call is one row (one per window if they overlap), so
     the search is ~22 calls of one row plus three calls of 2 rows per window, however many
     ties it brackets. When the last tie sits in the first SHORT of the sequence (one
     sequence: its window ends at the middle cut) and the prefix up to the last tie decides
     every position it holds as the inputs do (else a decision whose shape or value follows
     the length, e.g. a capacity sized from T, would lose or move ties there), the
     bisection runs on that prefix, and the ends are confirmed at the inputs' length in the
     rows step 3 runs: ends the length moved are found again there, or every tie is
     bracketed again at that length (brackets.confirm). A tie's decision also depends on the ties before it
     (its past: its window's and, in one row, the earlier windows'), which move while it is
     bisected: a bracket that this moves out of is found in step 3 (its end no longer
     decides as recorded) and that end is not used.
  3. Run the low ends together and the high ends together (every window's row holding every
     tie at that end, as bisection held them) with what follows each window replaced, and
     unchanged, in calls of the same layout (row for row: rounding that depends on a row's
     place or the batch size is the same in each). A causal target cannot move any tie's
     decision; a leak that shifts a boundary by more than the bracket moves one end. The
     unchanged ends run once more, whether or not anything moved: two unchanged calls that
     disagree are nondeterminism (TP-C2), since at a tie any run-to-run noise flips a
     choice (and noise that missed the perturbed call would otherwise pass). (The
     other ties of the window, between a tie and its window's cut, are not replaced: the
     future tested is what follows the cut.)
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
from trainprobes.causality.brackets import bisect, confirm
from trainprobes.causality.classify import Judge, Kind, Nondeterministic, Outputs, reduction_ulps
from trainprobes.causality.target import Target, differs, differs_each
from trainprobes.errors import TargetError

__all__ = ["NearTies", "search", "skipped"]

SHORT = 0.75        # brackets sought on the prefix up to the last tie if it is this short
REACH_FACTOR = 1    # beyond reduction noise from the tie (as classify judges a score gap): a leak
MAX_REACH = 20      # distances 2^1 .. 2^20 brackets from the tie


@dataclass
class NearTies:
    """What the near-tie search did: brackets reached, flips and how they were judged."""
    tried: int = 0                 # positions for which a bracket was sought
    windows: int = 0               # copies of rows holding them (rows of every search call)
    reached: int = 0               # brackets around a tie (ends with different decisions)
    width: float | None = None     # the widest bracket, relative to its segment
    held: int = 0                  # bracket ends that decided as recorded when run together
    noise_reach: float = 0.0       # relative distance reordered reductions may move a tie
    flips: int = 0
    kinds: list = field(default_factory=lambda: [0] * len(Kind))
    records: list = field(default_factory=list)  # the first flips: batch, position, reach, kind
    evaluations: int = 0
    one_row: bool = False          # the windows were bisected together in one copy of row 0
    length: int | None = None      # the length of the bisection's calls (the prefix up to the
                                   # last tie, or the inputs' length)
    moved: int = 0                 # ends moved to hold at the inputs' length
    confirm_calls: int = 0         # calls spent moving them
    rebracketed: bool = False      # an end lost at full length: all bracketed again there
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
           max_batch_tokens: int, max_records: int = 20, rows_per_call: int | None = None) -> NearTies:
    """Bracket up to `points` decisions in windows before the cuts and perturb what follows
    each window (see module)."""
    x = judge.x
    B, T = x.shape[:2]
    out = NearTies(noise_reach=reduction_ulps(T) * torch.finfo(x.dtype).eps)
    calls = _Caller(tgt, rows_per_call or max(1, max_batch_tokens // T), out)
    # 1. windows: one copy of a row each, its ties on the positions up to a cut
    src, ends_of, w, t = _windows(B, T, cuts, points)
    W = len(src)
    out.tried, out.windows = len(w), W
    # windows that share no position are bisected together in one copy of row 0: a
    # bisection call is then one row, however many windows (their futures differ only in
    # step 3, which gives each window its own row)
    one_row = W > 1 and len(set(t.tolist())) == len(t)
    if one_row:
        src = torch.zeros_like(src)
    out.one_row = one_row
    base = x[src]  # [W, T, ...] the copies step 3 starts from
    bb, bw = (base[:1], torch.zeros_like(w)) if one_row else (base, w)  # what bisection calls hold
    lo_v = base[w, t]
    # 2. brackets sought on the prefix up to the last tie where that is much cheaper,
    # confirmed at the inputs' length below (brackets.py)
    L = int(t.max()) + 1
    short = bb[:, :L].contiguous() if L <= SHORT * T else None
    d_lo = None
    if short is not None:
        try:
            got = calls(short)
        except TargetError:  # a target that takes its own length only
            got = None
        # the prefix stands in for the inputs only if it decides every position it holds as
        # the inputs do: a decision whose shape or value follows the length (capacity from
        # T, a [T, T] key mask, length-scaled positions) would drop or move ties there
        full_dec = judge.base.decision[src[:len(bb)], :L]
        if got is None or got.shape != full_dec.shape or differs(got, full_dec, judge.atol).any():
            short = None
        else:
            d_lo = got[bw, t]  # the ties' own decisions at that length
    if short is None:
        d_lo = judge.base.decision[src[w], t]
    out.length = T if short is None else L
    rows_b = bb if short is None else short
    hi_v, d_hi, ok = _other_end(calls, x, rows_b, R, src, bw, t, d_lo, judge.atol)
    if not ok.any():
        out.reason = (f"no second input value changed any of {len(w)} decisions at the cuts "
                      f"(the decision may not depend on the token's own value)")
        return out
    w, t, lo_v, hi_v, d_lo, d_hi, bw = w[ok], t[ok], lo_v[ok], hi_v[ok], d_lo[ok], d_hi[ok], bw[ok]
    n = len(w)
    seg = (hi_v.double() - lo_v.double())
    at = lambda a: (lo_v.double() + a.view(-1, *[1] * (lo_v.dim() - 1)) * seg).to(x.dtype)
    ends = bisect(lambda v: calls(_set(rows_b, bw, t, v))[bw, t], at, n, d_lo, d_hi, judge.atol)
    out.reached = n
    # 3. the low ends together and the high ends together, unchanged and with what follows
    # each window replaced: base and perturbed copies in calls of the same layout, row for
    # row (rounding that depends on a row's place in the batch or its size is the same)
    trial = R[0].to(x.device)

    def make_rows(p0, p1):
        if one_row:  # every window's row holds every tie at its end, as bisection held them
            return torch.cat([_set(bb, bw, t, p).expand(W, *bb.shape[1:]) for p in (p0, p1)])
        return torch.cat([_set(base, w, t, p0), _set(base, w, t, p1)])  # [2W, T, ...]

    def run_ends(a0, a1, length=T):
        """[2, n]: each low end in its window's row of low ends, each high end in its row of
        high ends (cut to `length`)."""
        got = calls(make_rows(at(a0), at(a1))[:, :length].contiguous())
        return torch.stack([got[w, t], got[W + w, t]])

    if short is not None:  # the ends must hold at the inputs' length: moved there if not
        def noise(flipped):  # [2, n]: ends two identical calls decided differently
            e, i = flipped.nonzero().unbind(1)
            raise Nondeterministic([[int(src[w[k]]), int(t[k])] for k in i[:10].tolist()],
                                   len(e))

        ends, unchanged, spent, out.moved, lost = confirm(
            run_ends, lambda a0, a1: run_ends(a0, a1, L), at, ends, judge.atol, noise=noise)
        out.confirm_calls = spent
        if lost:  # the length moved an end farther than a few brackets: bracket at T
            out.rebracketed = True
            full = lambda v: calls(_set(bb, bw, t, v))[bw, t]
            d_lo, d_hi = judge.base.decision[src[w], t], full(at(torch.ones(n, dtype=torch.float64)))
            # a tie at this length too (a decision is a tie whichever of its top-k slots differ)
            out.reached = int(differs_each(d_lo, d_hi, judge.atol).sum())
            ends = bisect(full, at, n, d_lo, d_hi, judge.atol)
            unchanged = None
    else:
        unchanged = None
    rows = make_rows(at(ends.a0), at(ends.a1))
    out.width = float(ends.width.max())
    rsrc, rend = src.repeat(2), ends_of.repeat(2)
    rw = torch.cat([w, W + w])  # the row of each (tie, end): low ends, then high ends
    tt = t.repeat(2)
    before = (calls(rows)[rw, tt] if unchanged is None else unchanged.flatten(0, 1))
    after = calls(_future(rows, rend, trial[rsrc]))[rw, tt]
    want = torch.cat([ends.d_lo, ends.d_hi])
    held = ~differs_each(want, before, judge.atol)
    out.held = int(held.sum())
    moved = differs_each(before, after, judge.atol) & held
    # the unchanged ends once more, whether or not anything moved: at a tie any
    # nondeterminism flips a decision, and a flip that two identical calls disagree on is
    # TP-C2, never a leak (nor a pass: noise that happened not to move the perturbed call
    # still shows here)
    again = differs_each(before, calls(rows)[rw, tt], judge.atol)
    if again.any():
        where = again.nonzero().flatten()
        raise Nondeterministic([[int(rsrc[rw[i]]), int(tt[i])] for i in where[:10].tolist()],
                               int(again.sum()))
    alpha = torch.cat([ends.a0, ends.a1])
    side = torch.cat([-torch.ones(n), torch.ones(n)]).double()
    j = moved.nonzero().flatten()
    out.flips = len(j)
    if not len(j):
        return out
    # 4. how far from the tie each flip persists (k = 0 re-runs the flip itself), in its own
    # end's copy with only that tie moved
    width = ends.width.reshape(-1)[j]
    dist = width[:, None] * (2.0 ** torch.arange(MAX_REACH + 1, dtype=torch.float64))[None]
    aj = (alpha[j][:, None] + side[j][:, None] * (dist - dist[:, :1])).clamp(0, 1)  # [f, K]
    K = aj.shape[1]
    seg_j = seg.repeat(2, *[1] * (seg.dim() - 1))[j].repeat_interleave(K, 0)
    lo_j = lo_v.repeat(2, *[1] * (lo_v.dim() - 1))[j].repeat_interleave(K, 0)
    pts = (lo_j.double() + aj.reshape(-1).view(-1, *[1] * (lo_v.dim() - 1)) * seg_j).to(x.dtype)
    rr, rt = rw[j].repeat_interleave(K), tt[j].repeat_interleave(K)
    bx = _set(rows, rr, rt, pts, take=True)
    rsj = rsrc[rr]
    dec2 = torch.cat([calls(bx), calls(_future(bx, rend[rr], trial[rsj]))])
    m = len(rr)
    k_idx = torch.arange(m)
    same_side = ~differs_each(want[j].repeat_interleave(K, 0), dec2[k_idx, rt], judge.atol)
    flipped = differs_each(dec2[k_idx, rt], dec2[m + k_idx, rt], judge.atol)
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
        far = (run.sum(1) - 1).clamp_min(0)
        pick = torch.arange(len(j))[ask] * K + far[ask]
        kind[ask] = _twin(judge, bx[pick], rt[pick], rend[rr][pick], trial[rsj][pick])
    out.kinds = torch.bincount(kind, minlength=len(Kind)).tolist()
    for r in range(min(len(j), max_records)):
        i = int(j[r])
        out.records.append({"batch": int(rsrc[rw[i]]), "position": int(tt[i]),
                            "cut": int(rend[rw[i]]), "width": float(width[r]),
                            "reach": float(reach[r]), "kind": Kind(int(kind[r])).label,
                            "before": before[i].tolist(), "after": after[i].tolist()})
    return out


def _twin(judge: Judge, base, t, end, trial) -> torch.Tensor:
    """Kinds of near-tie flips the distance test could not settle, by the fp64 twin: its
    decision at the same point moves with what follows the window too (structural) or not
    (numerical); no twin: unverified."""
    got = [judge.fp64(xc) for xc in (base, _future(base, end, trial))]
    if None in got:
        return torch.full((len(t),), int(Kind.UNVERIFIED), dtype=torch.long)
    i = torch.arange(len(t))
    moved = differs_each(got[0].decision[i, t], got[1].decision[i, t], judge.atol)
    return torch.where(moved, int(Kind.STRUCTURAL), int(Kind.NUMERICAL))


def _windows(B: int, T: int, cuts: list, points: int):
    """Where the ties go: min(B, points) windows, each a copy of one row (rows in turn) with
    up to ceil(points / windows) ties on consecutive positions ending at a cut (cuts spread
    evenly, centred); what follows the window's last position is what gets replaced.
    Returns (source row per window [W], last position per window [W], window and position
    of each tie [n], [n])."""
    W = max(1, min(B, points))
    k = -(-points // W)
    picks = [cuts[min(len(cuts) - 1, int((i + 0.5) * len(cuts) / W))] for i in range(W)]
    src = torch.arange(W) % B
    ends, w, t = [], [], []
    for i, c in enumerate(picks):
        end = min(max(c, k - 1), T - 2)
        for p in range(max(0, end - k + 1), end + 1):
            w.append(i)
            t.append(p)
        ends.append(end)
    return src, torch.tensor(ends), torch.tensor(w), torch.tensor(t)


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


def _set(rows, w, t, values, take: bool = False):
    """A copy of rows with rows[w, t] set to values (take: rows[w] taken as one copy each)."""
    xs = rows[w].clone() if take else rows.clone()
    xs[torch.arange(len(w)) if take else w, t] = values.to(rows.device)
    return xs


def _future(xs, t, rep):
    """xs with every position after t (per copy) taken from rep (same rows)."""
    late = torch.arange(xs.shape[1], device=xs.device)[None, :] > t.to(xs.device)[:, None]
    return torch.where(late.view(*late.shape, *[1] * (xs.dim() - 2)), rep.to(xs.device), xs)


def _other_end(calls, x, base, R, src, w, t, d_lo, atol):
    """A second value for each tie whose decision differs: a replacement value, or the value
    at another row or position, tried for every open tie of every window in one call each.
    Returns (values, decisions, found)."""
    B, T = x.shape[:2]
    b = src[w]
    sources = [R[i, b, t] for i in range(len(R))] + [x[(b + 1) % B, t], x[b, (t + 1) % T],
                                                     2 * x[b, t] - x[(b + 1) % B, t]]
    val = x[b, t].clone()
    dec = d_lo.clone()
    found = torch.zeros(len(w), dtype=torch.bool)
    for src_v in sources:
        if found.all():
            break
        # a source equal to the tie's own value (the next row's, with one row) cannot differ
        need = ~found & (src_v.to(x.dtype) != val).reshape(len(w), -1).any(1)
        if not need.any():
            continue
        d = calls(_set(base, w[need], t[need], src_v[need].to(x.dtype)))[w[need], t[need]]
        new = differs_each(d_lo[need], d, atol)
        idx = need.nonzero().flatten()[new]
        val[idx] = src_v[need][new].to(x.dtype)
        dec[idx] = d[new]
        found[idx] = True
    return val, dec, found
