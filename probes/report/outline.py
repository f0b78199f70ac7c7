"""What every report says first, in one place for the terminal, summary.md and report.html.

A Result is a *finding* (about the user's code or this machine) or a *control* (a case with
a known verdict, `Result.expected`). Findings are ranked by how bad they are; controls are
counted per family as reproduced or missed. A missed control means the harness itself did
not work here, so it ranks with the worst findings.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from trainprobes.display import format_number
from trainprobes.result import Result

# Worst first.
SEVERITY = {"error": 0, "fail": 1, "warn": 2, "pass": 3}

# Metrics that say what a Result found, in the order a reader wants them; the markdown
# table shows the first few present and the history plots trends of the numeric ones.
HEADLINE_METRICS = ("causal", "n_leaks", "flip_rate", "bias", "mean_log_ratio", "k3_kl",
                    "frac_ratio_outside", "accumulator_mantissa_bits", "max_ulp_error",
                    "bitwise_match_fraction", "relative_error", "update_relative_error",
                    "max_abs_relative_error", "mismatch_rate", "rel_error", "p_value")
# Numeric metrics whose change across runs is worth a trend line (p-values only jitter).
TREND_METRICS = tuple(m for m in HEADLINE_METRICS if m not in ("causal", "p_value"))
# What each trend metric is measured in: every axis says it.
METRIC_UNITS = {"n_leaks": "decisions", "flip_rate": "fraction of decisions",
                "bias": "relative error", "mean_log_ratio": "nats/token", "k3_kl": "nats/token",
                "frac_ratio_outside": "fraction of tokens",
                "accumulator_mantissa_bits": "bits", "max_ulp_error": "ulp",
                "bitwise_match_fraction": "fraction", "relative_error": "relative error",
                "update_relative_error": "relative error",
                "max_abs_relative_error": "relative error", "mismatch_rate": "fraction",
                "rel_error": "relative error"}
# Where a family measures a metric in another unit: a collective's bias is the mean signed
# error in ulps of the output (trainprobes.distributed.compare), not a relative error.
FAMILY_UNITS = {"distributed.collective": {"bias": "ulp"}}


def metric_unit(family_name: str, metric: str) -> str:
    """The unit `metric` has in Results of `family_name` (numerics.bias, ...)."""
    return FAMILY_UNITS.get(family_name, {}).get(metric, METRIC_UNITS.get(metric, ""))


# What each trend metric is, in words: plot titles and axes say this, never the key.
METRIC_LABELS = {"causal": "causal", "n_leaks": "leaking decisions", "flip_rate": "flip rate",
                 "bias": "bias",
                 "mean_log_ratio": "mean log-ratio (infer - train)", "k3_kl": "KL estimate k3",
                 "frac_ratio_outside": "tokens with importance ratio outside the clip",
                 "accumulator_mantissa_bits": "accumulator mantissa bits",
                 "max_ulp_error": "largest error", "bitwise_match_fraction": "bitwise match",
                 "relative_error": "relative error", "update_relative_error": "update relative error",
                 "max_abs_relative_error": "largest relative error", "mismatch_rate": "mismatch rate",
                 "rel_error": "relative error", "p_value": "p-value"}


def metric_label(name: str) -> str:
    """A metric in words (METRIC_LABELS), its key where no label is known."""
    return METRIC_LABELS.get(name, name)


@dataclass(frozen=True)
class Badge:
    text: str    # what the reader sees, in words (no emoji: many fonts lack them)
    css: str     # the class report.html styles it with
    title: str   # what it means, for a tooltip


def badge(r: Result) -> Badge:
    if r.verdict == "error":
        return Badge("ERROR", "b-error", "the check could not run: its traceback is in the evidence")
    if r.is_control:
        if r.reproduced:
            return Badge("OK", "b-ok", f"control reproduced its known verdict ({r.expected})")
        return Badge("MISSED", "b-missed", f"control missed its known verdict: expected "
                                           f"{r.expected}, got {r.verdict}; the harness is "
                                           "not working as designed here")
    return {"pass": Badge("PASS", "b-pass", "fine"),
            "warn": Badge("WARN", "b-warn", "watch out: worth a look, not a failure"),
            "fail": Badge("FAIL", "b-fail", "a finding: this fails the audit")}[r.verdict]


def family(r: Result) -> str:
    """The probe family a Result belongs to: numerics.bias, causality.check, ..."""
    return ".".join(r.probe.split(".")[:2])


def is_problem(r: Result) -> bool:
    """What fails an audit: an error, a failing finding, a control that missed."""
    return r.verdict == "error" or r.reproduced is False or (not r.is_control and r.verdict == "fail")


def rank(r: Result) -> int:
    """Sort key, worst first: errors, missed controls, failing, warning, passing findings."""
    if r.verdict == "error":
        return 0
    if r.reproduced is False:
        return 1
    return 1 + SEVERITY[r.verdict] if not r.is_control else 9


def findings(results: list[Result]) -> list[Result]:
    """The findings, worst first (stable within a verdict: suite order)."""
    return sorted((r for r in results if not r.is_control), key=rank)


def controls(results: list[Result]) -> list[Result]:
    return [r for r in results if r.is_control]


@dataclass
class FamilyCalibration:
    family: str
    controls: list = field(default_factory=list)

    @property
    def reproduced(self) -> int:
        return sum(bool(r.reproduced) for r in self.controls)

    @property
    def missed(self) -> list[Result]:
        return [r for r in self.controls if not r.reproduced]

    def line(self) -> str:
        n = len(self.controls)
        text = f"{self.family}: {self.reproduced} of {n} control{'s' if n != 1 else ''} reproduced"
        if self.missed:
            text += "; missed: " + ", ".join(r.target for r in self.missed)
        return text


def calibration(results: list[Result]) -> list[FamilyCalibration]:
    """One entry per family that has controls, in suite order."""
    fams: OrderedDict[str, FamilyCalibration] = OrderedDict()
    for r in controls(results):
        fams.setdefault(family(r), FamilyCalibration(family(r))).controls.append(r)
    return list(fams.values())


def counts(results: list[Result]) -> str:
    """'3 pass, 1 warn' over the given Results' verdicts."""
    n = {v: sum(r.verdict == v for r in results) for v in SEVERITY}
    return ", ".join(f"{n[v]} {v}" for v in ("pass", "warn", "fail", "error") if n[v])


