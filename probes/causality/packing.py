"""How many perturbed copies go into one packed call, chosen by measuring the target.

A packed call costs what the target costs on a bigger batch. For a cheap router the per-call
overhead dominates and bigger is better up to the memory budget; for a target whose cost per
copy grows with the batch (attention's T x T scores falling out of cache, or intra-op threads
contending on a loaded machine) a packed call can cost more per copy than a call alone. No
fixed token budget suits both, so the sizer measures. Every measured call is real work (a
cut judged), and only the target's calls are timed, never the probe's own work around them.

A call of n + 1 copies of the inputs (n perturbed ones and the control) costs t: t / n per
copy; a size's cost is its fastest call, since noise only adds time. The first call carries
START copies beside the two check rows (all the cuts if there are at most ALL_AT_ONCE: one
call), the same call size as n = START + 1, so it is the first sample of that size; it is
small, so a target that packing slows does not pay for a big first call. The loop's cost
per cut is a call alone: the fastest of the baseline call (the first call, so at most an
overestimate) and the cuts timed alone (which run right after a packed call, on cold caches).
  1. A size that costs under CLEAR_WIN of a call alone per copy pays, even if that call alone
     is the baseline's (the first call, so it may include warming up); otherwise
     ALONE_SAMPLES cuts run alone, timed, before going on (useful work, and cheaper than a
     second big call on a superlinear target), after a second call of that size only if
     its first call already looked cheaper than the baseline (it may yet be a clear win).
  2. Grow (n doubles, never past the memory budget) while the size pays (cheaper than a call
     alone) and beats the smaller sizes: at once if by a clear margin (CLEAR), else after
     SAMPLES calls and within TOLERANCE (TIGHT where packing saves less than half).
  3. A size that does not beat them gets SAMPLES calls (the first call at a new size pays for
     warming up) unless it is clearly worse (WORSE times the best cost so far, and not a clear
     win over a call alone: a GPU's first call at a new shape can cost several warm ones);
     then settle on the best size if it pays by a margin (PAYS), else one call per cut for
     every later cut.
     Where packing saves more than half, of the sizes within SAME of the best the biggest
     is kept: timing noise should not cost calls.
`fixed` skips all of this: that many copies per call (capped by the budget), for
reproducible evaluation counts.
"""
from __future__ import annotations

START = 2          # copies in the first packed call beside the checks, as many as the check
                   # rows (4 cost a single-sequence attention router ~3% of a certification,
                   # where packing does not pay); all the cuts if they
ALL_AT_ONCE = 8    # are no more than this: the default check's 8 cuts take one call)
GROWTH = 2
SAMPLES = 2        # calls timed at a size before it is called slower
CLEAR = 0.6        # one call this far below every smaller size: grow at once
CLEAR_WIN = 0.25   # per copy under this share of a call alone (the baseline first): pays
ALONE_SAMPLES = 2  # else cuts are timed alone (their fastest: the loop's cost per cut)
TOLERANCE = 0.25   # timing noise allowed before a bigger size counts as slower, while packing
TIGHT = 0.10       # saves at least half of a call alone; TIGHT where it saves less
SAME = 0.10        # sizes this close to the best cost the same: the biggest is kept
WORSE = 2.0        # a first call this many times the best: slower, warming up or not
PAYS = 0.9         # settle on packing only below this share of a call alone per copy: a
                   # smaller gain is within the noise of the few calls timed, while a loss
                   # would be paid on every later cut


