"""Speed of the GEMM probe, as ratios measured side by side in one run.

    python benchmarks/bench_gemm.py            # writes reports/gemm-benchmark.md
    python benchmarks/bench_gemm.py --quick    # smaller shapes, prints only

1. A verdict for one GEMM of M x N x K = 4096 x 4096 x 16384 by sampling (numerics.gemm.gemm_bias
   at its defaults: 2,048 sampled outputs, 32 groups, the h200-scaled-mm accumulator, the
   promotion search included) against one fp32 torch.matmul of the same shape, on the same
   operands (random e4m3 values held in fp32). Target: <= 1x.
2. Whole-GEMM emulation (reference.gemm.matmul, every output, h200-scaled-mm and fp32)
   against an fp64 torch.matmul of the same shape: the throughput ratio, and where the
   emulation's time goes (cProfile, by function).
The pairs run alternately (--repeat rounds) and the medians are compared, so both sides see
the same machine load.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainprobes.numerics.gemm import gemm_bias  # noqa: E402
from trainprobes.reference.gemm import matmul  # noqa: E402
from trainprobes.result import write_atomic  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(a, b, repeat: int) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(repeat):
        ta.append(timed(a))
        tb.append(timed(b))
    return statistics.median(ta), statistics.median(tb)


def e4m3(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(torch.float8_e4m3fn).float()


def verdict_vs_matmul(M: int, N: int, K: int, repeat: int, promotion: bool = True) -> dict:
    a, b = e4m3(M, K, 1), e4m3(N, K, 2)
    holder = {}

    def verdict():
        holder["r"] = gemm_bias(a, b, preset="h200-scaled-mm", promotion=promotion)

    def mm():
        torch.matmul(a, b.t())
    t_v, t_m = side_by_side(verdict, mm, repeat)
    r = holder["r"]
    return {"shape": f"{M} x {N} x {K}", "promotion": promotion, "verdict_s": t_v, "matmul_s": t_m, "ratio": t_v / t_m,
            "gemm_verdict": r.metrics["gemm_verdict"], "samples": r.metrics["samples"],
            "promotion_candidates": len(r.evidence["promotion"])}


def emulation_vs_fp64(M: int, N: int, K: int, preset: str, repeat: int) -> dict:
    a, b = e4m3(M, K, 3).double(), e4m3(N, K, 4).double().t().contiguous()
    t_e, t_m = side_by_side(lambda: matmul(a, b, preset), lambda: torch.matmul(a, b), repeat)
    prof = cProfile.Profile()
    prof.enable()
    matmul(a, b, preset)
    prof.disable()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    total = st.total_tt
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:6]   # by own (internal) time
    where = [(f"{Path(f).name}:{fn}" if f != "~" else fn, tt / total) for (f, _, fn), (_, _, tt, _, _) in rows]
    return {"shape": f"{M} x {N} x {K}", "preset": preset, "emulated_s": t_e, "fp64_s": t_m,
            "ratio": t_e / t_m, "where": where}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--out", default="reports/gemm-benchmark.md")
    args = ap.parse_args(argv)
    big = (1024, 1024, 4096) if args.quick else (4096, 4096, 16384)
    small = (64, 64, 1024) if args.quick else (256, 256, 4096)
    repeat = args.repeat or (1 if args.quick else 2)
    verdicts = [verdict_vs_matmul(*big, repeat, promotion) for promotion in (False, True)]
    for v in verdicts:
        print(f"verdict by sampling (promotion search {'on' if v['promotion'] else 'off'}) vs fp32 "
              f"matmul, {v['shape']}: {v['verdict_s']:.2f} s vs {v['matmul_s']:.2f} s = "
              f"{v['ratio']:.2f}x ({v['gemm_verdict']}, {v['samples']} samples, "
              f"{v['promotion_candidates']} promotion candidates)", flush=True)
    emu = [emulation_vs_fp64(*small, p, repeat) for p in ("h200-scaled-mm", "fp32")]
    for e in emu:
        print(f"whole-GEMM emulation {e['preset']} {e['shape']}: {e['emulated_s']:.2f} s vs fp64 "
              f"matmul {e['fp64_s'] * 1e3:.2f} ms = {e['ratio']:,.0f}x; own time: "
              + ", ".join(f"{n} {s:.0%}" for n, s in e["where"][:4]), flush=True)
    if args.quick:
        return 0
    lines = ["# GEMM probe benchmark", "",
             f"`python benchmarks/bench_gemm.py` on {platform.machine()}, {platform.processor() or 'CPU'}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {repeat} "
             "alternating rounds. The machine was shared with other jobs and loaded; read the ratios, "
             "measured side by side, not the seconds.", "",
             "## A verdict by sampling vs one fp32 matmul (target <= 1x)", "",
             "| shape (M x N x K) | promotion search | verdict (gemm_bias) | fp32 torch.matmul | ratio | verdict, samples |",
             "|---|---|---|---|---|---|",
             *(f"| {v['shape']} | {'on (default)' if v['promotion'] else 'off'} | {v['verdict_s']:.2f} s | "
               f"{v['matmul_s']:.2f} s | **{v['ratio']:.2f}x** | {v['gemm_verdict']}, {v['samples']} outputs, "
               f"{v['promotion_candidates']} promotion candidates |" for v in verdicts),
             "", "## Whole-GEMM emulation vs an fp64 matmul", "",
             "| preset | shape | emulated | fp64 torch.matmul | ratio | own time by function (cProfile) |",
             "|---|---|---|---|---|---|"]
    for e in emu:
        lines.append(f"| {e['preset']} | {e['shape']} | {e['emulated_s']:.2f} s | {e['fp64_s'] * 1e3:.2f} ms | "
                     f"{e['ratio']:,.0f}x | " + ", ".join(f"`{n}` {s:.0%}" for n, s in e["where"][:5]) + " |")
    write_atomic(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
