"""Evidence as report.json keeps it: summarised, so a nightly report stays small.

A probe's evidence can hold every leak of 4000 compared decisions or every trial's error;
report.json keeps the first LIMIT items of each long list and records how long it was in
`evidence["truncated"]` ({"leaks": 978, "cuts.flips": 63, ...}). Plot specs are kept whole,
since report.html is drawn from them. `trainprobes audit --full-evidence` (or
write_report(..., full_evidence=True)) keeps everything; the Results in memory are never cut.
"""
from __future__ import annotations

import json

LIMIT = 32
KEEP_WHOLE = ("plots",)


def _cut(value, path: str, truncated: dict):
    if isinstance(value, dict):
        return {k: _cut(v, f"{path}.{k}" if path else str(k), truncated) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > LIMIT:
            truncated[path] = len(value)
            value = value[:LIMIT]
        return [_cut(v, f"{path}[]", truncated) for v in value]
    return value


def summarise(evidence: dict) -> dict:
    """A copy of evidence with every list longer than LIMIT cut to its first LIMIT items."""
    if not isinstance(evidence, dict):
        return evidence
    truncated: dict = {}
    out = {k: (v if k in KEEP_WHOLE else _cut(v, k, truncated)) for k, v in evidence.items()}
    if truncated:
        out["truncated"] = {**(evidence.get("truncated") or {}), **truncated}
    return out


def _one_line(v) -> bool:
    """A plain value, a list of plain values, or a short object of plain values."""
    if isinstance(v, dict):
        return all(not isinstance(x, (dict, list)) for x in v.values()) and \
            len(json.dumps(v)) <= 120
    if isinstance(v, list):
        return all(not isinstance(x, (dict, list)) for x in v)
    return True


def dumps(doc, indent: int = 1) -> str:
    """JSON a person can read and diff: one item per line down to lists of plain values
    and short flat objects, which stay on one line (a 64 x 64 leak map is 64 lines, not
    4096; a timing is one line, not six)."""
    def enc(v, depth: int) -> str:
        if not v or _one_line(v):
            return json.dumps(v, allow_nan=False, separators=(", ", ": "))
        pad, inner = " " * (indent * depth), " " * (indent * (depth + 1))
        if isinstance(v, dict):
            return "{\n" + ",\n".join(f"{inner}{json.dumps(str(k))}: {enc(x, depth + 1)}"
                                       for k, x in v.items()) + f"\n{pad}}}"
        return "[\n" + ",\n".join(inner + enc(x, depth + 1) for x in v) + f"\n{pad}]"
    return enc(doc, 0)
