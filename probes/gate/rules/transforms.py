"""The rule of trainprobes.transforms: a transform's scale, tests and errors read against its verdict."""
from __future__ import annotations

import math

from trainprobes.gate.rules.base import REL, Counts, Reader, close, fmt, p_agree, t_p


def _transform(rd: Reader) -> None:
    """trainprobes.transforms.judge: scales are 1 + their errors, CIs are centred on their
    estimates, the kind carries its code. (scale = 1 + scale_error: DERIVED below.)"""
    kind = rd.label("transform_verdict", optional=True)
    codes = {"biased": "TP-T1", "inconsistent": "TP-T2", "wrong": "TP-T3"}
    if kind is not None:
        for k, code in codes.items():
            rd.codes_agree(code, kind == k, f"transform_verdict={kind!r}")
    inc = rd.count("n_inconsistent", optional=True)
    if inc is not None and kind is not None and (kind == "inconsistent") > (inc > 0):
        rd.fail("transform_verdict='inconsistent' beside n_inconsistent=0")
    if inc and kind not in (None, "inconsistent", "wrong"):
        rd.fail(f"transform_verdict={kind!r} beside n_inconsistent={inc}: replicas that "
                "disagree make a transform inconsistent (or wrong)")
    paired = rd.flag("paired", optional=True)
    if paired is not None and paired != ("single_device_max_relative_error" in rd.m):
        rd.fail(f"paired={paired} {'without' if paired else 'beside'} "
                "single_device_max_relative_error: the probe pairs with a single-device base "
                "exactly when it reports that base's error")
    loss = rd.flag("loss_reported", optional=True)
    if loss is not None and loss != rd.has("loss_relative_error"):
        rd.fail(f"loss_reported={loss} {'without' if loss else 'beside'} loss_relative_error")
    trials = rd.count("trials", optional=True)
    per_trial = rd.ev.get("per_trial")
    if isinstance(per_trial, dict) and isinstance(per_trial.get("scale"), list) and \
            "per_trial.scale" not in (rd.ev.get("truncated") or {}) and trials is not None \
            and len(per_trial["scale"]) != trials:
        rd.fail(f"metric trials={trials} but evidence per_trial holds "
                f"{len(per_trial['scale'])} trials")
    for shown, est in (("loss_scale", "loss_relative_error"), ("scale", "scale_error")):
        a, b = rd.opt(shown), rd.opt(est)
        if None not in (a, b):
            rd.agree(shown, a, 1 + b, f"1 + {est}")
    for name in ("scale", "loss_scale", "signed_relative_error"):
        v, lo, hi = rd.opt(name), rd.opt(f"{name}_ci_low"), rd.opt(f"{name}_ci_high")
        if None not in (v, lo, hi) and not math.isnan(v):
            rd.agree(name, v, (lo + hi) / 2, f"the centre of [{name}_ci_low, {name}_ci_high]",
                     tiny=REL * (abs(hi) + abs(lo)))
    _transform_errors(rd)
    _transform_tests(rd)
    mx, mean = rd.opt("max_relative_error"), rd.opt("mean_relative_error")
    if None not in (mx, mean) and not 0 <= mean <= mx * (1 + REL):
        rd.fail(f"mean_relative_error={fmt(mean)} beside max_relative_error={fmt(mx)}")
    nb, npar = rd.count("n_biased_parameters", optional=True), rd.count("n_parameters", optional=True)
    if None not in (nb, npar) and nb > npar:
        rd.fail(f"n_biased_parameters={nb} exceeds n_parameters={npar}")
    known, matches = rd.m.get("known_verdict"), rd.flag("matches_known_verdict", optional=True)
    if known is not None and matches is not None and kind is not None and matches != (known == kind):
        rd.fail(f"matches_known_verdict={matches} beside known_verdict={known!r}, "
                f"transform_verdict={kind!r}")
    _transform_kind(rd, kind)


