"""The pre-merge gate: compare a candidate report with a baseline and say what regressed.

Exit codes (`GateReport.exit_code`): 0 no unwaived regression, 1 at least one, 2 the gate
cannot judge. It fails closed: a report that is missing, corrupt or of another schema, or
any Result that does not explain its own verdict or lacks (or mistypes) a metric a rule
reads (check_judgeable), or whose figures contradict one another as its probe derives them
(trainprobes.gate_rules: a bias beside its own CI, a collective's bias_z beside its ulp errors),
is "cannot judge", naming the report side, the key and the field.

Regressions, each with a code from trainprobes.result.CODES so a reviewer can search and waive it:
  TP-G1  a probe present in the baseline is missing from the candidate;
  TP-C1  a target that was causal now leaks (metric `causal` True -> False); the same for
         any probe's verdict boolean (trainprobes.result.PROBES) going from good to bad;
  TP-G2  a bias significantly larger: one-sided z-test on |bias| with both standard errors
         (trainprobes.numerics.bias: `bias`, SE = std / sqrt(trials));
  TP-G3  drift significantly worse (the same test on `mean_log_ratio` with `se_mean`, from
         trainprobes.drift.compare), or a drift Result newly over its threshold (TP-D3);
  TP-B3  lower revealed accumulator precision (`accumulator_mantissa_bits` decreased);
  TP-G4  a control (Result.expected set) that reproduced its known verdict in the baseline,
         or is new, misses it in the candidate: the harness is broken on that machine;
  TP-T1/T2/T3  a parallel transform that was equivalent (exact or noise) is now biased /
         inconsistent / wrong (trainprobes.transforms: `equivalent` True -> False, coded by
         its `transform_verdict`);
  TP-T4  a transform's gradient or loss scale error significantly larger (`scale_error`,
         `loss_relative_error` with their `_se`), judged like bias;
  TP-E1  the probe errored in the candidate;
  and any other result whose verdict went from pass/warn to fail keeps the candidate's codes.
Waivers name a code, a target (exact, or an fnmatch pattern) and a reason, and expire.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import date
from typing import NamedTuple

from trainprobes.display import format_number
from trainprobes.errors import CannotJudge, InvalidType
from trainprobes.gate_render import render_markdown
from trainprobes.gate_rules import check_consistent
from trainprobes.gate_waivers import Waiver, load_waivers, parse_waivers, waiver_dict  # noqa: F401 (the public API)
from trainprobes.result import CODES, PROBES, VERDICT_FLAGS, Result, SchemaError, load_results
from trainprobes.validation import check_number

# The estimates the gate tests, as probes name them: (code, metric, label). Each Result also
# carries the estimate's standard error, found by `standard_error` (trainprobes.numerics.bias:
# std and trials, and a (1 - alpha) CI; trainprobes.drift.compare: se_mean).
# (code, estimate, label, the metric holding the probe's own floor for a bias that matters)
ESTIMATES = (("TP-G2", "bias", "bias", "min_effect"),
             ("TP-G3", "mean_log_ratio", "drift", "min_bias"),
             ("TP-T4", "scale_error", "transform gradient scale error", "min_effect"),
             ("TP-T4", "loss_relative_error", "transform loss error", "min_effect"),
             ("TP-G2", "relative_bias", "GEMM relative bias", "tolerance"))
# trainprobes.transforms: `equivalent` True -> False blocks, coded by the candidate's kind
TRANSFORM_CODES = {"biased": "TP-T1", "inconsistent": "TP-T2", "wrong": "TP-T3"}


@dataclass
class Regression:
    code: str
    probe: str
    target: str
    what: str              # one sentence: what regressed and by how much
    baseline: str = ""     # the baseline figure, formatted
    candidate: str = ""    # the candidate figure, formatted
    evidence: str = ""     # statistic or message that backs it
    waived_by: Waiver | None = None

    @property
    def key(self) -> str:
        return f"{self.probe}::{self.target}"


@dataclass
class GateReport:
    regressions: list[Regression] = field(default_factory=list)
    expired_waivers: list[Waiver] = field(default_factory=list)
    unused_waivers: list[Waiver] = field(default_factory=list)
    compared: int = 0
    cannot_judge: str | None = None

    @property
    def blocking(self) -> list[Regression]:
        return [r for r in self.regressions if r.waived_by is None]

    @property
    def waived(self) -> list[Regression]:
        return [r for r in self.regressions if r.waived_by is not None]

    @property
    def exit_code(self) -> int:
        if self.cannot_judge is not None:
            return 2
        return 1 if self.blocking else 0

    def to_dict(self) -> dict:
        def reg(r):
            d = {k: getattr(r, k) for k in ("code", "probe", "target", "what", "baseline",
                                              "candidate", "evidence")}
            d["waived_by"] = None if r.waived_by is None else waiver_dict(r.waived_by)
            return d
        return {"exit_code": self.exit_code, "compared": self.compared,
                "cannot_judge": self.cannot_judge,
                "regressions": [reg(r) for r in self.regressions],
                "expired_waivers": [waiver_dict(w) for w in self.expired_waivers],
                "unused_waivers": [waiver_dict(w) for w in self.unused_waivers]}

    def to_markdown(self) -> str:
        return render_markdown(self)


# --- reading metrics, failing closed -----------------------------------------------------

# Numbers some rule reads from any Result that holds them (estimates, their standard-error
# sources, floors, precision): present with another type, the gate cannot judge.
NUMBERS = ("bias", "bias_se", "bias_z", "mean_log_ratio", "mean_log_ratio_se",
           "mean_log_ratio_z", "se_mean", "std", "trials", "ci_low", "ci_high", "confidence",
           "min_effect", "min_bias", "accumulator_mantissa_bits")
# The label a probe derives its verdict boolean from: (metric, labels of the good value,
# labels of the bad). trainprobes.transforms.judge: equivalent = kind in EQUIVALENT;
# trainprobes.drift.verdict.classify: biased <=> drift_verdict "biased".
FLAG_LABELS = {
    "transforms.equivalence": ("transform_verdict", ("exact", "noise"),
                               ("biased", "inconsistent", "wrong")),
    "drift.compare": ("drift_verdict", ("clean", "noisy", "heavy-tailed"), ("biased",)),
    "numerics.gemm": ("gemm_verdict", ("exact", "noise"), ("biased",)),
}
# Booleans beside the verdict one whose bad value carries its own code and never passes:
# (metric, bad value, code). drift.verdict.judge: heavy_tailed -> TP-D2 (warn);
# causality.summary: batch_isolated False -> TP-C3 (fail); isolation.documents: causal
# False (its within-document causality check leaked) -> TP-C1 (fail).
SIDE_FLAGS = {
    "drift.compare": (("heavy_tailed", True, "TP-D2"),),
    "causality.check": (("batch_isolated", False, "TP-C3"),),
    "isolation.documents": (("causal", False, "TP-C1"),),
}
# The probes' own floors (ESTIMATES): growth below one is not a regression, so they must be finite.
FLOORS = ("min_effect", "min_bias", "tolerance")


class Counts(NamedTuple):
    """What a probe's verdict boolean says of counts it reports beside it (each a number, or
    a list counted by its length): with the good value every count in `zero` is 0; with the
    bad value at least one in `positive` is above 0 (empty: the Result cannot show it)."""
    zero: tuple
    positive: tuple = ()
    optional: tuple = ()  # counts older Results lack: absent reads as 0


_BATCH = Counts(("frac_rows_differ", "breaking_sizes"), ("frac_rows_differ", "breaking_sizes"))
COUNTS = {
    # causality.summary: causal = no leak at random inputs, in the scores, or at near-ties
    "causality.check": Counts(("n_leaks", "n_score_leaks", "n_near_tie_leaks"),
                              ("n_leaks", "n_score_leaks", "n_near_tie_leaks"),
                              optional=("n_near_tie_leaks",)),
    # isolation.documents: isolated = False if n_leaks, None if n_unverified or
    # n_blind_tokens, else True
    "isolation.documents": Counts(("n_leaks", "n_unverified", "n_blind_tokens"), ("n_leaks",)),
    # isolation.batch: batch_invariant = no batch size at which a row differs (breaking_sizes)
    "isolation.batch_invariance": _BATCH, "isolation.op_map": _BATCH,
    # isolation.end_to_end: invariant = no token differs at any size (d > 0, no atol); the
    # Result shows the largest size only, so a variant one need not show it
    "isolation.end_to_end": Counts(("frac_tokens_differ", "max_abs_diff")),
    # transforms.judge: replicas that disagree (n_inconsistent) make it inconsistent or wrong
    "transforms.equivalence": Counts(("n_inconsistent",)),
}
# Counts a probe reports as the sum of others: (probe, total, parts). causality.summary:
# n_leaks = structural + unconfirmed flips (the CLI shows all three side by side).
SUMS = (("causality.check", "n_leaks", ("n_structural", "n_unconfirmed")),)


class Significance(NamedTuple):
    """A verdict boolean a probe derives from its own test: bad exactly when the p-value is
    below alpha (a NaN one is not) and |estimate| reaches the floor."""
    p: str
    alpha: str
    estimate: str
    floor: str


TESTS = {
    # numerics.bias.error_stats: biased = p_value < alpha and |bias| >= min_effect
    "numerics.bias": Significance("p_value", "alpha", "bias", "min_effect"),
    # drift.verdict.classify: biased = p_value < alpha and not |mean_log_ratio| < min_bias
    "drift.compare": Significance("p_value", "alpha", "mean_log_ratio", "min_bias"),
    # numerics.gemm is not here: its verdict reads the CI against the tolerance (a point
    # estimate under it with a CI past it is biased), which gate_rules._gemm checks with the
    # probe's own is_biased / is_within
}


def _number(r: Result, name: str, side: str) -> float | None:
    try:
        return r.number(name)
    except InvalidType as e:
        raise CannotJudge(f"{side} {e}") from None
    except OverflowError:  # a JSON integer past float's range: no probe writes one
        raise CannotJudge(f"{side} {r.key!r}: metric {name}={_short(r.metrics[name])} is too "
                          "large for a float (was the report edited?)") from None


def _short(v) -> str:
    """repr of v, its middle cut: a 400-digit integer must not flood the verdict."""
    s = repr(v)
    return s if len(s) <= 40 else f"{s[:18]}...{s[-18:]} ({len(s)} characters)"


def _threshold_broken(r: Result) -> bool:
    """A configured fail_above/fail_below limit broke (trainprobes.audit.config)."""
    t = r.evidence.get("thresholds")
    return isinstance(t, dict) and bool(t.get("broken"))


def check_judgeable(r: Result, side: str) -> None:
    """Raise CannotJudge (naming side and key) unless the Result explains its own verdict
    and holds, well typed, every metric the gate's rules read from it.

    - a fail carries a code (every probe names why it fails);
    - a probe with a verdict boolean (result.PROBES) reports it, as true/false (None only
      beside fail/error), and the verdict agrees: the bad value never passes, and a fail
      with the good value is explained by another code or a broken configured threshold;
    - its labels, side booleans, counts and test agree with that boolean (FLAG_LABELS,
      SIDE_FLAGS, COUNTS, SUMS, TESTS): `causal` true beside leaks cannot be judged;
    - the numbers PROBES says the probe reports whenever it measured are present;
    - every metric in NUMBERS, and every metric PROBES documents as a number, that is
      present is a number (NaN is a number; None where a probe had nothing to report);
    - its figures agree with one another as its probe derives them (gate_rules.RULES).
    """
    if r.verdict == "error":
        return  # it measured nothing; the candidate's error is TP-E1
    where = f"{side} {r.key!r}"
    if r.verdict == "fail" and not r.codes:
        raise CannotJudge(f"{where}: verdict 'fail' carries no code, so nothing explains it "
                          "(every probe names why it fails; was the report edited?)")
    spec = PROBES.get(r.probe)
    measured = True
    if spec is not None and spec.flag is not None:
        try:
            value = r.flag()
        except CannotJudge as e:
            raise CannotJudge(f"{side} {e}") from None
        good = VERDICT_FLAGS[spec.flag]
        measured = value is not None
        # an advisory probe's bad value is a watch-out: warn, with its code, never pass
        if value is (not good) and (r.verdict == "pass" or not spec.advisory and r.passed
                                    or r.verdict == "warn" and spec.code not in r.codes):
            raise CannotJudge(f"{where}: verdict {r.verdict!r} contradicts metric "
                              f"{spec.flag}={value} (that "
                              f"{'warns' if spec.advisory else 'fails'} with {spec.code}; was "
                              "the report edited?)")
        others = [c for c in r.codes if c != spec.code]
        if value is good and r.verdict == "fail" and not others and not _threshold_broken(r):
            raise CannotJudge(f"{where}: verdict 'fail' but metric {spec.flag}={value}, and no "
                              f"other code ({r.codes}) or broken threshold explains it (was "
                              "the report edited?)")
    _check_labels(r, where, measured)
    if spec is not None and spec.flag is not None and measured:
        _check_flag_evidence(r, side, spec.flag)
    _check_derived(r, side)
    if spec is not None and measured:
        missing = [n for n in spec.needs if n not in r.metrics]
        if missing:
            raise CannotJudge(f"{where}: metric(s) {missing} missing: probe {r.probe!r} "
                              "always reports them and the gate's rules need them")
    for name in NUMBERS:
        _number(r, name, side)
    for name in FLOORS:  # abs(x) >= NaN (or inf) is False: the growth test would be skipped
        v = _number(r, name, side)
        if v is not None and not math.isfinite(v):
            raise CannotJudge(f"{where}: metric {name}={v} is the probe's floor for an effect "
                              "that matters, and is not finite (was the report edited?)")
    if spec is not None:  # every number the probe documents, not only those a rule reads
        for name, v in r.metrics.items():
            if v is not None and spec.is_number(name):
                _number(r, name, side)
    for name in VERDICT_FLAGS:  # causality's batch_invariant may be None (unknown)
        v = r.metrics.get(name)
        if v is not None and not isinstance(v, bool):
            raise CannotJudge(f"{where}: metric {name}={v!r} is mistyped: a "
                              f"{type(v).__name__}, expected true or false")
    # last: the probe's figures against each other (a bias x1000 beside its own CI), once
    # every field is known to be present and well typed
    check_consistent(r, side)


# Metrics a probe derives from one estimate: (probe, shown, estimate, offset): shown =
# offset + estimate (trainprobes.transforms.judge: scale = 1 + scale_error). The gate reads the
# estimate; an edit of the shown value alone (or of the estimate alone) cannot be judged.
DERIVED = (("transforms.equivalence", "scale", "scale_error", 1.0),)


def _check_derived(r: Result, side: str) -> None:
    where = f"{side} {r.key!r}"
    for probe, shown, est, offset in DERIVED:
        if r.probe != probe:
            continue
        a, b = _number(r, shown, side), _number(r, est, side)
        if a is None or b is None or (math.isnan(a) and math.isnan(b)):
            continue
        if not abs(a - (offset + b)) <= 1e-9 * max(1.0, abs(a)):
            raise CannotJudge(f"{where}: metric {shown}={a!r} is not {offset:g} + {est}={b!r}, "
                              "as the probe writes it (was the report edited?)")
        lo, hi = _number(r, f"{shown}_ci_low", side), _number(r, f"{shown}_ci_high", side)
        if None not in (lo, hi) and not math.isnan(lo + hi + a) and not lo <= a <= hi:
            raise CannotJudge(f"{where}: metric {shown}={a!r} lies outside its CI "
                              f"[{lo!r}, {hi!r}] (was the report edited?)")


def _count(r: Result, name: str, where: str) -> float:
    """A count the verdict boolean must agree with: a number, or a list's length."""
    if name not in r.metrics:
        raise CannotJudge(f"{where}: metric {name!r} missing: probe {r.probe!r} always reports "
                          "it beside its verdict boolean, which must agree with it")
    v = r.metrics[name]
    if isinstance(v, list):
        return float(len(v))
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CannotJudge(f"{where}: metric {name}={v!r} is mistyped: a {type(v).__name__}, "
                          "expected a number (or a list)")
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    # NaN > 0 is False and a negative part balances a sum: either would let a verdict
    # boolean agree with counts that no probe writes
    if not (math.isfinite(x) and x >= 0):
        raise CannotJudge(f"{where}: metric {name}={_short(v)} is not a count (finite and "
                          "0 or more), as the probe writes it (was the report edited?)")
    return x


