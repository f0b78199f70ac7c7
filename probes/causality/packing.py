"""How many perturbed copies go into one packed call, chosen by measuring the target.

A packed call costs what the target costs on a bigger batch. For a cheap router the per-call
overhead dominates and bigger is better up to the memory budget; for a target whose cost per
copy grows with the batch (attention's T x T scores falling out of cache, or intra-op threads
contending on a loaded machine) a packed call can cost more per copy than a call alone. No
fixed token budget suits both, so the sizer measures. Every measured call is real work (a
cut judged), and only the target's calls are timed, never the probe's own work around them.

A call of n + 1 copies of the inputs (n perturbed ones and the control) costs t: t / n per
copy. The first call carries START copies beside the two check rows: the same call size as
n = START + 1, so it is the first sample of that size.
  1. ALONE_SAMPLES cuts run alone at the inputs' shape: the cost of the per-cut loop.
  2. Grow: n = START + 1, then doubled (never past the memory budget), SAMPLES calls each (the
     first call at a new size pays for warming up; the fastest call is the estimate, since
     noise only adds time). Growing stops at the budget, at a size that costs more than
     TOLERANCE above the best so far, or at one that costs as much as a call alone.
  3. Settle: the best size if it costs less per copy than a call alone, else one call per
     cut for every later cut.
`fixed` skips all of this: that many copies per call (capped by the budget), for
reproducible evaluation counts.
"""
from __future__ import annotations

START = 8          # copies in the first packed call: the default check's 8 cuts fit in it
GROWTH = 2
SAMPLES = 2        # calls timed at each size while growing
ALONE_SAMPLES = 2  # cuts run alone, timed, to know the loop's cost
TOLERANCE = 0.10   # timing noise allowed before a bigger size counts as slower


class Sizer:
    """Copies per packed call: `next()` says how many (0: run the next cut alone); the caller
    reports each call's time with `packed()` or `alone()`."""

    def __init__(self, cap: int, *, fixed: int | None = None):
        self.cap = cap                 # copies the memory budget allows next to one control
        self.fixed = fixed
        self.want = min(fixed or START + 1, cap)
        self.state = "pack" if fixed else "grow"  # grow -> pack | alone
        self.per_copy: dict[int, float] = {}      # copies per call -> fastest seconds per copy
        self.samples: dict[int, int] = {}
        self.alone_s: list[float] = []
        self.sizes: list[int] = []                # copies of every packed call, in order
        self.why = (f"fixed: pack={fixed}" + (f", capped at {cap} by max_batch_tokens"
                                              if fixed > cap else "")) if fixed else None

    def next(self) -> int:
        if self.state == "alone" or self.state == "grow" and len(self.alone_s) < ALONE_SAMPLES:
            return 0
        return self.want

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
        self._review()

    def _review(self) -> None:
        if (self.state != "grow" or len(self.alone_s) < ALONE_SAMPLES
                or self.samples.get(self.want, 0) < SAMPLES):
            return
        cost, best, alone = self.per_copy[self.want], min(self.per_copy.values()), min(self.alone_s)
        if self.want >= self.cap or cost > best * (1 + TOLERANCE) or cost >= alone:
            self.want = min(self.per_copy, key=self.per_copy.get)
            self.state = "pack" if self.per_copy[self.want] < alone else "alone"
            self.why = (f"settled on {self.per_copy[self.want] * 1e3:.3g} ms per copy at "
                        f"{self.want} copies per call vs {alone * 1e3:.3g} ms per call alone: "
                        + ("packed" if self.state == "pack" else
                           "packing does not pay, one call per cut"))
        else:
            self.want = min(self.want * GROWTH, self.cap)

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
                "copies_per_call": 0 if self.state == "alone" else self.want,
                "cap": self.cap, "state": self.state, "why": self.why}
