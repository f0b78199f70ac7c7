"""The gate's judgeability rule for each probe: a Result read against itself.

A report is judged on figures a probe derives from one another (a bias and its confidence
interval, a z statistic and its p-value, a bitwise match fraction and its verdict). An edit of
one of them alone, e.g. a bias multiplied by 1000 whose standard error was taken as
bias / bias_z and so grew with it, made a contradiction no probe writes; the gate must not
pass it. Each probe in trainprobes.result.PROBES has one rule here (RULES; a test fails for a
probe without one). A rule:

  1. reads the fields its probe always writes beside its estimate (metrics, and the evidence
     the probe keeps for that purpose: per-trial errors, stages, the error record); one that
     is missing, None or mistyped cannot be judged;
  2. re-derives what the probe derives from them, with the probe's own formula, and says
     "cannot judge" when a figure differs beyond rounding (REL);
  3. checks the verdict and codes against what the probe decides from those figures.

The standard errors the gate's growth tests use are read from fields that do not move with
the estimate: numerics.bias std / sqrt(trials) (and std must agree with the CI, rms, p-value
and per-trial errors); distributed.collective |bias / bias_z|, which must lie between the
bounds n, mean_ulp_error and max_ulp_error put on it.

Several probes' Results are also built by hand in user tests and carry no evidence; for
those (causality, isolation, transforms) the cross-checks that need a metric or evidence key
the hand-made Result lacks are skipped, and the rule still checks every relation among the
fields present. numerics.bias and distributed.collective always need theirs.
"""
from __future__ import annotations

import math
from typing import Callable

from trainprobes.errors import CannotJudge
from trainprobes.result import Result

# Relative agreement of a figure re-derived from its sources: the probes compute in float64
# (torch or numpy), the rule in Python floats, so values agree to ~1e-15; 1e-9 leaves room
# for a different summation order and nothing for an edit.
REL = 1e-9
# p-values from Student's t through scipy on either side: agree to ~1e-12 except deep in the
# tail, where |t| > 30 puts both below 1e-100
P_REL = 1e-6
P_TINY = 1e-100


