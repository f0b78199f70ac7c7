"""The gate's verdict: as Markdown for a PR comment or job summary (render_markdown), as
plain text for a terminal or a CI log (render_text): what regressed, by how much, the
evidence and the waiver snippet. Every text from a report or a waiver goes through
trainprobes.markup."""
from __future__ import annotations

import json
from datetime import date, timedelta

from trainprobes.markup import md_code, md_text, plain_text


def _toml_string(s: str) -> str:
    """s as a TOML basic string: JSON's escapes are TOML's (quotes, backslashes, control
    characters), so a target with a quote or a newline cannot break the waiver snippet."""
    return json.dumps(s, ensure_ascii=False)


def _waiver_snippet(r) -> list[str]:
    return ["[[waiver]]", f"code = {_toml_string(r.code)}", f"target = {_toml_string(r.target)}",
            'reason = "<why this regression is accepted>"',
            f'expires = "{(date.today() + timedelta(days=30)).isoformat()}"']


def render_markdown(report) -> str:
    """The verdict a reviewer reads in a PR: what regressed, by how much, evidence, waiver.
    Every text from the reports or the waivers goes through trainprobes.markup."""
    if report.cannot_judge is not None:
        lines = [md_text(x) for x in report.cannot_judge.splitlines()]
        body = lines[0] if len(lines) == 1 else "\n".join(
            [lines[0], ""] + [f"- {x}" for x in lines[1:]])
        return ("## trainprobes gate: CANNOT JUDGE (exit 2)\n\n"
                f"{body}\n\nThe gate fails closed: fix the report and rerun.\n")
    lines = []
    blocking, waived = report.blocking, report.waived
    head = "BLOCKED" if blocking else "PASSED"
    lines.append(f"## trainprobes gate: {head} (exit {report.exit_code})\n")
    lines.append(f"{report.compared} probe(s) compared; {len(blocking)} regression(s), "
                 f"{len(waived)} waived.\n")
    if blocking:
        lines.append("### Regressions\n")
        lines.append("| code | probe | target | what | baseline | candidate | evidence |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in blocking:
            lines.append("| " + " | ".join(
                [md_code(r.code, table=True), md_text(r.probe), md_code(r.target, table=True)]
                + [md_text(x) for x in (r.what, r.baseline, r.candidate, r.evidence)]) + " |")
        lines.append("\nTo waive one, add to the waivers file (and say why):\n")
        lines.append("```toml")
        r = blocking[0]
        lines += _waiver_snippet(r) + ["```\n"]
    if waived:
        lines.append("### Waived\n")
        for r in waived:
            w = r.waived_by
            lines.append(f"- {md_code(r.code)} {md_text(r.probe)} {md_code(r.target)}: "
                         f"{md_text(r.what)}. Waived until {w.expires.isoformat()}: "
                         f"{md_text(w.reason)}")
        lines.append("")
    if report.expired_waivers:
        lines.append("### Expired waivers (not applied)\n")
        for w in report.expired_waivers:
            lines.append(f"- {md_code(w.code)} {md_code(w.target)} expired "
                         f"{w.expires.isoformat()}: {md_text(w.reason)}")
        lines.append("")
    if report.unused_waivers:
        lines.append("### Unused waivers (nothing matched; remove them)\n")
        for w in report.unused_waivers:
            lines.append(f"- {md_code(w.code)} {md_code(w.target)} (until {w.expires.isoformat()})")
        lines.append("")
    return "\n".join(lines)


def render_text(report) -> str:
    """The verdict as a terminal or a CI log shows it: the Markdown's facts, one per line,
    nothing escaped (no table, no code spans); every text from the reports or the waivers
    kept on one line (trainprobes.markup.plain_text). The waiver snippet is TOML to paste."""
    t = plain_text
    if report.cannot_judge is not None:
        first, *rest = [t(x) for x in report.cannot_judge.splitlines()] or [""]
        return "\n".join(["trainprobes gate: CANNOT JUDGE (exit 2)", "", first]
                         + [f"  - {x}" for x in rest]
                         + ["", "The gate fails closed: fix the report and rerun."]) + "\n"
    blocking, waived = report.blocking, report.waived
    lines = [f"trainprobes gate: {'BLOCKED' if blocking else 'PASSED'} (exit {report.exit_code})",
             f"{report.compared} probe(s) compared; {len(blocking)} regression(s), "
             f"{len(waived)} waived."]
    if blocking:
        lines += ["", "Regressions:"]
        for r in blocking:
            lines.append(f"  {t(r.code)}  {t(r.probe)}  {t(r.target)}")
            lines.append(f"    {t(r.what)}")
            lines += [f"    {name:9}  {t(value)}" for name, value in
                      (("baseline", r.baseline), ("candidate", r.candidate), ("evidence", r.evidence))
                      if value != ""]
        lines += ["", "To waive one, add to the waivers file (and say why):", ""]
        lines += _waiver_snippet(blocking[0])
    if waived:
        lines += ["", "Waived:"]
        for r in waived:
            w = r.waived_by
            lines.append(f"  {t(r.code)}  {t(r.probe)}  {t(r.target)}: {t(r.what)}; waived until "
                         f"{w.expires.isoformat()}: {t(w.reason)}")
    if report.expired_waivers:
        lines += ["", "Expired waivers (not applied):"]
        lines += [f"  {t(w.code)}  {t(w.target)} expired {w.expires.isoformat()}: {t(w.reason)}"
                  for w in report.expired_waivers]
    if report.unused_waivers:
        lines += ["", "Unused waivers (nothing matched; remove them):"]
        lines += [f"  {t(w.code)}  {t(w.target)} (until {w.expires.isoformat()})"
                  for w in report.unused_waivers]
    return "\n".join(lines) + "\n"
