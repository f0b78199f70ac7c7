"""The upstream check: the newest releases of everything trainprobes depends on, in a throwaway
venv, against the tested set pinned in constraints.txt; writes what changed.

  python scripts/upstream_check.py                       # suite + zoo findings, report under reports/
  python scripts/upstream_check.py --map                 # also the whole zoo map, diffed with docs/zoo_map.json
  python scripts/upstream_check.py --venv /tmp/up --keep --report /tmp/upstream.md

Steps:
  1. a new venv (a temporary folder unless --venv), torch installed first (--torch, default the
     torch of the Python running this script, else torch==2.13.0: never a CUDA build you did not
     ask for), then `pip install --upgrade -e ".[test]"` with no constraints: the newest releases;
  2. which releases differ from constraints.txt;
  3. the test suite there (JUnit XML): every failure is newly broken, since CI runs the pinned set
     green (pass --baseline to run the suite in a pinned venv too and list only the difference);
  4. `trainprobes zoo --findings --json` there: findings fixed or changed upstream (news), missed
     or not judged (the harness cannot handle the release yet);
  5. model types the new transformers registers that the published map (docs/zoo_map.json) lacks,
     and with --map the whole map swept there and `zoo --diff` against the published one;
  6. a Markdown report (default reports/upstream-<date>.md; an existing file is refused unless
     --force). Exit 0: nothing newly broken (news alone is 0); 1: a test newly fails or a finding
     was missed; 2: bad usage or a step could not run (its output is in the report).
Every process it starts dies with it (PR_SET_PDEATHSIG on Linux); Ctrl-C stops it, exit 130.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _die_with_parent():
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run(cmd, log, *, timeout=None, **kw) -> subprocess.CompletedProcess:
    print(f"{Path(sys.argv[0]).stem}: {' '.join(map(str, cmd))[:160]}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=timeout,
                       preexec_fn=_die_with_parent if os.name == "posix" else None, **kw)
    log.write(f"$ {' '.join(map(str, cmd))}\n[exit {p.returncode}, {time.monotonic() - t0:.0f} s]\n"
              f"{p.stdout[-20000:]}\n{p.stderr[-20000:]}\n")
    log.flush()
    return p


def pins(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line.strip())
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def freeze(py: Path, log) -> dict:
    p = run([py, "-m", "pip", "freeze", "--exclude-editable"], log)
    return {k.lower().replace("_", "-"): v for k, _, v in
            (ln.partition("==") for ln in p.stdout.splitlines() if "==" in ln)}


def default_torch() -> str:
    try:
        import torch
        return f"torch=={torch.__version__.split('+')[0]}"
    except ImportError:
        return "torch==2.13.0"


class StepFailed(Exception):
    """A step of the check itself could not run (a venv, an install): nothing was judged."""


def make_venv(folder: Path, torch_spec: str, pinned: bool, log) -> Path:
    if run([sys.executable, "-m", "venv", folder], log).returncode:
        raise StepFailed(f"creating the venv {folder} failed")
    py = folder / "bin" / "python"
    if run([py, "-m", "pip", "install", "-q", torch_spec], log).returncode:
        raise StepFailed(f"installing {torch_spec} failed")
    extra = ["-c", ROOT / "constraints.txt"] if pinned else ["--upgrade", "--upgrade-strategy", "eager"]
    if run([py, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]", *extra], log).returncode:
        raise StepFailed(f"installing trainprobes' test set ({'pinned' if pinned else 'newest releases'}) failed")
    return py


def failed_report(started, step: str, log_path: Path) -> str:
    return (f"# Upstream check, {started:%Y-%m-%d %H:%M} UTC\n\nNot judged: {step}. Nothing was measured; the "
            f"command's output is in {log_path}.\n")


def suite(py: Path, xml: Path, log, args) -> dict:
    """{test id: first line of its failure}; {'(suite)': why} where the run itself broke."""
    # -m "": the whole suite, slow tests included (the README's command skips them)
    p = run([py, "-m", "pytest", "-q", "-m", "", "-p", "no:cacheprovider", f"--junitxml={xml}",
             *args.pytest_args], log, cwd=ROOT, env={**os.environ, "PATH": f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    if not xml.is_file():
        return {"(suite)": f"pytest exited {p.returncode} without a report: {p.stdout[-300:]}"}
    failed = {}
    for case in ET.parse(xml).iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            failed[name] = (bad.get("message") or bad.text or "").strip().splitlines()[0][:200] if (
                bad.get("message") or bad.text) else "(no message)"
    return failed


def findings(py: Path, log) -> tuple[list, str]:
    p = run([py, "-m", "trainprobes", "zoo", "--findings", "--json", "--no-progress"], log, cwd=ROOT)
    try:
        doc = json.loads(p.stdout)
    except json.JSONDecodeError:
        return [], f"zoo --findings exited {p.returncode} without a report: {p.stderr.strip()[-300:]}"
    return [r["evidence"]["finding"] | {"target": r["target"]} for r in doc["results"]], ""


def registered(py: Path, log) -> list:
    p = run([py, "-c", "from trainprobes.zoo.shrink import causal_lm_types; print('\\n'.join(causal_lm_types()))"],
            log)
    return p.stdout.split() if p.returncode == 0 else []


def sweep_map(py: Path, work: Path, log) -> str:
    new = work / "zoo_map.json"
    run([py, ROOT / "scripts" / "zoo_sweep.py", "--moe-first", "--jsonl", work / "rows.jsonl", "--out", new,
         "--force"], log, cwd=ROOT)
    if not new.is_file():
        return "the sweep wrote no map (log in the report)"
    return run([py, "-m", "trainprobes", "zoo", "--diff", ROOT / "docs" / "zoo_map.json", new], log).stdout


def report(args, started, pinned, newest, broken, base_broken, found, found_err, new_types, diff) -> str:
    changed = sorted(k for k in pinned if k in newest and newest[k] != pinned[k])
    lines = [f"# Upstream check, {started:%Y-%m-%d %H:%M} UTC", "",
             f"Newest releases in a throwaway venv (Python {sys.version.split()[0]}, {args.torch}) against "
             f"constraints.txt.", "", "## Releases that differ from the tested set", ""]
    lines += (["| package | pinned | newest |", "|---|---|---|"]
              + [f"| {k} | {pinned[k]} | {newest[k]} |" for k in changed] if changed else ["none"])
    new_fail = {k: v for k, v in broken.items() if k not in base_broken}
    lines += ["", f"## Newly broken tests ({len(new_fail)})", ""]
    lines += [f"- `{k}`: {v}" for k, v in sorted(new_fail.items())] or ["none"]
    if base_broken:
        lines += ["", f"(already failing on the pinned set, not counted: {len(base_broken)})"]
    lines += ["", "## Zoo findings", ""]
    if found_err:
        lines += [f"not judged: {found_err}"]
    by: dict = {}
    for f in found:
        by.setdefault(f["outcome"], []).append(f)
    for outcome in ("fixed upstream", "changed upstream", "not yet in this release", "missed", "cannot judge",
                    "reproduced"):
        fs = by.get(outcome, [])
        if fs:
            lines.append(f"- **{outcome}**: {len(fs)}")
            for news in dict.fromkeys(f["news"] for f in fs if f["news"]):
                which = [f["target"] for f in fs if f["news"] == news]
                lines.append(f"  - {news} ({len(which)}: {', '.join(which[:6])}{' ...' if len(which) > 6 else ''})")
    lines += ["", "## What the harness cannot handle yet", ""]
    lines += [f"- model types registered now that the published map lacks ({len(new_types)}): "
              f"{', '.join(new_types) or 'none'} (sweep them: --map, or `trainprobes zoo --model TYPE`)"]
    lines += [f"- {f['target']}: {f['news']}" for f in by.get("cannot judge", [])]
    if diff is not None:
        lines += ["", "## The zoo map against docs/zoo_map.json", "", "```", diff.strip() or "no change", "```"]
    lines += ["", "The full log of every command is in the file beside this one, ending `.log`."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, help="build the venv here (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the venv afterwards")
    ap.add_argument("--torch", default=default_torch(), help="the torch to install first (default: %(default)s)")
    ap.add_argument("--report", type=Path, help="the Markdown report (default reports/upstream-<date>.md)")
    ap.add_argument("--force", action="store_true", help="replace an existing report")
    ap.add_argument("--baseline", action="store_true", help="also run the suite on the pinned set and "
                    "count only failures it does not have")
    ap.add_argument("--map", action="store_true", help="also sweep the whole zoo map (minutes)")
    ap.add_argument("--no-tests", action="store_true", help="skip the test suite")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = ap.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    out = args.report or ROOT / "reports" / f"upstream-{started:%Y%m%d-%H%M}.md"
    if out.is_dir():
        ap.error(f"--report {str(out)!r} is a folder; name a file, e.g. {str(out / 'upstream.md')!r}")
    if out.exists() and not args.force:
        ap.error(f"--report {str(out)!r} exists; pass --force to replace it, or name a new file")
    if args.venv is not None and args.venv.exists() and any(args.venv.iterdir()):
        ap.error(f"--venv {str(args.venv)!r} is not empty; name a new folder")
    if not out.parent.is_dir():
        ap.error(f"--report {str(out)!r}: the folder {str(out.parent)!r} does not exist")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="upstream-"))
    folder = args.venv or Path(tempfile.mkdtemp(prefix="upstream-venv-"))
    log_path = out.with_suffix(".log")
    try:
        with open(log_path, "w") as log:
            py = make_venv(folder, args.torch, False, log)
            newest, pinned = freeze(py, log), pins(ROOT / "constraints.txt")
            broken = {} if args.no_tests else suite(py, tmp / "junit.xml", log, args)
            base_broken = {}
            if args.baseline and not args.no_tests:
                base_py = make_venv(tmp / "pinned", args.torch, True, log)
                base_broken = suite(base_py, tmp / "junit-pinned.xml", log, args)
            found, found_err = findings(py, log)
            published = json.loads((ROOT / "docs" / "zoo_map.json").read_text())["rows"]
            new_types = [t for t in registered(py, log) if t not in published]
            diff = sweep_map(py, tmp, log) if args.map else None
        out.write_text(report(args, started, pinned, newest, broken, base_broken, found, found_err, new_types, diff))
    except StepFailed as e:
        out.write_text(failed_report(started, str(e), log_path))
        print(f"upstream_check: cannot judge: {e}; report {out}, the command's output in {log_path}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("upstream_check: interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"upstream_check: venv kept at {folder}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"upstream_check: report {out} (log {log_path})", file=sys.stderr)
    newly = [k for k in broken if k not in base_broken]
    missed = [f for f in found if f["outcome"] == "missed"]
    return 1 if newly or missed else 2 if found_err else 0


if __name__ == "__main__":
    sys.exit(main())
