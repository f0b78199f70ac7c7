"""The gate's statistics: an estimate and its standard error as the probe wrote them, and the
one-sided test that its magnitude grew."""
from __future__ import annotations

import math

from trainprobes.gate.judgeable import read_number
from trainprobes.result import PROBES, Result


def standard_error(r: Result, name: str, side: str = "") -> float | None:
    """The standard error of metric `name` of r, from the first of: `<name>_se`, `se_mean`,
    |value / <name>_z|, std / sqrt(trials), or the CI (ci_low, ci_high) at `confidence`
    (normal approximation). None when there is none, or it is NaN or infinite: an infinite
    SE makes z = 0 (or inf/inf = NaN), so any growth would pass untested."""
    from statistics import NormalDist

    spec = PROBES.get(r.probe)

    def num(n):
        # only what the probe writes: an added `bias_se` (read first) on numerics.bias, whose
        # SE is std / sqrt(trials), would hide any growth behind a made-up standard error
        if spec is not None and not spec.documents(n):
            return None
        return read_number(r, n, side)
    se = num(f"{name}_se")
    if se is None:
        se = num("se_mean")
    if se is None:  # trainprobes.distributed: bias with its z statistic
        value, z = num(name), num(f"{name}_z")
        if value is not None and z:
            se = abs(value / z)
    if se is None:
        std, n = num("std"), num("trials")
        if std is not None and n is not None and n >= 2:
            se = std / math.sqrt(n)
    if se is None:
        lo, hi = num("ci_low"), num("ci_high")
        conf = num("confidence") or 0.95
        if lo is not None and hi is not None and 0 < conf < 1:
            se = (hi - lo) / (2 * NormalDist().inv_cdf((1 + conf) / 2))
    return None if se is None or not math.isfinite(se) else abs(se)


def estimate(r: Result, name: str, side: str = "") -> tuple[float, float] | None:
    """(value, standard error) of metric `name` of r, or None when the value is missing or
    NaN, or the standard error missing, NaN or infinite."""
    value = read_number(r, name, side)
    if value is None or math.isnan(value):
        return None
    se = standard_error(r, name, side)
    return None if se is None else (value, se)


def larger_magnitude(base: tuple[float, float], cand: tuple[float, float],
                     alpha: float, rel_tol: float = 0.0) -> tuple[bool, float, float]:
    """One-sided z-test that |cand| > |base|: (regressed, z, p).

    z = (|b_c| - |b_b|) / sqrt(se_b^2 + se_c^2), the difference of two independent means.
    Testing magnitudes makes a bias that flips sign and grows count too. With both standard
    errors zero (deterministic probes) any increase is certain. A significant increase of
    less than rel_tol * |b_b| is not a regression: with thousands of trials a 1% change in a
    1e-8 bias is significant and irrelevant.
    """
    from statistics import NormalDist
    (bb, sb), (bc, sc) = base, cand
    diff = abs(bc) - abs(bb)
    se = math.hypot(sb, sc)
    if se == 0.0:
        z = math.inf if diff > 0 else (0.0 if diff == 0 else -math.inf)
    else:
        z = diff / se
    p = 1.0 - NormalDist().cdf(z) if math.isfinite(z) else (0.0 if z > 0 else 1.0)
    return p < alpha and diff > rel_tol * abs(bb), z, p
