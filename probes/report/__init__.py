"""Report writers: report.json (schema-versioned), summary.md and a self-contained report.html.

    write_report(out_dir, results, meta) -> {"json": Path, "markdown": Path, "html": Path}

All three are written atomically (temp file + rename) via trainprobes.result.write_atomic.
"""
from __future__ import annotations

import os
from pathlib import Path

from trainprobes.report.html import render_html
from trainprobes.report.markdown import summary_markdown
from trainprobes.result import Result, save_results, write_atomic

__all__ = ["write_report", "render_html", "summary_markdown", "append_step_summary"]


def append_step_summary(markdown: str, env: dict | None = None) -> Path | None:
    """Append to $GITHUB_STEP_SUMMARY when set (GitHub Actions job summary)."""
    path = (os.environ if env is None else env).get("GITHUB_STEP_SUMMARY")
    if not path:
        return None
    with open(path, "a", encoding="utf-8") as f:
        f.write(markdown + "\n")
    return Path(path)


def write_report(out_dir, results: list[Result], meta: dict | None = None) -> dict[str, Path]:
    out_dir = Path(out_dir)
    meta = dict(meta or {})
    json_meta = {k: v for k, v in meta.items() if k != "history_plots"}
    md = summary_markdown(results, meta)
    paths = {"json": save_results(out_dir / "report.json", results, **json_meta),
             "markdown": write_atomic(out_dir / "summary.md", md),
             "html": write_atomic(out_dir / "report.html", render_html(results, meta))}
    return paths
