"""Report writers: report.json (schema-versioned), summary.md and a self-contained report.html.

    write_report(out_dir, results, meta, progress=None, full_evidence=False, started=None)
        -> {"json": Path, "markdown": Path, "html": Path}

All three are written atomically (temp file + rename) via trainprobes.result.write_atomic.
report.json is the document every `--json` prints: {"schema_version", "command", <run
facts>, "results": [...]}, with evidence summarised (trainprobes.report.evidence).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from trainprobes.display import append_step_summary
from trainprobes.report.evidence import dumps, summarise
from trainprobes.report.html import build_page, render_html
from trainprobes.report.markdown import summary_markdown
from trainprobes.result import Result, report_document, write_atomic

__all__ = ["write_report", "render_html", "summary_markdown", "append_step_summary",
           "summarised_document"]

# Drawn into report.html only; report.json stays the run's facts and its Results.
HTML_ONLY = ("history_plots",)


def summarised_document(results: list[Result], meta: dict | None = None, *,
                        full_evidence: bool = False) -> dict:
    """What report.json holds and `--json` prints: trainprobes.result.report_document (the
    one shape of a report), each Result's evidence summarised unless full_evidence."""
    doc = report_document(results, **{k: v for k, v in (meta or {}).items()
                                      if k not in HTML_ONLY})
    if not full_evidence:
        for d in doc["results"]:
            d["evidence"] = summarise(d["evidence"])
    return doc


def write_report(out_dir, results: list[Result], meta: dict | None = None, *,
                 progress: Callable[[str], None] | None = None, full_evidence: bool = False,
                 started: float | None = None) -> dict[str, Path]:
    """Draw the plots (saying so through progress), then write the three files.

    started: time.perf_counter() at the start of the run; meta["seconds"] then becomes the
    wall time up to the moment the files are written, report writing included.
    """
    out_dir = Path(out_dir)
    meta = dict(meta or {})
    page = build_page(results, meta)
    n = len(page.specs())
    t0 = time.perf_counter()
    if progress and n:
        progress(f"drawing {n} plot{'s' if n != 1 else ''} for report.html")
    page.draw(None if not progress else
              lambda i, k, title: progress(f"plot {i}/{k}: {title}"))
    if started is not None:
        meta["seconds"] = round(time.perf_counter() - started, 2)
    meta["report_seconds"] = round(time.perf_counter() - t0, 2)
    doc = summarised_document(results, meta, full_evidence=full_evidence)
    paths = {"json": write_atomic(out_dir / "report.json", dumps(doc)),
             "markdown": write_atomic(out_dir / "summary.md", summary_markdown(results, meta)),
             "html": write_atomic(out_dir / "report.html", page.html())}
    if progress:
        progress("wrote " + ", ".join(f"{p.name} ({_size(p)})" for p in paths.values()))
    return paths


def _size(path: Path) -> str:
    b = path.stat().st_size
    return f"{b / 1e6:.1f} MB" if b >= 1e6 else f"{max(1, round(b / 1e3))} KB"
