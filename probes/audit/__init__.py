"""Audit: suites of checks over the probes, run nightly or by hand, written as reports.

  trainprobes.audit.run      Check, Progress, run_suite, run_audit, history (trends across nights)
  trainprobes.audit.suites   the built-in default suite (no configuration needed)
  trainprobes.audit.config   a user's suite from `[tool.trainprobes]` in pyproject.toml

A suite is a list of `Check`s: a family, a name, and a zero-argument function returning one
Result or a list of them. Nothing here runs at import; probes are imported when a check runs.
"""
from trainprobes.audit.run import (
                              AuditOutcome,
                              Check,
                              Progress,
                              append_history,
                              read_history,
                              run_audit,
                              run_check,
                              run_suite,
                              trend_plots,
)

__all__ = ["AuditOutcome", "Check", "Progress", "append_history", "read_history", "run_audit",
           "run_check", "run_suite", "trend_plots"]
