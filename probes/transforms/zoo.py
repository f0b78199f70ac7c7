"""The zoo of published bugs (trainprobes.reference.bugs) run as controls through the probe.

    rows = run_zoo(trials=16, seed=0)   # every bug and its fixed twin on one set of 2 ranks

Each row holds the buggy step's Result (expected: its known verdict kind, Result.expected
"fail") and the fixed twin's (expected: exact or noise, "pass"), what today's tolerance
checks would have flagged (trainprobes.transforms.tolerances), and whether the measured
scale factors contain the analytic ones the arithmetic gives.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

from scipy import stats
from trainprobes.reference.bugs import ZOO, Bug, data
from trainprobes.result import Result
from trainprobes.transforms.custom import Custom
from trainprobes.transforms.equivalence import Probe, run_probes
from trainprobes.transforms.judge import EQUIVALENT
from trainprobes.transforms.step import TrainingStep

__all__ = ["ZooRow", "zoo_probes", "run_zoo", "analytic_checks"]


class ZooRow(NamedTuple):
    bug: Bug
    buggy: Result
    fixed: Result

    @property
    def reproduced(self) -> bool:
        """The bug gets its known verdict and the fixed twin is equivalent."""
        return (self.buggy.metrics.get("transform_verdict") == self.bug.expected
                and self.fixed.metrics.get("transform_verdict") in EQUIVALENT)


def step_of(bug: Bug) -> TrainingStep:
    return TrainingStep(model=bug.model, batch=bug.batch, loss=bug.loss or data.loss, tokens=data.tokens,
                        name=f"zoo.{bug.name}")


def zoo_probes(bugs=ZOO, *, trials: int = 16, seed: int = 0, fixed_only: bool = False,
               **options) -> list:
    """[Probe] for every bug (unless fixed_only) and its fixed twin, in zoo order."""
    out = []
    for b in bugs:
        step = step_of(b)
        if not fixed_only:
            out.append(Probe(step, Custom(b.buggy, title=b.name), trials, seed,
                             target=f"zoo.{b.name}[bug]", expected="fail", tolerances=True, **options))
        out.append(Probe(step, Custom(b.fixed, title=f"{b.name}.fixed"), trials, seed,
                         target=f"zoo.{b.name}[fixed]", expected="pass", tolerances=True, **options))
    return out


def run_zoo(bugs=ZOO, *, trials: int = 16, seed: int = 0, backend: str = "gloo", timeout: float = 600.0,
            progress: Callable | None = None, **options) -> list:
    """Every bug beside its fixed twin, on one launch of 2 ranks."""
    bugs = tuple(bugs)
    results = run_probes(zoo_probes(bugs, trials=trials, seed=seed, **options), world=2,
                         backend=backend, timeout=timeout, progress=progress)
    for r, b in zip(results[0::2], bugs):
        r.metrics["known_verdict"] = b.expected
        r.metrics["matches_known_verdict"] = r.metrics["transform_verdict"] == b.expected
    for r in results[1::2]:
        r.metrics["known_verdict"] = "equivalent"
        r.metrics["matches_known_verdict"] = r.metrics["equivalent"]
    return [ZooRow(b, results[2 * i], results[2 * i + 1]) for i, b in enumerate(bugs)]


def _within(value: float, lo: float, hi: float) -> bool:
    slack = 1e-6 * max(1.0, abs(value))  # rounding of an fp32 step around an exact ratio
    return lo - slack <= value <= hi + slack


def analytic_checks(row: ZooRow) -> list:
    """[(what, analytic, estimate, ci_low, ci_high, within)] for the row's analytic values."""
    a, m = row.bug.analytic, row.buggy.metrics
    if a is None:
        return []
    out = []
    if a.scale is not None:
        out.append(("gradient scale", a.scale, m["scale"], m["scale_ci_low"], m["scale_ci_high"]))
    if a.loss_scale is not None and "loss_scale" in m:
        out.append(("loss scale", a.loss_scale, m["loss_scale"], m["loss_scale_ci_low"],
                    m["loss_scale_ci_high"]))
    table = {p["parameter"]: p for p in row.buggy.evidence["parameters"]}
    for name, value in (a.parameters or {}).items():
        p = table[name]
        half = stats.t.ppf(1 - m["alpha"] / 2, m["trials"] - 1) * p["scale_se"] \
            if not math.isnan(p["scale_se"]) else math.nan
        out.append((f"{name} scale", value, p["scale"], p["scale"] - half, p["scale"] + half))
    return [(w, v, e, lo, hi, _within(v, lo, hi)) for w, v, e, lo, hi in out]