def _check_flag_evidence(r: Result, side: str, flag: str) -> None:
    """The verdict boolean agrees with the counts or the test the probe derives it from
    (COUNTS, SUMS, TESTS): `causal` true beside leaks, or false beside none, was edited (or
    the probe is broken). Only for a Result that measured (its boolean is true or false)."""
    where = f"{side} {r.key!r}"
    for probe, total, parts in SUMS:
        if r.probe == probe:
            got = [_count(r, n, where) for n in (total, *parts)]
            if not got[0] == sum(got[1:]):
                raise CannotJudge(f"{where}: metric {total}={r.metrics[total]!r} is not the sum "
                                  f"of {' + '.join(parts)} ({' + '.join(format_number(v) for v in got[1:])}), "
                                  "as the probe writes it (was the report edited?)")
    test = TESTS.get(r.probe)
    if test is not None:
        _check_test(r, side, flag, test)
    rule = COUNTS.get(r.probe)
    if rule is None:
        return
    good = r.metrics[flag] is VERDICT_FLAGS[flag]
    present = lambda n: n in r.metrics or n not in rule.optional
    if good:
        above = [n for n in rule.zero if present(n) and _count(r, n, where) > 0]
        if above:
            raise CannotJudge(f"{where}: metric {flag}={r.metrics[flag]} contradicts "
                              + ", ".join(f"{n}={r.metrics[n]!r}" for n in above)
                              + f": the probe sets {flag}={r.metrics[flag]} only when "
                              f"{', '.join(rule.zero)} are all 0 (was the report edited?)")
    elif rule.positive and not any(present(n) and _count(r, n, where) > 0 for n in rule.positive):
        raise CannotJudge(f"{where}: metric {flag}={r.metrics[flag]} but "
                          + ", ".join(f"{n}={r.metrics[n]!r}" for n in rule.positive)
                          + f": the probe sets {flag}={r.metrics[flag]} only when one of them "
                          "is above 0 (was the report edited?)")


