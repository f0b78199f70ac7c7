"""The gate's comparison: two reports matched by probe::target, each pair judged by its
probe's verdict boolean, its estimates' growth, its precision and its codes; waivers applied."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import date

from trainprobes.display import format_number
from trainprobes.errors import CannotJudge
from trainprobes.gate.judgeable import check_judgeable, read_number
from trainprobes.gate.render import render_markdown
from trainprobes.gate.statistics import estimate, larger_magnitude, standard_error
from trainprobes.gate.waivers import Waiver, load_waivers, waiver_dict
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
        floors = [f for f in (read_number(b, floor, "baseline"), read_number(c, floor, "candidate"))
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
    bb = read_number(b, "accumulator_mantissa_bits", "baseline")
    cb = read_number(c, "accumulator_mantissa_bits", "candidate")
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
    # Nothing in both reports: every baseline Result is "missing" (TP-G1) only because the two
    # reports are of different suites, so neither a pass nor those TP-G1s would mean anything.
    # A candidate Result that fails on its own still blocks: a finding is never hidden.
    own = [r for r in report.blocking if r.code != "TP-G1"]
    if not report.compared and not own:
        def keys(results):
            shown = ", ".join(repr(k) for k in list(results)[:2])
            return f"{len(results)} Result(s)" + (f" ({shown}{', ...' if len(results) > 2 else ''})"
                                                   if results else "")
        report.regressions = []
        report.cannot_judge = (
            f"nothing to compare: the baseline holds {keys(base)}, the candidate {keys(cand)}, "
            "and no probe::target is in both (are they reports of the same suite?); save a "
            "report of the base branch as the baseline, from the same command and suite as the "
            "candidate")
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
