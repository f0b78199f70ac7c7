"""Speed of the GEMM probe, as ratios measured side by side in one run.

    python benchmarks/bench_gemm.py            # writes reports/gemm-benchmark.md
    python benchmarks/bench_gemm.py --quick    # smaller shapes, prints only

1. A verdict for one GEMM of M x N x K = 4096 x 4096 x 16384 by sampling (numerics.gemm.gemm_bias
   at its defaults: 2,048 sampled outputs, 32 groups, the h200-scaled-mm accumulator, the
   promotion search included) against one fp32 torch.matmul of the same shape, on the same
   operands (random e4m3 values held in fp32). Target: <= 1x. Then where one verdict's time
   goes (cProfile, cumulative time of its phases).
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
import os
import platform
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import side_by_side  # noqa: E402  (benchmarks/, the script's own folder)
from trainprobes.numerics.gemm import gemm_bias  # noqa: E402
from trainprobes.reference.gemm import matmul  # noqa: E402
from trainprobes.result import write_atomic  # noqa: E402


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


# the phases of one verdict (numerics.gemm), as cProfile names them: (function, what it does)
PHASES = (("_scan", "operand scans (finite, amax)"), ("_row_norms", "row norms"),
          ("held_in", "operand formats (exact recipe)"), ("prepare_gemm", "prepare: sample, gather, quantise, fp64 reference, products"),
          ("sample_gemm", "emulate the sample (checkpoints, stall trace, partial sums)"),
          ("_promotion", "promotion search"))


def profiled(fn) -> tuple[pstats.Stats, float]:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    st = pstats.Stats(prof, stream=io.StringIO())
    return st, st.total_tt


def own_time(st: pstats.Stats, total: float, top: int = 6) -> list[tuple[str, float]]:
    """The functions with the most own (internal) time, as shares of the total."""
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{Path(f).name}:{fn}" if f != "~" else fn, tt / total) for (f, _, fn), (_, _, tt, _, _) in rows]


def verdict_phases(M: int, N: int, K: int) -> dict:
    a, b = e4m3(M, K, 1), e4m3(N, K, 2)
    st, total = profiled(lambda: gemm_bias(a, b, preset="h200-scaled-mm"))
    cum = {fn: ct for (f, _, fn), (_, _, _, ct, _) in st.stats.items() if Path(f).name == "gemm.py"}
    return {"shape": f"{M} x {N} x {K}", "total_s": total,
            "phases": [(name, what, cum.get(name, 0.0) / total) for name, what in PHASES],
            "own": own_time(st, total)}


def emulation_vs_fp64(M: int, N: int, K: int, preset: str, repeat: int) -> dict:
    a, b = e4m3(M, K, 3).double(), e4m3(N, K, 4).double().t().contiguous()
    t_e, t_m = side_by_side(lambda: matmul(a, b, preset), lambda: torch.matmul(a, b), repeat)
    st, total = profiled(lambda: matmul(a, b, preset))
    return {"shape": f"{M} x {N} x {K}", "preset": preset, "emulated_s": t_e, "fp64_s": t_m,
            "ratio": t_e / t_m, "where": own_time(st, total)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--out", default="reports/gemm-benchmark.md")
    args = ap.parse_args(argv)
    big = (1024, 1024, 4096) if args.quick else (4096, 4096, 16384)
    small = (64, 64, 1024) if args.quick else (256, 256, 4096)
    repeat = args.repeat or (1 if args.quick else 3)
    load = os.getloadavg()[0]
    verdicts = [verdict_vs_matmul(*big, repeat, promotion) for promotion in (False, True)]
    for v in verdicts:
        print(f"verdict by sampling (promotion search {'on' if v['promotion'] else 'off'}) vs fp32 "
              f"matmul, {v['shape']}: {v['verdict_s']:.2f} s vs {v['matmul_s']:.2f} s = "
              f"{v['ratio']:.2f}x ({v['gemm_verdict']}, {v['samples']} samples, "
              f"{v['promotion_candidates']} promotion candidates)", flush=True)
    ph = verdict_phases(*big)
    print(f"one verdict under cProfile, {ph['total_s']:.2f} s: "
          + ", ".join(f"{n} {s:.0%}" for n, _, s in ph["phases"]) + "; own time: "
          + ", ".join(f"{n} {s:.0%}" for n, s in ph["own"]), flush=True)
    emu = [emulation_vs_fp64(*small, p, repeat) for p in ("h200-scaled-mm", "fp32")]
    for e in emu:
        print(f"whole-GEMM emulation {e['preset']} {e['shape']}: {e['emulated_s']:.2f} s vs fp64 "
              f"matmul {e['fp64_s'] * 1e3:.2f} ms = {e['ratio']:,.0f}x; own time: "
              + ", ".join(f"{n} {s:.0%}" for n, s in e["where"][:4]), flush=True)
    load_end = os.getloadavg()[0]
    if args.quick:
        return 0
    lines = ["# GEMM probe benchmark", "",
             f"`python benchmarks/bench_gemm.py` on {platform.machine()}, {platform.processor() or 'CPU'}, "
             f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; medians "
             f"of {repeat} alternating rounds. The machine was shared with other jobs and loaded (1-minute "
             f"load average {load:.1f} at the start, {load_end:.1f} at the end); read the ratios, measured "
             "side by side, not the seconds.", "",
             "## A verdict by sampling vs one fp32 matmul (target <= 1x)", "",
             "| shape (M x N x K) | promotion search | verdict (gemm_bias) | fp32 torch.matmul | ratio | verdict, samples |",
             "|---|---|---|---|---|---|",
             *(f"| {v['shape']} | {'on (default)' if v['promotion'] else 'off'} | {v['verdict_s']:.2f} s | "
               f"{v['matmul_s']:.2f} s | **{v['ratio']:.2f}x** | {v['gemm_verdict']}, {v['samples']} outputs, "
               f"{v['promotion_candidates']} promotion candidates |" for v in verdicts),
             "", f"Where one verdict's time goes ({ph['shape']}, promotion search on; cProfile, "
             f"{ph['total_s']:.2f} s with its overhead): cumulative share of each phase (nested: "
             "the operand formats and scans are part of prepare).", "",
             "| phase | what | share |", "|---|---|---|",
             *(f"| `{n}` | {what} | {s:.0%} |" for n, what, s in ph["phases"]),
             "", "Own time by function: " + ", ".join(f"`{n}` {s:.0%}" for n, s in ph["own"]) + ".",
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
