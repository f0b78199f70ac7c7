"""`trainprobes gate`: block a change that regresses bias, causality, drift or precision."""
from __future__ import annotations

import json
import sys

from trainprobes.display import append_step_summary

HELP = ("compare a candidate report with a baseline; exit 0 no regression, 1 regression, "
        "2 cannot judge")


def add_arguments(p):
    p.add_argument("--baseline", required=True, metavar="A.json",
                   help="report.json of the accepted state (e.g. main's nightly audit)")
    p.add_argument("--candidate", required=True, metavar="B.json",
                   help="report.json of the change under review")
    p.add_argument("--waivers", metavar="FILE",
                   help="TOML ([[waiver]] code, target, reason, expires) or JSON waivers")
    p.add_argument("--alpha", type=float, default=0.01,
                   help="significance level of the bias/drift tests (default 0.01)")
    p.add_argument("--rel-tol", type=float, default=0.1,
                   help="smallest relative growth of a bias/drift estimate that counts, on top "
                        "of significance (default 0.1 = 10%%)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.add_argument("--markdown", metavar="FILE",
                   help="also write the Markdown verdict to FILE (e.g. a PR comment)")


def run(args) -> int:
    from trainprobes.gate import gate_files
    from trainprobes.result import write_atomic

    if not 0.0 < args.alpha < 1.0:
        print(f"error: --alpha={args.alpha!r} must be in (0, 1), e.g. 0.01", file=sys.stderr)
        return 2
    if not args.rel_tol >= 0:  # also NaN
        print(f"error: --rel-tol={args.rel_tol!r} must be >= 0, e.g. 0.1", file=sys.stderr)
        return 2
    report = gate_files(args.baseline, args.candidate, args.waivers, alpha=args.alpha,
                        rel_tol=args.rel_tol)
    md = report.to_markdown()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(md)
    if args.markdown:
        write_atomic(args.markdown, md)
    append_step_summary(md)
    return report.exit_code
