"""Run a suite of checks and write reports/<timestamp>/ (report.json, summary.md,
report.html), point reports/latest at it, and optionally append one line per run to a
history for nightly trends.

A check that raises becomes a Result with verdict "error" and code TP-E1, so one broken
target never loses the rest of the night's report. A control check (Check.control) must
give every Result its known verdict (`expected`); one that does not is an error too.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from trainprobes import progress
from trainprobes.audit.history import append_history, history_line, read_history, trend_plots
from trainprobes.result import Result, environment, repeat_suffix, write_atomic


@dataclass
class Check:
    family: str                                   # "numerics", "causality", "drift", ...
    name: str                                     # what the progress line shows
    run: Callable[[], "Result | list[Result]"]
    control: bool = False      # its Results are controls: each carries its known `expected`
    background: bool = False   # mostly waits on other processes (local gloo ranks, a worker
    #                            process): it runs in a thread of its own beside the others,
    #                            its Results kept in suite order


def outcome_words(results: list[Result]) -> str:
    """What a check's Results did, in words a log grep can trust: a control that did what
    it is known to do is `reproduced` (a known-leaky router that leaks included), one that
    did not is `MISSED`; a finding is its verdict."""
    words = []
    for r in results:
        if r.verdict == "error":
            words.append("error")
        elif r.is_control:
            words.append("reproduced" if r.reproduced else
                         f"MISSED (expected {r.expected}, got {r.verdict})")
        else:
            words.append(r.verdict)
    return ", ".join(dict.fromkeys(words)) or "no result"


class Progress(progress.Progress):
    """The audit's progress (trainprobes.progress): a bar on a terminal, a numbered line per
    check in a CI log (no carriage returns in a log file), and the shared heartbeat while a
    check runs long (a log that stays silent for a minute looks hung): what runs, for how
    long, and about how much of the suite is left, estimated from the checks done so far."""

    def __init__(self, total: int, stream=None, tty: bool | None = None, width: int = 24,
                 heartbeat: float | None = progress.EVERY):
        super().__init__("audit", total, unit="checks", stream=stream, tty=tty,
                         every=heartbeat or 0)
        self.width = width

    def _say(self, text: str, number: int) -> None:
        if self.tty:
            filled = self.width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            self._write_line(f"[{bar}] {self.done}/{self.total} {text}")
        else:
            self._write_line(f"[{number}/{self.total}] {text}")

    def line(self) -> None:
        if self.current is not None:  # between checks (writing the report) there is no beat
            self._say(f"{self.current} still running ({progress.duration_text(progress.now() - self._since)})"
                      f"; {self.remaining()}", self.done + 1)

    def start(self, check: Check) -> None:
        self.doing(f"{check.family}: {check.name}")
        self._launch()
        if self.tty:
            self._say(self.current, self.done + 1)

    def finish(self, check: Check, results: list[Result], seconds: float) -> None:
        self.current = None
        self.done += 1
        if not self.tty:
            self._say(f"{check.family}: {check.name} ... {outcome_words(results)} "
                      f"({seconds:.1f} s)", self.done)

    def note(self, text: str) -> None:
        """A step after the checks (writing the report): on the bar's line, or a log line."""
        if self.tty:
            self._say(text, self.done)
        else:
            self._write_line(f"[report] {text}")


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
    unknown = [r.key for r in results if check.control and r.expected is None]
    if unknown:  # a control without its known verdict would show up as a finding
        return [error_result(check, ValueError(
            f"control check {check.name!r} returned {unknown} without a known verdict "
            f"(Result.expected)"))]
    return results


def _timed(check: Check, clock) -> tuple[list[Result], float, float]:
    t0, c0 = time.perf_counter(), clock()
    got = run_check(check)
    return got, time.perf_counter() - t0, clock() - c0


def run_suite(checks: list[Check], *, progress: Progress | None = None,
              ) -> tuple[list[Result], list[dict]]:
    """Run every check; return its Results and per-check timings, in suite order.

    Background checks start first, each in a thread of its own, while the others run here;
    they are waited for (and shown as done) after the others.
    """
    pool = ThreadPoolExecutor(max_workers=max(1, sum(c.background for c in checks)),
                              thread_name_prefix="trainprobes-audit")
    pending = {id(c): pool.submit(_timed, c, time.thread_time) for c in checks if c.background}
    done: dict[int, tuple] = {}
    try:
        for check in sorted(checks, key=lambda c: c.background):  # stable: suite order
            if progress:
                progress.start(check)
            if check.background:
                done[id(check)] = pending[id(check)].result()
            else:  # cpu_seconds: this process only (gloo ranks run in their own)
                done[id(check)] = _timed(check, time.process_time)
            if progress:
                progress.finish(check, done[id(check)][0], done[id(check)][1])
    except BaseException:  # Ctrl-C: do not start what has not started
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    results, timings = [], []
    for check in checks:
        got, dt, cpu = done[id(check)]
        for r in got:
            # two entries with one name, or a router in perturb and truncate mode
            r.target += repeat_suffix(r.key, [x.key for x in results])
            results.append(r)
        timings.append({"family": check.family, "name": check.name, "seconds": round(dt, 3),
                        "cpu_seconds": round(cpu, 3), "control": check.control})
    return results, timings


# --- reports/latest ----------------------------------------------------------------------

