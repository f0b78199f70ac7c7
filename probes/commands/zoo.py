"""`trainprobes zoo`: one row of the model-zoo map, measured here, or the diff of two maps.

  trainprobes zoo --model mixtral              # every cell of one model type
  trainprobes zoo --model mixtral --json
  trainprobes zoo --diff docs/zoo_map.json new_map.json
Exit 0: every cell agrees with the model's design (diff: no verdict changed); 1: a finding
(a cell contradicts the design; diff: a verdict changed); 2: an unknown model type (the
closest names are listed), an unreadable map, a row the machine cannot hold (its memory
estimated before anything is built), or a row that cannot be judged (the model could not be
built, or a cell raised or came out unknown: the cells are printed, and the ones not judged
named on stderr).
"""
from __future__ import annotations

import itertools
import json
import sys

HELP = "the transformers model zoo: one model type's row of probes, or the diff of two maps"


def add_arguments(parser) -> None:
    g = parser.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", metavar="TYPE", help="a transformers causal-LM model type (mixtral, llama, ...)")
    g.add_argument("--findings", action="store_true",
                   help="re-run the confirmed findings (controls) and say what changed upstream: exit 1 if one "
                        "is missed on a release it was recorded on, 2 if one cannot be judged; a finding fixed "
                        "upstream is news, exit 0")
    g.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"), help="two zoo maps (JSON)")
    parser.add_argument("--probes", default=None, metavar="LIST",
                        help="comma-separated subset of isolation,router,batch,drift (all)")
    from trainprobes.validation import parse_int
    parser.add_argument("--seed", type=parse_int("--seed", min=0), default=0, help="seed (0)")
    parser.add_argument("--json", action="store_true", help="print the row (or the diff) as JSON")
    from trainprobes.commands.options import add_progress_options
    add_progress_options(parser)


def run(args) -> int:
    if args.diff:
        return _diff(args)
    if args.findings:
        return _findings(args)
    from trainprobes.errors import InvalidArgument
    from trainprobes.zoo.cells import PROBES, row
    from trainprobes.zoo.shrink import check_model_type
    from trainprobes.zoo.sweep import versions
    check_model_type(args.model)
    probes = PROBES if args.probes is None else tuple(p.strip() for p in args.probes.split(","))
    bad = [p for p in probes if p not in PROBES]
    if bad:
        raise InvalidArgument(f"--probes names {bad!r}; choose from {', '.join(PROBES)}")
    import warnings
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    # bounded: the row's memory estimated (its parameters counted on the meta device) and
    # refused before anything is built
    from trainprobes.budget import check_fits
    from trainprobes.zoo.sweep import row_bytes
    check_fits(row_bytes(args.model), f"zoo --model {args.model}",
               fix="free memory, or run it where more is available")
    from trainprobes.commands.options import progress_for
    from trainprobes.zoo.cells import IMPLEMENTATIONS
    from trainprobes.zoo.targets import CONVENTIONS
    # the steps row() reports: one per isolation cell, one per other probe (an estimate: a
    # build that fails leaves its cells out)
    total = sum(len(IMPLEMENTATIONS) * len(CONVENTIONS) if pr == "isolation" else 1 for pr in probes)
    with progress_for(args, f"zoo --model {args.model}", total, unit="cells") as p:
        started = itertools.count()   # row() reports each cell as it begins
        cells = row(args.model, probes=probes, seed=args.seed,
                    progress=lambda what: p.step(next(started), current=what))
    findings = [c for c in cells if c.finding]
    if args.json:
        from trainprobes.result import dumps_report
        print(dumps_report([r for r in map(_result, cells) if r is not None], command="zoo",
                           options={"model": args.model, "probes": list(probes), "seed": args.seed},
                           versions=versions(), model_type=args.model, n_findings=len(findings),
                           cells=json.loads(json.dumps([c.to_dict() for c in cells], default=str))))
    else:
        print(f"zoo {args.model}: {len(cells)} cells, {len(findings)} contradict the design")
        for c in cells:
            num = "" if c.number is None else f"{c.number:.3g}"
            flag = "FINDING" if c.finding else ""
            print(f"  {c.probe:9s} {c.variant:28s} {c.verdict:10s} {num:>9s} {flag:7s} {c.reason}")
    if findings:
        return 1
    # fail closed: a row with nothing built, or a cell that raised or could not decide, has
    # not shown the model agrees with its design
    unjudged = [c for c in cells if c.verdict in ("error", "unknown")]
    if unjudged or all(c.probe == "build" for c in cells):
        what = ("the model could not be built" if all(c.probe == "build" for c in cells) else
                f"{len(unjudged)} cells not judged: "
                + "; ".join(f"{c.probe} {c.variant}: {c.reason[:120]}".replace("  ", " ") for c in unjudged[:3]))
        from trainprobes.errors import CannotJudge
        raise CannotJudge(f"cannot judge {args.model}: {what}")
    return 0