def _check_test(r: Result, side: str, flag: str, test: Significance) -> None:
    """The verdict boolean is what the probe's own test says (TESTS): `biased` false beside
    p < alpha and a bias past the floor was edited. An estimate of NaN is left alone (the two
    probes read it differently); the growth rules judge it."""
    where, got = f"{side} {r.key!r}", {}
    for name in test:
        v = _number(r, name, side)
        if v is None:
            raise CannotJudge(f"{where}: metric {name!r} missing: probe {r.probe!r} always "
                              f"reports it beside {flag}, which must agree with its test")
        got[name] = v
    p, alpha, est, floor = (got[n] for n in test)
    if not 0 < alpha < 1:  # NaN, 0 or below: `p < alpha` is never true, so never biased
        raise CannotJudge(f"{where}: metric {test.alpha}={alpha!r} is not a significance "
                          "level in (0, 1), as the probe writes it (was the report edited?)")
    if math.isnan(est):
        return
    bad = p < alpha and abs(est) >= floor
    if bad != (r.metrics[flag] is not VERDICT_FLAGS[flag]):
        raise CannotJudge(
            f"{where}: metric {flag}={r.metrics[flag]} contradicts its test: {test.p}="
            f"{format_number(p)} {'<' if p < alpha else 'is not below'} {test.alpha}="
            f"{format_number(alpha)} and |{test.estimate}|={format_number(abs(est))} "
            f"{'>=' if abs(est) >= floor else '<'} {test.floor}={format_number(floor)}, so the "
            f"probe writes {flag}={bad} (was the report edited?)")


