"""Drift benchmark: DriftMonitor.update and compare on 10M tokens, each divided by the time of
one bare `(infer - train).abs().max()` over the same tensors, without and with a 90% mask,
measured side by side in one run: every repeat times all six in turn (interleaved), so machine
load hits them alike. Reported: the ratio of median times, and the spread (lowest and highest)
of the per-repeat ratios.

Targets (issue 13): update <= 5x, compare <= 15x. Writes reports/drift-benchmark.md.
Usage: python benchmarks/bench_drift.py [--tokens 10000000] [--repeats 7] [--threads 2 1] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from trainprobes.drift import DriftMonitor, compare
from trainprobes.validation import parse_int

TARGETS = {"update": 5.0, "compare": 15.0}


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(train, infer, mask, repeats: int) -> dict:
    """{(case, what): [seconds per repeat]} for case in (no mask, 90% mask) and what in (bare,
    update, compare), interleaved within each repeat, after one warm-up of each."""
    cases = {"no mask": None, "90% mask": mask}
    monitors = {c: DriftMonitor() for c in cases}
    calls = {}
    for case, m in cases.items():
        calls[case, "bare"] = lambda: (infer - train).abs().max()
        calls[case, "update"] = lambda c=case, m=m: monitors[c].update(train, infer, m)
        calls[case, "compare"] = lambda m=m: compare(train, infer, mask=m)
    for fn in calls.values():  # warm-up: first-touch of the monitor's buffers, lazy imports
        fn()
    times = {key: [] for key in calls}
    for _ in range(repeats):  # interleaved: one of each per repeat
        for key, fn in calls.items():
            times[key].append(_time(fn))
    return times


def table_rows(times: dict) -> list:
    rows = []
    for case in ("no mask", "90% mask"):
        bare = times[case, "bare"]
        row = {"case": case, "bare_ms": statistics.median(bare) * 1e3}
        for what in ("update", "compare"):
            t = times[case, what]
            per = [a / b for a, b in zip(t, bare)]
            row[what] = (statistics.median(t) / statistics.median(bare), min(per), max(per),
                         statistics.median(t) * 1e3)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=parse_int("tokens", min=1000), default=10_000_000)
    ap.add_argument("--seq-len", type=parse_int("seq_len", min=1), default=1000)
    ap.add_argument("--repeats", type=parse_int("repeats", min=1), default=7)
    ap.add_argument("--threads", type=parse_int("threads", min=1), nargs="+", default=[torch.get_num_threads()],
                    help="torch intra-op threads, one table each (default: the current setting)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "reports" / "drift-benchmark.md"))
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    B = args.tokens // args.seq_len
    train = -torch.rand(B, args.seq_len, generator=g) * 5
    infer = (train + torch.randn(B, args.seq_len, generator=g) * 0.02).clamp(max=0)
    mask = torch.rand(B, args.seq_len, generator=g) > 0.1
    cores = os.cpu_count()
    lines = [
        "# Drift benchmark",
        "",
        f"`python benchmarks/bench_drift.py --tokens {args.tokens} --repeats {args.repeats} --threads "
        f"{' '.join(map(str, args.threads))}`: {B} sequences x {args.seq_len} tokens (fp32), log-ratio "
        f"noise 0.02 nats, a random 90% mask; torch {torch.__version__}, {cores} cores, "
        f"{platform.processor() or platform.machine()}.",
        "",
        "Ratio = median time / median time of one bare `(infer - train).abs().max()` on the same tensors "
        f"(interleaved repeats after a warm-up); [lowest - highest] of the {args.repeats} per-repeat ratios. "
        "Load average = `os.getloadavg()` (1 min) before and after each table: the machine is shared.",
    ]
    threads0 = torch.get_num_threads()
    try:
        for n in args.threads:
            torch.set_num_threads(n)
            before = os.getloadavg()[0]
            rows = table_rows(measure(train, infer, mask, args.repeats))
            after = os.getloadavg()[0]
            lines += ["", f"## {n} intra-op thread{'s' if n > 1 else ''}, load average {before:.1f} -> {after:.1f}",
                      "", "| input | bare abs-max (ms) | DriftMonitor.update | compare | targets |",
                      "|---|---|---|---|---|"]
            for r in rows:
                cells = [f"{r[w][0]:.1f}x [{r[w][1]:.1f} - {r[w][2]:.1f}] ({r[w][3]:.0f} ms)"
                         for w in ("update", "compare")]
                lines.append(f"| {r['case']} | {r['bare_ms']:.1f} | {cells[0]} | {cells[1]} | "
                             f"update <= {TARGETS['update']:g}x, compare <= {TARGETS['compare']:g}x |")
                print(f"{n} thread(s), {r['case']}: bare {r['bare_ms']:.1f} ms, update {cells[0]}, "
                      f"compare {cells[1]} (load {before:.1f} -> {after:.1f})", flush=True)
    finally:
        torch.set_num_threads(threads0)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
