"""`trainprobes audit`: run a suite and write reports/<timestamp>/ with JSON, Markdown, HTML.

Exit codes (docs/audit.md): 0 no problem; 1 a finding failed or a control missed its known
verdict; 2 could not run (bad configuration, a check errored; with --strict, a family
skipped). --report-only: 0 whenever the report was written (2 still means it could not run).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from trainprobes.commands.options import add_progress_options, progress_wanted
from trainprobes.validation import parse_int


def _families() -> str:
    """The --families help, from the suite itself (so it cannot go stale)."""
    from trainprobes.audit.suites import FAMILIES, STACK
    part = {True: [], False: []}
    for name, f in FAMILIES.items():
        part[f.part == STACK].append(name + ("" if f.default else " (only when named)"))
    return f"{', '.join(part[True])} (your stack); {', '.join(part[False])} (calibration)"

HELP = ("run the audit suite (built-in default: your stack, then calibration; or "
        "[tool.trainprobes] from pyproject.toml) and write report.json, summary.md and "
        "report.html")


def add_arguments(p):
    p.add_argument("--config", metavar="FILE",
                   help="TOML file with a [tool.trainprobes] table (default: ./pyproject.toml "
                        "when it has one, else the built-in default suite)")
    p.add_argument("--default", action="store_true",
                   help="run the built-in default suite even where a config exists")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where reports/<timestamp>/ go, and reports/latest (default: reports, "
                        "or the config's out)")
    p.add_argument("--history", metavar="DIR", default=None,
                   help="append a summary line per run to DIR/history.jsonl and plot trends")
    p.add_argument("--families", metavar="A,B", default=None,
                   help=f"only these default-suite families (implies --default): {_families()}")
    p.add_argument("--quick", action="store_true", help="a smaller default suite (smoke test)")
    p.add_argument("--seed", type=parse_int("seed", min=0), default=None,
                   help="seed for every random choice (default 0)")
    p.add_argument("--report-only", action="store_true",
                   help="exit 0 once the report is written, whatever it found (2 still means "
                        "it could not run); default: exit 1 on a failing finding or a missed "
                        "control, as pytest does")
    p.add_argument("--strict", action="store_true",
                   help="also exit 2 when a family or section was skipped because its probe "
                        "module is missing (an incomplete audit)")
    p.add_argument("--full-evidence", action="store_true",
                   help="keep every probe's evidence whole in report.json (default: long lists "
                        "cut to their first 32 items, lengths recorded under 'truncated')")
    p.add_argument("--threads", type=parse_int("threads", min=0), default=1, metavar="N",
                   help="torch intra-op threads while the audit runs (default 1: the suite's "
                        "tensors are small; on a busy 2-core machine 2 threads made the tiny-LM "
                        "scenarios up to ~50x slower, on an idle one it makes no difference); "
                        "0 keeps torch's default")
    p.add_argument("--json", action="store_true",
                   help="print the report document (what report.json holds: schema_version, "
                        "command, run facts, results) with its paths and exit code on stdout")
    add_progress_options(p)


def _suite(args):
    """(checks, skipped, not here, suite label, seed, config)."""
    from trainprobes.audit.config import check_top, find_config, suite_from_config
    from trainprobes.audit.suites import default_suite, not_here

    use_default = args.default or args.families is not None
    cfg, cfg_path = (None, None) if use_default else find_config(args.config)
    if cfg is not None:
        check_top(cfg)  # before its seed, out or history is read
    seed = args.seed if args.seed is not None else (cfg or {}).get("seed", 0)
    families = [f.strip() for f in args.families.split(",") if f.strip()] \
        if args.families is not None else None
    if families == []:
        from trainprobes.audit.suites import FAMILIES
        raise ValueError(f"--families {args.families!r} names no family; e.g. --families "
                         f"reveal,causality (all: {', '.join(FAMILIES)})")
    if cfg is None:
        checks, skipped = default_suite(seed=seed, quick=args.quick, families=families)
        absent = not_here(families)
        suite = "default" + (" (quick)" if args.quick else "")
    else:
        checks, skipped = suite_from_config(cfg, seed=seed, base_dir=cfg_path.parent,
                                            quick=args.quick)
        absent = not_here(cfg.get("families")) if cfg.get("defaults") else {}
        suite = f"{cfg_path}"
    return checks, skipped, absent, suite, seed, cfg


def run(args) -> int:
    # the wall time is the command's own: from trainprobes.cli.main (torch's import
    # included), never the process's age, which an exec'ing shell (`sleep 8 && ...`) inflates
    started = getattr(args, "_started", None) or time.perf_counter()
    from trainprobes.audit import Progress, run_audit
    from trainprobes.audit.suites import CONTROL_SEED
    from trainprobes.commands.options import options_of
    from trainprobes.errors import ConfigError

    try:
        checks, skipped, absent, suite, seed, cfg = _suite(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not checks:
        print("error: the suite has no checks" + (f" (skipped: {skipped})" if skipped else "")
              + (f" (not on this machine: {absent})" if absent else ""), file=sys.stderr)
        return 2
    out = args.out or (cfg or {}).get("out") or "reports"
    history = args.history or (cfg or {}).get("history")
    try:  # before minutes of checks, not after them
        for d in (out, history):
            if d:
                Path(d).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: --out/--history directory cannot be created: {e}", file=sys.stderr)
        return 2
    progress = Progress(len(checks)) if progress_wanted(args) else None
    if progress:
        print(f"trainprobes audit: {len(checks)} checks, suite {suite}", file=sys.stderr)
    import torch
    before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        outcome = run_audit(checks, out, history=history, progress=progress,
                            full_evidence=args.full_evidence, started=started,
                            meta={"options": options_of(args), "suite": suite, "seed": seed,
                                  "skipped": skipped,
                                  "not_here": absent, "torch_threads": torch.get_num_threads(),
                                  **({"control_seed": CONTROL_SEED}
                                     if any(c.control for c in checks) else {})})
    except OSError as e:  # the checks catch their own errors: this is writing the report
        if progress:
            progress.close()
        print(f"error: the report cannot be written, so none was kept (latest still names "
              f"the last whole run): {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(before)  # the command may run inside a longer process
    code = outcome.exit_code_with(report_only=args.report_only, strict=args.strict)
    if args.json:
        print(_json(outcome, code))
    else:
        print(render(outcome, suite=suite, absent=absent))
    why = _why(outcome, code)
    if why:
        print(why, file=sys.stderr)
    return code


def _json(outcome, code: int) -> str:
    import json

    from trainprobes.report.evidence import dumps
    doc = json.loads(outcome.paths["json"].read_text(encoding="utf-8"))
    return dumps({**{k: v for k, v in doc.items() if k != "results"}, "exit_code": code,
                  "paths": {k: str(v) for k, v in outcome.paths.items()},
                  "results": doc["results"]})


def _why(outcome, code: int) -> str:
    """The exit code in a sentence on stderr, naming what caused it."""
    from trainprobes.report import outline
    if code == 0:
        return ""
    errors = [r for r in outcome.results if r.verdict == "error"]
    if code == 2 and not errors:
        return f"exit 2 (--strict): skipped {', '.join(outcome.skipped)}"
    bad = errors or [r for r in outcome.results if outline.is_problem(r)]
    names = "; ".join(f"{outline.badge(r).text} {r.probe} {r.target}" for r in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    what = "could not run" if code == 2 else "problems"
    return f"exit {code} ({what}): {names}{more}"


def render(outcome, *, suite: str = "", absent: dict | None = None) -> str:
    """The terminal summary: findings (worst first), one calibration line per family (with
    the missed controls spelled out), the headline, where the report is."""
    from trainprobes.markup import plain_text as t  # a name never starts a line of its own
    from trainprobes.report import outline
    from trainprobes.result import environment

    results = outcome.results
    lines = []
    found = outline.findings(results)
    if found:
        env = environment()
        where = f" about this machine (torch {env.get('torch', '?')}, {env.get('device', '?')})" \
            if suite.startswith("default") else ""
        lines += ["", f"Findings{where}: PASS fine, WARN watch out, FAIL a problem"]
        lines += [f"  {outline.badge(r).text:6} {t(r.probe)} {t(r.target)}"
                  + (f" [{', '.join(r.codes)}]" if r.codes else "") + f": {t(r.message)}"
                  for r in found]
    for fam, why in (absent or {}).items():
        lines.append(f"  not on this machine: {fam} ({why})")
    fams = outline.calibration(results)
    if fams:
        lines += ["", "Calibration: controls with a known verdict (OK: reproduced)"]
        for f in fams:
            lines.append(f"  {'OK' if not f.missed else 'MISSED':6} {t(f.line())}")
            lines += [f"         {t(r.target)}: expected {r.expected}, got {r.verdict}: "
                      f"{t(r.message)}" for r in f.missed]
    # what changed upstream (a zoo finding fixed or changed in the installed release): news, not
    # a problem; one line per piece of news, the controls it concerns counted
    news: dict = {}
    for r in results:
        text = (r.evidence.get("finding") or {}).get("news") if isinstance(r.evidence, dict) else None
        if text and r.reproduced:
            news.setdefault(text, []).append(r.target)
    if news:
        lines += ["", "News from upstream (controls that changed with a library release)"]
        lines += [f"  {t(text)} ({len(which)}: {t(', '.join(which[:3]))}{' ...' if len(which) > 3 else ''})"
                  for text, which in news.items()]
    for fam, why in outcome.skipped.items():
        lines.append(f"SKIP  {fam}: {why}")
    bad = [r for r in results if outline.is_problem(r)]
    status = f"{len(bad)} problem{'s' if len(bad) != 1 else ''}" if bad else "no problems"
    lines += ["", f"{status}; {outline.headline(results)}; {outcome.seconds:.1f} s",
              f"report: {outcome.paths['html']}"]
    latest = outcome.paths.get("latest")
    if latest is not None and latest.name == "latest":
        lines.append(f"latest: {latest / 'report.html'}")
    return "\n".join(lines)
