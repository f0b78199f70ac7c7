"""Speed of the numerics probes, as ratios measured side by side in one run.

    python benchmarks/bench_numerics.py            # writes reports/numerics-benchmark.md
    python benchmarks/bench_numerics.py --quick    # smaller sizes, prints only

Each pair runs alternately (`--repeat` rounds) and the medians are compared, so both sides
see the same machine load. Threads default to 1.
1. stall_table vectorised over K increments vs K one-increment calls (target: > 1, faster).
2. bias_probe overhead: collective_bias vs the bare all_reduce calls and data it makes
   (target: ~1, the statistics cost nothing next to the emulation).
3. reveal on torch.sum: n=32 vs n=16 (the order step is O(n^2) calls: expect ~4).
4. one impact step per variant vs the fp64 step (what each emulated format costs).
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import side_by_side  # noqa: E402  (benchmarks/, the script's own folder)
from trainprobes.numerics.bias import collective_bias, gradient_like  # noqa: E402
from trainprobes.numerics.reveal import reveal  # noqa: E402
from trainprobes.numerics.stall import stall_table  # noqa: E402
from trainprobes.reference.collectives import all_reduce  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []

    incs = [1.0, 0.5, 0.25, 1e-3, 3.0, 0.1, 7.0, 1e-2]
    n = 2000 if args.quick else 10_000
    fmts = ["fp16", "bf16", "fp8_e4m3fn"]
    vec, one = side_by_side(lambda: stall_table(fmts, incs, n),
                            lambda: [stall_table(fmts, [d], n) for d in incs], args.repeat)
    rows.append(("stall_table, 8 increments x 3 formats: one call vs 8 calls", vec, one, one / vec,
                 "speed-up of vectorising over increments"))

    world, numel, trials = (256, 256, 4) if args.quick else (1024, 256, 8)

    def bare():
        gs = torch.randint(0, 2**62, (trials,), generator=torch.Generator().manual_seed(0)).tolist()
        for s in gs:
            g = torch.Generator().manual_seed(s)
            x = gradient_like(world, numel, generator=g, fmt="bf16")
            all_reduce(x, dtype="bf16")
            all_reduce(x, dtype="fp64")
    probe, raw = side_by_side(lambda: collective_bias(dtype="bf16", world=world, numel=numel, trials=trials),
                              bare, args.repeat)
    rows.append((f"collective_bias bf16 w={world} n={numel} x{trials} trials vs bare all_reduces",
                 probe, raw, probe / raw, "probe overhead (1.0 = none)"))

    r16, r32 = side_by_side(lambda: reveal(torch.sum, n=16, dtype="fp16"),
                            lambda: reveal(torch.sum, n=32, dtype="fp16"), args.repeat)
    rows.append(("reveal(torch.sum, fp16): n=32 vs n=16", r32, r16, r32 / r16, "O(n^2) order step: ~4"))

    x = list(torch.randn(512, 16, dtype=torch.float64).unbind(0))
    for label, kw in [("bf16", {"dtype": "bf16"}), ("bf16 stochastic", {"dtype": "bf16", "rounding": "stochastic", "seed": 1}),
                      ("fp8_e4m3fn", {"dtype": "fp8_e4m3fn"})]:
        lo, ref = side_by_side(lambda kw=kw: all_reduce(x, op="avg", **kw),
                               lambda: all_reduce(x, op="avg", dtype="fp64"), args.repeat)
        rows.append((f"impact step all_reduce avg 512 x 16: {label} vs fp64", lo, ref, lo / ref,
                     "cost of the emulated format"))

    lines = ["| case | A (s) | B (s) | ratio A/B or B/A | meaning |", "|---|---:|---:|---:|---|"]
    for case, a, b, ratio, meaning in rows:
        lines.append(f"| {case} | {a:.4f} | {b:.4f} | {ratio:.2f} | {meaning} |")
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        head = (f"# numerics benchmark\n\n`python benchmarks/bench_numerics.py` on {platform.processor() or platform.machine()}, "
                f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeat} alternating runs; "
                "the machine is shared, so only the ratios mean anything.\n\n")
        out = Path(__file__).resolve().parents[1] / "reports" / "numerics-benchmark.md"
        out.write_text(head + table + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
