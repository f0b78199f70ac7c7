"""`trainprobes gate`: block a change that regresses bias, causality, drift or precision."""
from __future__ import annotations

import json

from trainprobes.commands.options import add_force_option, write_announced
from trainprobes.display import append_step_summary
from trainprobes.validation import parse_number

HELP = ("compare a candidate report with a baseline; exit 0 no regression, 1 regression, "
        "2 cannot judge")


def add_arguments(p):
    p.add_argument("--baseline", required=True, metavar="A.json",
                   help="report.json of the accepted state (e.g. main's nightly audit, or "
                        "`trainprobes <command> --json > A.json`)")
    p.add_argument("--candidate", required=True, metavar="B.json",
                   help="report.json of the change under review")
    p.add_argument("--waivers", metavar="FILE",
                   help="TOML ([[waiver]] code, target, reason, expires) or JSON waivers")
    p.add_argument("--alpha", type=parse_number("alpha", min=0.0, max=1.0, min_open=True,
                                                max_open=True, hint="e.g. 0.01"), default=0.01,
                   help="significance level of the bias/drift tests (default 0.01)")
    p.add_argument("--rel-tol", type=parse_number("rel_tol", min=0.0, hint="e.g. 0.1"),
                   default=0.1,
                   help="smallest relative growth of a bias/drift estimate that counts, on top "
                        "of significance (default 0.1 = 10%%)")
    p.add_argument("--json", action="store_true",
                   help="print the verdict as JSON: {schema_version, command, exit_code, "
                        "compared, cannot_judge, regressions, expired_waivers, unused_waivers}")
    p.add_argument("--markdown", metavar="FILE",
                   help="also write the verdict as Markdown to FILE (e.g. a PR comment; "
                        "stdout shows it as plain text); an existing FILE is refused unless --force")
    add_force_option(p)


def run(args) -> int:
    from trainprobes.gate import gate_files
    from trainprobes.result import SCHEMA_VERSION, write_atomic

    report = gate_files(args.baseline, args.candidate, args.waivers, alpha=args.alpha,
                        rel_tol=args.rel_tol)
    md = report.to_markdown()
    if args.json:
        print(json.dumps({"schema_version": SCHEMA_VERSION, "command": "gate",
                          **report.to_dict()}, indent=2))
    else:  # a terminal or a log: plain text; the Markdown goes to --markdown and the job summary
        from trainprobes.gate.render import render_text
        print(render_text(report), end="")
    if args.markdown:
        write_announced(args.markdown, lambda p: write_atomic(p, md, replace=args.force), "Markdown summary")
    append_step_summary(md)
    return report.exit_code
