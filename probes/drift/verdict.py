"""The drift verdict, shared by `compare` and `DriftMonitor.summary`: the options it reads,
the classification of metrics into clean / noisy / biased / heavy-tailed, and the Result.
The rules and their reasons are in trainprobes.drift.compare's module doc."""
from __future__ import annotations

import math

from trainprobes.drift.stats import METRICS
from trainprobes.errors import InvalidArgument
from trainprobes.result import Result
from trainprobes.validation import check_number, check_type

DRIFT_VERDICTS = ("clean", "noisy", "biased", "heavy-tailed")


def check_options(*, alpha, clip, clean_tol, noise_kl_max, tail_frac, tail_share_min, kl_warn,
                  min_bias=0.0, thresholds=None) -> dict | None:
    """Check the verdict options (naming the bad one); returns thresholds as a dict (or None)."""
    check_number(alpha, "alpha", min=0, max=1, min_open=True, max_open=True, hint="e.g. 0.01")
    check_number(clip, "clip", min=1, min_open=True,
                 hint="the ratio band is [1/clip, clip], e.g. 2.0")
    for name, v in (("clean_tol", clean_tol), ("noise_kl_max", noise_kl_max), ("kl_warn", kl_warn),
                    ("min_bias", min_bias)):
        check_number(v, name, min=0, finite=False)  # inf: never warn / never fail
    for name, v in (("tail_frac", tail_frac), ("tail_share_min", tail_share_min)):
        check_number(v, name, min=0, max=1, min_open=True)
    if thresholds is None:
        return None
    check_type(dict, thresholds, "thresholds", hint="a dict metric -> max allowed |value|")
    unknown = [k for k in thresholds if k not in METRICS]
    if unknown:
        raise InvalidArgument(f"thresholds names unknown metrics {unknown!r}; known: {sorted(METRICS)}")
    return {k: check_number(v, f"thresholds[{k!r}]", finite=False, hint="the max allowed |value|")
            for k, v in thresholds.items()}


def classify(metrics: dict, *, alpha: float, clean_tol: float, tail_frac: float,
             tail_share_min: float) -> tuple:
    """(drift_verdict, biased, heavy_tailed, reason) from the metrics; shared with the monitor."""
    p = metrics["p_value"]
    significant = bool(math.isfinite(p) and p < alpha)
    tiny = abs(metrics["mean_log_ratio"]) < metrics.get("min_bias", 0.0)
    biased = significant and not tiny
    frac, share = metrics["frac_ratio_outside"], metrics["tail_share"]
    heavy = bool(0 < frac <= tail_frac and share >= tail_share_min)
    mean, lo, hi = metrics["mean_log_ratio"], metrics.get("ci_low"), metrics.get("ci_high")
    if biased:
        ci = f" [{lo:.3g}, {hi:.3g}]" if lo is not None else ""
        why = ("and the excess over the x^2/2 that small sampling noise gives is significant too"
               if metrics["k2_kl"] <= metrics.get("noise_kl_max", 0.0) else
               f"and k2 {metrics['k2_kl']:.3g} is too large for rounding noise")
        reason = (f"mean log-ratio (infer - train) {mean:.3g}{ci} nats/token is not zero-mean noise "
                  f"(p = {p:.2g} < alpha {alpha:g}, {why})")
        label = "biased"
    elif heavy:
        reason = (f"{frac:.2%} of tokens have an importance ratio outside [1/C, C] and carry "
                  f"{share:.0%} of the squared log-ratio (max |log-ratio| "
                  f"{metrics['max_abs_log_ratio']:.3g})")
        label = "heavy-tailed"
    elif metrics["std_log_ratio"] <= clean_tol and frac == 0:
        reason = (f"log-ratios have std {metrics['std_log_ratio']:.2g} <= {clean_tol:g} nats and no "
                  f"ratio outside the band")
        if significant:
            reason += (f"; a significant bias {mean:.2g} nats/token lies below min_bias "
                       f"{metrics['min_bias']:g} (p = {p:.2g})")
        label = "clean"
    else:
        why = ("bias untestable with one sequence (pass more rows, or lengths=)" if not math.isfinite(p)
               else "no significant bias" if p >= alpha
               else f"a significant bias below min_bias {metrics['min_bias']:g} nats/token" if tiny
               else "mean explained by noise")
        reason = (f"zero-mean mismatch, {why} (p = {p:.2g}); std {metrics['std_log_ratio']:.3g} nats, "
                  f"k3 KL(infer||train) {metrics['k3_kl']:.3g}")
        label = "noisy"
    return label, biased, heavy, reason


def judge(metrics: dict, evidence: dict, *, alpha: float, clean_tol: float, tail_frac: float,
          tail_share_min: float, kl_warn: float, thresholds: dict | None, probe: str, target: str) -> Result:
    """The Result: metrics gain biased, heavy_tailed and drift_verdict; codes TP-D1 (biased,
    fail), TP-D2 (heavy-tailed, warn), TP-D3 (a threshold exceeded: fail; or noisy with k3
    above kl_warn: warn)."""
    label, biased, heavy, reason = classify(metrics, alpha=alpha, clean_tol=clean_tol,
                                            tail_frac=tail_frac, tail_share_min=tail_share_min)
    metrics.update({"biased": biased, "heavy_tailed": heavy, "drift_verdict": label})
    codes, verdict = [], "pass"
    if biased:
        codes.append("TP-D1")
        verdict = "fail"
    if heavy:
        codes.append("TP-D2")
        verdict = "fail" if verdict == "fail" else "warn"
    over = {k: metrics[k] for k, v in (thresholds or {}).items()
            if isinstance(metrics.get(k), (int, float)) and not abs(metrics[k]) <= v}
    if over:
        codes.append("TP-D3")
        verdict = "fail"
        reason += "; over threshold: " + ", ".join(f"{k} = {v:.3g} > {thresholds[k]:g}" for k, v in over.items())
    elif label == "noisy" and metrics["k3_kl"] > kl_warn:
        codes.append("TP-D3")
        verdict = "warn" if verdict == "pass" else verdict
        reason += f"; k3_kl {metrics['k3_kl']:.3g} > kl_warn {kl_warn:g}"
    evidence["thresholds"] = dict(thresholds or {})
    return Result(probe=probe, target=target, verdict=verdict, metrics=metrics, evidence=evidence,
                  seed=None, codes=codes, message=f"{label}: {reason}")
