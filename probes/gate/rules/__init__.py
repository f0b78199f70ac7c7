"""The gate's judgeability rules, one module per probe family: a Result read against itself.

A report is judged on figures a probe derives from one another (a bias and its confidence
interval, a z statistic and its p-value, a bitwise match fraction and its verdict). An edit of
one of them alone, e.g. a bias multiplied by 1000 whose standard error was taken as
bias / bias_z and so grew with it, made a contradiction no probe writes; the gate must not
pass it. Each probe in trainprobes.result.PROBES has one rule, in its family's module (numerics,
distributed, drift, causality, transforms, isolation), merged into RULES here (a test fails
for a probe without one). A rule:

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

Beside its rule, a family declares the tables check_judgeable reads for its probes
(trainprobes.gate.judgeable): FLAG_LABELS, SIDE_FLAGS, COUNTS, SUMS, TESTS, DERIVED.
"""
from __future__ import annotations

from typing import Callable

from trainprobes.gate.rules import causality, distributed, drift, isolation, numerics, transforms
from trainprobes.gate.rules.base import Counts, Reader, Significance
from trainprobes.result import Result

FAMILIES = (numerics, distributed, drift, causality, transforms, isolation)


def _merged(name: str) -> dict:
    out: dict = {}
    for family in FAMILIES:
        table = getattr(family, name, {})
        clash = set(out) & set(table)
        assert not clash, f"probe(s) {sorted(clash)} have {name} in two families"
        out.update(table)
    return out


RULES: dict[str, Callable[[Reader], None]] = _merged("RULES")
# The label a probe derives its verdict boolean from: (metric, labels of the good value,
# labels of the bad)
FLAG_LABELS: dict[str, tuple] = _merged("FLAG_LABELS")
# Booleans beside the verdict one whose bad value carries its own code and never passes:
# (metric, bad value, code)
SIDE_FLAGS: dict[str, tuple] = _merged("SIDE_FLAGS")
COUNTS: dict[str, Counts] = _merged("COUNTS")
TESTS: dict[str, Significance] = _merged("TESTS")
# Counts a probe reports as the sum of others: (probe, total, parts)
SUMS: tuple = tuple(s for f in FAMILIES for s in getattr(f, "SUMS", ()))
# Metrics a probe derives from one estimate: (probe, shown, estimate, offset)
DERIVED: tuple = tuple(d for f in FAMILIES for d in getattr(f, "DERIVED", ()))


def check_consistent(r: Result, side: str) -> None:
    """Raise CannotJudge unless r's figures agree with one another as its probe derives them
    (RULES). A Result that measured nothing (verdict error) is left to the gate's TP-E1."""
    rule = RULES.get(r.probe)
    if rule is None or r.verdict == "error":
        return
    rule(Reader(r, side))
