"""Whether the gate can judge a Result: it explains its own verdict, holds every metric a
rule reads, well typed, and its figures agree with one another (trainprobes.gate.rules, where
each probe family declares its tables). Anything else is "cannot judge", naming the side, the
key and the field."""
from __future__ import annotations

import math

from trainprobes.display import format_number
from trainprobes.errors import CannotJudge, InvalidType
from trainprobes.gate.rules import (
    COUNTS,
    DERIVED,
    FLAG_LABELS,
    SIDE_FLAGS,
    SUMS,
    TESTS,
    Significance,
    check_consistent,
)
from trainprobes.gate.rules.base import threshold_broken
from trainprobes.result import PROBES, VERDICT_FLAGS, Result

# Numbers some rule reads from any Result that holds them (estimates, their standard-error
# sources, floors, precision): present with another type, the gate cannot judge.
NUMBERS = ("bias", "bias_se", "bias_z", "mean_log_ratio", "mean_log_ratio_se",
           "mean_log_ratio_z", "se_mean", "std", "trials", "ci_low", "ci_high", "confidence",
           "min_effect", "min_bias", "accumulator_mantissa_bits")
# The probes' own floors (ESTIMATES): growth below one is not a regression, so they must be finite.
FLOORS = ("min_effect", "min_bias", "tolerance")


def read_number(r: Result, name: str, side: str) -> float | None:
    """Metric `name` of r as a float, None when absent; mistyped or too large: CannotJudge
    naming the side."""
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
    - its figures agree with one another as its probe derives them (trainprobes.gate.rules).
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
        if value is good and r.verdict == "fail" and not others and not threshold_broken(r):
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
        read_number(r, name, side)
    for name in FLOORS:  # abs(x) >= NaN (or inf) is False: the growth test would be skipped
        v = read_number(r, name, side)
        if v is not None and not math.isfinite(v):
            raise CannotJudge(f"{where}: metric {name}={v} is the probe's floor for an effect "
                              "that matters, and is not finite (was the report edited?)")
    if spec is not None:  # every number the probe documents, not only those a rule reads
        for name, v in r.metrics.items():
            if v is not None and spec.is_number(name):
                read_number(r, name, side)
    for name in VERDICT_FLAGS:  # causality's batch_invariant may be None (unknown)
        v = r.metrics.get(name)
        if v is not None and not isinstance(v, bool):
            raise CannotJudge(f"{where}: metric {name}={v!r} is mistyped: a "
                              f"{type(v).__name__}, expected true or false")
    # last: the probe's figures against each other (a bias x1000 beside its own CI), once
    # every field is known to be present and well typed
    check_consistent(r, side)


def _check_derived(r: Result, side: str) -> None:
    where = f"{side} {r.key!r}"
    for probe, shown, est, offset in DERIVED:
        if r.probe != probe:
            continue
        a, b = read_number(r, shown, side), read_number(r, est, side)
        if a is None or b is None or (math.isnan(a) and math.isnan(b)):
            continue
        if not abs(a - (offset + b)) <= 1e-9 * max(1.0, abs(a)):
            raise CannotJudge(f"{where}: metric {shown}={a!r} is not {offset:g} + {est}={b!r}, "
                              "as the probe writes it (was the report edited?)")
        lo, hi = read_number(r, f"{shown}_ci_low", side), read_number(r, f"{shown}_ci_high", side)
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
        v = read_number(r, name, side)
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
