"""The map as a Markdown page: model types as rows, probe cells as columns, one mark per
verdict (a finding in bold), the library versions, and every cell that could not be measured
listed with its reason."""
from __future__ import annotations

__all__ = ["render"]

_MARK = {"isolated": "iso", "leaky": "LEAK", "unknown": "?", "causal": "causal",
         "non-causal": "NON-CAUSAL", "invariant": "inv", "variant": "var", "clean": "clean",
         "noisy": "noisy", "biased": "BIASED", "heavy-tailed": "tails", "n/a": "n/a", "error": "err"}


def _columns(rows: dict) -> list[tuple[str, str]]:
    seen = []
    for cells in rows.values():
        for c in cells:
            k = (c["probe"], c["variant"])
            if c["probe"] != "build" and k not in seen:
                seen.append(k)
    order = {"isolation": 0, "router": 1, "batch": 2, "drift": 3}
    return sorted(seen, key=lambda k: (order.get(k[0], 9), k[1]))


def render(m: dict) -> str:
    rows = m["rows"]
    cols = _columns(rows)
    v = m.get("versions", {})
    lines = [f"Made with transformers {v.get('transformers')}, torch {v.get('torch')}, trainprobes "
             f"{v.get('trainprobes')}, Python {v.get('python')}; {m.get('n_model_types')} model types; "
             f"sweep wall time {m.get('wall_seconds')} s, sum of rows {m.get('sum_row_seconds')} s, "
             f"largest peak RSS of one model's process {m.get('peak_rss_mb')} MB.", "",
             "Marks: iso / LEAK / ? (isolation unknown), causal / NON-CAUSAL, inv / var (batch), "
             "clean / noisy / BIASED / tails (drift), n/a (not applicable or cannot be built), err "
             "(the probe raised; reason below). **Bold**: a finding (the cell contradicts the "
             "model's design).", ""]
    head = ["model type"] + [f"{p} {var}".strip() for p, var in cols]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    unmeasured = []
    for mt in sorted(rows):
        by = {(c["probe"], c["variant"]): c for c in rows[mt]}
        out = [mt]
        for k in cols:
            c = by.get(k)
            if c is None:
                out.append("")
                continue
            mark = _MARK.get(c["verdict"], c["verdict"])
            out.append(f"**{mark}**" if c.get("finding") else mark)
        lines.append("| " + " | ".join(out) + " |")
        unmeasured += [c for c in rows[mt] if c["verdict"] in ("error", "n/a") and c["probe"] != "router"
                       or c["probe"] == "build"]
    lines += ["", "## Cells not measured, with the reason", ""]
    for c in unmeasured:
        lines.append(f"- `{c['model_type']}` {c['probe']} {c['variant']}: {c['reason']}".replace("|", "\\|"))
    return "\n".join(lines) + "\n"
