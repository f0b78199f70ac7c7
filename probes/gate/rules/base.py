"""What every rule shares: a Result's fields read failing closed (Reader), agreement to
rounding (close) and the tables a probe family declares beside its rule (Counts,
Significance)."""
from __future__ import annotations

import math
from typing import NamedTuple

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


def fmt(v) -> str:
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
            self.fail(f"{what}={fmt(x)} is not a count (a whole number, 0 or more)")
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
            self.fail(f"metric {name}={fmt(got)} is not {how} = {fmt(want)}, as the probe "
                      "writes it")

    def codes_agree(self, code: str, present: bool, why: str):
        # a broken fail_above/fail_below limit adds its family's code (audit.thresholds)
        if not present and code in self.r.codes and threshold_broken(self.r):
            return
        if present != (code in self.r.codes):
            self.fail(f"codes {self.r.codes} {'lack' if present else 'carry'} {code}, but {why}")

    def verdict_is(self, allowed: tuple, why: str):
        if self.r.verdict not in allowed and not threshold_broken(self.r):
            self.fail(f"verdict {self.r.verdict!r} contradicts {why}: the probe writes "
                      f"{' or '.join(map(repr, allowed))}")


def threshold_broken(r: Result) -> bool:
    """A configured fail_above/fail_below limit broke (trainprobes.audit.config): it fails a
    Result whatever the probe's own verdict was."""
    t = r.evidence.get("thresholds")
    return isinstance(t, dict) and bool(t.get("broken"))


def t_p(mean: float, se: float, df: float) -> float:
    """Two-sided p of Student's t = mean / se with df degrees of freedom; se == 0: 1 for a
    zero mean, else 0 (numerics.bias.error_stats)."""
    from scipy import stats
    if se == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    return float(2 * stats.t.sf(abs(mean / se), df))


def p_agree(rd: Reader, name: str, got: float, want: float, how: str):
    if not (got < P_TINY and want < P_TINY):
        rd.agree(name, got, want, how, rel=P_REL, tiny=1e-300)


def deterministic(rd: Reader, flag: str) -> None:
    """A probe that measured (its verdict boolean true or false) found the target
    deterministic: a nondeterministic one returns early with the boolean None (TP-C2)."""
    if rd.m.get(flag) is not None and rd.flag("deterministic", optional=True) is False:
        rd.fail(f"deterministic=False beside {flag}={rd.m[flag]}: the probe judges only a "
                f"deterministic target (else {flag}=None, TP-C2)")


class Counts(NamedTuple):
    """What a probe's verdict boolean says of counts it reports beside it (each a number, or
    a list counted by its length): with the good value every count in `zero` is 0; with the
    bad value at least one in `positive` is above 0 (empty: the Result cannot show it)."""
    zero: tuple
    positive: tuple = ()
    optional: tuple = ()  # counts older Results lack: absent reads as 0


class Significance(NamedTuple):
    """A verdict boolean a probe derives from its own test: bad exactly when the p-value is
    below alpha (a NaN one is not) and |estimate| reaches the floor."""
    p: str
    alpha: str
    estimate: str
    floor: str