def _check_labels(r: Result, where: str, measured: bool) -> None:
    """The labels and side booleans a probe writes agree with its verdict (FLAG_LABELS,
    SIDE_FLAGS): a transform labelled "biased" beside `equivalent` true, or a heavy-tailed
    drift that passes, was edited (or the probe is broken); neither can be judged."""
    spec = PROBES.get(r.probe)
    if r.probe in FLAG_LABELS and measured and r.metrics.get(spec.flag) is not None:
        name, good, bad = FLAG_LABELS[r.probe]
        label = r.metrics.get(name)
        if name in r.metrics and label not in good + bad:
            raise CannotJudge(f"{where}: metric {name}={label!r} is not one of "
                              f"{list(good + bad)} (was the report edited?)")
        flag = r.metrics[spec.flag]
        if name in r.metrics and (label in good) != (flag is VERDICT_FLAGS[spec.flag]):
            raise CannotJudge(f"{where}: metric {name}={label!r} contradicts "
                              f"{spec.flag}={flag} (was the report edited?)")
    for name, bad, code in SIDE_FLAGS.get(r.probe, ()):
        v = r.metrics.get(name)
        if v is not None and not isinstance(v, bool):
            raise CannotJudge(f"{where}: metric {name}={v!r} is mistyped: a "
                              f"{type(v).__name__}, expected true or false")
        if v is bad and (r.verdict == "pass" or code not in r.codes):
            raise CannotJudge(f"{where}: metric {name}={v} goes with code {code} and never "
                              f"passes, but the verdict is {r.verdict!r} with codes {r.codes} "
                              "(was the report edited?)")


