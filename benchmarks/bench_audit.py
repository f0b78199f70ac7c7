"""Time `trainprobes audit` (the default suite, report writing included) as a user runs it,
and write reports/audit-benchmark.md.

    python benchmarks/bench_audit.py [--repeats 5] [--compare /path/to/other/venv/bin/python]

Each run is a fresh Python process running `trainprobes audit` (the command's own entry
point, through runpy), timed from spawn to exit (what `time trainprobes audit` says):
Python's start-up, imports, the checks, the plots and the files. The target is <= 10 s
wall on 2 cores. With --compare, the same command under another interpreter (e.g. a venv
holding an older checkout) runs interleaved with this one, run for run, and the ratio of
the medians is reported. The machine may be shared, so beside every run are the load
average and CPU times, which other jobs disturb far less than wall time: the main
process's own (the critical path when a second core takes the worker process and the gloo
ranks) and that of the processes it waited for (the worker; gloo's ranks are children of
a forkserver and are not counted).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# `trainprobes audit --out OUT --no-progress` in this process, then its own CPU seconds and
# those of the children it waited for, as the last line of stderr.
WRAPPER = """
import json, resource, runpy, sys
sys.argv = ["trainprobes", "audit", "--out", sys.argv[1], "--no-progress"]
code = 0
try:
    runpy.run_module("trainprobes", run_name="__main__")
except SystemExit as e:
    code = e.code
s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"self": s.ru_utime + s.ru_stime, "children": c.ru_utime + c.ru_stime}),
      file=sys.stderr)
sys.exit(code)
"""


def run_once(python: str, out: Path) -> dict:
    """One `trainprobes audit` in a fresh process; its wall, CPU and report."""
    env = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run([python, "-c", WRAPPER, str(out)], capture_output=True, text=True,
                          cwd=out, env=env)
    wall = time.perf_counter() - t0
    cpu = json.loads(proc.stderr.strip().splitlines()[-1])
    reports = sorted(p for p in out.glob("2*/report.json"))
    if not reports:
        raise RuntimeError(f"{python}: no report written (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    doc = json.loads(reports[-1].read_text())
    html = reports[-1].with_name("report.html")
    return {"wall": wall, "cpu_main": cpu["self"], "cpu_waited": cpu["children"],
            "reported": doc.get("seconds"), "checks": doc.get("check_seconds"),
            "report": doc.get("report_seconds"), "exit": proc.returncode,
            "json_bytes": reports[-1].stat().st_size, "html_bytes": html.stat().st_size,
            "results": len(doc["results"]), "timings": doc.get("timings", []),
            "load": (load0, os.getloadavg()[0]), "last_line": proc.stdout.strip().splitlines()[-3:]}


def median(runs: list[dict], key: str) -> float:
    vals = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else float("nan")


def families(run: dict) -> list[str]:
    fam = defaultdict(lambda: [0.0, 0.0, 0])
    for t in run["timings"]:
        f = fam[t["family"]]
        f[0] += t["seconds"]
        f[1] += t["cpu_seconds"]
        f[2] += 1
    lines = ["| family | checks | wall s | CPU s (this process) |", "|---|---|---|---|"]
    lines += [f"| {name} | {n} | {wall:.1f} | {cpu:.1f} |" for name, (wall, cpu, n) in fam.items()]
    return lines + [""]


def summary(label: str, runs: list[dict]) -> list[str]:
    kb = 1e3
    return [f"| {label} | {median(runs, 'wall'):.1f} | {median(runs, 'cpu_main'):.1f} | "
            f"{median(runs, 'cpu_waited'):.1f} | "
            f"{median(runs, 'reported'):.1f} | {median(runs, 'checks'):.1f} | "
            f"{median(runs, 'report'):.1f} | {median(runs, 'html_bytes') / kb:.0f} | "
            f"{median(runs, 'json_bytes') / kb:.0f} | {runs[0]['results']} | "
            f"{', '.join(str(r['exit']) for r in runs)} |"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compare", metavar="PYTHON", default=None,
                    help="another interpreter whose `-m trainprobes` is the baseline")
    ap.add_argument("--compare-label", default="baseline")
    ap.add_argument("--out", default=str(ROOT / "reports" / "audit-benchmark.md"))
    args = ap.parse_args()
    pythons = {"this checkout": sys.executable}
    if args.compare:
        pythons[args.compare_label] = args.compare
    runs: dict[str, list] = {k: [] for k in pythons}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):  # interleaved: A B A B ...
            for label, py in pythons.items():
                out = Path(tmp) / f"{label.replace(' ', '_')}-{i}"
                out.mkdir()
                r = run_once(py, out)
                runs[label].append(r)
                print(f"{label} #{i + 1}: {r['wall']:.1f} s wall, {r['cpu_main']:.1f} + "
                      f"{r['cpu_waited']:.1f} s CPU, exit {r['exit']}, load "
                      f"{r['load'][0]:.1f}", file=sys.stderr)
    this = runs["this checkout"]
    loads = [x for rs in runs.values() for r in rs for x in r["load"]]
    lines = ["# `trainprobes audit` (default suite): wall time as a user sees it", "",
             f"`python benchmarks/bench_audit.py --repeats {args.repeats}"
             + (" --compare ..." if args.compare else "") + f"` on {platform.machine()}, "
             f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}. Each run is a fresh Python "
             "process running `trainprobes audit`, timed from spawn to exit; configurations "
             "interleaved run for run; medians shown. The machine was shared with other jobs: "
             f"load average {min(loads):.1f} to {max(loads):.1f} during the runs.", "",
             "Target: <= 10 s wall on 2 cores, report writing included.", "",
             "| | wall s | CPU s, main process | CPU s, worker process | summary says s | "
             "checks s | report writing s | report.html KB | report.json KB | Results | "
             "exit codes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, rs in runs.items():
        lines += summary(label, rs)
    if args.compare:
        base = runs[args.compare_label]
        lines += ["", f"**Ratio of medians, this checkout / {args.compare_label}: wall "
                      f"{median(this, 'wall') / median(base, 'wall'):.2f}x, main process's "
                      f"CPU {median(this, 'cpu_main') / median(base, 'cpu_main'):.2f}x.**"]
    lines += ["", "Every run, this checkout (wall s / main process CPU s / load at start): "
              + "; ".join(f"{r['wall']:.1f} / {r['cpu_main']:.1f} / {r['load'][0]:.1f}"
                          for r in this),
              "", "## Per family, this checkout (the median run by wall time)", ""]
    mid = sorted(this, key=lambda r: r["wall"])[len(this) // 2]
    lines += families(mid)
    lines += ["gloo (distributed) and the collectives calibration (in a worker process, one "
              "check here) run beside the other checks, so their wall time overlaps theirs.", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
