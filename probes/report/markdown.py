"""summary.md: what a person reads first in the morning (and in $GITHUB_STEP_SUMMARY).

Findings first (problems, then how many passed), one calibration line per family, then one
row per Result. Verdicts are words (PASS, WARN, FAIL, ERROR; OK and MISSED for controls), not
emoji, so the file reads the same in a terminal, a log and a browser.
"""
from __future__ import annotations

import trainprobes.report.outline as outline
from trainprobes.display import format_number
from trainprobes.markup import md_code, md_text
from trainprobes.result import CODES, Result


def _line(r: Result) -> str:
    codes = ", ".join(f"{md_code(c)} {md_text(CODES.get(c, ''))}" for c in r.codes)
    kind = f" ({md_text(outline.known(r))}, got {md_text(r.verdict)})" if r.is_control else ""
    return (f"- **{outline.badge(r).text}** {md_text(r.probe)} {md_code(r.target)}{kind}"
            + (f" [{codes}]" if codes else "") + f": {md_text(r.message)}")


def summary_markdown(results: list[Result], meta: dict | None = None) -> str:
    """Every text from the Results or the run's facts goes through trainprobes.markup: a
    target named `</td><script>` or `a | b` shows as written and keeps the table's shape."""
    meta = meta or {}
    title = meta.get("title", "trainprobes audit")
    lines = [f"## {md_text(title)}", ""]
    bad = [r for r in results if outline.is_problem(r)]
    bits = [f"**{len(bad)} problem{'s' if len(bad) != 1 else ''}**" if bad else "**no problems**",
            outline.headline(results) or "no results"]
    if isinstance(meta.get("seconds"), (int, float)):
        bits.append(f"{format_number(round(meta['seconds'], 1))} s")
    if "suite" in meta:
        bits.append(f"suite: {md_text(meta['suite'])}")
    lines += [" · ".join(bits), ""]
    for fam, why in (meta.get("skipped") or {}).items():
        lines += [f"Skipped **{md_text(fam)}**: {md_text(why)}", ""]
    if meta.get("not_here"):
        lines += ["Not on this machine: " + "; ".join(f"{md_text(k)} ({md_text(v)})" for k, v in
                                                      meta["not_here"].items()), ""]
    found = outline.findings(results)
    watch = [r for r in found if r.verdict == "warn"]
    if bad or watch:
        lines += ["**Findings**", ""]
        lines += [_line(r) for r in sorted(bad + watch, key=outline.rank)]
        lines.append("")
    passed = sum(r.verdict == "pass" for r in found)
    if passed:
        lines += [f"{passed} finding{'s' if passed != 1 else ''} passed.", ""]
    fams = outline.calibration(results)
    if fams:
        lines += ["**Calibration** (controls with a known verdict)", ""]
        lines += [f"- {'OK' if not f.missed else '**MISSED**'} {md_text(f.line())}" for f in fams]
        lines.append("")
    lines += ["| result | kind | probe | target | codes | key metrics | seed |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append("| " + " | ".join((
            outline.badge(r).text, md_text(outline.known(r)), md_text(r.probe),
            md_code(r.target, table=True), md_text(" ".join(r.codes)),
            md_text(outline.key_metrics(r)), "" if r.seed is None else str(r.seed))) + " |")
    lines.append("")
    return "\n".join(lines)