class Sizer:
    """Copies per packed call: `next()` says how many (0: run the next cut alone); the caller
    reports each call's time with `packed()` or `alone()`."""

    def __init__(self, cap: int, *, baseline_s: float, fixed: int | None = None):
        self.cap = cap                 # copies the memory budget allows next to one control
        self.baseline_s = baseline_s   # the first call of the target, at the inputs' shape
        self.fixed = fixed
        self.want = min(fixed or START + 1, cap)
        self.state = "pack" if fixed else "grow"  # grow -> pack | alone
        self.need_alone = False                   # time a cut alone before deciding
        self.per_copy: dict[int, float] = {}      # copies per call -> fastest seconds per copy
        self.samples: dict[int, int] = {}
        self.alone_s: list[float] = []
        self.sizes: list[int] = []                # copies of every packed call, in order
        self.why = (f"fixed: pack={fixed}" + (f", capped at {cap} by max_batch_tokens"
                                              if fixed > cap else "")) if fixed else None

    def next(self) -> int:
        return 0 if self.state == "alone" or self.need_alone else self.want

    def deciding(self) -> bool:
        """Whether timings still count: once settled, calls are no longer timed."""
        return self.state == "grow"

    def packed(self, copies: int, overhead: int, seconds: float) -> None:
        """A packed call of `copies` perturbed copies and `overhead` unperturbed ones (the
        control; the first call also carries the isolation rows) took `seconds`."""
        self.sizes.append(copies)
        n = copies + overhead - 1  # the same call with one control holds n copies
        if n < 1:
            return
        self.per_copy[n] = min(self.per_copy.get(n, float("inf")), seconds / n)
        self.samples[n] = self.samples.get(n, 0) + 1
        if n == self.want:  # else a last, smaller call: it says nothing about the size wanted
            self._review()

    def alone(self, seconds: float) -> None:
        """A cut run alone at the inputs' shape took `seconds` (the target's call only)."""
        self.alone_s.append(seconds)
        self.need_alone = False
        self._review()

    def _review(self) -> None:
        if self.state != "grow" or not self.samples.get(self.want):
            return
        cost, k = self.per_copy[self.want], self.samples[self.want]
        smaller = min((c for n, c in self.per_copy.items() if n < self.want), default=float("inf"))
        # a call alone: its fastest timing, the baseline's included (a call alone too; cuts
        # timed right after a big packed call run on cold caches, which favoured packing)
        alone = min([*self.alone_s, self.baseline_s])
        best = min(smaller, alone)
        if cost > CLEAR_WIN * alone:  # not a clear win: is it cheaper than a call alone at all?
            # a size that looks cheaper than the baseline gets its second call first (it may
            # turn out a clear win); one that does not, cuts timed alone first (useful work)
            if k < SAMPLES and cost < alone and not self.alone_s:
                return
            if len(self.alone_s) < ALONE_SAMPLES:
                self.need_alone = True
                return
            if k < SAMPLES and cost <= WORSE * best:
                return  # one more call of this size (the first one warms up)
        tolerance = TOLERANCE if cost < alone / 2 else TIGHT
        better = cost <= CLEAR * smaller or k >= SAMPLES and cost <= smaller * (1 + tolerance)
        if cost < alone and better and self.want < self.cap:
            self.want = min(self.want * GROWTH, self.cap)
        elif k < SAMPLES and (cost <= WORSE * best or cost <= CLEAR_WIN * alone):
            # not clearly worse (a first call may be slow from warming up; on a GPU a new
            # shape's first call can cost several warm ones, and one still a clear win
            # over a call alone is worth a second look): one more
            return
        else:
            self._settle(alone)

    def _settle(self, alone: float) -> None:
        self.want = min(self.per_copy, key=self.per_copy.get)
        best = self.per_copy[self.want]
        if best < alone / 2:  # of sizes that cost the same, the biggest: noise should not cost calls
            self.want = max(n for n, c in self.per_copy.items() if c <= best * (1 + SAME))
        self.state = "pack" if self.per_copy[self.want] < PAYS * alone else "alone"
        self.why = (f"settled on {self.per_copy[self.want] * 1e3:.3g} ms per copy at "
                    f"{self.want} copies per call vs {alone * 1e3:.3g} ms per call alone: "
                    + ("packed" if self.state == "pack" else "packing does not pay, one call per cut"))

    def shrink(self, copies: int) -> bool:
        """Out of memory at `copies` per call: halve the budget. False if that leaves fewer
        than two copies per call (a control beside one copy doubles the cost: calls alone)."""
        self.cap = copies // 2
        self.per_copy = {n: s for n, s in self.per_copy.items() if n <= self.cap}
        self.samples = {n: k for n, k in self.samples.items() if n <= self.cap}
        self.want = min(self.want, self.cap)
        if self.state != "alone" and not self.fixed:
            self.state = "grow"  # measure the size that fits, then settle again
            self._review()
        return self.cap >= 2

    def evidence(self) -> dict:
        return {"sizes": self.sizes, "alone_calls_timed": len(self.alone_s),
                "ms_per_copy": {str(n): round(s * 1e3, 4) for n, s in sorted(self.per_copy.items())},
                "ms_alone": round(min(self.alone_s) * 1e3, 4) if self.alone_s else None,
                "ms_baseline": round(self.baseline_s * 1e3, 4),
                "copies_per_call": 0 if self.state == "alone" else self.want,
                "cap": self.cap, "state": self.state, "why": self.why}
