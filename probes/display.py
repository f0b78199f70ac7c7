"""How trainprobes shows numbers and hands summaries to CI: one of each, for every face.

    format_number(v, digits=4)   2048, 0.001, 1.235e-05, -0.2356, nan, inf, true
    append_step_summary(markdown, env=None)   GitHub Actions' $GITHUB_STEP_SUMMARY

A floor module: it imports nothing from trainprobes, so probes and faces alike may use it.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["format_number", "append_step_summary"]


def format_number(v, digits: int = 4) -> str:
    """A value as a person reads it in a message or a table cell.

    bools as true/false (JSON's spelling); integers, and floats holding an integer below
    1e15, in full (2048, not 2.048e+03); other floats to `digits` significant digits;
    non-finite floats as nan, inf, -inf; anything else via str().
    """
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) or (getattr(v, "shape", None) == () and hasattr(v, "item")):
        x = float(v)
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == int(x) and abs(x) < 1e15:
            return str(int(x))
        return f"{x:.{digits}g}"
    return str(v)


def append_step_summary(markdown: str, env: dict | None = None) -> Path | None:
    """Append markdown to the file named by $GITHUB_STEP_SUMMARY (the job summary GitHub
    Actions shows); do nothing when it is unset. Returns the file appended to, or None."""
    path = (os.environ if env is None else env).get("GITHUB_STEP_SUMMARY")
    if not path:
        return None
    with open(path, "a", encoding="utf-8") as f:
        f.write(markdown.rstrip("\n") + "\n")
    return Path(path)
