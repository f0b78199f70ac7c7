"""What changed between two zoo maps (a transformers upgrade, a torch upgrade): every cell
whose verdict differs, the model types in one map only, and the versions of each."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trainprobes.errors import DataFileError

__all__ = ["Change", "diff_maps", "load_map", "format_diff", "categorise", "CATEGORIES"]


@dataclass(frozen=True)
class Change:
    model_type: str
    probe: str
    variant: str
    before: str | None     # None: the cell is new
    after: str | None      # None: the cell is gone


_KEYS = ("model_type", "probe", "variant", "verdict")


def load_map(path) -> dict:
    try:
        m = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:   # RecursionError: nested past the limit
        raise DataFileError(f"{path}: cannot read a zoo map ({type(e).__name__}: {e})") from None
    if not isinstance(m, dict) or not isinstance(m.get("rows"), dict):
        raise DataFileError(f"{path}: not a zoo map (no 'rows'); make one with scripts/zoo_sweep.py")
    seen = set()
    for mt, cells in m["rows"].items():   # a hand-edited map is read or refused, never half-read
        if not isinstance(cells, list):
            raise DataFileError(f"{path}: rows[{mt!r}] is {type(cells).__name__}, expected a list of cells")
        for i, c in enumerate(cells):
            bad = ([k for k in _KEYS if not isinstance(c.get(k), str)] if isinstance(c, dict) else list(_KEYS))
            if bad:
                raise DataFileError(f"{path}: rows[{mt!r}][{i}] lacks {', '.join(bad)} (each cell names "
                                    f"{', '.join(_KEYS)} as strings)")
            if c["model_type"] != mt:
                raise DataFileError(f"{path}: rows[{mt!r}][{i}] is a cell of {c['model_type']!r}, in the row of {mt!r}")
            if not isinstance(c.get("finding", False), bool):
                raise DataFileError(f"{path}: rows[{mt!r}][{i}] has finding={c['finding']!r}, expected true or false")
            key = (c["model_type"], c["probe"], c["variant"])
            if key in seen:   # a cell pasted twice: the diff would keep one verdict of the two
                raise DataFileError(f"{path}: rows[{mt!r}][{i}] repeats the cell {key!r}")
            seen.add(key)
    return m


def _cells(m: dict) -> dict:
    # a verdict and whether it contradicts the design: the same "leaky" that becomes a finding
    # (a model that now takes position_ids, a by-design call withdrawn) changed what the map says
    return {(c["model_type"], c["probe"], c["variant"]): c["verdict"] + (" (finding)" if c.get("finding") else "")
            for cells in m["rows"].values() for c in cells}


def diff_maps(a: dict, b: dict) -> list[Change]:
    ca, cb = _cells(a), _cells(b)
    out = [Change(*k, ca.get(k), cb.get(k)) for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)]
    return out


# what a reader of an upgrade wants first, in this order
CATEGORIES = ("new model types", "model types gone", "newly buildable", "no longer buildable",
              "newly leaky", "newly isolated", "newly non-causal", "newly causal", "new findings",
              "findings gone", "other verdict changes")
_CLEAN = {"isolated": "newly isolated", "causal": "newly causal"}
_BAD = {"leaky": "newly leaky", "non-causal": "newly non-causal"}


def _built(cells) -> bool:
    return any(c["probe"] != "build" for c in cells)


def categorise(a: dict, b: dict, changes: list[Change]) -> dict:
    """{category: [one line per model type or cell]} for the CATEGORIES an upgrade shows; a
    finding that went away is named beside its new verdict (a fix upstream reads "leaky
    (finding) -> isolated": newly isolated, and a finding gone)."""
    out: dict = {k: [] for k in CATEGORIES}
    ra, rb = a["rows"], b["rows"]
    out["new model types"] = sorted(set(rb) - set(ra))
    out["model types gone"] = sorted(set(ra) - set(rb))
    rebuilt = set()
    for mt in sorted(set(ra) & set(rb)):
        if _built(ra[mt]) != _built(rb[mt]):
            rebuilt.add(mt)   # its cells came or went with the build: one line, not each cell
            why = next((c["reason"] for c in ra[mt] if c["probe"] == "build"), "")
            out["newly buildable" if _built(rb[mt]) else "no longer buildable"].append(
                f"{mt}" + (f" (was: {why[:100]})" if _built(rb[mt]) and why else ""))
    for c in changes:
        if c.model_type not in ra or c.model_type not in rb or c.probe == "build" or c.model_type in rebuilt:
            continue
        cell = f"{c.model_type} {c.probe} {c.variant}: {c.before} -> {c.after}"
        before, after = (c.before or "").replace(" (finding)", ""), (c.after or "").replace(" (finding)", "")
        was, now = "(finding)" in (c.before or ""), "(finding)" in (c.after or "")
        placed = False
        if before != after and after in _CLEAN:
            out[_CLEAN[after]].append(cell)
            placed = True
        elif before != after and after in _BAD:
            out[_BAD[after]].append(cell)
            placed = True
        if was and not now:
            out["findings gone"].append(cell)
        elif now and not was:
            out["new findings"].append(cell)
        elif not placed:
            out["other verdict changes"].append(cell)
    return out


def format_diff(a: dict, b: dict, changes: list[Change]) -> str:
    lines = [f"before: {a.get('versions')}", f"after:  {b.get('versions')}"]
    summary = {k: v for k, v in categorise(a, b, changes).items() if v}
    lines.append("summary: " + ("; ".join(f"{k} {len(v)}" for k, v in summary.items()) or "no change"))
    only_a = sorted(set(a["rows"]) - set(b["rows"]))
    only_b = sorted(set(b["rows"]) - set(a["rows"]))
    if only_a:
        lines.append(f"model types only before: {', '.join(only_a)}")
    if only_b:
        lines.append(f"model types only after: {', '.join(only_b)}")
    shared = [c for c in changes if c.model_type in a["rows"] and c.model_type in b["rows"]]
    lines.append(f"{len(shared)} cells changed verdict in the {len(set(a['rows']) & set(b['rows']))} "
                 f"model types both maps hold")
    for c in shared:
        lines.append(f"  {c.model_type:24s} {c.probe:9s} {c.variant:28s} {c.before} -> {c.after}")
    return "\n".join(lines)
