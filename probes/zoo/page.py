"""The map as a Markdown page: model types as rows, probe cells as columns, one mark per
verdict (a finding in bold), the library versions, and every cell that could not be measured
listed with its reason. `tone(cell)` sorts a cell for any face (this page, the HTML page in
trainprobes.report.zoo): good, as designed, rounding, finding, unknown, not applicable, error.
"""
from __future__ import annotations

from trainprobes.markup import md_text

__all__ = ["render", "tone", "columns", "column_label", "MARK", "TONES", "summary"]

_MARK = {"isolated": "iso", "leaky": "leak", "unknown": "?", "causal": "causal",
         "non-causal": "non-causal", "invariant": "inv", "variant": "var", "clean": "clean",
         "noisy": "noisy", "biased": "biased", "heavy-tailed": "tails", "n/a": "n/a", "error": "err"}
MARK = _MARK
# tone -> what it means, in page order
TONES = {
    "good": "the design's promise holds (isolated, causal, bit-identical, clean drift)",
    "design": "leaky or non-causal where the design promises nothing else (a cached call, a "
              "recurrent state, an expert-choice router)",
    "rounding": "batch-variant within rounding, or noisy drift: no bias",
    "finding": "contradicts the model's design: a finding (bold on the Markdown page)",
    "unknown": "the probe could not decide (nondeterministic target, or a router it cannot see)",
    "na": "not applicable (no MoE layer) or the model cannot be built with this attention",
    "error": "the probe raised: the reason is listed below the table",
}
_GOOD = {"isolated", "causal", "invariant", "clean"}


def tone(c: dict) -> str:
    if c.get("finding"):
        return "finding"
    v = c["verdict"]
    if v == "error":
        return "error"
    if v == "unknown":
        return "unknown"
    if v == "n/a" or c["probe"] == "build":
        return "na"
    if v in _GOOD:
        return "good"
    if v in ("leaky", "non-causal"):
        return "design"
    return "rounding"   # variant within rounding, noisy or heavy-tailed drift without bias


def columns(rows: dict) -> list[tuple[str, str]]:
    seen = []
    for cells in rows.values():
        for c in cells:
            k = (c["probe"], c["variant"])
            if c["probe"] != "build" and k not in seen:
                seen.append(k)
    order = {"isolation": 0, "router": 1, "batch": 2, "drift": 3}
    return sorted(seen, key=lambda k: (order.get(k[0], 9), k[1]))


def column_label(probe: str, variant: str) -> str:
    return f"{probe} {variant}".strip()


def summary(m: dict) -> dict:
    """Counts a reader wants first: model types, rows measured (built with at least one
    attention implementation), MoE rows with a training-time router verdict, findings."""
    rows = m["rows"]
    measured = [mt for mt, cells in rows.items() if any(c["probe"] != "build" for c in cells)]
    routers = {mt: c for mt, cells in rows.items() for c in cells
               if c["probe"] == "router" and c["variant"] == "perturb"}
    return {"model_types": len(rows), "measured": len(measured),
            "routers": len(routers),
            "routers_decided": sum(c["verdict"] in ("causal", "non-causal") for c in routers.values()),
            "findings": sum(c.get("finding", False) for cells in rows.values() for c in cells),
            "unmeasured": sorted(set(rows) - set(measured))}


def render(m: dict) -> str:
    rows = m["rows"]
    cols = columns(rows)
    v = m.get("versions", {})
    s = summary(m)
    lines = [f"Made with transformers {v.get('transformers')}, torch {v.get('torch')}, trainprobes "
             f"{v.get('trainprobes')}, Python {v.get('python')}: {s['model_types']} model types, "
             f"{s['measured']} measured (the others could not be built: reasons below), "
             f"{s['routers']} MoE routers of which {s['routers_decided']} have a training-time verdict, "
             f"{s['findings']} cells contradicting the design. Sweep wall time {m.get('wall_seconds')} s, "
             f"sum of rows {m.get('sum_row_seconds')} s, largest peak RSS of one row "
             f"{m.get('peak_rss_mb')} MB.", "",
             "Marks: iso / leak / ? (isolation unknown), causal / non-causal, inv / var (batch), "
             "clean / noisy / biased / tails (drift), n/a (not applicable or cannot be built), err "
             "(the probe raised; reason below). **Bold**: a finding (the cell contradicts the "
             "model's design). Each cell's reason and number are in docs/zoo_map.json and "
             "`trainprobes zoo --model TYPE`.", ""]
    head = ["model type"] + [column_label(p, var) for p, var in cols]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    unmeasured = []
    for mt in sorted(rows):
        by = {(c["probe"], c["variant"]): c for c in rows[mt]}
        out = [md_text(mt)]
        for k in cols:
            c = by.get(k)
            if c is None:
                out.append("")
                continue
            mark = _MARK.get(c["verdict"], md_text(c["verdict"]))
            out.append(f"**{mark.upper()}**" if c.get("finding") else mark)
        lines.append("| " + " | ".join(out) + " |")
        unmeasured += [c for c in rows[mt] if c["verdict"] in ("error", "unknown")
                       or c["probe"] == "build"]
    lines += ["", "## Cells not measured, with the reason", ""]
    for c in unmeasured:
        lines.append(f"- `{c['model_type']}` {c['probe']} {c['variant']}: {md_text(c['reason'])}")
    return "\n".join(lines) + "\n"