def _fmt(v) -> str:
    from trainprobes.display import format_number
    return format_number(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


def close(a: float, b: float, rel: float = REL, tiny: float = 0.0) -> bool:
    """a and b equal up to rel (relative) or tiny (absolute); NaN only equals NaN, an
    infinity only itself."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rel * max(abs(a), abs(b)) + tiny


class Reader:
    """The fields of one Result, read failing closed: every fault names the side, the key,
    the field and what the probe writes there."""

    def __init__(self, r: Result, side: str):
        self.r, self.m, self.ev = r, r.metrics, r.evidence
        self.where = f"{side} {r.key!r}"

    def fail(self, what: str):
        raise CannotJudge(f"{self.where}: {what} (was the report edited?)")

    def _missing(self, what: str, why: str):
        raise CannotJudge(f"{self.where}: {what} missing: probe {self.r.probe!r} always writes "
                          f"it, and the gate reads it {why}")

    def has(self, name: str) -> bool:
        return self.m.get(name) is not None

    def num(self, name: str, why: str = "") -> float:
        if self.m.get(name) is None:
            self._missing(f"metric {name!r}", why or "to check the figures it is derived with")
        return self.as_number(self.m[name], f"metric {name}")

    def opt(self, name: str) -> float | None:
        """A number the probe writes in some modes only: None when absent."""
        return None if self.m.get(name) is None else self.as_number(self.m[name], f"metric {name}")

    def as_number(self, v, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CannotJudge(f"{self.where}: {what}={v!r} is mistyped: a {type(v).__name__}, "
                              "expected a number")
        try:
            return float(v)
        except OverflowError:
            self.fail(f"{what} is too large for a float")

    def count(self, name: str, optional: bool = False) -> int | None:
        if optional and self.m.get(name) is None:
            return None
        return self.as_count(self.num(name), f"metric {name}")

    def as_count(self, x: float, what: str) -> int:
        if not (math.isfinite(x) and x >= 0 and x == int(x)):
            self.fail(f"{what}={_fmt(x)} is not a count (a whole number, 0 or more)")
        return int(x)

    def flag(self, name: str, optional: bool = False) -> bool | None:
        v = self.m.get(name)
        if v is None:
            if optional:
                return None
            self._missing(f"metric {name!r}", "to check the verdict it goes with")
        if not isinstance(v, bool):
            raise CannotJudge(f"{self.where}: metric {name}={v!r} is mistyped: a "
                              f"{type(v).__name__}, expected true or false")
        return v

    def label(self, name: str, optional: bool = False) -> str | None:
        v = self.m.get(name)
        if v is None and optional:
            return None
        if not isinstance(v, str):
            if v is None:
                self._missing(f"metric {name!r}", "to check the figures it names")
            raise CannotJudge(f"{self.where}: metric {name}={v!r} is mistyped: a "
                              f"{type(v).__name__}, expected a string")
        return v

    def evidence(self, key: str, kind: type, optional: bool = False):
        v = self.ev.get(key)
        if v is None:
            if optional:
                return None
            self._missing(f"evidence[{key!r}]", "to check the figures the metrics are derived from")
        if not isinstance(v, kind) or isinstance(v, bool):
            raise CannotJudge(f"{self.where}: evidence[{key!r}] is mistyped: a "
                              f"{type(v).__name__}, expected a {kind.__name__}")
        return v

    def field(self, d: dict, key: str, where: str) -> float:
        if not isinstance(d, dict) or d.get(key) is None:
            self._missing(f"{where}[{key!r}]", "to check the metrics against it")
        return self.as_number(d[key], f"{where}[{key!r}]")

    def agree(self, name: str, got: float, want: float, how: str, rel: float = REL,
              tiny: float = 0.0):
        """Metric `name` (value got) must be `want`, which the probe derives as `how`."""
        if not close(got, want, rel, tiny):
            self.fail(f"metric {name}={_fmt(got)} is not {how} = {_fmt(want)}, as the probe "
                      "writes it")

    def codes_agree(self, code: str, present: bool, why: str):
        # a broken fail_above/fail_below limit adds its family's code (audit.thresholds)
        if not present and code in self.r.codes and _threshold_broken(self.r):
            return
        if present != (code in self.r.codes):
            self.fail(f"codes {self.r.codes} {'lack' if present else 'carry'} {code}, but {why}")

    def verdict_is(self, allowed: tuple, why: str):
        if self.r.verdict not in allowed and not _threshold_broken(self.r):
            self.fail(f"verdict {self.r.verdict!r} contradicts {why}: the probe writes "
                      f"{' or '.join(map(repr, allowed))}")


def _threshold_broken(r: Result) -> bool:
    """A configured fail_above/fail_below limit broke (trainprobes.audit.config): it fails a
    Result whatever the probe's own verdict was."""
    t = r.evidence.get("thresholds")
    return isinstance(t, dict) and bool(t.get("broken"))


def _t_p(mean: float, se: float, df: float) -> float:
    """Two-sided p of Student's t = mean / se with df degrees of freedom; se == 0: 1 for a
    zero mean, else 0 (numerics.bias.error_stats)."""
    from scipy import stats
    if se == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    return float(2 * stats.t.sf(abs(mean / se), df))


def _p_agree(rd: Reader, name: str, got: float, want: float, how: str):
    if not (got < P_TINY and want < P_TINY):
        rd.agree(name, got, want, how, rel=P_REL, tiny=1e-300)


# --- numerics.bias ------------------------------------------------------------------------

def _bias(rd: Reader) -> None:
    """trainprobes.numerics.bias: error_stats over per-trial signed errors, the two-stage
    design (and Holm) on its p-value."""
    from scipy import stats
    from trainprobes.power import min_detectable_effect

    if rd.m.get("biased") is None:  # nothing measured: too few finite trials (verdict fail)
        trials, nonfinite = rd.count("trials"), rd.count("nonfinite_trials")
        if not (nonfinite <= trials and trials - nonfinite < 3):
            rd.fail(f"biased=None (nothing measured) but only {nonfinite} of {trials} trials are "
                    "non-finite: the probe measures whenever 3 are finite")
        return
    n, bias, std = rd.count("trials"), rd.num("bias"), rd.num("std")
    alpha, conf = rd.num("alpha"), rd.num("confidence")
    lo, hi, p = rd.num("ci_low"), rd.num("ci_high"), rd.num("p_value")
    if n < 3 or not math.isfinite(bias) or not (math.isfinite(std) and std >= 0):
        rd.fail(f"trials={n}, bias={_fmt(bias)}, std={_fmt(std)}: the probe measures at least 3 "
                "finite trials, whose mean and spread are finite")
    if not 0 < alpha < 1:
        rd.fail(f"metric alpha={_fmt(alpha)} is not a significance level in (0, 1)")
    rd.agree("confidence", conf, 1 - alpha, "1 - alpha")
    # 1. the standard error, from std and trials alone; the CI is bias -/+ t * se
    se = std / math.sqrt(n)
    half = 0.0 if std == 0 else float(stats.t.ppf(1 - alpha / 2, n - 1)) * se
    tiny = REL * (abs(bias) + half)
    rd.agree("ci_low", lo, bias - half, "bias - t(1 - alpha/2, trials - 1) std / sqrt(trials)",
             tiny=tiny)
    rd.agree("ci_high", hi, bias + half, "bias + t(1 - alpha/2, trials - 1) std / sqrt(trials)",
             tiny=tiny)
    rd.agree("rms", rd.num("rms"), math.sqrt(bias * bias + std * std * (n - 1) / n),
             "sqrt(bias^2 + std^2 (trials - 1) / trials)")
    rd.agree("min_detectable_bias", rd.num("min_detectable_bias"),
             min_detectable_effect(se, n - 1, alpha), "the 80%-power effect of std / sqrt(trials)")
    # 2. the signs of the trials
    pos, neg, zero = (rd.count(k) for k in ("positive_trials", "negative_trials", "zero_trials"))
    if pos + neg + zero != n:
        rd.fail(f"positive_trials + negative_trials + zero_trials = {pos} + {neg} + {zero} is "
                f"not trials={n}")
    if (bias > 0 and not pos) or (bias < 0 and not neg) or (bias == 0 and std == 0 and zero != n) \
            or (std == 0 and bias != 0 and max(pos, neg) != n) or (not pos + neg and bias != 0):
        rd.fail(f"bias={_fmt(bias)} (std={_fmt(std)}) cannot be the mean of {pos} positive, "
                f"{neg} negative and {zero} zero trials")
    want = float(stats.binomtest(pos, pos + neg, 0.5).pvalue) if pos + neg else 1.0
    _p_agree(rd, "p_sign", rd.num("p_sign"), want, "the sign test of positive_trials")
    # 3. the stages and the design's p-value
    stages = rd.evidence("stages", list)
    if len(stages) not in (1, 2):
        rd.fail(f"evidence['stages'] holds {len(stages)} stages; the design runs 1 or 2")
    ps = []
    for i, s in enumerate(stages):
        where = f"evidence['stages'][{i}]"
        sn = rd.as_count(rd.field(s, "finite_trials", where), f"{where}['finite_trials']")
        sb, ss, sp = (rd.field(s, k, where) for k in ("bias", "std", "p_value"))
        if sn >= 2 and not close(sp, _t_p(sb, ss / math.sqrt(sn), sn - 1), P_REL, 1e-300) \
                and not (sp < P_TINY and _t_p(sb, ss / math.sqrt(sn), sn - 1) < P_TINY):
            rd.fail(f"{where}['p_value']={_fmt(sp)} is not the t-test of its bias and std")
        ps.append(sp)
    last = stages[-1]
    total = rd.as_count(rd.field(last, "trials", "evidence['stages'][-1]"), "stages[-1].trials")
    for k, v in (("finite_trials", n), ("bias", bias), ("std", std)):
        if not close(rd.field(last, k, "evidence['stages'][-1]"), v):
            rd.fail(f"metric {'trials' if k == 'finite_trials' else k}={_fmt(v)} is not the last "
                    f"stage's {k}={_fmt(last[k])}")
    nonfinite, zero_ref = rd.count("nonfinite_trials"), rd.count("zero_reference_trials")
    if total - n != nonfinite + zero_ref:
        rd.fail(f"nonfinite_trials + zero_reference_trials = {nonfinite} + {zero_ref} is not the "
                f"{total - n} of {total} trials run that were left out")
    if len(stages) == 2 and rd.field(stages[1], "trials", "stages[1]") != 2 * rd.field(
            stages[0], "trials", "stages[0]"):
        rd.fail("the second stage does not run as many trials again as the first")
    design = rd.evidence("design", str)
    mt = rd.ev.get("multiple_testing")
    tests = 1
    if mt is not None:
        tests = rd.as_count(rd.field(mt, "tests", "evidence['multiple_testing']"), "tests")
        if mt.get("method") != "holm" or tests < 1:
            rd.fail(f"evidence['multiple_testing']={mt!r} is not a Holm correction over >= 1 tests")
    p1 = ps[0]
    if design.startswith("one stage"):
        if len(stages) != 1:
            rd.fail("a one-stage design with two stages")
        p_design = p1
    elif design.startswith("two stages"):
        band = alpha / (10 * tests) <= p1 < alpha
        if band != (len(stages) == 2):
            rd.fail(f"stage 1 p={_fmt(p1)} {'lies' if band else 'does not lie'} in "
                    f"[alpha/{10 * tests:g}, alpha), yet {len(stages)} stage(s) ran")
        p_design = min(10 * p1, max(p1, ps[1])) if len(stages) == 2 else \
            (min(1.0, 10 * p1) if p1 < alpha else p1)
    else:
        rd.fail(f"evidence['design']={design!r} is neither design the probe runs")
    if rd.ev.get("p_design") is not None:
        _p_agree(rd, "p_value (evidence p_design)", rd.as_number(rd.ev["p_design"], "p_design"),
                 p_design, "the design's p from its stages")
    if mt is None:
        _p_agree(rd, "p_value", p, p_design, "the design's p-value from its stages")
    else:
        pu = rd.as_number(rd.ev.get("p_unadjusted"), "evidence['p_unadjusted']")
        _p_agree(rd, "evidence p_unadjusted", pu, p_design, "the design's p from its stages")
        if not (p_design * (1 - P_REL) <= p <= min(1.0, tests * p_design) * (1 + P_REL)):
            rd.fail(f"metric p_value={_fmt(p)} is not a Holm adjustment over {tests} tests of "
                    f"{_fmt(p_design)} (between it and {tests} times it)")
    # 4. the per-trial errors, where the report keeps them whole (an audit's report.json
    # keeps the first 32 and says how many there were)
    errors = rd.evidence("errors", list)
    cut = (rd.ev.get("truncated") or {}).get("errors")
    if cut is not None:
        if cut != total or len(errors) > total:
            rd.fail(f"evidence['errors'] was cut from {cut!r} trials; the probe ran {total}")
    else:
        _errors_agree(rd, errors, total, n, bias, std, (pos, neg, zero), nonfinite + zero_ref)
    # 5. the verdict: fail with TP-B1 exactly when biased (the flag rule); warn when
    # trials were left out
    if not rd.m["biased"]:
        rd.verdict_is(("warn",) if nonfinite + zero_ref else ("pass",),
                      f"biased=False with {nonfinite + zero_ref} trials left out")


def _errors_agree(rd, errors, total, n, bias, std, signs, left_out):
    from scipy import stats
    vals = [rd.as_number(e, "evidence['errors'][...]") for e in errors]
    finite = [e for e in vals if math.isfinite(e)]
    if len(vals) != total or len(finite) != n or len(vals) - n != left_out:
        rd.fail(f"evidence['errors'] holds {len(vals)} trials, {len(finite)} finite; the metrics "
                f"say {total} run, {n} finite")
    mean = math.fsum(finite) / n
    sd = math.sqrt(math.fsum((e - mean) ** 2 for e in finite) / (n - 1))
    scale = max(abs(e) for e in finite)
    rd.agree("bias", bias, mean, "the mean of the per-trial errors", tiny=REL * scale)
    rd.agree("std", std, sd, "the spread of the per-trial errors", tiny=REL * scale)
    got = (sum(e > 0 for e in finite), sum(e < 0 for e in finite), sum(e == 0 for e in finite))
    if got != signs:
        rd.fail(f"positive/negative/zero trials {signs} are not the per-trial errors' {got}")
    nz = [e for e in finite if e != 0]
    want = float(stats.wilcoxon(nz).pvalue) if nz else 1.0
    _p_agree(rd, "p_wilcoxon", rd.num("p_wilcoxon"), want, "the signed-rank test of the errors")


# --- distributed.collective ---------------------------------------------------------------

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
            rd.fail(f"bias={_fmt(bias)}, mean_ulp_error={_fmt(mean_abs)}, max_ulp_error={_fmt(mx)}: "
                    "a mean error is at most the mean of its magnitudes, which is at most their "
                    "largest")
        _collective_z(rd, n, bias, z, mean_abs, mx)
        want = 1.0 if z == 0 else (0.0 if math.isinf(z) else math.erfc(abs(z) / math.sqrt(2)))
        _p_agree(rd, "bias_p", p, want, "erfc(|bias_z| / sqrt 2)")
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
        rd.codes_agree("TP-B4", frac < 1.0, f"bitwise_match_fraction={_fmt(frac)} "
                       "(the emulator must predict every bit: a fraction below 1 fails with TP-B4)")
    flagged, _ = biased({"bias_p": p, "bias_relative": got["bias_relative"]})
    rd.codes_agree("TP-B1", flagged, f"bias_p={_fmt(p)} and bias_relative="
                   f"{_fmt(got['bias_relative'])} {'are' if flagged else 'are not'} a bias the "
                   "probe flags")
    # 3. the verdict: fail with TP-B4, warn with TP-B1 (or an fp8 case gloo cannot run,
    # emulated and said so), else pass
    if "TP-B4" in rd.r.codes:
        rd.verdict_is(("fail",), "TP-B4")
    elif flagged or (backend == "emulated" and ev.get("note")):
        rd.verdict_is(("warn",), "TP-B1" if flagged else "an emulated fallback")
    else:
        rd.verdict_is(("pass",), f"bitwise_match_fraction={_fmt(frac)}, no TP-B1")


def _collective_z(rd: Reader, n: int, bias: float, z: float, mean_abs: float, mx: float):
    """bias_z = bias / (sd / sqrt(n)) with sd the spread of n errors whose mean magnitude is
    mean_abs and largest magnitude mx: mean(e^2) lies in [mean_abs^2, mx * mean_abs], so
    se^2 = (mean(e^2) - bias^2) / (n - 1) lies between the two bounds below."""
    if bias == 0 or math.isinf(z):
        # sd == 0 or mean == 0: z is 0 (mean 0) or +-inf (every error equal)
        ok = (z == 0) if bias == 0 else (math.copysign(1, z) == math.copysign(1, bias)
                                         and close(abs(bias), mean_abs) and close(abs(bias), mx))
        if not ok:
            rd.fail(f"bias_z={_fmt(z)} beside bias={_fmt(bias)}, mean_ulp_error="
                    f"{_fmt(mean_abs)}, max_ulp_error={_fmt(mx)}: z is 0 for a zero bias and "
                    "infinite only when every error is the same")
        return
    if n < 2 or z == 0 or math.isnan(z) or math.copysign(1, z) != math.copysign(1, bias):
        rd.fail(f"bias_z={_fmt(z)} beside bias={_fmt(bias)} over {n} element(s): z has the "
                "bias's sign")
    se = abs(bias / z)
    lo = math.sqrt(max(mean_abs * mean_abs - bias * bias, 0.0) / (n - 1))
    hi = math.sqrt(max(mx * mean_abs - bias * bias, 0.0) / (n - 1))
    slack = 1e-6 * hi + 1e-12 * mx
    if not lo - slack <= se <= hi + slack:
        rd.fail(f"bias / bias_z = {_fmt(se)} is not a standard error {n} errors with mean "
                f"{_fmt(bias)}, mean magnitude {_fmt(mean_abs)} and largest {_fmt(mx)} can have "
                f"(between {_fmt(lo)} and {_fmt(hi)})")


# --- drift.compare ------------------------------------------------------------------------

def _student(m: float, se: float, units: int, alpha: float) -> tuple:
    """(t, p, half) as trainprobes.drift.stats._student writes them for one estimate."""
    from scipy import stats
    df = max(units - 1, 1)
    t = m / se if se > 0 else (0.0 if m == 0 else math.copysign(math.inf, m))
    p = float(2 * stats.t.sf(abs(t), df)) if units >= 2 else math.nan
    return t, p, float(stats.t.ppf(1 - alpha / 2, df)) * se


def _drift(rd: Reader) -> None:
    """trainprobes.drift.compare: the cluster-robust t-test over units of mean_log_ratio."""
    from trainprobes.power import min_detectable_effect

    mean, se, alpha = rd.num("mean_log_ratio"), rd.num("se_mean"), rd.num("alpha")
    units = rd.count("n_units")
    if not 0 < alpha < 1:
        rd.fail(f"metric alpha={_fmt(alpha)} is not a significance level in (0, 1)")
    if not (se >= 0 or math.isnan(se)):
        rd.fail(f"metric se_mean={_fmt(se)} is negative")
    t, p_mean, half = _student(mean, se, units, alpha)
    rd.agree("t_stat", rd.num("t_stat"), t, "mean_log_ratio / se_mean")
    _p_agree(rd, "p_mean", rd.num("p_mean"), p_mean, "the t-test over n_units of t_stat")
    tiny = REL * (abs(mean) + abs(half))
    rd.agree("ci_low", rd.num("ci_low"), mean - half, "mean_log_ratio - t se_mean", tiny=tiny)
    rd.agree("ci_high", rd.num("ci_high"), mean + half, "mean_log_ratio + t se_mean", tiny=tiny)
    p_excess = rd.num("p_excess")
    small_noise = rd.num("k2_kl") <= rd.num("noise_kl_max")
    want = max(p_mean, p_excess) if small_noise else p_mean
    _p_agree(rd, "p_value", rd.num("p_value"), want,
             "max(p_mean, p_excess)" if small_noise else "p_mean (k2_kl > noise_kl_max)")
    mdb = rd.opt("min_detectable_bias")
    if mdb is not None:
        rd.agree("min_detectable_bias", mdb, min_detectable_effect(se, units - 1, alpha),
                 "the 80%-power effect of se_mean")
    n_tok, n_out, frac = rd.opt("n_tokens"), rd.opt("n_ratio_outside"), rd.opt("frac_ratio_outside")
    if None not in (n_tok, n_out, frac) and n_tok > 0:
        rd.agree("frac_ratio_outside", frac, n_out / n_tok, "n_ratio_outside / n_tokens")
    mabs, mx = rd.opt("mean_abs_log_ratio"), rd.opt("max_abs_log_ratio")
    # the token figures are accumulated in float32 blocks (trainprobes.drift.tokens)
    if None not in (mabs, mx) and not (abs(mean) <= mabs * (1 + 1e-5) and mabs <= mx * (1 + 1e-5)):
        rd.fail(f"|mean_log_ratio|={_fmt(abs(mean))}, mean_abs_log_ratio={_fmt(mabs)}, "
                f"max_abs_log_ratio={_fmt(mx)}: a mean is at most its mean magnitude, at most "
                "the largest")
    # the ratio rho = exp(-x): its quantiles are ordered and lie in [min_ratio, max_ratio]
    qs = [rd.opt(f"ratio_p{q}") for q in ("0.1", "1", "5", "50", "95", "99", "99.9")]
    lo_r, hi_r = rd.opt("min_ratio"), rd.opt("max_ratio")
    chain = [v for v in [lo_r, *qs, hi_r] if v is not None]
    if any(b < a * (1 - 1e-6) for a, b in zip(chain, chain[1:])):
        rd.fail(f"min_ratio, ratio_p0.1 ... ratio_p99.9, max_ratio = {[_fmt(v) for v in chain]} "
                "are not in order, as quantiles of one distribution are")
    if None not in (lo_r, hi_r, mx) and lo_r > 0 and math.isfinite(hi_r):
        rd.agree("max_abs_log_ratio", mx, max(-math.log(lo_r), math.log(hi_r)),
                 "the larger of |log min_ratio| and |log max_ratio|", rel=1e-5)
    for name in ("tail_share", "ess_token", "ess_seq", "frac_seq_ratio_outside",
                 "frac_seq_geo_ratio_outside", "frac_ratio_outside"):
        v = rd.opt(name)
        if v is not None and not 0 <= v <= 1 * (1 + 1e-9):
            rd.fail(f"metric {name}={_fmt(v)} is not a fraction")
    pm, px = rd.opt("mean_abs_prob_diff"), rd.opt("max_abs_prob_diff")
    if None not in (pm, px) and not 0 <= pm <= px * (1 + 1e-5):
        rd.fail(f"mean_abs_prob_diff={_fmt(pm)} beside max_abs_prob_diff={_fmt(px)}")
    seqs = rd.count("n_sequences", optional=True)
    if n_tok is not None and units > n_tok:
        rd.fail(f"n_units={units} exceeds n_tokens={_fmt(n_tok)}: a unit holds tokens")
    if None not in (seqs, n_tok) and seqs > n_tok:
        rd.fail(f"n_sequences={seqs} exceeds n_tokens={_fmt(n_tok)}")
    if rd.opt("n_units") is not None and units < 1:
        rd.fail("n_units=0: the probe tests over at least one unit")


# --- the other probes: their metrics against each other -----------------------------------

def _causality(rd: Reader) -> None:
    """trainprobes.causality.summary: every leak is a flip, flips are bounded by what was
    compared, flip_rate is n_leaks / n_compared, a pass has nothing unverified. (causal
    against n_leaks, n_leaks as a sum: gate.COUNTS, gate.SUMS.)"""
    n_leaks = rd.count("n_leaks", optional=True)
    flips, num = rd.count("n_flips", optional=True), rd.count("n_numerical", optional=True)
    unver = rd.count("n_unverified", optional=True)
    if None not in (n_leaks, flips, num, unver) and not n_leaks + num <= flips <= n_leaks + num + unver:
        rd.fail(f"n_flips={flips} is not n_leaks + n_numerical ({n_leaks} + {num}) plus at most "
                f"n_unverified={unver} flips, as the probe counts them")
    compared = rd.count("n_compared", optional=True)
    if None not in (compared, flips) and flips > compared:
        rd.fail(f"n_flips={flips} exceeds n_compared={compared}")
    rate = rd.opt("flip_rate")
    if None not in (compared, n_leaks, rate):
        rd.agree("flip_rate", rate, n_leaks / compared if compared else 0.0, "n_leaks / n_compared")
    if unver and rd.r.verdict == "pass":
        rd.fail(f"verdict 'pass' beside n_unverified={unver}: unverified flips warn")
    first = rd.opt("first_leak_position")
    if n_leaks is not None and "first_leak_position" in rd.m and (first is None) != (n_leaks == 0):
        rd.fail(f"first_leak_position={first!r} beside n_leaks={n_leaks}")
    lo, hi = rd.count("min_leak_distance", optional=True), rd.count("max_leak_distance", optional=True)
    if None not in (lo, hi) and lo > hi:
        rd.fail(f"min_leak_distance={lo} > max_leak_distance={hi}")
    evals = rd.count("n_evaluations", optional=True)
    for name in ("n_confirmations", "evaluations_to_first_flip"):
        v = rd.count(name, optional=True)
        if None not in (v, evals) and v > evals:
            rd.fail(f"{name}={v} exceeds n_evaluations={evals}")
    _near_ties(rd)
    if rd.flag("packed", optional=True) and rd.flag("batch_invariant", optional=True) is False:
        rd.fail("packed=True beside batch_invariant=False: the probe packs only a batch-invariant "
                "target")
    _deterministic(rd, "causal")


def _near_ties(rd: Reader) -> None:
    """causality.near_tie: the counts are those of the search's evidence (older Results,
    from before the search, carry neither)."""
    reached, leaks = rd.count("n_near_ties", optional=True), rd.count("n_near_tie_leaks", optional=True)
    ev = rd.evidence("near_tie_search", dict, optional=True)
    if ev is None:
        if reached or leaks:
            rd.fail(f"n_near_ties={reached}, n_near_tie_leaks={leaks} without the search's "
                    "evidence['near_tie_search']")
        return
    if reached != rd.as_count(rd.field(ev, "reached", "near_tie_search"), "near_tie_search.reached"):
        rd.fail(f"n_near_ties={reached} is not near_tie_search.reached={ev.get('reached')!r}")
    kinds = ev.get("kinds")
    found = rd.field(kinds, "structural", "near_tie_search.kinds") if isinstance(kinds, dict) else None
    if found is None or leaks != found:
        rd.fail(f"n_near_tie_leaks={leaks} is not near_tie_search.kinds.structural={found!r}")
    if leaks > reached:
        rd.fail(f"n_near_tie_leaks={leaks} exceeds n_near_ties={reached}")


def _reveal(rd: Reader) -> None:
    """trainprobes.numerics.reveal: the mantissa bits are where the precision trace first
    leaves 1 (step 2 of its docstring), rounds_per_add follows from them."""
    from trainprobes.reference.formats import get_format

    bits = rd.count("accumulator_mantissa_bits")
    lower = rd.flag("accumulator_bits_lower_bound")
    per_add = rd.flag("rounds_per_add")
    out = rd.label("output_format")
    try:
        out_bits = get_format(out).mantissa_bits
    except Exception:
        rd.fail(f"metric output_format={out!r} is not a format")
    if per_add != ((not lower) and bits <= out_bits):
        rd.fail(f"rounds_per_add={per_add} beside {bits} mantissa bits "
                f"({'a lower bound' if lower else 'exact'}) and a {out} output ({out_bits} bits)")
    if lower and rd.m.get("rounding") != "unknown":
        rd.fail(f"rounding={rd.m.get('rounding')!r} beside a lower bound: the probe measures "
                "rounding only for a known precision")
    trace = rd.evidence("precision_trace", dict)
    try:
        steps = sorted((int(k), v) for k, v in trace.items())
    except (TypeError, ValueError):
        rd.fail("evidence['precision_trace'] is keyed by something other than step numbers")
    values = [rd.as_number(v, f"precision_trace[{s}]") for s, v in steps]
    if [s for s, _ in steps] != list(range(1, len(steps) + 1)):
        rd.fail("evidence['precision_trace'] skips a step")
    ones = next((i for i, v in enumerate(values) if v != 1.0), len(values))
    if lower:
        ok = ones >= len(values) - 1 and bits == ones and (ones == len(values) or
                                                            not math.isfinite(values[-1]))
    else:
        ok = ones == bits and ones == len(values) - 1 and math.isfinite(values[-1])
    if not ok:
        rd.fail(f"accumulator_mantissa_bits={bits} (lower bound: {lower}) is not where "
                f"evidence['precision_trace'] first leaves 1 ({len(values)} steps, "
                f"{ones} of them 1)")
    n, fan_in = rd.count("n"), rd.count("fan_in", optional=True)
    if fan_in is not None and fan_in > n:
        rd.fail(f"fan_in={fan_in} exceeds n={n}")
    tree = rd.ev.get("tree")
    if tree is not None and _leaf_count(tree) != n:
        rd.fail(f"metric n={n} is not the {_leaf_count(tree)} inputs of the order in "
                "evidence['tree']")
    if rd.r.verdict == "pass" and rd.r.codes:
        rd.fail(f"verdict 'pass' with codes {rd.r.codes}")


def _leaf_count(tree) -> int:
    """Inputs in a revealed order: a nested list whose leaves are input positions."""
    return sum(_leaf_count(t) for t in tree) if isinstance(tree, list) else 1


def _stall(rd: Reader) -> None:
    """trainprobes.numerics.stall: one row per (format, increment) in the evidence, each
    sum's relative error, and TP-B2 when any is over rel_tol."""
    rows_n, over, rel_tol = rd.count("rows"), rd.count("rows_over_tolerance"), rd.num("rel_tol")
    worst = rd.num("max_abs_relative_error")
    if over > rows_n:
        rd.fail(f"rows_over_tolerance={over} exceeds rows={rows_n}")
    rd.codes_agree("TP-B2", over > 0, f"rows_over_tolerance={over}")
    rd.verdict_is(("warn",) if over else ("pass",), f"rows_over_tolerance={over}")
    sums = [(k, rd.num(k)) for k in rd.m if k.startswith("sequential_sum[")]
    if len(sums) != rows_n:
        rd.fail(f"{len(sums)} sequential_sum[...] metrics for rows={rows_n}")
    rows = rd.evidence("rows", list)
    if (rd.ev.get("truncated") or {}).get("rows") is not None:
        return  # a long table was cut in report.json: the metrics are checked among themselves
    if len(rows) != rows_n:
        rd.fail(f"rows={rows_n} but evidence['rows'] holds {len(rows)}")
    errs = []
    for i, ((key, s), row) in enumerate(zip(sums, rows)):
        where = f"evidence['rows'][{i}]"
        seq, true = rd.field(row, "sequential_sum", where), rd.field(row, "true_sum", where)
        inc, n = rd.field(row, "increment", where), rd.field(row, "n", where)
        if not key.startswith(f"sequential_sum[{row.get('format')},") or not close(s, seq):
            rd.fail(f"metric {key}={_fmt(s)} is not row {i}'s {row.get('format')} sum {_fmt(seq)}")
        if not close(true, n * inc):
            rd.fail(f"{where}: true_sum={_fmt(true)} is not n x increment")
        rel = rd.field(row, "relative_error", where)
        if not close(rel, (seq - true) / true if true else math.nan):
            rd.fail(f"{where}: relative_error={_fmt(rel)} is not (sequential_sum - true_sum) / true_sum")
        errs.append(rel)
    finite = [abs(e) for e in errs if not math.isnan(e)]
    rd.agree("max_abs_relative_error", worst, max(finite) if finite else math.nan,
             "the largest |relative_error| of the rows")
    want = sum(not abs(e) <= rel_tol for e in errs)
    if over != want:
        rd.fail(f"rows_over_tolerance={over}, but {want} row(s) are off by more than "
                f"rel_tol={_fmt(rel_tol)}")


def _transform(rd: Reader) -> None:
    """trainprobes.transforms.judge: scales are 1 + their errors, CIs are centred on their
    estimates, the kind carries its code. (scale = 1 + scale_error: gate.DERIVED.)"""
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
        rd.fail(f"mean_relative_error={_fmt(mean)} beside max_relative_error={_fmt(mx)}")
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
            rd.fail(f"transform_verdict='noise' beside {name}={_fmt(v)} > noise_tol={_fmt(tol)}: "
                    f"the probe calls that wrong")
    table = rd.ev.get("parameters")
    for row in table if isinstance(table, list) else ():
        for key in ("median_added_error", "peak_added_error"):
            v = row.get(key) if isinstance(row, dict) else None
            if v is not None and not rd.as_number(v, "parameters[...]") <= tol:
                rd.fail(f"transform_verdict='noise' beside parameter {row.get('parameter')!r} with "
                        f"{key}={_fmt(v)} > noise_tol={_fmt(tol)}: the probe calls that wrong")


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
                    f"p={_fmt(p)}, |mean|={_fmt(abs(mean))}, alpha_per_test={_fmt(per_test)}, "
                    f"min_effect={_fmt(floor)}")
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
            rd.fail(f"metric {se_name}={_fmt(se)} is negative")
        if None in (se, lo, hi, alpha, trials) or not 0 < alpha < 1 or math.isnan(se + lo + hi):
            continue
        if se == 0:
            if lo != hi:
                rd.fail(f"{ci} CI [{_fmt(lo)}, {_fmt(hi)}] has a width, {se_name}=0 has none")
            continue
        # scale's CI is 1 + the error's: its width is known to a few ulps of 1
        half, ulps = (hi - lo) / 2, 4 * 2.0 ** -52 * max(abs(lo), abs(hi))
        k = next((k for k in range(trials, 2, -1)
                  if close(half, float(stats.t.ppf(1 - alpha / 2, k - 1)) * se, 1e-7, ulps)), None)
        if k is None:
            rd.fail(f"the {ci} CI [{_fmt(lo)}, {_fmt(hi)}] is not {ci} -/+ t(1 - alpha/2, k - 1) "
                    f"x {se_name}={_fmt(se)} for any k <= trials={trials}")
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
            _p_agree(rd, f"{added}_p", p, _t_p(e, se, k - 1), f"the t-test of {est}")
        mde = rd.opt(mde_name)
        if mde is not None:
            rd.agree(mde_name, mde, min_detectable_effect(se, k - 1, per_test),
                     "the 80%-power effect of its standard error at alpha_per_test", rel=1e-6)


