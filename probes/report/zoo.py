"""The zoo map as one self-contained HTML page in the report's style (its CSS, no script, no
network): the headline counts, the versions, one row per model type with a coloured mark per
cell (the cell's reason and number in its tooltip), the confirmed findings, and every cell
that could not be measured with its reason."""
from __future__ import annotations

from trainprobes.markup import html_text as _e
from trainprobes.report.html import CSS
from trainprobes.zoo.page import MARK, TONES, column_label, columns, summary, tone

__all__ = ["render_zoo_html"]

_ZOO_CSS = """
table.zoo{border-collapse:collapse} table.zoo td,table.zoo th{font-size:11px;padding:2px 4px;
 text-align:center;white-space:nowrap} table.zoo th.v{writing-mode:vertical-rl;transform:rotate(180deg);
 vertical-align:bottom;height:9.5em} table.zoo td.mt{text-align:left;font-family:ui-monospace,Menlo,monospace}
table.zoo td.why{text-align:left;white-space:normal;font-size:11px}
table.zoo tr:nth-child(even) td.mt{background:#fafafa}
.t-good{background:#e6f4ea;color:#1e5e2e} .t-design{background:#e8eef8;color:#2c4a7a}
.t-rounding{background:#fff4d6;color:#6b5100} .t-finding{background:#c62828;color:#fff;font-weight:bold}
.t-unknown{background:#ffe082;color:#222} .t-na{background:#f3f3f3;color:#999}
.t-error{background:#6a1b9a;color:#fff} .legend span{display:inline-block;padding:0 .5em;margin:.1em .3em .1em 0}
"""


def _cell(c: dict | None) -> str:
    if c is None:
        return "<td class='t-na'></td>"
    num = "" if c.get("number") is None else f" [{c.get('what') or 'number'}: {c['number']:.3g}]"
    tip = f"{c['verdict']}: {c['reason']}{num}"
    if c.get("expected"):
        tip += f" (design: {c['expected']})"
    mark = MARK.get(c["verdict"], c["verdict"])
    return f"<td class='t-{tone(c)}' title='{_e(tip)}'>{_e(mark.upper() if c.get('finding') else mark)}</td>"


_CONV = {"position_ids": "pos ids, cache", "position_ids_no_cache": "pos ids", "mask_4d": "4-D mask",
         "collator": "collator", "position_ids_ones_mask": "pos ids, 1s"}
_GROUP = {"isolation": "packed documents", "router": "router", "batch": "batch", "drift": "drift"}


def _short(probe: str, variant: str) -> str:
    if probe == "isolation" and "," in variant:
        impl, conv = variant.split(",", 1)
        return f"{impl}: {_CONV.get(conv, conv)}"
    return {"perturb": "train (perturb)", "truncate": "infer (prefix)", "": probe}.get(variant, variant)


def _group_row(cols) -> str:
    """One header cell per probe, spanning its columns."""
    out, last = ["<tr><th></th>"], None
    for p, _ in cols:
        if p != last:
            n = sum(1 for q, _ in cols if q == p)
            out.append(f"<th colspan='{n}'>{_e(_GROUP.get(p, p))}</th>")
            last = p
    return "".join(out) + "</tr>"


def render_zoo_html(m: dict, findings=()) -> str:
    """m: a zoo map (trainprobes.zoo.sweep.to_map); findings: trainprobes.zoo.findings.FINDINGS."""
    rows = m["rows"]
    cols = columns(rows)
    v = m.get("versions", {})
    s = summary(m)
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>trainprobes zoo map</title>"
           f"<style>{CSS}{_ZOO_CSS}</style></head><body><h1>The transformers model zoo, probed</h1>",
           f"<p class='lead'><span class='status {'bad' if s['findings'] else 'good'}'>{s['findings']} "
           f"finding cells</span> {s['model_types']} causal-LM model types, {s['measured']} measured; "
           f"{s['routers']} MoE routers, {s['routers_decided']} with a training-time verdict.</p>",
           "<table class='meta'>" + "".join(
               f"<tr><th>{_e(k)}</th><td>{_e(val)}</td></tr>" for k, val in (
                   ("transformers", v.get("transformers")), ("torch", v.get("torch")),
                   ("trainprobes", v.get("trainprobes")), ("python", v.get("python")),
                   ("sweep wall time", f"{m.get('wall_seconds')} s"),
                   ("largest peak RSS of one row", f"{m.get('peak_rss_mb')} MB"))) + "</table>",
           "<p class='legend small'>" + "".join(
               f"<span class='t-{t}'>{_e(t)}</span>{_e(what)}<br>" for t, what in TONES.items()) + "</p>",
           "<table class='zoo'>" + _group_row(cols) + "<tr><th>model type</th>"
           + "".join(f"<th class='v' title='{_e(column_label(p, var))}'>{_e(_short(p, var))}</th>"
                     for p, var in cols) + "</tr>"]
    for mt in sorted(rows):
        by = {(c["probe"], c["variant"]): c for c in rows[mt]}
        built = [c for c in rows[mt] if c["probe"] == "build"]
        tip = "; ".join(f"{c['variant']}: {c['reason']}" for c in built)
        if len(built) == len(rows[mt]):   # built under no attention implementation: say why, once
            why = "; ".join(dict.fromkeys(c["reason"] for c in built))
            out.append(f"<tr><td class='mt'>{_e(mt)}</td><td class='t-na why' colspan='{len(cols)}'>"
                       f"not built: {_e(why[:160])}</td></tr>")
            continue
        out.append(f"<tr><td class='mt' title='{_e(tip)}'>{_e(mt)}</td>"
                   + "".join(_cell(by.get(k)) for k in cols) + "</tr>")
    out.append("</table>")
    if findings:
        out.append("<h2>Confirmed findings (kept as controls)</h2><table class='results'><tr><th>model "
                   "type</th><th>cell</th><th>call</th><th>cause</th><th>versions</th><th>reproduction</th></tr>")
        for f in findings:
            life = f.life() if hasattr(f, "life") else ""
            out.append(f"<tr><td>{_e(f.model_type)}</td><td>{_e(f.probe)} {_e(f.variant)}: {_e(f.verdict)}"
                       f"</td><td>{_e(f.call)}{' (fixed upstream)' if getattr(f, 'fixed', None) else ''}</td>"
                       f"<td><code>{_e(f.cause)}</code>: {_e(f.why)}</td><td>{_e(life)}</td>"
                       f"<td><code>{_e(f.script)}</code></td></tr>")
        out.append("</table>")
    flagged = [c for cells in rows.values() for c in cells if c.get("finding")]
    out.append(f"<h2>Cells that contradict the design ({len(flagged)})</h2><ul class='small'>")
    out += [f"<li><code>{_e(c['model_type'])}</code> {_e(c['probe'])} {_e(c['variant'])}: "
            f"{_e(c['verdict'])} (design: {_e(c.get('expected'))}) - {_e(c['reason'])}</li>" for c in flagged]
    out.append("</ul>")
    missing = [c for cells in rows.values() for c in cells
               if c["probe"] == "build" or c["verdict"] in ("error", "unknown")]
    out.append(f"<h2>Cells not measured, with the reason ({len(missing)})</h2><ul class='small'>")
    out += [f"<li><code>{_e(c['model_type'])}</code> {_e(c['probe'])} {_e(c['variant'])}: {_e(c['reason'])}</li>"
            for c in missing]
    out.append("</ul><p class='small muted'>Hover a mark for the cell's verdict, reason, number and the "
               "design's answer. docs/zoo_map.json holds every cell.</p></body></html>")
    return "\n".join(out)
