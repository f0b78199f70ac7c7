"""Drift benchmark: DriftMonitor.update and compare on 10M tokens, each divided by the time of
one bare `(a - b).abs().max()` over the same tensors, measured side by side in one run.

Targets (issue 5): update <= 10x, compare <= 30x. Writes reports/drift-benchmark.md.
Usage: python benchmarks/bench_drift.py [--tokens 10000000] [--repeats 5] [--out PATH]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from trainprobes.drift import DriftMonitor, compare


def timed(fn, repeats):
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--seq-len", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "reports" / "drift-benchmark.md"))
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    B = args.tokens // args.seq_len
    train = -torch.rand(B, args.seq_len, generator=g) * 5
    infer = (train + torch.randn(B, args.seq_len, generator=g) * 0.02).clamp(max=0)
    mask = torch.rand(B, args.seq_len, generator=g) > 0.1
    rows = []
    for label, m in (("no mask", None), ("90% mask", mask)):
        mon = DriftMonitor()
        # interleave the three so machine load hits them alike
        base, upd, cmp = [], [], []
        for _ in range(args.repeats):
            base += timed(lambda: (infer - train).abs().max(), 1)
            upd += timed(lambda: mon.update(train, infer, m), 1)
            cmp += timed(lambda: compare(train, infer, mask=m), 1)
        b = statistics.median(base)
        rows.append((label, b, statistics.median(upd), statistics.median(cmp)))
        print(f"{label}: bare {b * 1e3:.1f} ms, update {rows[-1][2] / b:.1f}x, compare {rows[-1][3] / b:.1f}x", flush=True)
    lines = [
        "# Drift benchmark",
        "",
        f"`python benchmarks/bench_drift.py --tokens {args.tokens} --repeats {args.repeats}`: "
        f"{B} sequences x {args.seq_len} tokens (fp32), log-ratio noise 0.02 nats; medians of "
        f"{args.repeats} interleaved runs after a warm-up; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}.",
        "",
        "Ratio = time / time of one bare `(infer - train).abs().max()` on the same tensors.",
        "",
        "| input | bare abs-max (ms) | DriftMonitor.update | compare | targets |",
        "|---|---|---|---|---|",
    ]
    for label, b, u, c in rows:
        lines.append(f"| {label} | {b * 1e3:.1f} | {u / b:.1f}x ({u * 1e3:.0f} ms) | "
                     f"{c / b:.1f}x ({c * 1e3:.0f} ms) | update <= 10x, compare <= 30x |")
    lines += ["", "The machine is shared (2 cores, other jobs running): ratios move with load; "
              "re-run to compare."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
