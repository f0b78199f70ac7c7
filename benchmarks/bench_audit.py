"""Time the default audit suite, family by family, and write reports/audit-benchmark.md.

    python benchmarks/bench_audit.py [--quick]

The target is the whole default suite under 2 minutes on a 2-core laptop. Wall time on a
shared machine says little, so each check's CPU time (this process; gloo ranks run in
their own) is recorded beside it, with the load average at start and end.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads, as `trainprobes audit --threads` (default 1)")
    ap.add_argument("--out", default=str(ROOT / "reports" / "audit-benchmark.md"))
    args = ap.parse_args()
    from probes.audit import Progress, run_audit
    from probes.audit.suites import default_suite

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    checks, skipped = default_suite(quick=args.quick)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        outcome = run_audit(checks, tmp, progress=Progress(len(checks)), step_summary=False)
        import json
        timings = json.loads((outcome.out_dir / "report.json").read_text())["timings"]
    total = time.perf_counter() - t0
    load1 = os.getloadavg()
    fam = defaultdict(lambda: [0.0, 0.0, 0])
    for t in timings:
        f = fam[t["family"]]
        f[0] += t["seconds"]
        f[1] += t["cpu_seconds"]
        f[2] += 1
    lines = ["# Default audit suite: time per family", "",
             f"`python benchmarks/bench_audit.py{' --quick' if args.quick else ''}` on "
             f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; "
             f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end (other jobs shared "
             f"the machine: wall time is inflated by roughly load / cores); torch intra-op "
             f"threads: {torch.get_num_threads()}.", "",
             "| family | checks | wall s | CPU s (this process) |", "|---|---|---|---|"]
    for name, (wall, cpu, n) in fam.items():
        lines.append(f"| {name} | {n} | {wall:.1f} | {cpu:.1f} |")
    cpu_total = sum(v[1] for v in fam.values())
    lines += [f"| **all** | {len(timings)} | {sum(v[0] for v in fam.values()):.1f} | "
              f"{cpu_total:.1f} |", "",
              f"Whole run including imports and report writing: {total:.1f} s wall. "
              f"Results: {len(outcome.results)}; errors: "
              f"{sum(r.verdict == 'error' for r in outcome.results)}; skipped families: "
              f"{skipped or 'none'}.", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
