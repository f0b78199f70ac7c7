"""Nightly history: one JSON line per run in DIR/history.jsonl, and trend plots from it.

A line holds when the run was, its counts (verdicts; findings and controls apart) and every
numeric metric keyed `probe::target::metric`. The trend plots take the headline metrics
(trainprobes.report.outline.TREND_METRICS), one picture per probe family with a panel per
metric and a line per target, runs numbered 1..N along x with their dates.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from trainprobes.report.outline import TREND_METRICS, is_problem, metric_label, metric_unit
from trainprobes.result import Result, SchemaError, from_jsonable, to_jsonable, write_atomic

HISTORY_FILE = "history.jsonl"
# Lines per picture: more would be unreadable; the rest are named as hidden, never dropped
# silently.
MAX_SERIES = 8
# Trend metrics that count things: their panels get integer ticks.
COUNT_METRICS = ("n_leaks", "accumulator_mantissa_bits")


def history_line(results: list[Result], meta: dict) -> dict:
    """One line per run: when, counts, and every numeric metric by result key."""
    metrics = {}
    for r in results:
        for k, v in r.metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics[f"{r.key}::{k}"] = v
    counts = {v: sum(r.verdict == v for r in results) for v in ("pass", "warn", "fail", "error")}
    problems = {"failing_findings": sum(not r.is_control and r.verdict == "fail" for r in results),
                "missed_controls": sum(r.reproduced is False for r in results),
                "errors": counts["error"], "total": sum(is_problem(r) for r in results)}
    return to_jsonable({"created": meta.get("created"), "report": meta.get("report"),
                        "seconds": meta.get("seconds"), "counts": counts, "problems": problems,
                        "metrics": metrics,
                        "controls": sorted({r.key for r in results if r.is_control})})


def append_history(history_dir, results: list[Result], meta: dict) -> Path:
    """Append one JSON line to DIR/history.jsonl (read-modify-write, atomically)."""
    path = Path(history_dir) / HISTORY_FILE
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if old and not old.endswith("\n"):
        old += "\n"  # a torn last line from an older crash stays one bad line, skipped on read
    return write_atomic(path, old + json.dumps(history_line(results, meta)) + "\n")


def read_history(history_dir) -> list[dict]:
    path = Path(history_dir) / HISTORY_FILE
    if not path.exists():
        return []
    runs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            doc = from_jsonable(json.loads(line))  # {"$float": "nan"} back to a float
        except (json.JSONDecodeError, SchemaError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("metrics"), dict):
            runs.append(doc)
    return runs


def _value(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def change(values: list) -> float:
    """How much a series moved across runs, scale-free: (max - min) / max |value| over its
    finite values; a series that appears, vanishes or turns non-finite counts as 1."""
    xs = [_value(v) for v in values]
    finite = [x for x in xs if math.isfinite(x)]
    if len(finite) < len(xs):
        return 1.0 if finite else 0.0
    top = max(abs(x) for x in finite)
    return (max(finite) - min(finite)) / top if top else 0.0


def _when(run: dict, i: int, seconds: bool = False) -> str:
    """'11-29 07:30' (or '07:30:12') from an ISO timestamp; the run number when there is none."""
    c = run.get("created")
    if isinstance(c, str) and len(c) >= 19 and c[4] == "-":
        return c[11:19] if seconds else f"{c[5:10]} {c[11:16]}"
    return str(i)


def trend_plots(runs: list[dict], max_series: int = MAX_SERIES) -> list[dict]:
    """Plot specs (kind "panels"): problems per run, then one per probe family that has a
    headline metric, a panel per metric, a line per target. Where a family has more targets
    than max_series, the ones that changed most are drawn and the note says how many are
    hidden and whether they moved at all."""
    if len(runs) < 2:
        return []
    x = list(range(1, len(runs) + 1))
    ticks = [_when(run, i) for i, run in enumerate(runs, 1)]
    if len(set(ticks)) < len(ticks):   # two runs in one minute: their seconds tell them apart
        ticks = [_when(run, i, seconds=True) for i, run in enumerate(runs, 1)]
    base = {"kind": "panels", "x": x, "xticklabels": ticks, "xlabel": "run (oldest first)"}
    problems = {name: [run.get("problems", {}).get(key, run.get("counts", {}).get(old, 0))
                       for run in runs]
                for name, key, old in (("failing findings", "failing_findings", "fail"),
                                       ("missed controls", "missed_controls", None),
                                       ("errors", "errors", "error"))}
    plots = [{**base, "title": "problems per run",
              "panels": [{"ylabel": "results", "title": "problems", "series": problems,
                          "integer": True}]}]
    # family -> metric -> target -> values across runs
    table: dict = {}
    keys = sorted({k for run in runs for k in run["metrics"]})
    for k in keys:
        key, _, metric = k.rpartition("::")
        if metric not in TREND_METRICS or "::" not in key:  # a line from elsewhere: skip it
            continue
        probe, target = key.split("::", 1)
        fam = ".".join(probe.split(".")[:2])
        table.setdefault(fam, {}).setdefault(metric, {})[target] = \
            [run["metrics"].get(k, math.nan) for run in runs]
    controls = {k for run in runs for k in run.get("controls", ())}

    def is_control(fam_target):
        return any(k.endswith("::" + fam_target[1]) and k.startswith(fam_target[0])
                   for k in controls)

    def stack_first(fam):  # the user's own stack before the reference controls
        targets = {t for m in table[fam].values() for t in m}
        return all(is_control((fam, t)) for t in targets)
    for fam in sorted(table, key=stack_first):
        by_metric = table[fam]
        targets = list(dict.fromkeys(t for m in by_metric.values() for t in m))
        moved = {t: max(change(m[t]) for m in by_metric.values() if t in m) for t in targets}
        shown = sorted(targets, key=lambda t: (is_control((fam, t)), -moved[t]))[:max_series]
        hidden = [t for t in targets if t not in shown]
        note = ""
        if hidden:
            names = ", ".join(hidden)  # every one named: a reader can look each up
            if not any(moved.values()):
                note = (f"no target changed across these runs; {len(shown)} of {len(targets)} "
                        f"drawn, {len(hidden)} not drawn: {names}")
            else:
                still = all(moved[t] == 0 for t in hidden)
                note = (f"{len(shown)} of {len(targets)} targets drawn (the stack's own first, "
                        f"then those that changed most); {len(hidden)} not drawn "
                        f"({'all unchanged' if still else 'changed less'}): " + names)

        def label(t):
            return f"{t} (control)" if is_control((fam, t)) else t
        metrics = [m for m in TREND_METRICS if m in by_metric]
        panels = [{"ylabel": metric_unit(fam, m), "title": metric_label(m),
                   "series": {label(t): by_metric[m][t] for t in shown if t in by_metric[m]},
                   "integer": m in COUNT_METRICS} for m in metrics]
        plots.append({**base, "title": f"{fam}: {', '.join(map(metric_label, metrics))} across runs",
                      "panels": [p for p in panels if p["series"]], "note": note})
    return plots