def _deterministic(rd: Reader, flag: str) -> None:
    """A probe that measured (its verdict boolean true or false) found the target
    deterministic: a nondeterministic one returns early with the boolean None (TP-C2)."""
    if rd.m.get(flag) is not None and rd.flag("deterministic", optional=True) is False:
        rd.fail(f"deterministic=False beside {flag}={rd.m[flag]}: the probe judges only a "
                f"deterministic target (else {flag}=None, TP-C2)")


def _documents(rd: Reader) -> None:
    """trainprobes.isolation.documents: a structural leak has a size (max_leak); its
    within-document causality check fails with TP-C1 exactly when causal is false."""
    _deterministic(rd, "isolated")
    causal = rd.flag("causal", optional=True)
    if causal is not None:
        rd.codes_agree("TP-C1", causal is False, f"causal={causal}")
    n_leaks, worst = rd.count("n_leaks", optional=True), rd.opt("max_leak")
    if None not in (n_leaks, worst) and (n_leaks > 0) != (worst > 0):
        rd.fail(f"max_leak={_fmt(worst)} beside n_leaks={n_leaks}: leaks have a size, and only leaks")
    docs = rd.count("n_documents", optional=True)
    if docs is not None and docs < 1:
        rd.fail("n_documents=0")


def _batch(rd: Reader) -> None:
    """trainprobes.isolation.batch: the figures over every batch are those of evidence
    by_size; a row differs when some output moves by more than atol."""
    _deterministic(rd, "batch_invariant")
    if rd.flag("companion_dependent", optional=True) and rd.m.get("batch_invariant") is True:
        rd.fail("companion_dependent=True beside batch_invariant=True: a row that changes with "
                "its companions differs from itself alone")
    mx, mean = rd.opt("max_abs_diff"), rd.opt("mean_abs_diff")
    frac_rows, frac_out = rd.opt("frac_rows_differ"), rd.opt("frac_outputs_differ")
    atol = rd.opt("atol") or 0.0
    if None not in (mx, mean) and not 0 <= mean <= mx * (1 + REL):
        rd.fail(f"mean_abs_diff={_fmt(mean)} beside max_abs_diff={_fmt(mx)}")
    for name, frac in (("frac_rows_differ", frac_rows), ("frac_outputs_differ", frac_out)):
        if frac is not None and not 0 <= frac <= 1:
            rd.fail(f"metric {name}={_fmt(frac)} is not a fraction")
        if frac is not None and mx is not None and (frac > 0) != (mx > atol):
            rd.fail(f"{name}={_fmt(frac)} beside max_abs_diff={_fmt(mx)} (atol {_fmt(atol)}): "
                    "an output differs exactly when it moves by more than atol")
    breaking = rd.m.get("breaking_sizes")
    if isinstance(breaking, list) and "first_breaking_size" in rd.m:
        first = rd.m["first_breaking_size"]
        if first != (breaking[0] if breaking else None):
            rd.fail(f"first_breaking_size={first!r} is not the first of breaking_sizes {breaking}")
    by_size = rd.evidence("by_size", list, optional=True)
    if by_size is None or frac_rows is None or not isinstance(breaking, list):
        return
    rows = [(rd.field(s, "rows", "by_size"), rd.field(s, "rows_differ", "by_size"),
             rd.field(s, "max_abs_diff", "by_size"), rd.field(s, "max_ulps", "by_size"),
             rd.field(s, "frac_outputs_differ", "by_size"), rd.field(s, "mean_abs_diff", "by_size"),
             s.get("size")) for s in by_size]
    total = sum(r[0] for r in rows)
    rd.agree("frac_rows_differ", frac_rows, sum(r[1] for r in rows) / total if total else 0.0,
             "the rows that differ over the rows of evidence by_size")
    if mx is not None:
        rd.agree("max_abs_diff", mx, max((r[2] for r in rows), default=0.0),
                 "the largest of evidence by_size")
    ulps = rd.opt("max_ulps")
    if ulps is not None:
        rd.agree("max_ulps", ulps, max((r[3] for r in rows), default=0.0), "the largest of by_size")
    for name, v, k in (("frac_outputs_differ", frac_out, 4), ("mean_abs_diff", mean, 5)):
        if v is not None and rows and not (min(r[k] for r in rows) * (1 - REL) <= v
                                           <= max(r[k] for r in rows) * (1 + REL)):
            rd.fail(f"metric {name}={_fmt(v)} is outside the range of its values per size in "
                    "evidence by_size, of which it is a weighted mean")
    if breaking != [r[6] for r in rows if r[1]]:
        rd.fail(f"breaking_sizes={breaking} are not the sizes of evidence by_size whose rows differ")


