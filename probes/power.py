"""What a pass rules out: the smallest effect a t-test would have detected.

A probe that finds no significant bias has not shown there is none; it has shown there is
none larger than the effect its trials could see. For a two-sided one-sample (or ratio)
t-test at level alpha with `df` degrees of freedom and standard error `se`, the minimum
detectable effect at power 1 - beta is the delta solving

    P(|T| > t_{1-alpha/2, df} ; T ~ noncentral t(df, delta / se)) = power,

found here exactly with scipy's noncentral t (for large df it tends to the textbook
(z_{1-alpha/2} + z_{power}) * se). "equivalent" then reads "no bias larger than delta".
Shared by trainprobes.numerics.bias, trainprobes.drift.compare and trainprobes.transforms.
"""
from __future__ import annotations

import functools
import math

from trainprobes.validation import check_number

__all__ = ["min_detectable_effect", "POWER"]

POWER = 0.8


def _power(delta_over_se: float, df: float, crit: float) -> float:
    from scipy import stats
    nc = stats.nct(df, delta_over_se)
    lower = float(nc.cdf(-crit))  # the wrong-sign tail; scipy returns NaN where it underflows
    return float(nc.sf(crit)) + (lower if math.isfinite(lower) else 0.0)


def min_detectable_effect(se: float, df: float, alpha: float, power: float = POWER) -> float:
    """Smallest |mean| that a two-sided t-test (level alpha, df degrees of freedom,
    standard error se) detects with probability `power`.

    0.0 when se == 0 (every trial made the same error: any non-zero mean is detected);
    NaN when se is NaN or df < 1 (nothing can be tested).
    """
    alpha = check_number(alpha, "alpha", min=0.0, max=1.0, min_open=True, max_open=True,
                         hint="e.g. 0.01")
    power = check_number(power, "power", min=alpha, max=1.0, min_open=True, max_open=True,
                         hint="e.g. 0.8")
    se = check_number(se, "se", min=0.0, finite=False) if not _nan(se) else math.nan
    if math.isnan(se) or _nan(df) or df < 1:
        return math.nan
    if se == 0.0:
        return 0.0
    if math.isinf(se):
        return math.inf
    return _multiplier(float(df), alpha, power) * se


@functools.lru_cache(maxsize=256)
def _multiplier(df: float, alpha: float, power: float) -> float:
    """delta / se at which the test reaches `power` (depends on df, alpha, power only)."""
    from scipy import optimize, stats
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    # the power grows monotonically in delta/se; bracket the root from the normal guess
    guess = float(stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power))
    hi = max(2 * guess, crit + 10.0)
    while _power(hi, df, crit) < power:
        hi *= 2
    return optimize.brentq(lambda d: _power(d, df, crit) - power, 0.0, hi, xtol=1e-10)


def _nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)
