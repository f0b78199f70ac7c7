"""Is a changed output a leak or rounding noise? Routing margins, the fp64 twin, reproduction.

A deterministic target run at the same shape can change an output only if data reached it
from what was perturbed, or if what was perturbed changed the order of a reduction (tiling by
tokens per expert, a row-wide max taken for stability): reordering a sum of T terms moves it
by up to ~T eps of the terms' magnitude (gamma_T, Higham), far beyond an ulp or two on a
large-magnitude output. So a change is *structural* without further test only beyond
reduction noise: max(32, T) ulps of its magnitude, T the positions of the row (for a routing
decision, its margin beyond that). A change within it, or any change where the shape or kernel
path differed (a truncated prefix), goes to the fp64 twin, a precision-scaling test: rounding
noise shrinks by ~2^-29 from fp32 to fp64, a real dependence does not. Without a twin such a
change stays *unverified*: never excused, never a pass. (A near-tie: within 32 ulps.)

Public: `classify_changes` (pure: the outputs in, one `Kind` per change out), `Kind`, `Outputs`,
`margins`. `Judge` wraps it for one probe run: the baseline, a lazily built fp64 twin, the
re-runs that tell nondeterminism from a leak. The isolation probe (packed documents) uses
`classify_changes` directly.
"""
from __future__ import annotations

import enum
from typing import Callable, NamedTuple, Union

import torch
from trainprobes.causality.target import Target, abs_diff, differs
from trainprobes.errors import TargetError, TrainprobesError

__all__ = ["Kind", "Outputs", "classify_changes", "near_tie", "margins", "reduction_ulps", "NOISE_ULPS"]

NOISE_ULPS = 32  # a score gap within 32 ulps of its magnitude is "near a tie"
REPRODUCTIONS = 3  # flipped cuts re-run to tell nondeterminism from a leak


class Kind(enum.IntEnum):
    """How a change is judged. The values index tallies (torch.bincount), so they are stable."""
    STRUCTURAL = 0   # data flowed from what was perturbed: a leak
    NUMERICAL = 1    # rounding noise, shown so by the fp64 twin: excused
    UNVERIFIED = 2   # within rounding of a tie and no fp64 twin to settle it: verdict warn
    UNCONFIRMED = 3  # a packed flip past the verification budget: counted as a leak

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def labels(cls, kinds: torch.Tensor) -> list[str]:
        """["structural", "numerical", ...] for a tensor of Kind values."""
        return [cls(k).label for k in kinds.tolist()]


class Outputs(NamedTuple):
    """What a target returned for one input: decisions [B, T, ...] and optional routing
    scores [B, T, E] (their runner-up gap is the routing margin)."""
    decision: torch.Tensor
    scores: torch.Tensor | None = None


Fp64 = Union[tuple, Callable[[], Union[tuple, None]], None]


def margins(scores: torch.Tensor, decision: torch.Tensor) -> torch.Tensor:
    """[B, T] routing margin: the gap between the k-th and (k+1)-th best score, where k is
    the number of experts the decision picks per token ([B, T] ids: 1; [B, T, k] ids: k;
    a [B, T, E] mask: its count of picks). A flip at a large margin cannot be rounding noise
    in the scores. A float decision not over the experts (hidden states [B, T, D], D != E)
    does not say k: the nearest tie at any k, the smallest gap between adjacent scores."""
    s = scores.reshape(*scores.shape[:2], -1).double()
    E = s.shape[-1]
    if E < 2:
        return torch.full(s.shape[:2], float("inf"), dtype=torch.float64)
    if decision.is_floating_point() and decision.dim() > 2 and decision.shape[-1] != E:
        return s.sort(dim=-1).values.diff(dim=-1).amin(-1)
    if decision.dim() == 2:
        k = torch.ones(s.shape[:2], dtype=torch.long)
    elif not decision.is_floating_point() and decision.shape[-1] != E or decision.dim() > 3:
        k = torch.full(s.shape[:2], min(decision.shape[-1], E - 1), dtype=torch.long)
    else:  # a mask or weights over experts: k = number of non-zero entries
        k = (decision.reshape(*decision.shape[:2], -1) != 0).sum(-1)
    k = k.clamp(1, E - 1)
    top = s.sort(dim=-1, descending=True).values
    return (top.gather(-1, (k - 1)[..., None]) - top.gather(-1, k[..., None]))[..., 0].abs()


