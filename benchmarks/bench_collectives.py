"""Speed of the emulated collectives against the fp64 reference, measured side by side.

    python benchmarks/bench_collectives.py            # 8 ranks x 16M, worlds 8..4096 at 16M total
    python benchmarks/bench_collectives.py --quick    # 8 ranks x 1M, worlds 8..512 at 1M total

Each case runs reference and emulation alternately (`--repeat` rounds) and reports the
median of each, so both see the same machine load; the ratio emulation / reference is the
figure, next to its target (bf16 and the world sweep <= 2; fp8 and stochastic rounding
<= 1.0, issue 13). On Linux the fp8 and stochastic cases run again in a child process with
glibc keeping freed memory, since the reference's time is mostly page faults. Threads
default to 1 so the ratio does not depend on what else the (shared) machine is doing. A
full run writes reports/collectives-benchmark.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainprobes.reference.collectives import all_reduce  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(cases: dict, repeat: int) -> dict:
    """Median and best seconds of each callable, run in interleaved rounds."""
    times = {k: [] for k in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    return {k: statistics.median(v) for k, v in times.items()}, \
        {k: min(v) for k, v in times.items()}


# glibc told to keep freed memory: the fp64 reference's 128 MB copy then reuses pages
# instead of faulting fresh ones (see the report's note)
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}


def narrow_cases(numel: int, seed: int, repeat: int) -> tuple[dict, dict]:
    """Median and best seconds of the fp64 reference, fp8 and stochastic rounding on
    8 ranks x numel fp64 inputs (float32 values), interleaved."""
    g = torch.Generator().manual_seed(seed)
    small = [torch.randn(numel, generator=g).double() for _ in range(8)]
    return side_by_side({
        "ref": lambda: all_reduce(small, dtype="fp64"),
        "fp8": lambda: all_reduce(small, dtype="fp8_e4m3fn"),
        "sr": lambda: all_reduce(small, dtype="bf16", rounding="stochastic", seed=0),
    }, repeat)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, for iterating")
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds (median taken)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--narrow-only", type=int, default=None, metavar="NUMEL",
                   help=argparse.SUPPRESS)  # child run: print the narrow cases as JSON
    p.add_argument("--out", type=Path, default=None,
                   help="Markdown report path (default: reports/collectives-benchmark.md for a "
                        "full run, none for --quick)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.narrow_only is not None:
        print(json.dumps(narrow_cases(args.narrow_only, args.seed, args.repeat)))
        return 0
    numel = (1 << 20) if args.quick else (1 << 24)
    worlds = [8, 64, 512] if args.quick else [8, 64, 512, 4096]
    g = torch.Generator().manual_seed(args.seed)
    lines = []

    def log(msg=""):
        print(msg, flush=True)
        lines.append(msg)

    log(f"# Collectives benchmark{' (quick)' if args.quick else ''}")
    log()
    log(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} thread(s), "
        f"median of {args.repeat} interleaved rounds, seed {args.seed}. Command: "
        f"`python benchmarks/bench_collectives.py{' --quick' if args.quick else ''}`.")
    log()

    # 1. the headline: bf16 ring over 8 ranks x numel against the fp64 reference.
    print(f"[1/2] 8 ranks x {numel:,} elements ...", file=sys.stderr, flush=True)
    x32 = [torch.randn(numel, generator=g) for _ in range(8)]
    x64 = [t.double() for t in x32]
    cases = {
        ("fp32 inputs", "fp64 reference"): lambda: all_reduce(x32, dtype="fp64"),
        ("fp32 inputs", "bf16 ring"): lambda: all_reduce(x32, dtype="bf16"),
        ("fp64 inputs", "fp64 reference"): lambda: all_reduce(x64, dtype="fp64"),
        ("fp64 inputs", "bf16 ring"): lambda: all_reduce(x64, dtype="bf16"),
    }
    t, best = side_by_side(cases, args.repeat)
    x64 = cases = None  # free 8 x numel doubles before the narrow cases and the sweep
    extra, extra_best = narrow_cases(numel // 8, args.seed, args.repeat)
    kept = None
    if platform.system() == "Linux":  # the same cases in a child with glibc keeping memory
        cmd = [sys.executable, __file__, "--narrow-only", str(numel // 8), "--repeat",
               str(args.repeat), "--threads", str(args.threads), "--seed", str(args.seed)]
        run = subprocess.run(cmd, capture_output=True, text=True,
                             env={**os.environ, **KEEP_FREED})
        kept = json.loads(run.stdout)[0] if run.returncode == 0 else None
    log(f"## bf16 ring all-reduce, 8 ranks x {numel:,} elements")
    log()
    log("| inputs | fp64 reference (s) | emulation (s) | emulation / reference (median) | "
        "ratio of best times | target |")
    log("|---|---:|---:|---:|---:|---:|")
    for src in ("fp32 inputs", "fp64 inputs"):
        ref, emu = t[(src, "fp64 reference")], t[(src, "bf16 ring")]
        rb = best[(src, "bf16 ring")] / best[(src, "fp64 reference")]
        log(f"| {src}, bf16 | {ref:.3f} | {emu:.3f} | {emu / ref:.2f} | {rb:.2f} | <= 2 |")
    for key, label in (("fp8", "fp8_e4m3fn (nccl_fp8: fp16 add + satfinite cast)"),
                       ("sr", "bf16, rounding='stochastic'")):
        log(f"| fp64 inputs, {label}, 8 x {numel // 8:,} | {extra['ref']:.3f} | "
            f"{extra[key]:.3f} | {extra[key] / extra['ref']:.2f} | "
            f"{extra_best[key] / extra_best['ref']:.2f} | <= 1.0 |")
    log()
    log("fp16/bf16/fp32 with round-to-nearest run on torch's native dtypes after one exact "
        "rounding of the inputs (fp64 inputs: round-to-odd to fp32, then RNE). fp8 runs on "
        "one-byte codes: inputs cast exactly (torch's cast from float32, which is one "
        "rounding; fastround elsewhere), NCCL's add (fp16 add, satfinite cast) as one lookup "
        "in a table of all 65,536 pairs (reference/fp8codes.py). Stochastic rounding runs on "
        "float32 bits: 16 random bits (numpy's SFC64 on CPU) added below the kept mantissa, "
        "then truncated, in reused buffers (reference/stochastic.py; Format.round for the few "
        "values float32 cannot hold exactly). Every path gives Format.round's bits (or, for "
        "stochastic rounding, its distribution), checked by the tests.")
    log()
    if kept is not None:
        log("The fp64 reference is memory-bound: most of its time is copying the inputs "
            "into a fresh [world, numel] float64 tensor, whose pages the kernel faults in on "
            "every call. With glibc told to keep freed memory (" +
            " ".join(f"{k}={v}" for k, v in KEEP_FREED.items()) + "), the same cases "
            f"measure: reference {kept['ref']:.3f} s, fp8 {kept['fp8']:.3f} s "
            f"({kept['fp8'] / kept['ref']:.2f}x), stochastic rounding {kept['sr']:.3f} s "
            f"({kept['sr'] / kept['ref']:.2f}x). The ratios depend on the allocator as much "
            "as on the arithmetic.")
        log()

    # 2. growth with the world size at a fixed total number of elements.
    print(f"[2/2] worlds {worlds} at {numel:,} elements in all ...", file=sys.stderr, flush=True)
    log(f"## World size at {numel:,} elements in all (ring, fp32 inputs)")
    log()
    log("| world | elements per rank | fp64 reference (s) | bf16 emulation (s) | ratio | "
        "ns per element (bf16) | target |")
    log("|---:|---:|---:|---:|---:|---:|---:|")
    for w in worlds:
        print(f"  world {w} ...", file=sys.stderr, flush=True)
        xw = torch.randn(w, numel // w, generator=g)
        tw, _ = side_by_side({"ref": lambda: all_reduce(xw, dtype="fp64"),
                              "bf16": lambda: all_reduce(xw, dtype="bf16")}, args.repeat)
        log(f"| {w} | {numel // w:,} | {tw['ref']:.3f} | {tw['bf16']:.3f} | "
            f"{tw['bf16'] / tw['ref']:.2f} | {tw['bf16'] / numel * 1e9:.1f} | <= 2 |")
    log()
    out = args.out or (None if args.quick else Path("reports/collectives-benchmark.md"))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
