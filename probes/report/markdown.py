"""summary.md: what a person reads first in the morning (and in $GITHUB_STEP_SUMMARY)."""
from __future__ import annotations

from collections import Counter

from trainprobes.result import CODES, Result

ICONS = {"pass": "✅", "warn": "⚠️", "fail": "❌", "error": "💥"}
# Metrics worth a column when present, in this order; others stay in report.json.
KEY_METRICS = ("causal", "n_leaks", "flip_rate", "mismatch_rate", "bias", "bias_se",
               "p_value", "mean_log_ratio", "k3_kl", "frac_ratio_outside",
               "accumulator_mantissa_bits", "stall_point", "max_ulp_error",
               "bitwise_match_fraction", "rel_error")


def fmt_value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def key_metrics(r: Result, limit: int = 4) -> str:
    shown = [k for k in KEY_METRICS if k in r.metrics][:limit]
    if not shown:
        shown = [k for k, v in r.metrics.items() if isinstance(v, (int, float))][:limit]
    return ", ".join(f"{k}={fmt_value(r.metrics[k])}" for k in shown)


def counts_line(results: list[Result]) -> str:
    c = Counter(r.verdict for r in results)
    return ", ".join(f"{c[v]} {v}" for v in ("pass", "warn", "fail", "error") if c[v])


def _cell(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def summary_markdown(results: list[Result], meta: dict | None = None) -> str:
    meta = meta or {}
    title = meta.get("title", "trainprobes audit")
    lines = [f"## {title}", ""]
    bits = [counts_line(results) or "no results"]
    if "seconds" in meta:
        bits.append(f"{meta['seconds']:.1f} s")
    if "suite" in meta:
        bits.append(f"suite: {meta['suite']}")
    lines += [" · ".join(bits), ""]
    for fam, why in (meta.get("skipped") or {}).items():
        lines += [f"Skipped **{fam}**: {why}", ""]
    bad = [r for r in results if r.verdict in ("fail", "error")]
    if bad:
        lines.append("**Findings**")
        lines.append("")
        for r in bad:
            codes = ", ".join(f"`{c}` {CODES.get(c, '')}" for c in r.codes)
            lines.append(f"- {ICONS[r.verdict]} **{r.probe}** `{r.target}`"
                         + (f" ({codes})" if codes else "") + f": {r.message}")
        lines.append("")
    lines += ["| | probe | target | codes | key metrics | seed |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append("| " + " | ".join(_cell(x) for x in (
            ICONS[r.verdict], r.probe, f"`{r.target}`", " ".join(r.codes), key_metrics(r),
            "" if r.seed is None else r.seed)) + " |")
    lines.append("")
    return "\n".join(lines)