# --- statistics --------------------------------------------------------------------------

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
        return _number(r, n, side)
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
    value = _number(r, name, side)
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


# --- comparison --------------------------------------------------------------------------

_fmt = format_number  # the one number format of every face (trainprobes.display)


def _control_pair(b: Result | None, c: Result) -> list[Regression]:
    """A control (Result.expected set) is judged on one thing: does it still reproduce its
    known verdict? One that did in the baseline (or is new) and does not in the candidate
    means the harness is broken on that machine (or the probe regressed)."""
    if c.reproduced or (b is not None and not b.reproduced):
        return []
    was = "new control" if b is None else f"control reproduced {b.expected!r} in the baseline"
    return [Regression("TP-G4", c.probe, c.target,
                       f"{was}, misses it in the candidate: the harness itself is broken on "
                       "this machine (or the probe regressed); not a finding about the change",
                       "absent" if b is None else f"{b.verdict} (expected {b.expected})",
                       f"{c.verdict} (expected {c.expected})", c.message)]


def _compare_pair(b: Result, c: Result, alpha: float, rel_tol: float) -> list[Regression]:
    regs: list[Regression] = []

    def add(code, what, base="", cand="", ev=""):
        regs.append(Regression(code, c.probe, c.target, what, base, cand, ev))

    if c.verdict == "error":
        add("TP-E1", "the probe errored in the candidate, so the change cannot be checked",
            b.verdict, "error", c.message)
        return regs
    if b.verdict == "error":
        # the baseline measured nothing: the candidate is judged on its own verdict
        if c.verdict == "fail":
            for code in c.codes:
                add(code, f"fails, and the baseline measured nothing (error) ({CODES[code]})",
                    "error", c.verdict, c.message)
        return regs
    spec = PROBES.get(c.probe)
    # the verdict boolean going from good to bad; `biased` is judged by its estimate below
    flag, code = (spec.flag, spec.code) if spec is not None else ("causal", "TP-C1")
    if flag is not None and flag != "biased":
        good = VERDICT_FLAGS[flag]
        if b.metrics.get(flag) is good and c.metrics.get(flag) is (not good):
            if flag == "causal":
                n = c.metrics.get("n_leaks")
                add(code, "was causal, now leaks future tokens into earlier decisions",
                    "causal", f"leaks ({n} leaks)" if n is not None else "leaks", c.message)
            elif flag == "equivalent":  # coded by what the transform became
                was, kind = b.metrics.get("transform_verdict"), c.metrics.get("transform_verdict")
                add(TRANSFORM_CODES.get(kind, code), f"was equivalent ({was}), now {kind} (worst "
                    f"parameter {c.metrics.get('worst_parameter')})", str(was), str(kind), c.message)
            else:
                add(code, f"was {flag} = {good}, now {flag} = {not good}",
                    f"{flag} = {good}", f"{flag} = {not good}", c.message)
    for code, name, label, floor in ESTIMATES:
        eb, ec = estimate(b, name, "baseline"), estimate(c, name, "candidate")
        shown = label if label == name else f"{label} ({name})"
        if eb and not ec and name in c.metrics:
            # NaN (or without a finite standard error): skipping the test would pass a
            # candidate whose estimate cannot be shown not to have grown
            add(code, f"{shown} cannot be tested in the candidate: the value is NaN, "
                "or its standard error is NaN, infinite or has no source", f"{eb[0]:.4g} ± {eb[1]:.2g} (SE)",
                f"{_fmt(c.metrics.get(name))} ± {_fmt(standard_error(c, name))} (SE)",
                c.message)
            continue
        # Growth that stays below the probe's own floor (drift min_bias, bias min_effect)
        # is significant and harmless: the candidate's probe would not fail it either. The
        # lower of the two reports' floors: a candidate that raised its own (a config edit in
        # the change under review) must not silence the test of that change.
        floors = [f for f in (_number(b, floor, "baseline"), _number(c, floor, "candidate"))
                  if f is not None]
        if eb and ec and abs(ec[0]) >= min(floors, default=0.0):
            sig, z, p = larger_magnitude(eb, ec, alpha, rel_tol)
            if sig:
                ratio = abs(ec[0]) / abs(eb[0]) if eb[0] else math.inf
                times = (f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x") \
                    if math.isfinite(ratio) else "from zero"
                add(code, f"{shown} significantly larger in magnitude ({times})",
                    f"{eb[0]:.4g} ± {eb[1]:.2g} (SE)", f"{ec[0]:.4g} ± {ec[1]:.2g} (SE)",
                    f"one-sided z = {_fmt(z)}, p = {p:.2g} < alpha = {alpha}")
    bb = _number(b, "accumulator_mantissa_bits", "baseline")
    cb = _number(c, "accumulator_mantissa_bits", "candidate")
    if bb is not None and cb is not None and not cb >= bb:
        add("TP-B3", f"revealed accumulator precision fell by {bb - cb:g} mantissa bits",
            f"{bb:g} bits", f"{cb:g} bits", c.message)
    if "TP-D3" in c.codes and "TP-D3" not in b.codes:
        add("TP-G3", "drift went over its threshold", b.verdict, c.verdict, c.message)
    # Any other verdict that worsened is reported as that, with the probe's own codes
    # (check_judgeable made sure a fail carries one and its metrics agree), and a Result
    # that already failed (a known leak, accepted) must not hide a new way to fail (TP-C3
    # beside the known TP-C1; a biased transform now wrong, TP-T3). Codes a rule above
    # already reported (the flag's or estimate's code, TP-D3 as TP-G3, TP-B3) are not
    # repeated; any other is its own regression, so a waiver of one (TP-C1) does not hide
    # another that is new (TP-C3).
    if c.verdict == "fail" and (b.passed or b.verdict == "fail"):
        covered = {r.code for r in regs} | (set(b.codes) if b.verdict == "fail" else set())
        if regs:
            covered |= {"TP-D3", "TP-B3"} | ({spec.code} if spec is not None else set())
        for code in [x for x in c.codes if x not in covered]:
            if b.passed:
                add(code, f"verdict went from {b.verdict} to fail ({CODES[code]})",
                    b.verdict, c.verdict, c.message)
            else:
                add(code, f"fails with a new code ({CODES[code]}); the baseline failed with "
                    f"{', '.join(b.codes)} only", ", ".join(b.codes), ", ".join(c.codes),
                    c.message)
    return regs


def _duplicates(side: str, results: list[Result]) -> str | None:
    seen, dups = set(), []
    for r in results:
        if r.key in seen and r.key not in dups:
            dups.append(r.key)
        seen.add(r.key)
    if not dups:
        return None
    # keeping either of two Results under one key would let a failing duplicate pass unseen
    return (f"{side} holds more than one Result for {len(dups)} key(s), e.g. {dups[0]!r}: "
            "Results are matched by probe::target, so each needs its own target (give each "
            "audit entry its own name)")


def _problems(base: dict, cand: dict) -> list[str]:
    """Every reason the gate cannot judge, over both reports (all of them, not the first)."""
    out = []
    for side, results in (("baseline", base), ("candidate", cand)):
        for r in results.values():
            try:
                check_judgeable(r, side)
            except CannotJudge as e:
                out.append(str(e))
    for key, c in cand.items():
        b = base.get(key)
        if b is not None and b.expected != c.expected:
            out.append(f"{key!r}: the control's known verdict differs between the reports "
                       f"(baseline expected={b.expected!r}, candidate expected={c.expected!r}); "
                       "a control cannot become a finding or change its known verdict unseen")
    return out


def compare(baseline: list[Result], candidate: list[Result], *, waivers=(),
            alpha: float = 0.01, rel_tol: float = 0.1, today: date | None = None) -> GateReport:
    """Compare two lists of Results matched by `Result.key`; apply unexpired waivers.

    alpha: level of the one-sided tests; rel_tol: smallest relative growth of a bias or
    drift estimate that counts (default 10%), on top of significance. Fails closed: any
    Result that cannot be judged (check_judgeable) makes the report "cannot judge" (exit 2).
    """
    alpha = check_number(alpha, "alpha", min=0.0, max=1.0, min_open=True, max_open=True,
                         hint="e.g. 0.01")
    rel_tol = check_number(rel_tol, "rel_tol", min=0.0, hint="e.g. 0.1 (10%)")
    today = today or date.today()
    for side, results in (("baseline", baseline), ("candidate", candidate)):
        dup = _duplicates(side, results)
        if dup:
            return GateReport(cannot_judge=dup)
    base = {r.key: r for r in baseline}
    cand = {r.key: r for r in candidate}
    problems = _problems(base, cand)
    if problems:
        return GateReport(cannot_judge=(f"{len(problems)} Result(s) cannot be judged:\n"
                                        if len(problems) > 1 else "") + "\n".join(problems))
    report = GateReport()
    for key, b in base.items():
        c = cand.get(key)
        if c is None:
            report.regressions.append(Regression(
                "TP-G1", b.probe, b.target, "probe present in the baseline is missing from the "
                "candidate, so it was not checked", b.verdict, "missing"))
            continue
        report.compared += 1
        report.regressions.extend(_control_pair(b, c) if c.is_control else
                                  _compare_pair(b, c, alpha, rel_tol))
    for key, c in cand.items():
        if key in base:
            continue
        if c.is_control:
            report.regressions.extend(_control_pair(None, c))
        elif c.verdict in ("fail", "error"):
            for code in (c.codes if c.verdict == "fail" else ["TP-E1"]):
                report.regressions.append(Regression(
                    code, c.probe, c.target, f"new probe fails ({CODES[code]})",
                    "absent", c.verdict, c.message))
    live = [w for w in waivers if w.expires >= today]
    report.expired_waivers = [w for w in waivers if w.expires < today]
    used = set()
    for r in report.regressions:
        for w in live:
            if w.matches(r.code, r.key, r.target):
                r.waived_by = w
                used.add(w)
                break
    report.unused_waivers = [w for w in live if w not in used]
    if not report.compared and not report.blocking:
        # nothing in both reports and nothing blocking: a pass here would have checked nothing
        report.cannot_judge = (
            f"nothing to compare: the baseline holds {len(base)} Result(s), the candidate "
            f"{len(cand)}, and no probe::target is in both; save a report of the base branch "
            f"as the baseline (the same command and suite as the candidate)")
    return report


def gate_files(baseline_path, candidate_path, waivers_path=None, *, alpha: float = 0.01,
               rel_tol: float = 0.1, today: date | None = None) -> GateReport:
    """Load both reports (and waivers) and compare; any fault to read is `cannot_judge`."""
    try:
        waivers = load_waivers(waivers_path) if waivers_path else []
        try:
            baseline, _ = load_results(baseline_path)
        except SchemaError as e:
            raise CannotJudge(f"baseline: {e}") from e
        try:
            candidate, _ = load_results(candidate_path)
        except SchemaError as e:
            raise CannotJudge(f"candidate: {e}") from e
        if not baseline:
            raise CannotJudge(f"baseline {str(baseline_path)!r} holds no results: nothing to "
                              "compare against; regenerate it with 'trainprobes audit'")
    except CannotJudge as e:
        return GateReport(cannot_judge=str(e))
    return compare(baseline, candidate, waivers=waivers, alpha=alpha, rel_tol=rel_tol,
                   today=today)