def _transform_kind(rd: Reader, kind: str | None) -> None:
    """judge._verdict: 'noise' is what is left when nothing else holds (no test significant;
    the whole gradient's and the loss's added errors, and each parameter's median, within
    noise_tol); 'biased' needs a significant test. A verdict edited to noise beside the
    figures that made it wrong or biased contradicts them."""
    tests = rd.ev.get("tests")
    significant = None if not isinstance(tests, dict) else [
        k for k, t in tests.items() if isinstance(t, dict) and t.get("significant") is True]
    if kind == "biased" and significant == []:
        rd.fail("transform_verdict='biased' beside no significant test in evidence['tests']")
    if kind != "noise":
        return
    if significant:
        rd.fail(f"transform_verdict='noise' beside significant tests {significant[:4]}: the "
                f"probe calls that biased")
    tol = rd.opt("noise_tol")
    if tol is None:
        return
    for name in ("max_added_error", "max_added_loss_error"):
        v = rd.opt(name)
        if v is not None and not v <= tol:
            rd.fail(f"transform_verdict='noise' beside {name}={fmt(v)} > noise_tol={fmt(tol)}: "
                    f"the probe calls that wrong")
    table = rd.ev.get("parameters")
    for row in table if isinstance(table, list) else ():
        for key in ("median_added_error", "peak_added_error"):
            v = row.get(key) if isinstance(row, dict) else None
            if v is not None and not rd.as_number(v, "parameters[...]") <= tol:
                rd.fail(f"transform_verdict='noise' beside parameter {row.get('parameter')!r} with "
                        f"{key}={fmt(v)} > noise_tol={fmt(tol)}: the probe calls that wrong")


def _transform_tests(rd: Reader) -> None:
    """judge: evidence['tests'] is the family of t-tests the metrics' added errors, their
    p-values and n_biased_parameters are copied from; a test is significant exactly when its
    p is below alpha_per_test and |mean| reaches min_effect."""
    tests, table = rd.ev.get("tests"), rd.ev.get("parameters")
    if not isinstance(tests, dict):
        return
    per_test, floor = rd.opt("alpha_per_test"), rd.opt("min_effect")
    for key, added in (("scale", "added_scale_error"),
                       ("signed_relative_error", "added_signed_relative_error"),
                       ("loss", "added_loss_error")):
        t = tests.get(key)
        if isinstance(t, dict) and rd.opt(added) is not None:
            rd.agree(added, rd.num(added), rd.field(t, "mean", f"evidence['tests'][{key!r}]"),
                     f"evidence['tests'][{key!r}]['mean']")
            if rd.opt(f"{added}_p") is not None:
                rd.agree(f"{added}_p", rd.num(f"{added}_p"),
                         rd.field(t, "p", f"evidence['tests'][{key!r}]"),
                         f"evidence['tests'][{key!r}]['p']")
    for key, t in tests.items():
        if not isinstance(t, dict) or None in (per_test, floor) or t.get("p") is None:
            continue
        p, mean = rd.field(t, "p", "tests"), rd.field(t, "mean", "tests")
        want = p < per_test and abs(mean) >= floor
        if t.get("significant") is not want:
            rd.fail(f"evidence['tests'][{key!r}] significant={t.get('significant')!r} beside "
                    f"p={fmt(p)}, |mean|={fmt(abs(mean))}, alpha_per_test={fmt(per_test)}, "
                    f"min_effect={fmt(floor)}")
    if isinstance(table, list):
        names = [row.get("parameter") for row in table if isinstance(row, dict)]
        npar = rd.count("n_parameters", optional=True)
        if npar is not None and "parameters" not in (rd.ev.get("truncated") or {}) \
                and npar != len(names):
            rd.fail(f"n_parameters={npar} but evidence['parameters'] lists {len(names)}")
        weakest, whole = rd.opt("min_detectable_parameter_scale_error"), rd.opt("min_detectable_scale_error")
        each = [rd.as_number(row.get("min_detectable_scale_error"), "parameters[...]")
                for row in table if isinstance(row, dict)
                and row.get("min_detectable_scale_error") is not None]
        each = [v for v in each if not math.isnan(v)]
        if weakest is not None and (each or whole is not None) and \
                "parameters" not in (rd.ev.get("truncated") or {}):
            rd.agree("min_detectable_parameter_scale_error", weakest,
                     max(each) if each else whole, "the least resolved parameter's")
        nb = rd.count("n_biased_parameters", optional=True)
        want = sum(1 for n in names if isinstance(tests.get(n), dict)
                   and tests[n].get("significant") is True)
        if nb is not None and "parameters" not in (rd.ev.get("truncated") or {}) and nb != want:
            rd.fail(f"n_biased_parameters={nb} but evidence['tests'] holds {want} significant "
                    "parameter test(s)")


