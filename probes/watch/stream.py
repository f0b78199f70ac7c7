"""Signed errors of sampled reductions, per bucket and over time, judged at every look.

Each sample is one signed relative error e (trainprobes.numerics.bias.signed_relative_error:
the reduced window against its fp64 re-reduction; e < 0: the reduction shrinks gradients).
Samples accumulate per stream (one per DDP bucket). Every `interval` steps is a look; at look
k every stream with >= 3 finite samples is judged by the bias test the probes already have
(numerics.bias.error_stats: t-test on the mean, sign and Wilcoxon tests beside it) on all
its samples so far, at

    alpha_k = alpha * 6 / (pi^2 k^2) / m_k        (m_k: streams judged at look k)

Why: the run is looked at again and again, so the chance of any false "biased" over the
whole run is what must stay under alpha. sum_k 6 / (pi^2 k^2) = 1, so by the union bound
(Bonferroni over looks and streams, valid under any dependence between them) that chance is
at most alpha for a run of any length. The price is power late in a run; a real bias's t
statistic grows like sqrt(samples), much faster than the threshold (which grows like
sqrt(log k)).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch
from scipy import stats
from trainprobes.numerics.bias import error_stats
from trainprobes.validation import check_int, check_number

MIN_SAMPLES = 3  # error_stats' own minimum
FOUND = ("bias", "ci_low", "ci_high", "confidence", "p_value", "trials")  # kept from the finding


def look_alpha(alpha: float, look: int, streams: int) -> float:
    """The level of one stream's test at look `look` (1-based) among `streams` streams."""
    return alpha * 6.0 / (math.pi ** 2 * look * look) / max(streams, 1)


@dataclass
class Stream:
    """One bucket's samples: the signed errors kept (the newest `keep`), counts of the rest."""

    key: str
    numel: int
    keep: int
    errors: deque = field(default=None)
    steps: deque = field(default=None)
    samples: int = 0
    nonfinite: int = 0
    zero_reference: int = 0
    skipped: int = 0  # samples some rank could not take: left out on every rank alike
    found_at: int | None = None  # first step of the look that called it biased
    found: dict | None = None  # that look's figures: what the finding says, however it ends

    def __post_init__(self):
        self.errors = deque(maxlen=self.keep)
        self.steps = deque(maxlen=self.keep)

    def add(self, step: int, error: float, *, zero_reference: bool = False,
            skipped: bool = False) -> None:
        self.samples += 1
        if skipped:
            self.skipped += 1
        elif zero_reference:
            self.zero_reference += 1
        elif not math.isfinite(error):
            self.nonfinite += 1
        else:
            self.errors.append(error)
            self.steps.append(step)


@dataclass(frozen=True)
class Judgement:
    """One stream at one look: its statistics (error_stats' dict) or why it cannot be judged."""

    key: str
    look: int
    step: int
    alpha: float
    stats: dict | None
    reason: str = ""
    # this look's own test on the latest `keep` samples: a bias that went away reads False
    # here while the finding (Stream.found) and stats["biased"] stand
    now: bool | None = None

    @property
    def biased(self) -> bool | None:
        return None if self.stats is None else bool(self.stats["biased"])


class Streams:
    """All streams of one sentinel; `look(step)` judges them (see the module docstring)."""

    def __init__(self, *, alpha: float, min_effect: float, keep: int):
        self.alpha = check_number(alpha, "alpha", min=0, max=1, min_open=True, max_open=True,
                                  hint="e.g. 0.01")
        self.min_effect = check_number(min_effect, "min_effect", min=0)
        self.keep = check_int(keep, "keep", min=MIN_SAMPLES, hint="samples kept per bucket")
        self.streams: dict[str, Stream] = {}
        self.looks = 0

    def stream(self, key: str, numel: int) -> Stream:
        s = self.streams.get(key)
        if s is None:
            s = self.streams[key] = Stream(key, numel, self.keep)
        return s

    def look(self, step: int, full: bool = False) -> list[Judgement]:
        """Judge every stream at the next look. full=False: a stream the t-test clearly
        clears gets only its mean and p-value (`quick` in its stats), the full error_stats
        (sign and Wilcoxon tests, CI) only where it may be biased; the verdict is the same,
        at about a 15th of the cost."""
        self.looks += 1
        k = self.looks
        ready = [s for s in self.streams.values() if len(s.errors) >= MIN_SAMPLES]
        a = look_alpha(self.alpha, k, len(ready))
        out = []
        for s in self.streams.values():
            if len(s.errors) < MIN_SAMPLES:
                out.append(Judgement(s.key, k, step, a, None,
                                     f"{len(s.errors)} finite samples, {MIN_SAMPLES} needed"))
                continue
            if not full and s.found_at is None:
                quick = _quick(s.errors)
                # error_stats' biased is p_t < alpha and |mean| >= min_effect on the same t-test;
                # the margin leaves rounding of p at the boundary to the full test
                if quick["p_value"] > a * (1 + 1e-6) or abs(quick["bias"]) < self.min_effect:
                    out.append(Judgement(s.key, k, step, a, {**quick, "biased": False}, now=False))
                    continue
            st = error_stats(list(s.errors), alpha=a, min_effect=self.min_effect)
            now = bool(st["biased"])
            if now and s.found_at is None:
                s.found_at = step
                s.found = {"step": step, "look": k, "alpha": a,
                           **{n: st[n] for n in FOUND if n in st}}
            elif s.found_at is not None:
                # called biased at an earlier look, at that look's level: the decision of a
                # sequential test stands (alpha was spent on it); a later look's stricter level
                # judging the same or more samples never turns it back into a pass
                st["biased"] = True
            out.append(Judgement(s.key, k, step, a, st, now=now))
        return out


def _quick(errors) -> dict:
    """The one-sample t-test of error_stats, alone: mean, p-value, trials."""
    e = torch.tensor(list(errors), dtype=torch.float64)
    n, mean, std = e.numel(), e.mean().item(), e.std().item()
    if std == 0.0:
        p = 1.0 if mean == 0.0 else 0.0
    else:
        p = float(2 * stats.t.sf(abs(mean) / (std / math.sqrt(n)), n - 1))
    return {"bias": mean, "p_value": p, "trials": n, "quick": True}