LATEST = "latest"          # a symlink to the newest run folder, or a copy where links fail
LATEST_FILE = "LATEST"     # one line, the newest run folder's name: readable on every OS
_COPY_MARK = ".trainprobes-latest-copy"


def point_latest(out_root, out_dir) -> Path:
    """Make out_root/latest name out_dir: a relative symlink where the OS allows one (swapped
    in atomically), else a folder holding copies of the report files; out_root/LATEST holds
    the folder's name either way. A `latest` that is neither of these is left alone."""
    root, out_dir = Path(out_root), Path(out_dir)
    write_atomic(root / LATEST_FILE, out_dir.name + "\n")
    link = root / LATEST
    if link.exists() and not link.is_symlink() and not (link / _COPY_MARK).exists():
        return root / LATEST_FILE  # someone's own folder named latest: not ours to replace
    tmp = root / f".{LATEST}.{os.getpid()}.{threading.get_ident()}"
    try:
        os.symlink(out_dir.name, tmp, target_is_directory=True)
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)  # an earlier copy
        os.replace(tmp, link)
    except OSError:  # no symlinks here (Windows without the privilege): copy the files
        if tmp.is_symlink():
            tmp.unlink()
        if link.is_symlink():
            link.unlink()
        link.mkdir(exist_ok=True)
        for f in out_dir.iterdir():
            if f.is_file():
                shutil.copyfile(f, link / f.name)
        (link / _COPY_MARK).write_text(out_dir.name + "\n", encoding="utf-8")
    return link


def claim_folder(root: Path, stamp: str) -> Path:
    """A new folder root/stamp (or stamp-1, stamp-2, ...), created now: mkdir is atomic, so
    audits started in the same second each get their own and none writes into another's."""
    root.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        out_dir = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            out_dir.mkdir()
            return out_dir
        except FileExistsError:
            continue
    raise FileExistsError(f"{str(root)!r} holds 10,000 runs named {stamp!r}-N; clean it up")


# --- the whole audit ---------------------------------------------------------------------

def exit_code(results: list[Result], *, skipped: dict | None = None, report_only: bool = False,
              strict: bool = False) -> int:
    """2: a check could not run (an error; with strict, also a skipped family or section) or
    a finding nothing could judge (a fail with its verdict boolean None: all-NaN decisions, a
    nondeterministic target; commands.options.exit_for).
    1: a finding failed or a control missed its known verdict (unless report_only).
    0: otherwise: passing and warning findings, controls reproduced (a known-leaky router
    that leaks is a reproduced control, not a failure)."""
    from trainprobes.commands.options import exit_for
    unjudged = any(not r.is_control and exit_for([r]) == 2 for r in results)
    if unjudged or (strict and skipped):
        return 2
    if report_only:
        return 0
    failed = any(r.reproduced is False or (not r.is_control and r.verdict == "fail")
                 for r in results)
    return 1 if failed else 0


@dataclass
class AuditOutcome:
    results: list[Result]
    out_dir: Path
    paths: dict
    seconds: float                     # wall time of the run, report writing included
    skipped: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """The default exit code (see exit_code())."""
        return exit_code(self.results, skipped=self.skipped)

    def exit_code_with(self, *, report_only: bool = False, strict: bool = False) -> int:
        return exit_code(self.results, skipped=self.skipped, report_only=report_only,
                         strict=strict)


def run_audit(checks: list[Check], out_root="reports", *, history=None, meta=None,
              progress: Progress | None = None, step_summary: bool = True,
              stamp: str | None = None, full_evidence: bool = False,
              started: float | None = None) -> AuditOutcome:
    """Run the suite and write out_root/<UTC timestamp>/ {report.json, summary.md, report.html};
    out_root/latest then names that folder.

    started: time.perf_counter() when the run began (e.g. the command's start); the reported
    wall time runs from there to the last file written. Default: now.
    """
    from trainprobes.report import append_step_summary, write_report

    started = time.perf_counter() if started is None else started
    now = datetime.now(timezone.utc)
    stamp = stamp or now.strftime("%Y%m%dT%H%M%SZ")
    out_dir = claim_folder(Path(out_root), stamp)
    t0 = time.perf_counter()
    try:
        results, timings = run_suite(checks, progress=progress)
    except BaseException:  # interrupted: leave no empty run folder behind
        try:
            out_dir.rmdir()
        except OSError:
            pass
        raise
    meta = {"command": "audit", "title": "trainprobes audit", **(meta or {}),
            "created": now.isoformat(), "check_seconds": round(time.perf_counter() - t0, 2),
            "seconds": round(time.perf_counter() - started, 2), "environment": environment(),
            "timings": timings, "report": str(out_dir / "report.json")}
    if history is not None:
        runs = read_history(history) + [history_line(results, meta)]
        meta["history_plots"] = trend_plots(runs)
    try:
        paths = write_report(out_dir, results, meta, progress=progress.note if progress else None,
                             full_evidence=full_evidence, started=started)
    except OSError:  # a full disk: no run folder that looks whole but lacks a file
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    paths["latest"] = point_latest(out_root, out_dir)
    seconds = time.perf_counter() - started
    if history is not None:
        meta["seconds"] = round(seconds, 2)
        paths["history"] = append_history(history, results, meta)
    if step_summary:
        append_step_summary(paths["markdown"].read_text(encoding="utf-8"))
    if progress:
        progress.close()
    return AuditOutcome(results, out_dir, paths, seconds, dict(meta.get("skipped") or {}))