def _transform_errors(rd: Reader) -> None:
    """judge.mean_ci: each CI is its estimate -/+ t(1 - alpha/2, k - 1) x its standard error,
    k the trials with a finite value (at most trials); without a single-device base (paired
    False) the t-tests run on the same columns, so the added errors are the errors and the
    smallest detectable scale error is the 80%-power effect of scale_error_se."""
    from scipy import stats
    from trainprobes.power import min_detectable_effect

    alpha, trials = rd.opt("alpha"), rd.count("trials", optional=True)
    tests, per_test = rd.count("tests", optional=True), rd.opt("alpha_per_test")
    if None not in (alpha, tests, per_test) and tests:
        rd.agree("alpha_per_test", per_test, alpha / tests, "alpha / tests")
    finite = {}  # estimate -> the trials its CI says were finite
    for est, se_name, ci in (("scale_error", "scale_error_se", "scale"),
                             ("signed_relative_error", "signed_relative_error_se",
                              "signed_relative_error"),
                             ("loss_relative_error", "loss_relative_error_se", "loss_scale")):
        se, lo, hi = rd.opt(se_name), rd.opt(f"{ci}_ci_low"), rd.opt(f"{ci}_ci_high")
        if se is not None and se < 0:
            rd.fail(f"metric {se_name}={fmt(se)} is negative")
        if None in (se, lo, hi, alpha, trials) or not 0 < alpha < 1 or math.isnan(se + lo + hi):
            continue
        if se == 0:
            if lo != hi:
                rd.fail(f"{ci} CI [{fmt(lo)}, {fmt(hi)}] has a width, {se_name}=0 has none")
            continue
        # scale's CI is 1 + the error's: its width is known to a few ulps of 1
        half, ulps = (hi - lo) / 2, 4 * 2.0 ** -52 * max(abs(lo), abs(hi))
        k = next((k for k in range(trials, 2, -1)
                  if close(half, float(stats.t.ppf(1 - alpha / 2, k - 1)) * se, 1e-7, ulps)), None)
        if k is None:
            rd.fail(f"the {ci} CI [{fmt(lo)}, {fmt(hi)}] is not {ci} -/+ t(1 - alpha/2, k - 1) "
                    f"x {se_name}={fmt(se)} for any k <= trials={trials}")
        finite[est] = (se, k)
    if rd.flag("paired", optional=True) is not False or per_test is None or not 0 < per_test < 1:
        return
    for est, added, mde_name in (("scale_error", "added_scale_error", "min_detectable_scale_error"),
                                 ("signed_relative_error", "added_signed_relative_error",
                                  "min_detectable_relative_bias"),
                                 ("loss_relative_error", "added_loss_error",
                                  "min_detectable_loss_error")):
        e, a = rd.opt(est), rd.opt(added)
        if est not in finite or None in (e, a) or math.isnan(e):
            continue
        se, k = finite[est]
        rd.agree(added, a, e, f"{est} (no single-device base: the same trials)", tiny=1e-15)
        p = rd.opt(f"{added}_p")
        if p is not None:
            p_agree(rd, f"{added}_p", p, t_p(e, se, k - 1), f"the t-test of {est}")
        mde = rd.opt(mde_name)
        if mde is not None:
            rd.agree(mde_name, mde, min_detectable_effect(se, k - 1, per_test),
                     "the 80%-power effect of its standard error at alpha_per_test", rel=1e-6)


# transforms.judge: equivalent = kind in EQUIVALENT; replicas that disagree (n_inconsistent)
# make it inconsistent or wrong; scale = 1 + scale_error (DERIVED: (probe, shown, estimate,
# offset), the gate reads the estimate and an edit of either alone cannot be judged)
FLAG_LABELS = {"transforms.equivalence": ("transform_verdict", ("exact", "noise"),
                                          ("biased", "inconsistent", "wrong"))}
COUNTS = {"transforms.equivalence": Counts(("n_inconsistent",))}
DERIVED = (("transforms.equivalence", "scale", "scale_error", 1.0),)
RULES = {"transforms.equivalence": _transform}
