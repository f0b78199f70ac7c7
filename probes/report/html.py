"""report.html: one self-contained file (inline CSS, plots as base64 PNG), no network."""
from __future__ import annotations

import html
import json
from collections import OrderedDict

from trainprobes.report.markdown import ICONS, counts_line, fmt_value
from trainprobes.report.plots import have_matplotlib, png_data_uri
from trainprobes.result import CODES, Result

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ddd;padding:2px 8px;
text-align:left;font-size:13px;vertical-align:top} th{background:#f6f6f6}
.card{border:1px solid #ddd;border-radius:6px;padding:.6em 1em;margin:1em 0}
.pass{border-left:6px solid #2a2} .warn{border-left:6px solid #e90}
.fail{border-left:6px solid #d22} .error{border-left:6px solid #808}
.plots img{margin:4px;border:1px solid #eee} code{background:#f4f4f4;padding:0 3px}
details pre{max-height:300px;overflow:auto;background:#fafafa;font-size:12px}
"""


def _e(s) -> str:
    return html.escape(str(s), quote=True)


def _plots(r: Result, draw: bool) -> str:
    specs = r.evidence.get("plots") if isinstance(r.evidence, dict) else None
    if not specs or not draw:
        return ""
    imgs = []
    for spec in specs:
        try:
            imgs.append(f'<img alt="{_e(spec.get("title", "plot"))}" '
                        f'src="{png_data_uri(spec)}">')
        except Exception as e:  # one bad spec must not lose the report
            imgs.append(f"<p>plot {_e(spec.get('title', ''))!s} could not be drawn: {_e(e)}</p>")
    return '<div class="plots">' + "".join(imgs) + "</div>"


def _card(r: Result, draw: bool) -> str:
    codes = " ".join(f"<code title='{_e(CODES.get(c, ''))}'>{_e(c)}</code>" for c in r.codes)
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(fmt_value(v))}</td></tr>"
                   for k, v in r.metrics.items())
    ev = {k: v for k, v in r.evidence.items() if k != "plots"} if isinstance(r.evidence, dict) \
        else r.evidence
    evidence = json.dumps(ev, indent=1)
    if len(evidence) > 20000:
        evidence = evidence[:20000] + "\n... (truncated; full evidence in report.json)"
    return (f'<div class="card {_e(r.verdict)}"><h3>{ICONS[r.verdict]} {_e(r.target)} '
            f'<small>{_e(r.probe)} {codes}</small></h3><p>{_e(r.message)}</p>'
            f"{_plots(r, draw)}"
            f"<details><summary>metrics ({len(r.metrics)}), seed {_e(r.seed)}</summary>"
            f"<table>{rows}</table></details>"
            f"<details><summary>evidence</summary><pre>{_e(evidence)}</pre></details></div>")


# Estimates drawn side by side per family, with their confidence intervals.
CI_METRICS = ("bias", "mean_log_ratio")


def family_plots(results: list[Result]) -> list[dict]:
    """One CI plot per estimate that several Results of a family carry (ci_low, ci_high)."""
    plots = []
    for name in CI_METRICS:
        rows = [r for r in results if all(isinstance(r.metrics.get(k), (int, float))
                                          for k in (name, "ci_low", "ci_high"))]
        if len(rows) >= 2:
            plots.append({"kind": "ci", "title": f"{name} with its confidence interval",
                          "labels": [r.target for r in rows],
                          "estimate": [r.metrics[name] for r in rows],
                          "low": [r.metrics["ci_low"] for r in rows],
                          "high": [r.metrics["ci_high"] for r in rows], "ylabel": name})
    return plots


def _family_plots_html(results: list[Result], draw: bool) -> str:
    if not draw:
        return ""
    imgs = "".join(f'<img alt="{_e(s["title"])}" src="{png_data_uri(s)}">'
                   for s in family_plots(results))
    return f'<div class="plots">{imgs}</div>' if imgs else ""


def render_html(results: list[Result], meta: dict | None = None) -> str:
    meta = meta or {}
    draw = have_matplotlib()
    title = meta.get("title", "trainprobes audit")
    families: OrderedDict[str, list[Result]] = OrderedDict()
    for r in results:
        families.setdefault(r.probe.split(".")[0], []).append(r)
    summary = "".join(
        f"<tr><td>{ICONS[r.verdict]} {_e(r.verdict)}</td><td>{_e(r.probe)}</td>"
        f"<td>{_e(r.target)}</td><td>{_e(' '.join(r.codes))}</td><td>{_e(r.message)}</td></tr>"
        for r in results)
    meta_rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in meta.items()
                        if k not in ("title", "history_plots") and not isinstance(v, (dict, list)))
    sections = "".join(
        f"<h2>{_e(fam)}</h2>" + _family_plots_html(rs, draw) + "".join(_card(r, draw) for r in rs)
        for fam, rs in families.items())
    history = ""
    if meta.get("history_plots") and draw:
        history = "<h2>trends across runs</h2><div class='plots'>" + "".join(
            f'<img alt="{_e(s.get("title", ""))}" src="{png_data_uri(s)}">'
            for s in meta["history_plots"]) + "</div>"
    note = "" if draw else "<p><b>matplotlib is not installed: no plots.</b></p>"
    for fam, why in (meta.get("skipped") or {}).items():
        note += f"<p><b>skipped {_e(fam)}</b>: {_e(why)}</p>"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{_e(title)}</h1>"
            f"<p>{_e(counts_line(results) or 'no results')}</p>{note}"
            f"<table>{meta_rows}</table><h2>summary</h2><table><tr><th>verdict</th>"
            f"<th>probe</th><th>target</th><th>codes</th><th>message</th></tr>{summary}</table>"
            f"{history}{sections}</body></html>")
