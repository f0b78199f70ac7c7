"""Time the default audit suite, family by family, and write reports/audit-benchmark.md.

    python benchmarks/bench_audit.py [--quick]

The target is the whole default suite under 2 minutes on a 2-core laptop. The suite runs
with one torch intra-op thread (what `trainprobes audit` uses by default, --threads 1) and
with torch's default thread count, each in a fresh process (first-use costs included, as a
user sees them), alternating 1, default, 1, default; the ratio of the medians is reported.
Each check's CPU time (this process; gloo ranks run in their own) is recorded beside its
wall time, with the load average, since the machine may be shared.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(threads: int, quick: bool):
    import torch
    from trainprobes.audit import Progress, run_audit
    from trainprobes.audit.suites import default_suite

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    used = torch.get_num_threads()
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        checks, skipped = default_suite(quick=quick)
        with tempfile.TemporaryDirectory() as tmp:
            outcome = run_audit(checks, tmp, progress=Progress(len(checks)), step_summary=False)
            timings = json.loads((outcome.out_dir / "report.json").read_text())["timings"]
    finally:
        torch.set_num_threads(before)
    return {"threads": used, "total": time.perf_counter() - t0, "timings": timings,
            "load": (load0, os.getloadavg()[0]), "results": outcome.results, "skipped": skipped}


def run_fresh(threads: int, quick: bool) -> dict:
    """run_once in a new Python process; the Results travel back as dicts."""
    import subprocess
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"from bench_audit import run_once; "
            f"r = run_once({threads}, {quick}); "
            f"r['results'] = [x.verdict for x in r['results']]; print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(run) -> list[str]:
    fam = defaultdict(lambda: [0.0, 0.0, 0])
    for t in run["timings"]:
        f = fam[t["family"]]
        f[0] += t["seconds"]
        f[1] += t["cpu_seconds"]
        f[2] += 1
    lines = [f"torch intra-op threads: {run['threads']} (load average {run['load'][0]:.1f} at "
             f"start, {run['load'][1]:.1f} at end)", "",
             "| family | checks | wall s | CPU s (this process) |", "|---|---|---|---|"]
    for name, (wall, cpu, n) in fam.items():
        lines.append(f"| {name} | {n} | {wall:.1f} | {cpu:.1f} |")
    lines += [f"| **all** | {len(run['timings'])} | {sum(v[0] for v in fam.values()):.1f} | "
              f"{sum(v[1] for v in fam.values()):.1f} |", "",
              f"Including report writing: {run['total']:.1f} s wall. Results: "
              f"{len(run['results'])}; errors: "
              f"{sum(v == 'error' for v in run['results'])}; skipped families: "
              f"{run['skipped'] or 'none'}.", ""]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "reports" / "audit-benchmark.md"))
    args = ap.parse_args()
    runs = [run_fresh(t, args.quick) for t in (1, 0, 1, 0)]
    wall = lambda r: sum(t["seconds"] for t in r["timings"])  # noqa: E731
    ones, defaults = sorted(runs[0::2], key=wall), sorted(runs[1::2], key=wall)
    one, default = ones[0], defaults[0]  # the faster of each pair: least disturbed
    lines = ["# Default audit suite: time per family", "",
             f"`python benchmarks/bench_audit.py{' --quick' if args.quick else ''}` on "
             f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; "
             "each configuration run twice in fresh processes, alternating; the faster run of "
             "each is shown. The machine was shared with other jobs (load averages below).", "",
             f"Wall time in the checks, all four runs: one thread "
             f"{', '.join(f'{wall(r):.1f}' for r in runs[0::2])} s; torch's default threads "
             f"{', '.join(f'{wall(r):.1f}' for r in runs[1::2])} s.", "",
             f"**Ratio (faster runs): torch's default threads / one thread = "
             f"{wall(default) / wall(one):.1f}x.**", "",
             "## --threads 1 (the default)", ""] + table(one) + \
            ["## torch's default thread count (--threads 0)", ""] + table(default)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