def noise_tol(values: torch.Tensor, ulps: float = NOISE_ULPS) -> torch.Tensor:
    """Rounding noise allowed for each value: `ulps` ulps of its magnitude (at least 1)."""
    eps = torch.finfo(values.dtype).eps if values.is_floating_point() else 0.0
    return ulps * eps * values.double().abs().clamp_min(1.0)


def reduction_ulps(length: int) -> int:
    """Ulps a reduction of `length` terms may move by when its order changes: ~length eps of
    the magnitude (never fewer than a near-tie's NOISE_ULPS)."""
    return max(NOISE_ULPS, int(length))


def change_size(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per change: the largest absolute difference over the trailing axes (to or from NaN
    or an infinity: infinite; equal infinities: none)."""
    if not len(a):
        return torch.zeros(0, dtype=torch.float64)
    return abs_diff(a, b).reshape(len(a), -1).amax(-1)


def near_tie(where, base: Outputs, changed: Outputs, *, margin_tol: float | None = None,
             ulps: float = NOISE_ULPS) -> torch.Tensor:
    """[n] bool: whether each change sits within rounding noise of a tie. With scores: the
    baseline's routing margin within margin_tol (default `ulps` ulps of the largest score
    magnitude: logits of -1000 round at 1000's ulp however small the largest value is).
    A float decision (with scores or without): also when its change is within `ulps` ulps of
    its magnitude (a value, not only a choice: the router's margin says nothing about an ulp
    of rounding in a hidden state). An integer decision without scores is never near a tie
    (nothing says how close it was)."""
    b, t = where
    y0, s0 = base
    tie = torch.zeros(len(b), dtype=torch.bool)
    if s0 is not None:
        m = margins(s0[b, t][:, None], y0[b, t][:, None])[:, 0]
        tol = (torch.full_like(m, margin_tol) if margin_tol is not None else
               noise_tol(s0[b, t].reshape(len(b), -1).abs().amax(-1), ulps))
        tie |= m <= tol
    before = y0[b, t]
    if before.is_floating_point():
        tol = noise_tol(before.reshape(len(b), -1), ulps).amax(-1)
        tie |= change_size(before, changed.decision[b, t]) <= tol
    return tie


def classify_changes(where, base: Outputs, changed: Outputs, *, fp64: Fp64 = None, atol: float = 0.0,
             margin_tol: float | None = None, same_shape: bool = True,
             twin_settles_reduction: bool = True) -> torch.Tensor:
    """One `Kind` per change: [n] long tensor of Kind values (STRUCTURAL, NUMERICAL, UNVERIFIED).

    where: (batch, position) index tensors of the changes, as `mask.nonzero(as_tuple=True)`.
    base, changed: `Outputs` of the unperturbed and the perturbed run, aligned [B, T, ...]
      (slice the baseline to a truncated run's length first).
    fp64: the same two runs computed in float64, as a pair (base64, changed64) of `Outputs`,
      or a callable returning that pair (or None), called only if some change needs it.
    same_shape: True when both runs had the same shape, so only changes within reduction
      noise (max(32, T) ulps, T = base.decision.shape[1]; a routing margin that small) can
      be noise; False (a truncated prefix, another packing) sends every change to fp64.
      Without a twin, changes within reduction noise are unverified, larger ones structural.
    twin_settles_reduction: False for a twin that may lack the leak (kernels substituted):
      it then settles near-ties (32 ulps) only, and same-shape changes between a near-tie
      and reduction noise stay unverified.

    Structural if in fp64 an integer decision still changes, or a float decision (or the
    scores) still moves by more than 1e-3 of its fp32 move and more than fp64 noise (an
    fp32 move to inf or NaN: more than fp64 noise).

    >>> import torch
    >>> from trainprobes.causality.classify import Kind, Outputs, classify_changes
    >>> before = torch.tensor([[1.0, 2.0, 3.0]])
    >>> after = torch.tensor([[1.0 + 2e-7, 2.5, 3.0]])  # position 0: an ulp, 1: a real change
    >>> where = (before != after).nonzero(as_tuple=True)
    >>> kinds = classify_changes(where, Outputs(before), Outputs(after))
    >>> Kind.labels(kinds)
    ['unverified', 'structural']
    >>> twin = (Outputs(before.double()), Outputs(before.double() + torch.tensor([[0.0, 0.5, 0]])))
    >>> Kind.labels(classify_changes(where, Outputs(before), Outputs(after), fp64=twin))
    ['numerical', 'structural']
    """
    b, t = where
    kind = torch.full((len(b),), Kind.STRUCTURAL, dtype=torch.long)
    if not len(b):
        return kind
    tiny = near_tie(where, base, changed, margin_tol=margin_tol)
    # reordered reductions: T terms over the row's positions (the margin_tol override stands)
    noisy = tiny | near_tie(where, base, changed, margin_tol=margin_tol,
                            ulps=reduction_ulps(base.decision.shape[1]))
    if not same_shape:
        ask = torch.ones(len(b), dtype=torch.bool)
    else:
        ask = noisy if twin_settles_reduction else tiny
    kind[noisy] = Kind.UNVERIFIED
    if not ask.any():
        return kind
    pair = fp64() if callable(fp64) else fp64
    if pair is None:
        return kind
    (d0, f0), (d1, f1) = pair
    bi, ti = b[ask], t[ask]
    # integer decisions: does the choice still change in fp64? float ones: scaling test below
    moved = (torch.zeros(len(bi), dtype=torch.bool) if d1.is_floating_point() else
             differs(d0, d1, atol)[bi, ti])
    for v0, v1, w0, w1 in ((f0, f1, base.scores, changed.scores), (d0, d1, base.decision, changed.decision)):
        if v0 is None or not v0.is_floating_point() or w1 is None:
            continue
        d64 = change_size(v0[bi, ti], v1[bi, ti])
        d32 = change_size(w0[bi, ti], w1[bi, ti])
        tol64 = noise_tol(v0[bi, ti].reshape(len(bi), -1)).amax(-1)
        # a change to inf or NaN has no size to scale (1e-3 x inf would excuse any fp64
        # move, an overflowed leak included): there the twin's move alone decides
        moved |= d64 > torch.maximum(torch.where(d32.isfinite(), 1e-3 * d32, 0.0), tol64)
    kind[ask] = torch.where(moved, int(Kind.STRUCTURAL), int(Kind.NUMERICAL))
    return kind


class Nondeterministic(TrainprobesError):
    """The same input gave different outputs: this is TP-C2, not a leak (caught by check)."""

    def __init__(self, where, count=None):
        super().__init__(f"nondeterministic at {where[:3]}")
        self.where, self.count = where, count if count is not None else len(where)


class Judge:
    """`classify_changes` for one probe run: the baseline outputs of x, the fp64 twin (built and run
    lazily, checked to really compute in float64), a budget of verification calls, and the
    re-runs of flipped inputs that tell nondeterminism from a leak."""

    def __init__(self, tgt: Target, x: torch.Tensor, base: Outputs, *, atol: float,
                 margin_tol: float | None, fp64, max_verify: int | None):
        self.tgt, self.x, self.atol, self.margin_tol = tgt, x, atol, margin_tol
        self.base = base  # the target's outputs on x
        self._fp64_fn = tgt.fp64(fp64)
        self._fp64_base: Outputs | None = None
        self._fp64_last = None
        self.fp64_status = "not needed" if fp64 is not False else "disabled"
        self.verify_left = max_verify if max_verify is not None else float("inf")
        self.reproduced = 0  # flipped inputs seen again on a second call
        self.confirmations = 0  # evaluations spent re-checking flips: re-runs, the fp64 twin

    def base_at(self, n: int) -> Outputs:
        """The baseline over the first n positions (a truncated run's length)."""
        y0, s0 = self.base
        return Outputs(y0[:, :n], s0[:, :n] if s0 is not None else None)

    def reproduce(self, xc, out: Outputs) -> None:
        """Re-run xc and demand identical output: a leak reproduces, nondeterminism (atomics,
        unseeded sampling) does not. A noise flip at a near-tie repeats by chance half the
        time, so the first REPRODUCTIONS flipped inputs are each re-run once."""
        if self.reproduced >= REPRODUCTIONS:
            return
        self.confirmations += 1
        y2, s2 = self.tgt(xc)
        # as the first determinism check: decisions within atol, scores bit for bit
        moved = differs(out.decision, y2, self.atol)
        if out.scores is not None and s2 is not None:
            moved |= differs(out.scores, s2, 0.0)
        if moved.any():
            raise Nondeterministic(moved.nonzero()[:10].tolist())
        self.reproduced += 1

    def fp64(self, xc) -> Outputs | None:
        """The fp64 twin's outputs on xc, or None if there is no usable twin (or no budget).
        The last answer is kept: decision flips and score changes of one input share it."""
        if self._fp64_last is not None and self._fp64_last[0] is xc:
            return self._fp64_last[1]
        if self._fp64_fn is None or self.verify_left <= 0:
            return None
        if self._fp64_base is None and not self._start_fp64():
            return None
        self.verify_left -= 1
        self.confirmations += 1
        self._fp64_last = (xc, Outputs(*self.tgt(xc, self._fp64_fn)))
        return self._fp64_last[1]

    def _start_fp64(self) -> bool:
        self.confirmations += 1
        try:
            base = Outputs(*self.tgt(self.x, self._fp64_fn))
        except TargetError as e:
            self._fp64_fn, self.fp64_status = None, f"unavailable: {e}"
            return False
        floats = [v for v in base if v is not None and v.is_floating_point()]
        if floats and any(v.dtype != torch.float64 for v in floats):
            self._fp64_fn = None
            self.fp64_status = (f"unavailable: the fp64 twin returned {floats[0].dtype}, not "
                                f"float64 (pass fp64= a callable that computes in float64)")
            return False
        # integer decisions alone cannot show the twin computed in fp64; a twin that did not
        # repeats the fp32 flips and leaves them structural, so trusting it is conservative
        self._fp64_base = base
        self.fp64_status = "used" if floats else "used (integer output: dtype not confirmed)"
        return True

    def _fp64_pair(self, xc, n: int, scores_only: bool = False):
        got = self.fp64(xc)
        if got is None or (scores_only and got.scores is None):
            return None
        d0, f0 = self._fp64_base
        if scores_only:
            return Outputs(f0[:, :n]), Outputs(got.scores)
        return Outputs(d0[:, :n], f0[:, :n] if f0 is not None else None), got

    def flips(self, xc, where, out: Outputs, same_shape: bool = True) -> torch.Tensor:
        """Kinds of the decision changes at `where` of out (the run of xc) against the baseline."""
        n = out.decision.shape[1]
        return classify_changes(where, self.base_at(n), out, fp64=lambda: self._fp64_pair(xc, n),
                        atol=self.atol, margin_tol=self.margin_tol, same_shape=same_shape)

    def score_changes(self, xc, where, scores: torch.Tensor, same_shape: bool = True):
        """Kinds of routing-score changes at `where` (where the decision held), or None when
        they cannot be judged: a changed shape needs the fp64 test and there is no twin."""
        n = scores.shape[1]
        base = Outputs(self.base.scores[:, :n])
        if same_shape:
            twin = lambda: self._fp64_pair(xc, n, scores_only=True)
        else:
            twin = self._fp64_pair(xc, n, scores_only=True)
            if twin is None:
                return None
        return classify_changes(where, base, Outputs(scores), fp64=twin, same_shape=same_shape)