def _end_to_end(rd: Reader) -> None:
    """trainprobes.isolation.end_to_end: a token differs exactly when its output moves."""
    frac, mx = rd.opt("frac_tokens_differ"), rd.opt("max_abs_diff")
    if frac is not None and not 0 <= frac <= 1:
        rd.fail(f"metric frac_tokens_differ={_fmt(frac)} is not a fraction")
    if None not in (frac, mx) and (frac > 0) != (mx > 0):
        rd.fail(f"frac_tokens_differ={_fmt(frac)} beside max_abs_diff={_fmt(mx)}: a token differs "
                "exactly when its output moves")



_LOCALIZE_KINDS = ("exact", "noise", "numeric", "routing", "weights", "temperature", "renormalisation")
_LOCALIZE_PARTS = ("weights", "routing", "temperature", "renormalisation", "numerics", "unexplained")


def _localize(rd: Reader) -> None:
    """trainprobes.drift.decompose.localize: the per-stage metrics are the stage table's, the
    first stage beyond noise is first_layer, a verdict per stage follows from its ratio, the
    shares are the evidence's, lie in their intervals and sum to 1, and the kind is the found
    part with the largest share (or exact / noise, which agree and pass)."""
    agree = rd.flag("engines_agree")
    kind = rd.label("kind")
    if kind not in _LOCALIZE_KINDS:
        rd.fail(f"metric kind={kind!r} is not one of {_LOCALIZE_KINDS}")
    if agree != (kind in ("exact", "noise")):
        rd.fail(f"engines_agree={agree} beside kind={kind!r}: the probe agrees exactly on exact and noise")
    rd.codes_agree("TP-D4", not agree, f"engines_agree={agree}")
    first = rd.label("first_layer")
    stages = rd.evidence("stages", list)
    from_dumps = rd.ev.get("from") == "dumps"
    margin = rd.num("margin")
    alpha = None if from_dumps else rd.num("alpha")
    beyond = []
    for i, st in enumerate(stages):
        if not isinstance(st, dict) or not isinstance(st.get("name"), str):
            rd.fail(f"evidence['stages'][{i}] is not a stage row")
        name = st["name"]
        for key in ("free_error", "noise_floor") + (() if from_dumps else ("own_error",)):
            rd.agree(f"{key}[{name}]", rd.num(f"{key}[{name}]"), rd.field(st, key, f"stages[{i}]"),
                     f"evidence['stages'][{i}][{key!r}]")
        if from_dumps:
            div = st.get("divergent")
            if div != (st["free_error"] > margin * st["noise_floor"]):
                rd.fail(f"stage {name!r}: divergent={div!r} is not free_error > margin x noise_floor")
            if div:
                beyond.append(name)
            continue
        own, ratio, p = st["own_error"], rd.field(st, "ratio", f"stages[{i}]"), rd.field(st, "p_value", f"stages[{i}]")
        v = st.get("verdict")
        if v == "exact" and own != 0 or v == "noise" and own == 0:
            rd.fail(f"stage {name!r}: verdict {v!r} beside own_error {_fmt(own)}")
        low = rd.field(st, "min_ratio", f"stages[{i}]")
        high = rd.field(st, "max_ratio", f"stages[{i}]")
        past = ratio > margin and (p < alpha / len(stages) or low > margin / 4) or high > margin ** 2
        if v == "beyond" and not st.get("nonfinite") and not past:
            rd.fail(f"stage {name!r} is beyond noise, but its ratio {_fmt(ratio)} <= margin {_fmt(margin)}, "
                    f"or its p {_fmt(p)} >= alpha / stages and a sequence's ratio {_fmt(low)} <= margin / 4; "
                    f"and its largest sequence ratio {_fmt(high)} <= margin^2")
        if v == "noise" and past:
            rd.fail(f"stage {name!r} is called noise, but its ratio {_fmt(ratio)} > margin and p "
                    f"{_fmt(p)} < alpha / stages or every sequence's ratio > margin / 4, or a sequence's "
                    f"ratio {_fmt(high)} > margin^2")
        if v != "exact" and high < ratio * (1 - 1e-9):
            rd.fail(f"stage {name!r}: max_ratio {_fmt(high)} is below the geometric mean ratio {_fmt(ratio)}")
        if v != "exact" and low > ratio * (1 + 1e-9):
            rd.fail(f"stage {name!r}: min_ratio {_fmt(low)} exceeds the geometric mean ratio {_fmt(ratio)}")
        if v == "beyond":
            beyond.append(name)
    flipped = [k[len("routing_mismatch["):-1] for k, v in rd.m.items()
               if k.startswith("routing_mismatch[") and isinstance(v, (int, float)) and v > 0]
    routed = not beyond and kind == "routing" and flipped and flipped[0].startswith(first + ".")
    if first != (beyond[0] if beyond else "") and not routed:
        rd.fail(f"metric first_layer={first!r}, but the first stage beyond noise in the table is "
                f"{(beyond[0] if beyond else '')!r}")
    if from_dumps:
        if kind != ("noise" if not beyond else "numeric"):
            rd.fail(f"kind={kind!r} from dumps: 'numeric' when a stage diverges, else 'noise'")
        return
    mean, mean_abs, mx = rd.num("mean_log_ratio"), rd.num("mean_abs_log_ratio"), rd.num("max_abs_log_ratio")
    if not (abs(mean) <= mean_abs * (1 + REL) and mean_abs <= mx * (1 + REL)):
        rd.fail(f"|mean_log_ratio| {_fmt(abs(mean))} <= mean_abs_log_ratio {_fmt(mean_abs)} <= "
                f"max_abs_log_ratio {_fmt(mx)} does not hold")
    shares = rd.evidence("shares", dict)
    total = 0.0
    for part in _LOCALIZE_PARTS + tuple(k for k in shares if k.startswith("numerics[")):
        row = shares.get(part)
        if row is None:
            rd.fail(f"evidence['shares'] has no {part!r}")
        keys = (("", "share"),) if "[" in part else (("", "share"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high"))
        vals = []
        for s, k in keys:
            v = rd.num(f"share_{part}{s}")
            rd.agree(f"share_{part}{s}", v, rd.field(row, k, f"shares[{part!r}]"),
                     f"evidence['shares'][{part!r}][{k!r}]")
            vals.append(v)
        if len(vals) == 1:
            continue
        if not vals[1] - 1e-12 <= vals[0] <= vals[2] + 1e-12:
            rd.fail(f"share_{part}={_fmt(vals[0])} lies outside its interval [{_fmt(vals[1])}, {_fmt(vals[2])}]")
        total += vals[0]
    if not close(total, 1.0 if mean_abs else 0.0, 0, 1e-9):
        rd.fail(f"the shares sum to {_fmt(total)}: the parts add up to the drift, so they sum to 1 (0 without drift)")
    by_stage = [k for k in shares if k.startswith("numerics[")]
    rd.agree("share_numerics", rd.num("share_numerics"), sum(rd.num(f"share_{k}") for k in by_stage),
             "the sum of share_numerics[stage]", 0, 1e-9)
    stale = rd.count("n_stale_tensors")
    rows = rd.evidence("weights", list)
    if stale != sum(isinstance(w, dict) and w.get("status") == "mismatch" for w in rows):
        rd.fail(f"n_stale_tensors={stale} is not the tensors evidence['weights'] calls mismatch")
    unmatched = rd.count("n_unmatched_tensors")
    if unmatched != sum(isinstance(w, dict) and w.get("status") == "missing" for w in rows):
        rd.fail(f"n_unmatched_tensors={unmatched} is not the tensors evidence['weights'] calls missing")
    held = rd.count("n_trainer_rounded_tensors")
    if held != sum(isinstance(w, dict) and w.get("status") == "trainer_rounded" for w in rows):
        rd.fail(f"n_trainer_rounded_tensors={held} is not the tensors evidence['weights'] calls trainer_rounded")
    temperature, renorm = rd.flag("temperature"), rd.flag("renormalised")
    slope, lo, hi = rd.num("temperature_slope"), rd.num("temperature_slope_ci_low"), rd.num("temperature_slope_ci_high")
    if not lo - 1e-12 <= slope <= hi + 1e-12:
        rd.fail(f"temperature_slope {_fmt(slope)} lies outside its interval [{_fmt(lo)}, {_fmt(hi)}]")
    if not close(slope - lo, hi - slope, 1e-6, 1e-12):
        rd.fail(f"temperature_slope_ci_low {_fmt(lo)} and _ci_high {_fmt(hi)} are not the slope "
                f"{_fmt(slope)} -/+ one half-width, as the probe writes them")
    if temperature and lo <= 1 <= hi:
        rd.fail("temperature is true, but the slope's interval holds 1")
    mass, frac = rd.num("mean_log_mass_kept"), rd.num("frac_positions_renormalised")
    if renorm and not (mass < 0 and 0 < frac <= 1) or not renorm and mass != 0:
        rd.fail(f"renormalised={renorm} beside mean_log_mass_kept {_fmt(mass)}, frac_positions_renormalised "
                f"{_fmt(frac)}")
    flips = {r.get("name"): r for r in rd.evidence("routing", list) if isinstance(r, dict)}
    dec = rd.opt("routing_frac_decisions")
    if flips:
        fr = [rd.num(f"routing_mismatch[{n}]") for n in flips]
        for n, f in zip(flips, fr):
            rd.agree(f"routing_mismatch[{n}]", f, rd.field(flips[n], "frac_flipped", "routing"),
                     f"evidence['routing'][{n!r}]['frac_flipped']")
        rd.agree("routing_frac_decisions", rd.num("routing_frac_decisions"), sum(fr) / len(fr),
                 "the mean of routing_mismatch over routers (each sees every token)")
        anyl = rd.num("routing_frac_tokens_any_layer")
        if not max(fr) - 1e-12 <= anyl <= min(1.0, sum(fr)) + 1e-12:
            rd.fail(f"routing_frac_tokens_any_layer {_fmt(anyl)} is not between the largest and the sum "
                    "of the per-router fractions")
    found = {"weights": stale > 0, "temperature": temperature, "renormalisation": renorm,
             "routing": bool(dec) and rd.num("share_routing_ci_low") > 0, "numeric": bool(by_stage)}
    named = {"numeric": "numerics"}
    if kind == "exact" and (mean_abs != 0 or any(s.get("verdict") != "exact" for s in stages) or stale):
        rd.fail("kind 'exact' beside a drift, a stage that is not exact or a stale tensor")
    cands = [k for k, v in found.items() if v]
    if kind == "noise" and cands:
        rd.fail(f"kind 'noise' beside parts found: {cands}")
    if kind not in ("exact", "noise"):
        best = max(cands, key=lambda k: rd.num(f"share_{named.get(k, k)}")) if cands else None
        if kind != best:
            rd.fail(f"kind={kind!r}, but the found part with the largest share is {best!r}")
# --- numerics.gemm ------------------------------------------------------------------------

def _gemm(rd: Reader) -> None:
    """trainprobes.numerics.gemm: error_stats (at alpha / 2: two ratios) over the groups'
    pseudo-values of the signed bias (evidence 'errors') and of the offset ('offset_errors'),
    SQNR and maximum error from the weighted sums the probe keeps, the growth fit from its
    points, stall_k and the promotion interval from their records, the verdict by judge()."""
    from scipy import stats
    from trainprobes.numerics.gemm import GEMMS, growth_exponent, is_within, judge
    from trainprobes.power import min_detectable_effect

    if rd.label("gemm") not in GEMMS:
        rd.fail(f"metric gemm={rd.m['gemm']!r} is not one of {list(GEMMS)}")
    preset, recipe = rd.label("preset"), rd.label("recipe")
    verdict = rd.label("gemm_verdict")
    # a what-if (a preset fed products it was not measured on) is named so, never silently
    said = rd.ev.get("combination")
    if not isinstance(said, str) or rd.m.get("what_if") is not (not said.endswith("was measured on these operands")):
        rd.fail(f"what_if={rd.m.get('what_if')!r} beside evidence['combination']={said!r}")
    from trainprobes.numerics.gemm import combination
    from trainprobes.reference.gemm import PRESETS
    from trainprobes.reference.recipes import RECIPES
    if preset in PRESETS and recipe in RECIPES:
        formats = rd.evidence("operand_formats", list)
        if bool(combination(PRESETS[preset], RECIPES[recipe], rd.m["gemm"], tuple(formats))) != rd.m["what_if"]:
            rd.fail(f"what_if={rd.m['what_if']!r} for preset {preset!r}, recipe {recipe!r} on "
                    f"{formats} operands: the preset's measured inputs say otherwise")
    n, S, K = rd.count("trials"), rd.count("samples"), rd.count("k")
    alpha, tol = rd.num("alpha"), rd.num("tolerance")
    if not 0 < alpha < 1:
        rd.fail(f"metric alpha={_fmt(alpha)} is not a significance level in (0, 1)")
    rd.agree("confidence", rd.num("confidence"), 1 - alpha / 2, "1 - alpha/2 (two ratios judged)")
    shape = rd.evidence("shape", list)
    if len(shape) != 3 or shape[2] != K:
        rd.fail(f"metric k={K} is not the K of evidence['shape']={shape!r}")
    if not (n <= S <= shape[0] * shape[1]):
        rd.fail(f"samples={S} is not between trials={n} and the {shape[0] * shape[1]} outputs")
    design = rd.evidence("design", dict)
    for name, size in (("rows_drawn", shape[0]), ("columns_drawn", shape[1])):
        got = rd.count(name)
        if not 1 <= got <= min(size, S) or got != design.get(name):
            rd.fail(f"{name}={got} is not the design's {design.get(name)!r} (between 1 and "
                    f"min({size}, samples={S}))")
    # 1. each ratio's group pseudo-values: mean, spread, t-test, CI (at alpha / 2)
    cis = []
    for prefix, key in (("", "errors"), ("offset_", "offset_errors")):
        bias_name = "relative_bias" if not prefix else "relative_offset"
        bias, std = rd.num(bias_name), rd.num(prefix + "std")
        lo, hi, p = rd.num(prefix + "ci_low"), rd.num(prefix + "ci_high"), rd.num(prefix + "p_value")
        errors = [rd.as_number(e, f"evidence[{key!r}][...]") for e in rd.evidence(key, list)]
        finite = [e for e in errors if math.isfinite(e)]
        census = design.get("kind") == "every output" and S == shape[0] * shape[1]  # no even split
        if len(finite) != n or n < 3 or (S % len(errors) and not census):
            rd.fail(f"evidence[{key!r}] holds {len(errors)} groups, {len(finite)} finite; trials={n}, "
                    f"samples={S} (the groups split the samples evenly)")
        mean = math.fsum(finite) / n
        sd = math.sqrt(math.fsum((e - mean) ** 2 for e in finite) / (n - 1))
        scale = max(abs(e) for e in finite)
        rd.agree(bias_name, bias, mean, f"the mean of evidence[{key!r}]", tiny=REL * scale)
        rd.agree(prefix + "std", std, sd, f"the spread of evidence[{key!r}]", tiny=REL * scale)
        se = std / math.sqrt(n)
        half = 0.0 if std == 0 else float(stats.t.ppf(1 - alpha / 4, n - 1)) * se
        tiny = REL * (abs(bias) + half)
        how = f"{bias_name} -+ t(1 - alpha/4, trials - 1) {prefix}std / sqrt(trials)"
        rd.agree(prefix + "ci_low", lo, bias - half, how, tiny=tiny)
        rd.agree(prefix + "ci_high", hi, bias + half, how, tiny=tiny)
        _p_agree(rd, prefix + "p_value", p, _t_p(bias, se, n - 1), f"the t-test of evidence[{key!r}]")
        if not prefix:
            rd.agree("min_detectable_bias", rd.num("min_detectable_bias"),
                     min_detectable_effect(se, n - 1, alpha / 2), "the 80%-power effect of std / sqrt(trials)")
        cis.append((lo, hi))
    # 2. SQNR and the maximum error, from the weighted sums kept
    ssr, sse = rd.as_number(rd.ev.get("sum_sq_ref"), "evidence['sum_sq_ref']"), \
        rd.as_number(rd.ev.get("sum_sq_err"), "evidence['sum_sq_err']")
    wsum = rd.as_number(rd.ev.get("weight_sum"), "evidence['weight_sum']")
    mae = rd.as_number(rd.ev.get("max_abs_err"), "evidence['max_abs_err']")
    if ssr <= 0 or sse < 0 or mae < 0 or not wsum > 0:
        rd.fail("evidence sums of squares, weight sum or maximum error are negative")
    rd.agree("sqnr_db", rd.num("sqnr_db"), 10 * math.log10(ssr / sse) if sse else math.inf,
             "10 log10(sum_sq_ref / sum_sq_err)")
    rd.agree("max_relative_error", rd.num("max_relative_error"), mae / math.sqrt(ssr / wsum),
             "max_abs_err / rms of the exact outputs (sqrt(sum_sq_ref / weight_sum))")
    if (verdict == "exact") != (mae == 0):
        rd.fail(f"gemm_verdict={verdict!r} beside a largest error of {_fmt(mae)}: exact means "
                "every sampled output equals fp64")
    if (mae == 0) != (sse == 0) or (mae == 0 and any(lo != 0 or hi != 0 for lo, hi in cis)):
        rd.fail("an exact GEMM (no error) with a non-zero error sum, bias or spread")
    # 3. the growth fit and its points
    growth = rd.evidence("growth", list)
    if not growth or not isinstance(growth[-1], dict) or growth[-1].get("k") != K:
        rd.fail(f"evidence['growth'] does not end at k={K}")
    rd.agree("growth_exponent", rd.num("growth_exponent"), growth_exponent(growth),
             "the log-log slope of evidence['growth']")
    # 4. stall_k: where half the outputs (by weight) had a fused add absorbed
    stall = rd.evidence("stall", dict)
    stalled = rd.as_count(rd.field(stall, "stalled_outputs", "evidence['stall']"), "stalled_outputs")
    share = rd.field(stall, "stalled_share", "evidence['stall']")
    sk = rd.num("stall_k")
    if stalled > S or not 0 <= share <= 1 or (share == 0) != (stalled == 0) \
            or (share < 0.5) != math.isinf(sk) or not (sk <= K or math.isinf(sk)) \
            or not close(sk, rd.field(stall, "stall_k", "evidence['stall']")):
        rd.fail(f"stall_k={_fmt(sk)} beside {stalled} of {S} stalled outputs (a share {_fmt(share)} "
                f"by weight) and k={K} (inf exactly when under half stalled; else the K by which half did)")
    # 5. the promotion interval: K unless biased, else the first candidate within tolerance
    need = rd.num("promote_every_needed")
    promo = rd.evidence("promotion", list)
    if verdict != "biased" or rd.m.get("biased") is not True:
        if need != K or promo:
            rd.fail(f"promote_every_needed={_fmt(need)} beside a GEMM that is not biased: the probe "
                    f"writes k={K} and searches nothing")
    elif promo:
        for c in promo:
            within = all(is_within(rd.field(c, lo, "promotion"), rd.field(c, hi, "promotion"), tol)
                         for lo, hi in (("ci_low", "ci_high"), ("offset_ci_low", "offset_ci_high")))
            if within != c.get("within"):
                rd.fail(f"evidence['promotion'] entry {c!r} is not judged against tolerance={_fmt(tol)}")
        hit = [c["promote_every"] for c in promo if c.get("within")]
        if not close(need, float(hit[0]) if hit else math.nan):
            rd.fail(f"promote_every_needed={_fmt(need)} is not the first candidate within the "
                    f"tolerance ({hit[:1] or 'none'})")
    if verdict != judge(mae == 0, cis, tol):
        shown = ", ".join(f"[{_fmt(lo)}, {_fmt(hi)}]" for lo, hi in cis)
        rd.fail(f"gemm_verdict={verdict!r} beside the CIs {shown} (bias, offset) and tolerance="
                f"{_fmt(tol)}: biased exactly when a CI excludes 0 and reaches past +-tolerance, "
                f"noise means the whole CI lies within it (else the probe cannot judge): "
                f"{judge(mae == 0, cis, tol)!r}")
    if (rd.m.get("biased") is True) != (verdict == "biased"):
        rd.fail(f"gemm_verdict={verdict!r} contradicts biased={rd.m.get('biased')}")
    rd.codes_agree("TP-B1", verdict == "biased", f"gemm_verdict is {verdict!r}")


RULES: dict[str, Callable[[Reader], None]] = {
    "numerics.gemm": _gemm,
    "numerics.bias": _bias,
    "distributed.collective": _collective,
    "drift.compare": _drift,
    "drift.localize": _localize,
    "causality.check": _causality,
    "numerics.reveal": _reveal,
    "numerics.stall": _stall,
    "transforms.equivalence": _transform,
    "isolation.documents": _documents,
    "isolation.batch_invariance": _batch,
    "isolation.op_map": _batch,
    "isolation.end_to_end": _end_to_end,
}


def check_consistent(r: Result, side: str) -> None:
    """Raise CannotJudge unless r's figures agree with one another as its probe derives them
    (RULES). A Result that measured nothing (verdict error) is left to the gate's TP-E1."""
    rule = RULES.get(r.probe)
    if rule is None or r.verdict == "error":
        return
    rule(Reader(r, side))

