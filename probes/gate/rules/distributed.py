"""The rule of trainprobes.distributed: a collective's ulp errors, bias and z read against each other."""
from __future__ import annotations

import math

from trainprobes.gate.rules.base import REL, Reader, close, fmt, p_agree

_ERROR_KEYS = ("max_ulp_error", "mean_ulp_error", "bias", "bias_z", "bias_p", "bias_relative",
               "nonfinite")
_AGREEMENT_KEYS = ("bitwise_match_fraction", "mismatched", "compared")


def _collective(rd: Reader) -> None:
    """trainprobes.distributed: error_vs_reference (ulps against fp64), bitwise_agreement
    (against the emulator), and the verdict predict.result_from_outputs gives them."""
    from trainprobes.distributed.predict import biased

    m, ev = rd.m, rd.ev
    backend = rd.label("backend")
    err = rd.evidence("error", dict)
    n = rd.as_count(rd.field(err, "n", "evidence['error']"), "evidence['error']['n']")
    got = {k: rd.num(k) for k in _ERROR_KEYS if k != "nonfinite"}
    rd.count("nonfinite")
    for k in _ERROR_KEYS:  # the metrics are copied from the error record
        rd.agree(k, rd.num(k), rd.field(err, k, "evidence['error']"), "evidence['error'][k]")
    case = rd.evidence("case", dict)
    for k in ("numel", "dtype", "op", "collective"):
        if m.get(k) != case.get(k):
            rd.fail(f"metric {k}={m.get(k)!r} is not the case's {case.get(k)!r}")
    bias, z, p = got["bias"], got["bias_z"], got["bias_p"]
    mx, mean_abs = got["max_ulp_error"], got["mean_ulp_error"]
    # 1. the error statistics against each other: |bias| <= mean |e| <= max |e|, z and p
    if n == 0:
        if not all(math.isnan(v) for k, v in got.items() if k != "bias_relative"):
            rd.fail("no finite element was compared (evidence n = 0), yet the error figures "
                    "are not NaN")
    else:
        tol = REL * mx
        if not (0 <= mean_abs <= mx + tol and abs(bias) <= mean_abs + tol):
            rd.fail(f"bias={fmt(bias)}, mean_ulp_error={fmt(mean_abs)}, max_ulp_error={fmt(mx)}: "
                    "a mean error is at most the mean of its magnitudes, which is at most their "
                    "largest")
        _collective_z(rd, n, bias, z, mean_abs, mx)
        want = 1.0 if z == 0 else (0.0 if math.isinf(z) else math.erfc(abs(z) / math.sqrt(2)))
        p_agree(rd, "bias_p", p, want, "erfc(|bias_z| / sqrt 2)")
    # 2. the bitwise agreement with the emulator (no real backend: none)
    frac = None
    if backend == "emulated":
        there = [k for k in _AGREEMENT_KEYS if k in m]
        if there:
            rd.fail(f"metric(s) {there} beside backend 'emulated': nothing real ran to agree with")
    else:
        frac, mism, comp = rd.num("bitwise_match_fraction"), rd.count("mismatched"), rd.count("compared")
        if not (comp >= 1 and mism <= comp):
            rd.fail(f"mismatched={mism} of compared={comp} elements")
        rd.agree("bitwise_match_fraction", frac, (comp - mism) / comp,
                 "(compared - mismatched) / compared")
        agree = rd.evidence("agreement", dict)
        for k in _AGREEMENT_KEYS:
            rd.agree(k, rd.num(k), rd.field(agree, k, "evidence['agreement']"),
                     "evidence['agreement'][k]")
        ranks = agree.get("ranks_compared")
        world = rd.count("world")
        if not isinstance(ranks, list) or not 1 <= len(ranks) <= world:
            rd.fail(f"metric world={world} beside ranks compared {ranks!r}")
        rd.codes_agree("TP-B4", frac < 1.0, f"bitwise_match_fraction={fmt(frac)} "
                       "(the emulator must predict every bit: a fraction below 1 fails with TP-B4)")
    flagged, _ = biased({"bias_p": p, "bias_relative": got["bias_relative"]})
    rd.codes_agree("TP-B1", flagged, f"bias_p={fmt(p)} and bias_relative="
                   f"{fmt(got['bias_relative'])} {'are' if flagged else 'are not'} a bias the "
                   "probe flags")
    # 3. the verdict: fail with TP-B4, warn with TP-B1 (or an fp8 case gloo cannot run,
    # emulated and said so), else pass
    if "TP-B4" in rd.r.codes:
        rd.verdict_is(("fail",), "TP-B4")
    elif flagged or (backend == "emulated" and ev.get("note")):
        rd.verdict_is(("warn",), "TP-B1" if flagged else "an emulated fallback")
    else:
        rd.verdict_is(("pass",), f"bitwise_match_fraction={fmt(frac)}, no TP-B1")


def _collective_z(rd: Reader, n: int, bias: float, z: float, mean_abs: float, mx: float):
    """bias_z = bias / (sd / sqrt(n)) with sd the spread of n errors whose mean magnitude is
    mean_abs and largest magnitude mx: mean(e^2) lies in [mean_abs^2, mx * mean_abs], so
    se^2 = (mean(e^2) - bias^2) / (n - 1) lies between the two bounds below."""
    if bias == 0 or math.isinf(z):
        # sd == 0 or mean == 0: z is 0 (mean 0) or +-inf (every error equal)
        ok = (z == 0) if bias == 0 else (math.copysign(1, z) == math.copysign(1, bias)
                                         and close(abs(bias), mean_abs) and close(abs(bias), mx))
        if not ok:
            rd.fail(f"bias_z={fmt(z)} beside bias={fmt(bias)}, mean_ulp_error="
                    f"{fmt(mean_abs)}, max_ulp_error={fmt(mx)}: z is 0 for a zero bias and "
                    "infinite only when every error is the same")
        return
    if n < 2 or z == 0 or math.isnan(z) or math.copysign(1, z) != math.copysign(1, bias):
        rd.fail(f"bias_z={fmt(z)} beside bias={fmt(bias)} over {n} element(s): z has the "
                "bias's sign")
    se = abs(bias / z)
    lo = math.sqrt(max(mean_abs * mean_abs - bias * bias, 0.0) / (n - 1))
    hi = math.sqrt(max(mx * mean_abs - bias * bias, 0.0) / (n - 1))
    slack = 1e-6 * hi + 1e-12 * mx
    if not lo - slack <= se <= hi + slack:
        rd.fail(f"bias / bias_z = {fmt(se)} is not a standard error {n} errors with mean "
                f"{fmt(bias)}, mean magnitude {fmt(mean_abs)} and largest {fmt(mx)} can have "
                f"(between {fmt(lo)} and {fmt(hi)})")


RULES = {"distributed.collective": _collective}
