"""report.html: one self-contained file (inline CSS, plots as base64 PNG, one small inline
script: the filter), nothing fetched, so it works offline and from a CI artifact.

The page reads top to bottom in the order a person needs it:
  1. the headline (findings by verdict, controls reproduced) and the run's facts;
  2. findings, real problems first (errors, missed controls, failing and warning findings
     as cards with their plots), then the passing findings as one compact table;
  3. calibration: one line per family ("20 of 20 controls reproduced") and one overview
     plot per family where its Results carry one;
  4. trends across runs (with --history);
  Each Result appears in one place only; report.json holds them all. A filter above the
  findings (by what a Result did, finding or control, family, and words in its target,
  probe, codes or message) hides what does not match and opens the folded tables that
  hold a match; without JavaScript it stays hidden and the page reads as it is. No text
  from a Result ever enters the script: it reads data-* attributes, escaped like any text.
Plots are drawn only where the page shows them.
"""
from __future__ import annotations

from typing import Callable

import trainprobes.report.outline as outline
from trainprobes.display import format_number
from trainprobes.markup import html_text
from trainprobes.report.plots import have_matplotlib, png_data_uri
from trainprobes.result import CODES, Result

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em auto;
 max-width:1100px;padding:0 1em;color:#222}
h1{font-size:1.5em;margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
.lead{font-size:1.1em} .muted{color:#666} .small{font-size:12px}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ddd;padding:3px 6px;
 text-align:left;font-size:13px;vertical-align:top} th{background:#f6f6f6}
table.results{table-layout:fixed;width:100%} table.results td{overflow-wrap:break-word}
table.meta th{font-weight:normal;color:#555;background:none}
.target{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
.b{display:inline-block;min-width:4.6em;text-align:center;border-radius:3px;padding:0 .35em;
 font:bold 11px/1.7 ui-monospace,Menlo,Consolas,monospace;letter-spacing:.03em}
.b-pass{background:#2a7a3a;color:#fff} .b-warn{background:#e0a000;color:#222}
.b-fail{background:#c62828;color:#fff} .b-error{background:#6a1b9a;color:#fff}
.b-ok{background:#fff;color:#2a7a3a;border:1px solid #2a7a3a;line-height:1.55}
.b-missed{background:#c62828;color:#fff}
.card{border:1px solid #ddd;border-radius:6px;padding:.5em 1em;margin:.8em 0}
.card h3{font-size:1em;margin:.2em 0} .card.control{border-style:dashed}
.card.v-fail,.card.v-missed{border-left:6px solid #c62828} .card.v-warn{border-left:6px solid #e0a000}
.card.v-error{border-left:6px solid #6a1b9a}
.status{font-weight:bold;padding:.1em .5em;border-radius:3px}
.status.good{background:#e6f4ea;color:#1e5e2e} .status.bad{background:#fde7e7;color:#8e1b1b}
ul.calib{list-style:none;padding-left:0} ul.calib li{margin:.25em 0}
.plots img{margin:4px;border:1px solid #eee;max-width:100%;height:auto}
.plots figure{display:inline-block;margin:0 .5em .5em 0;vertical-align:top}
.plots figcaption{font-size:12px;color:#555;max-width:640px}
code{background:#f4f4f4;padding:0 3px} details summary{cursor:pointer;color:#444}
details table{margin:.3em 0} .advice{background:#fff8e1;border-radius:4px;padding:.1em .7em}
[hidden]{display:none!important}
form.filter{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:.4em 0;
 margin:1em 0 0;z-index:1;font-size:13px} form.filter select,form.filter input{font:inherit;
 margin-right:.4em} form.filter input{width:16em}
"""

# The filter: reads each Result's data-* attributes (data-show, data-kind, data-family,
# data-words), hides what does not match, opens the folded tables holding a match and
# hides the groups holding none; clearing it restores the page as written. A link may
# set it: report.html#show=problem&kind=finding (keys show, kind, family, words). A
# constant: nothing from a Result is ever written into it.
FILTER_JS = """(function(){
var f=document.getElementById('filter');if(!f)return;f.hidden=false;
var items=[].slice.call(document.querySelectorAll('[data-family]'));
var groups=[].slice.call(document.querySelectorAll('.group'));
groups.forEach(function(d){d.dataset.wasOpen=d.open?'1':'';});
function val(id){return document.getElementById(id).value;}
function apply(){
 var show=val('f-show'),kind=val('f-kind'),fam=val('f-family'),q=val('f-words').trim().toLowerCase();
 var active=!!(show||kind||fam||q),n=0;
 items.forEach(function(el){
  var ok=(!show||el.dataset.show.split(' ').indexOf(show)>=0)&&(!kind||el.dataset.kind===kind)
   &&(!fam||el.dataset.family===fam)&&(!q||el.dataset.words.indexOf(q)>=0);
  el.hidden=!ok;if(ok)n++;});
 groups.forEach(function(d){
  var any=!!d.querySelector('[data-family]:not([hidden])');
  if(d.tagName==='DETAILS')d.open=active?any:d.dataset.wasOpen==='1';
  (d.closest('li')||d).hidden=active&&!any;});
 document.getElementById('f-count').textContent=active?n+' of '+items.length+' results match'
  :items.length+' results';}
var ids={show:'f-show',kind:'f-kind',family:'f-family',words:'f-words'};
var h=new URLSearchParams(location.hash.slice(1));
Object.keys(ids).forEach(function(k){if(h.get(k))document.getElementById(ids[k]).value=h.get(k);});
f.addEventListener('input',apply);f.addEventListener('change',apply);
f.addEventListener('submit',function(e){e.preventDefault();});
document.getElementById('f-clear').addEventListener('click',function(){f.reset();apply();});
apply();})();"""

# What the first filter chooses, against the badge each Result shows (outline.badge).
SHOW = (("problem", "problems: FAIL, ERROR, MISSED"), ("warn", "WARN"), ("pass", "PASS"),
        ("ok", "OK: controls that reproduced"))


_e = html_text  # every text from a Result or the run's facts, in text and attributes alike


class Page:
    """HTML pieces in page order: strings, plot specs (drawn by draw()) and callables
    (evaluated by html(), for facts known only once the plots are drawn: the wall time)."""

    def __init__(self, draw: bool = True):
        self.parts: list = []
        self.draws = draw

    def add(self, *pieces) -> None:
        self.parts.extend(pieces)

    def plot(self, spec: dict) -> None:
        if self.draws:
            self.parts.append(spec)

    def specs(self) -> list[dict]:
        return [p for p in self.parts if isinstance(p, dict)]

    def draw(self, progress: Callable[[int, int, str], None] | None = None) -> None:
        """Turn every plot spec into a <figure> with its PNG inline."""
        where = [k for k, p in enumerate(self.parts) if isinstance(p, dict)]
        for i, k in enumerate(where, 1):
            if progress:
                progress(i, len(where), str(self.parts[k].get("title", "")))
            self.parts[k] = _figure(self.parts[k])

    def html(self) -> str:
        self.draw()  # anything not drawn yet
        return "".join(p() if callable(p) else p for p in self.parts)


def _figure(spec: dict) -> str:
    note = f"<figcaption>{_e(spec['note'])}</figcaption>" if spec.get("note") else ""
    try:
        img = f'<img alt="{_e(spec.get("title", "plot"))}" src="{png_data_uri(spec)}">'
    except Exception as e:  # one bad spec must not lose the report
        img = f"<p>plot {_e(spec.get('title', ''))} could not be drawn: {_e(e)}</p>"
    return f"<figure>{img}{note}</figure>"


def _target(name: str) -> str:
    """A target name that may wrap after its punctuation (a long import path or
    all_reduce[fp32,sum,...] breaks between fields, not inside a number)."""
    out = _e(name)
    for ch in (",", ".", ":", "[", "/"):
        out = out.replace(ch, ch + "<wbr>")
    return out


def _badge(r: Result) -> str:
    b = outline.badge(r)
    return f'<span class="b {b.css}" title="{_e(b.title)}">{_e(b.text)}</span>'


def _codes(r: Result) -> str:
    return " ".join(f"<code title='{_e(CODES.get(c, ''))}'>{_e(c)}</code>" for c in r.codes)


def _metrics_table(r: Result) -> str:
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(format_number(v))}</td></tr>"
                   for k, v in r.metrics.items())
    return f"<details><summary>metrics ({len(r.metrics)})</summary><table>{rows}</table></details>"


def _evidence_outline(r: Result) -> str:
    """The evidence's plain fields and the length of its lists; the rest is in report.json."""
    ev = r.evidence if isinstance(r.evidence, dict) else {}
    rows = []
    for k, v in ev.items():
        if k == "plots":
            continue
        if k == "traceback":
            shown = f"<pre class='small'>{_e(v)}</pre>"
        elif isinstance(v, (list, dict)):
            shown = f"{len(v)} {'items' if isinstance(v, list) else 'fields'} (report.json)"
        else:
            shown = _e(format_number(v)[:300])
        rows.append(f"<tr><td>{_e(k)}</td><td>{shown}</td></tr>")
    if not rows:
        return ""
    return f"<details><summary>evidence ({len(rows)} fields)</summary><table>{''.join(rows)}</table></details>"


def _data(r: Result) -> str:
    """The attributes the filter reads: what the Result did (its badge, and 'problem' for
    what fails the audit), finding or control, family, and its words (lower case)."""
    show = outline.badge(r).css[2:] + (" problem" if outline.is_problem(r) else "")
    words = " ".join([r.target, r.probe, *r.codes, r.message]).lower()
    return (f' data-show="{_e(show)}" data-kind="{"control" if r.is_control else "finding"}"'
            f' data-family="{_e(outline.family(r))}" data-words="{_e(words)}"')


def _filter(results: list[Result]) -> str:
    """The filter's form: hidden until the script shows it (a page without JavaScript has
    no dead controls)."""
    fams = sorted({outline.family(r) for r in results})
    opt = "".join(f"<option value='{_e(v)}'>{_e(t)}</option>" for v, t in SHOW)
    famopt = "".join(f"<option value='{_e(f)}'>{_e(f)}</option>" for f in fams)
    return ("<form id='filter' class='filter' hidden><b>Filter</b> "
            f"<select id='f-show' aria-label='what a result did'><option value=''>every outcome"
            f"</option>{opt}</select>"
            "<select id='f-kind' aria-label='finding or control'><option value=''>findings and "
            "controls</option><option value='finding'>findings (your stack)</option>"
            "<option value='control'>controls (known verdicts)</option></select>"
            f"<select id='f-family' aria-label='family'><option value=''>every family</option>"
            f"{famopt}</select>"
            "<input id='f-words' type='search' placeholder='target, probe, code or words' "
            "aria-label='words'> <button type='button' id='f-clear'>clear</button> "
            "<span id='f-count' class='muted'></span></form>")


def _seed(r: Result) -> str:
    return "" if r.seed is None else f" · seed {_e(r.seed)}"


def _card(page: Page, r: Result) -> None:
    b = outline.badge(r)
    kind = "control" if r.is_control else "finding"
    page.add(f'<div class="card {kind} v-{b.css[2:]}"{_data(r)}><h3>{_badge(r)} <span class="target">'
             f'{_target(r.target)}</span></h3><p class="small muted">{_e(outline.known(r))} · '
             f"{_e(r.probe)} {_codes(r)}{_seed(r)}</p><p>{_e(r.message)}</p>")
    if not r.is_control and r.verdict == "warn":
        page.add(_advice(r))
    if r.reproduced is False:
        page.add(f"<p><b>expected {_e(r.expected)}, got {_e(r.verdict)}</b>: this control's "
                 "verdict is known from its mechanism, so the harness did not work as designed "
                 "on this machine (or this trainprobes changed it).</p>")
    specs = r.evidence.get("plots") if isinstance(r.evidence, dict) else None
    if specs and page.draws:
        page.add('<div class="plots">')
        for spec in specs:
            page.plot(spec)
        page.add("</div>")
    page.add(_metrics_table(r), _evidence_outline(r), "</div>")


def _results_table(results: list[Result], *, full: bool = True) -> str:
    """One row per Result; full: numbered, with the kind column (finding or control)."""
    cols = ("<colgroup>" + ("<col style='width:2.6em'>" if full else "")
            + "<col style='width:6.2em'>" + ("<col style='width:8.5em'>" if full else "")
            + "<col style='width:30%'><col style='width:5.5em'><col></colgroup>")
    head = ("<tr>" + ("<th>#</th>" if full else "") + "<th>result</th>"
            + ("<th>kind</th>" if full else "")
            + "<th>target / probe</th><th>codes</th><th>message</th></tr>")
    rows = []
    for i, r in enumerate(results, 1):
        rows.append(f"<tr{_data(r)}>" + (f"<td>{i}</td>" if full else "") + f"<td>{_badge(r)}</td>"
                    + (f"<td class='small'>{_e(outline.known(r))}</td>" if full else "")
                    + f"<td><span class='target'>{_target(r.target)}</span><br>"
                    f"<span class='small muted'>{_e(r.probe)}{_seed(r)}</span></td>"
                    f"<td>{_codes(r)}</td><td>{_e(r.message)}{_metrics_table(r)}</td></tr>")
    return f"<table class='results'>{cols}{head}{''.join(rows)}</table>"


def _meta_table(meta: dict) -> str:
    env = meta.get("environment") or {}
    wall, checks = meta.get("seconds"), meta.get("check_seconds")
    seed, control_seed = meta.get("seed"), meta.get("control_seed")
    facts = [("suite", meta.get("suite")), ("created", meta.get("created")),
             ("wall time", None if not isinstance(wall, (int, float)) else f"{wall:.1f} s"
              + (f" (checks {checks:.1f} s)" if isinstance(checks, (int, float)) else "")),
             ("seed", seed if control_seed is None else f"{seed} (controls: {control_seed})"),
             ("torch threads", meta.get("torch_threads")),
             ("machine", ", ".join(f"{k} {v}" for k, v in env.items() if v) or None),
             ("report.json", meta.get("report"))]
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts if v is not None)
    return f"<table class='meta small'>{rows}</table>"


def _notes(meta: dict, draw: bool) -> str:
    out = "" if draw else "<p><b>matplotlib is not installed: no plots</b> (pip install matplotlib).</p>"
    for fam, why in (meta.get("skipped") or {}).items():
        out += f"<p><b>skipped {_e(fam)}</b>: {_e(why)}</p>"
    here = meta.get("not_here") or {}
    if here:
        out += ("<p class='muted'>not on this machine: " + "; ".join(
            f"{_e(k)} ({_e(v)})" for k, v in here.items()) + "</p>")
    return out


def _alike(problems: list[Result]) -> list[list[Result]]:
    """Findings that say the same thing (one probe, one verdict, the same codes, no plots of
    their own: six ops that are batch-variant) as one group, in the order of their first;
    errors and missed controls stay one card each (each has its own traceback or cause)."""
    groups: dict = {}
    for r in problems:
        alone = (r.verdict == "error" or r.is_control
                 or (isinstance(r.evidence, dict) and r.evidence.get("plots")))
        key = id(r) if alone else (r.probe, r.verdict, tuple(r.codes))
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _advice(r: Result) -> str:
    """What each of r's codes means and what to do (outline.ADVICE), `code` as code."""
    def words(text: str) -> str:   # ADVICE is ours: only its backticks become <code>
        parts = _e(text).split("`")
        return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    tips = outline.advice(r)
    return "<div class='advice'>" + ("".join(
        f"<p><b>What {_e(c)} means:</b> {words(a.means)}.<br><b>What to do:</b> {words(a.todo)}.</p>"
        for c, a in tips) or "<p><b>WARN</b> is not a failure: worth a look. The message "
                             "above says what was seen.</p>") + "</div>"


def _group_card(page: Page, group: list[Result]) -> None:
    """One card for findings that say the same thing: the advice once, then a row each."""
    r = group[0]
    b = outline.badge(r)
    codes = f" {_codes(r)}" if r.codes else ""
    page.add(f'<div class="card finding group v-{b.css[2:]}"><h3>{_badge(r)} {len(group)} '
             f'findings of {_e(r.probe)}{codes}</h3><p class="small muted">the same verdict '
             "and codes on each target below</p>")
    if r.verdict == "warn":
        page.add(_advice(r))
    page.add(_results_table(group, full=False), "</div>")


def _findings(page: Page, results: list[Result]) -> None:
    found = outline.findings(results)
    problems = sorted((r for r in results if outline.is_problem(r)
                       or (not r.is_control and r.verdict == "warn")), key=outline.rank)
    page.add("<h2 id='findings'>Findings</h2>",
             "<p class='small muted'><span class='b b-pass'>PASS</span> fine "
             "<span class='b b-warn'>WARN</span> watch out "
             "<span class='b b-fail'>FAIL</span> a problem: fails the audit "
             "<span class='b b-missed'>MISSED</span> a control did not reproduce its known verdict: "
             "the harness is not working here "
             "<span class='b b-ok'>OK</span> a control reproduced its known verdict</p>")
    if not problems and not found:
        page.add("<p>No findings in this suite: only controls (see calibration).</p>")
    for group in _alike(problems):
        if len(group) == 1:
            _card(page, group[0])
        else:
            _group_card(page, group)
    fine = [r for r in found if r.verdict == "pass"]
    if fine:
        page.add(f"<details class='group'><summary>{len(fine)} finding{'s' if len(fine) != 1 else ''} "
                 "passed (open to see each)</summary>", _results_table(fine, full=False),
                 "</details>")


def _calibration(page: Page, results: list[Result]) -> None:
    fams = outline.calibration(results)
    if not fams:
        return
    page.add("<h2 id='calibration'>Calibration</h2>",
             "<p class='small muted'>Controls are cases whose verdict is known from their "
             "mechanism (a known-leaky router, a bf16 ring that stalls, an engine pair with a "
             "temperature bug). Reproducing that verdict, pass or fail, shows the probes work on "
             "this machine; a missed one is listed under findings.</p><ul class='calib'>")
    for f in fams:
        css = "b-ok" if not f.missed else "b-missed"
        page.add(f"<li><details class='group'{' open' if f.missed else ''}><summary>"
                 f"<span class='b {css}'>{'OK' if not f.missed else 'MISSED'}</span> "
                 f"{_e(f.line())}</summary>",
                 # a missed control is a card under findings: here only the others
                 _results_table([r for r in f.controls if not outline.is_problem(r)], full=False),
                 "</details></li>")
    page.add("</ul>")
    if page.draws:
        overviews = [s for s in (overview_plot(f.controls) for f in fams) if s]
        if overviews:
            page.add("<div class='plots'>")
            for spec in overviews:
                page.plot(spec)
            page.add("</div>")


# Estimates drawn side by side per family, with their confidence intervals: the metric,
# how it is shown (a relative error in %), its unit, what it is and its axis label.
CI_METRICS = {"bias": (100.0, "%", "bias: mean signed relative error", "bias"),
              "mean_log_ratio": (1.0, "nats/token", "mean log-ratio log p_infer - log p_train",
                                 "mean log-ratio")}


def row_status(r: Result) -> str:
    """What a row did against its expectation, as the forest plot colours it."""
    return outline.badge(r).css[2:]


def family_plots(results: list[Result]) -> list[dict]:
    """One forest plot per estimate that several Results of a family carry (ci_low, ci_high)."""
    plots = []
    for name, (scale, unit, what, label) in CI_METRICS.items():
        rows = [r for r in results if all(isinstance(r.metrics.get(k), (int, float))
                                          and not isinstance(r.metrics.get(k), bool)
                                          for k in (name, "ci_low", "ci_high"))]
        if len(rows) >= 2:
            plots.append({"kind": "ci", "title": f"{what}, with its confidence interval",
                          "labels": [r.target for r in rows],
                          "estimate": [r.metrics[name] for r in rows],
                          "low": [r.metrics["ci_low"] for r in rows],
                          "high": [r.metrics["ci_high"] for r in rows], "xlabel": label,
                          "scale": scale, "unit": unit,
                          "control": [r.is_control for r in rows],
                          "status": [row_status(r) for r in rows],
                          "expected": [r.expected for r in rows],
                          "note": "Each row's value and interval are written beside it; rows "
                                  "of very different size get panels of their own, each on a "
                                  "linear axis. Hollow diamonds: controls (green: reproduced "
                                  "their known verdict, pass or fail); filled circles: findings."})
    return plots


def overview_plot(members: list[Result]) -> dict | None:
    """A family's one picture: its estimates side by side, else its single Result's plot."""
    ci = family_plots(members)
    if ci:
        return ci[0]
    if len(members) == 1:
        specs = members[0].evidence.get("plots") if isinstance(members[0].evidence, dict) else None
        return specs[0] if specs else None
    return None


def render_html(results: list[Result], meta: dict | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> str:
    page = build_page(results, meta)
    page.draw(progress)
    return page.html()


def build_page(results: list[Result], meta: dict | None = None) -> Page:
    """The page with its plots still to draw (Page.draw) and the run's facts read from
    meta when the page is joined (Page.html), so they can include the drawing time."""
    meta = {} if meta is None else meta
    draw = have_matplotlib()
    title = meta.get("title", "trainprobes audit")
    bad = [r for r in results if outline.is_problem(r)]
    status = (f"<span class='status bad'>{len(bad)} problem{'s' if len(bad) != 1 else ''}</span>"
              if bad else "<span class='status good'>no problems</span>")
    page = Page(draw)
    page.add(f"<!doctype html><html><head><meta charset='utf-8'><meta name='viewport' "
             f"content='width=device-width,initial-scale=1'><title>{_e(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{_e(title)}</h1>"
             f"<p class='lead'>{status} {_e(outline.headline(results) or 'no results')}</p>",
             _notes(meta, draw), lambda: _meta_table(meta))
    if results:
        page.add(_filter(results))
    _findings(page, results)
    _calibration(page, results)
    trends = meta.get("history_plots") or []
    if trends:
        page.add("<h2 id='trends'>Trends across runs</h2><div class='plots'>")
        for spec in trends:
            page.plot(spec)
        page.add("</div>")
    page.add("<p class='small muted'>Each Result is shown once: problems and warnings as "
             "cards, passing findings in one table, controls under their family in calibration "
             "(open a family to see them). report.json holds every Result with its metrics and "
             "summarised evidence (<code>--full-evidence</code> keeps long lists).</p>",
             f"<script>{FILTER_JS}</script></body></html>" if results else "</body></html>")
    return page