def headline(results: list[Result]) -> str:
    """One line: findings by verdict, then controls reproduced; errors named by count."""
    found, ctl = findings(results), controls(results)
    parts = []
    if found or not ctl:
        parts.append("findings: " + (counts(found) or "none"))
    if ctl:
        ok = sum(bool(r.reproduced) for r in ctl)
        errors = sum(r.verdict == "error" for r in ctl)
        parts.append(f"calibration: {ok} of {len(ctl)} controls reproduced"
                     + (f" ({errors} errored)" if errors else ""))
    return "; ".join(parts)


def known(r: Result) -> str:
    """'control, known fail' / 'finding': what kind of Result this is, in words."""
    return f"control, known {r.expected}" if r.is_control else "finding"


def key_metrics(r: Result, limit: int = 4) -> str:
    shown = [k for k in HEADLINE_METRICS if k in r.metrics][:limit]
    if not shown:
        shown = [k for k, v in r.metrics.items() if isinstance(v, (int, float))][:limit]
    return ", ".join(f"{k}={format_number(r.metrics[k])}" for k in shown)


@dataclass(frozen=True)
class Advice:
    means: str    # what the code means for the reader's training
    todo: str     # what to do about it


# What a warning code means for the reader and what to do: every WARN card says it.
ADVICE = {
    "TP-I2": Advice("the same row gives different bits alone and inside a batch (a kernel "
                    "picks its reduction order by batch size): a sampler and a trainer that "
                    "batch differently see different log-probs, a few ulps here",
                    "nothing, if ulp-level train/inference drift is acceptable; for bitwise "
                    "equality use batch-invariant kernels, or compare with `trainprobes drift`"),
    "TP-B3": Advice("this machine's kernel keeps partial sums in fewer bits than fp32: long "
                    "reductions (large K, long sequences) lose small terms",
                    "keep long reductions in fp32 (or split K); check the kernel's accumulator "
                    "setting (e.g. torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)"),
    "TP-B2": Advice("a running sum stops growing: each add is under half an ulp of the sum",
                    "accumulate in a wider format (fp32) or use Kahan/pairwise summation"),
    "TP-D2": Advice("a few tokens carry most of the train/inference disagreement: importance "
                    "ratios of those tokens are far from 1",
                    "look at the tokens in the tail (drift localisation); clip or mask them "
                    "in the loss (e.g. truncated importance sampling)"),
    "TP-D1": Advice("inference log-probs sit on one side of the trainer's",
                    "find the op where the two engines part (`trainprobes drift` localisation)"),
    "TP-B1": Advice("the result is wrong in the same direction every time, so it compounds",
                    "run the reduction in a wider format or with an unbiased order"),
    "TP-C2": Advice("the target gave different outputs for the same input",
                    "seed it or make it deterministic before judging causality"),
}


def advice(r: Result) -> list[tuple[str, Advice]]:
    """(code, advice) for each of a Result's codes that has advice."""
    return [(c, ADVICE[c]) for c in r.codes if c in ADVICE]
