"""`trainprobes audit`: run a suite and write reports/<timestamp>/ with JSON, Markdown, HTML."""
from __future__ import annotations

import json
import sys
from pathlib import Path

HELP = ("run the audit suite (built-in default, or [tool.trainprobes] from pyproject.toml) "
        "and write report.json, summary.md and report.html")


def add_arguments(p):
    p.add_argument("--config", metavar="FILE",
                   help="TOML file with a [tool.trainprobes] table (default: ./pyproject.toml "
                        "when it has one, else the built-in default suite)")
    p.add_argument("--default", action="store_true",
                   help="run the built-in default suite even where a config exists")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where reports/<timestamp>/ go (default: reports, or the config's out)")
    p.add_argument("--history", metavar="DIR", default=None,
                   help="append a summary line per run to DIR/history.jsonl and plot trends")
    p.add_argument("--families", metavar="A,B", default=None,
                   help="only these default-suite families (implies --default): stall, sites, "
                        "reveal, collectives, causality, drift, gloo")
    p.add_argument("--quick", action="store_true", help="a smaller default suite (smoke test)")
    p.add_argument("--seed", type=int, default=None, help="seed for every random choice (default 0)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when any probe fails (default: exit 0 once the report is written)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads while the audit runs (default 1: the suite's "
                        "tensors are small; on a busy 2-core machine 2 threads made the tiny-LM "
                        "scenarios up to ~50x slower, on an idle one it makes no difference); "
                        "0 keeps torch's default")
    p.add_argument("--json", action="store_true",
                   help="print {report, counts, results} as JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")


def run(args) -> int:
    from trainprobes.audit import Progress, run_audit
    from trainprobes.audit.config import ConfigError, find_config, suite_from_config
    from trainprobes.audit.suites import default_suite
    from trainprobes.report.markdown import counts_line

    try:
        use_default = args.default or bool(args.families)
        cfg, cfg_path = (None, None) if use_default else find_config(args.config)
        seed = args.seed if args.seed is not None else (cfg or {}).get("seed", 0)
        families = args.families.split(",") if args.families else None
        if cfg is None:
            checks, skipped = default_suite(seed=seed, quick=args.quick, families=families)
            suite = "default" + (" (quick)" if args.quick else "")
        else:
            checks, skipped = suite_from_config(cfg, seed=seed, base_dir=cfg_path.parent,
                                                quick=args.quick)
            suite = f"{cfg_path}"
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not checks:
        print("error: the suite has no checks" + (f" (skipped: {skipped})" if skipped else ""),
              file=sys.stderr)
        return 2
    out = args.out or (cfg or {}).get("out") or "reports"
    history = args.history or (cfg or {}).get("history")
    progress = None if args.no_progress else Progress(len(checks))
    if not args.no_progress:
        print(f"trainprobes audit: {len(checks)} checks, suite {suite}", file=sys.stderr)
    if args.threads < 0:
        print(f"error: --threads={args.threads!r} must be >= 0 (0: torch's default)",
              file=sys.stderr)
        return 2
    try:  # before minutes of checks, not after them
        for d in (out, history):
            if d:
                Path(d).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: --out/--history directory cannot be created: {e}", file=sys.stderr)
        return 2
    import torch
    before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        outcome = run_audit(checks, out, history=history, progress=progress,
                            meta={"suite": suite, "seed": seed, "skipped": skipped,
                                  "torch_threads": torch.get_num_threads()})
    except OSError as e:  # the checks catch their own errors: this is writing the report
        print(f"error: the report cannot be written: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(before)  # the command may run inside a longer process
    if args.json:
        print(json.dumps({"report": str(outcome.paths["json"]), "html": str(outcome.paths["html"]),
                          "counts": {v: sum(r.verdict == v for r in outcome.results)
                                     for v in ("pass", "warn", "fail", "error")},
                          "skipped": skipped,
                          "results": [{"probe": r.probe, "target": r.target, "verdict": r.verdict,
                                       "codes": r.codes, "message": r.message}
                                      for r in outcome.results]}, indent=2))
    else:
        family = None
        for r in outcome.results:
            fam = r.probe.split(".")[0]
            if fam != family:  # a header per probe family, with its counts
                family = fam
                members = [x for x in outcome.results if x.probe.split(".")[0] == fam]
                controls = [x.metrics.get("matches_known_verdict", x.metrics.get(
                    "matches_expected")) for x in members]
                controls = [c for c in controls if c is not None]
                print(f"\n== {fam}: {counts_line(members)}" + (
                    f" (controls with their known verdict: {sum(controls)} of "
                    f"{len(controls)})" if controls else ""))
            print(r.summary_line())
        for fam, why in skipped.items():
            print(f"SKIP  {fam}: {why}")
        print(f"\n{counts_line(outcome.results)} in {outcome.seconds:.1f} s")
        print(f"report: {outcome.paths['html']}")
    if outcome.exit_code:
        return outcome.exit_code
    return 1 if args.strict and any(r.verdict == "fail" for r in outcome.results) else 0