def _result(cell):
    """The cell's Result for the report the gate reads: the probe's own where it ran, with the
    design's call in the message; an error Result where the model could not be built under an
    implementation or the probe raised or could not decide (never dropped); None for a probe
    that does not apply (no MoE layer: the cell says so in `cells`)."""
    r = cell.result
    if r is not None:
        if cell.finding:
            r.message = f"contradicts the design ({cell.expected}): {r.message}"
        return r
    if cell.probe == "build" or cell.verdict in ("error", "unknown"):
        return cell.unmeasured(f"not judged: {cell.reason}")
    return None


def _diff(args) -> int:
    from trainprobes.zoo.diff import diff_maps, format_diff, load_map
    a, b = load_map(args.diff[0]), load_map(args.diff[1])
    changes = diff_maps(a, b)
    if args.json:
        print(json.dumps({"before": a.get("versions"), "after": b.get("versions"),
                          "changes": [c.__dict__ for c in changes]}, indent=1))
    else:
        print(format_diff(a, b, changes), file=sys.stdout)
    return 1 if changes else 0


def _findings(args) -> int:
    import warnings
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()   # the tiny configs' own notes, not findings
    from trainprobes.commands.options import progress_for
    from trainprobes.zoo.confirm import Outcome, control, judge, measure, transformers_version
    from trainprobes.zoo.findings import FINDINGS
    from trainprobes.zoo.sweep import versions
    cells = []
    with progress_for(args, "zoo --findings", len(FINDINGS), unit="findings") as p:
        for i, f in enumerate(FINDINGS):
            p.step(i, current=f"{f.model_type} {f.probe} {f.variant}")
            cells.append(measure(f, args.seed))
    version = transformers_version()
    statuses = judge(FINDINGS, cells, version)
    n = {o: sum(s.outcome is o for s in statuses) for o in Outcome}
    if args.json:
        from trainprobes.result import dumps_report
        print(dumps_report([control(s, c) for s, c in zip(statuses, cells)], command="zoo --findings",
                           options={"seed": args.seed}, versions=versions()))
    else:
        print(f"zoo --findings on transformers {version}: {n[Outcome.REPRODUCED]} of {len(FINDINGS)} reproduced, "
              f"{n[Outcome.FIXED]} fixed upstream, {n[Outcome.CHANGED]} changed upstream, "
              f"{n[Outcome.OLDER]} not yet in this older release, "
              f"{n[Outcome.MISSED]} missed, {n[Outcome.UNJUDGED]} not judged")
        for s in statuses:
            f = s.finding
            print(f"  {s.outcome.value:16s} {f.model_type} {f.probe} {f.variant}: {f.call}, {f.cause}"
                  + ("" if s.outcome is Outcome.REPRODUCED else f" -- now {s.now[:160]}"))
        news: dict = {}   # one line per piece of news, the findings it concerns beside it
        for s in statuses:
            if s.news and s.outcome is not Outcome.UNJUDGED:
                news.setdefault(s.news, []).append(f"{s.finding.model_type} ({s.finding.variant or s.finding.probe})")
        if news:
            print("news:")
            for text, which in news.items():
                print(f"  {text}\n    {len(which)} finding(s): {', '.join(which)}")
    # a control missed on a release it was recorded on: the harness failed (1); a finding that
    # cannot be measured, or a change the run cannot tell from a failure: cannot judge (2)
    if n[Outcome.MISSED]:
        return 1
    if n[Outcome.UNJUDGED]:
        from trainprobes.errors import CannotJudge
        bad = [s for s in statuses if s.outcome is Outcome.UNJUDGED]
        raise CannotJudge(f"{len(bad)} finding(s) not judged on transformers {version}: "
                          + "; ".join(f"{s.finding.model_type} {s.finding.variant}: {s.news}" for s in bad[:3]))
    return 0
