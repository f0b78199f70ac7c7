"""Run a suite of checks and write reports/<timestamp>/ (report.json, summary.md,
report.html), optionally appending one line per run to a history for nightly trends.

A check that raises becomes a Result with verdict "error" and code TP-E1, so one broken
target never loses the rest of the night's report.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from trainprobes.result import (
    Result,
    SchemaError,
    from_jsonable,
    repeat_suffix,
    to_jsonable,
    write_atomic,
)


@dataclass
class Check:
    family: str                                   # "numerics", "causality", "drift", ...
    name: str                                     # what the progress line shows
    run: Callable[[], "Result | list[Result]"]


class Progress:
    """A bar on a terminal, plain lines in CI logs (no carriage returns in a log file)."""

    def __init__(self, total: int, stream=None, tty: bool | None = None, width: int = 24):
        self.total, self.done, self.width = total, 0, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = (hasattr(self.stream, "isatty") and self.stream.isatty()) if tty is None else tty

    def start(self, check: Check) -> None:
        if self.tty:
            filled = self.width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {check.family}: "
                              f"{check.name}"[:110].ljust(110))
            self.stream.flush()

    def finish(self, check: Check, results: list[Result], seconds: float) -> None:
        self.done += 1
        verdicts = ",".join(sorted({r.verdict for r in results})) or "no result"
        if not self.tty:
            self.stream.write(f"[{self.done}/{self.total}] {check.family}: {check.name} "
                              f"... {verdicts} ({seconds:.1f} s)\n")
            self.stream.flush()
        elif self.done == self.total:
            self.stream.write("\r" + " " * 130 + "\r")
            self.stream.flush()


def error_result(check: Check, exc: BaseException) -> Result:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
    return Result(probe=f"{check.family}.audit", target=check.name, verdict="error",
                  codes=["TP-E1"], message=f"{type(exc).__name__}: {exc}",
                  evidence={"traceback": tb})


def run_check(check: Check) -> list[Result]:
    try:
        out = check.run()
    except Exception as e:  # a broken target is a finding, not the end of the audit
        return [error_result(check, e)]
    results = [out] if isinstance(out, Result) else list(out)
    bad = [r for r in results if not isinstance(r, Result)]
    if bad:
        return [error_result(check, TypeError(
            f"check {check.name!r} returned {type(bad[0]).__name__}, expected Result"))]
    return results


def run_suite(checks: list[Check], *, progress: Progress | None = None,
              ) -> tuple[list[Result], list[dict]]:
    """Run every check; return its Results and per-check timings."""
    results, timings = [], []
    for check in checks:
        if progress:
            progress.start(check)
        t0, c0 = time.perf_counter(), time.process_time()
        got = run_check(check)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if progress:
            progress.finish(check, got, dt)
        for r in got:
            # two entries with one name, or a router in perturb and truncate mode
            r.target += repeat_suffix(r.key, [x.key for x in results])
            results.append(r)
        # cpu_seconds: this process only (gloo ranks run in their own); wall >> cpu means
        # the machine was busy with something else
        timings.append({"family": check.family, "name": check.name, "seconds": round(dt, 3),
                        "cpu_seconds": round(cpu, 3)})
    return results, timings


# --- history -----------------------------------------------------------------------------

HISTORY_FILE = "history.jsonl"


def history_line(results: list[Result], meta: dict) -> dict:
    """One line per run: when, counts, and every numeric metric by result key."""
    metrics = {}
    for r in results:
        for k, v in r.metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics[f"{r.key}::{k}"] = v
    counts = {v: sum(r.verdict == v for r in results) for v in ("pass", "warn", "fail", "error")}
    return to_jsonable({"created": meta.get("created"), "report": meta.get("report"),
                        "counts": counts, "metrics": metrics})


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


# Trends worth plotting across nights: metric names whose growth means trouble.
TREND_METRICS = ("bias", "mean_log_ratio", "k3_kl", "frac_ratio_outside", "flip_rate",
                 "max_ulp_error", "n_leaks", "rel_error")


def trend_plots(runs: list[dict], max_series: int = 8) -> list[dict]:
    """Line-plot specs: one per trend metric, a series per result key, x = run index."""
    if len(runs) < 2:
        return []
    plots = []
    for name in TREND_METRICS:
        keys = sorted({k for run in runs for k in run["metrics"] if k.endswith(f"::{name}")})
        if not keys:
            continue
        series = {}
        for k in keys[:max_series]:
            series[k.rsplit("::", 1)[0]] = [run["metrics"].get(k, "nan") for run in runs]
        plots.append({"kind": "line", "title": f"{name} across runs", "x": list(range(len(runs))),
                      "series": series, "xlabel": "run (oldest first)", "ylabel": name})
    counts = {v: [run.get("counts", {}).get(v, 0) for run in runs] for v in ("fail", "error")}
    plots.append({"kind": "line", "title": "failures across runs", "x": list(range(len(runs))),
                  "series": counts, "xlabel": "run (oldest first)", "ylabel": "results"})
    return plots


# --- the whole audit ---------------------------------------------------------------------

@dataclass
class AuditOutcome:
    results: list[Result]
    out_dir: Path
    paths: dict
    seconds: float

    @property
    def exit_code(self) -> int:
        """0 report written; 2 a probe errored (the audit is incomplete)."""
        return 2 if any(r.verdict == "error" for r in self.results) else 0


def run_audit(checks: list[Check], out_root="reports", *, history=None, meta=None,
              progress: Progress | None = None, step_summary: bool = True,
              stamp: str | None = None) -> AuditOutcome:
    """Run the suite and write out_root/<UTC timestamp>/ {report.json, summary.md, report.html}."""
    from trainprobes.report import append_step_summary, write_report

    now = datetime.now(timezone.utc)
    stamp = stamp or now.strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(out_root) / stamp
    n = 1
    while out_dir.exists():  # two runs in one second must not overwrite each other
        out_dir = Path(out_root) / f"{stamp}-{n}"
        n += 1
    t0 = time.perf_counter()
    results, timings = run_suite(checks, progress=progress)
    seconds = time.perf_counter() - t0
    meta = {"title": "trainprobes audit", **(meta or {}), "created": now.isoformat(),
            "seconds": round(seconds, 2), "timings": timings,
            "report": str(out_dir / "report.json")}
    if history is not None:
        runs = read_history(history) + [history_line(results, meta)]
        meta["history_plots"] = trend_plots(runs)
    paths = write_report(out_dir, results, meta)
    if history is not None:
        paths["history"] = append_history(history, results, meta)
    if step_summary:
        append_step_summary(paths["markdown"].read_text(encoding="utf-8"))
    return AuditOutcome(results, out_dir, paths, seconds)
