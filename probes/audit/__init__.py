"""Audit: suites of checks over the probes, run nightly or by hand, written as reports.

  trainprobes.audit.run      Check, Progress, run_suite, run_audit, exit_code, point_latest
  trainprobes.audit.history  history.jsonl (one line per run) and trend plots across runs
  trainprobes.audit.suites   the built-in default suite: your stack, then calibration
  trainprobes.audit.config   a user's suite from `[tool.trainprobes]` in pyproject.toml

A suite is a list of `Check`s: a family, a name, and a zero-argument function returning one
Result or a list of them. Nothing here runs at import; probes are imported when a check runs.
"""
from trainprobes.audit.history import append_history, read_history, trend_plots
from trainprobes.audit.run import (
                              AuditOutcome,
                              Check,
                              Progress,
                              exit_code,
                              point_latest,
                              run_audit,
                              run_check,
                              run_suite,
)

__all__ = ["AuditOutcome", "Check", "Progress", "append_history", "exit_code", "point_latest",
           "read_history", "run_audit", "run_check", "run_suite", "trend_plots"]
