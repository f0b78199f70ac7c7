"""Does numerics.gemm's CI cover the whole GEMM's bias? Coverage over sampling seeds.

For each case, one fixed GEMM of moderate size is emulated whole (reference.gemm.matmul, every
output), giving the true relative bias B = sum(sign(ref) err) / sum|ref| and offset
O = sum(err) / sum|ref|; then gemm_bias samples it under `--seeds` sampling seeds (the data
fixed, the sample moving) and counts how often each CI (at 1 - alpha/2 = 99.5% each) holds
the truth, and how often the verdict is exact or noise although the truth is past the
tolerance (a miss). Cases: heavy rows ("massive activations": one token row 100x the others),
a heavy-tailed spread of row and column norms, zero-mean and mostly positive e4m3 operands,
and a round-to-nearest accumulator beside a heavy row (an unbiased truth). Each coverage
comes with its 95% Clopper-Pearson interval. docs/gemm.md quotes the figures.

    python benchmarks/gemm_coverage.py [--seeds 200]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _rates import rate  # noqa: E402  (benchmarks/, the script's own folder)
from trainprobes.numerics.gemm import gemm_bias  # noqa: E402
from trainprobes.reference.gemm import PRESETS, matmul  # noqa: E402

NEAREST = PRESETS["h200-scaled-mm"].with_(rounding="nearest", alignment="sum")


def _e4m3(x):
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).double()


def massive_row(M, N, K, seed, scale=100.0):
    """Token rows of small integers (exact under a 14-bit accumulator at this K) and one
    row `scale` times larger, positive, whose sums the accumulator truncates."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-1, 2, (M, K), generator=g).double()
    b = torch.randint(0, 2, (N, K), generator=g).double()
    a[M // 3] = _e4m3(scale * torch.randn(K, generator=g).abs())
    return a, b


def heavy_tailed(M, N, K, seed):
    """Row and column scales drawn from a Pareto tail (a few rows and columns far heavier)."""
    g = torch.Generator().manual_seed(seed)
    ra = torch.distributions.Pareto(1.0, 1.2).sample((M, 1)).clamp(max=200)
    rb = torch.distributions.Pareto(1.0, 1.2).sample((N, 1)).clamp(max=200)
    return (_e4m3((torch.randn(M, K, generator=g) + 1) * ra),
            _e4m3((torch.randn(N, K, generator=g) + 1) * rb))


def random(M, N, K, seed, mean):
    g = torch.Generator().manual_seed(seed)
    return _e4m3(torch.randn(M, K, generator=g) + mean), _e4m3(torch.randn(N, K, generator=g) + mean)


CASES = {
    "massive row, h200-scaled-mm (1024 x 64 x 1024)": (lambda: massive_row(1024, 64, 1024, 0), "h200-scaled-mm", 1024),
    "massive row, 13-bit nearest (1024 x 64 x 1024)": (lambda: massive_row(1024, 64, 1024, 0), NEAREST, 1024),
    "Pareto row/column norms, h200-scaled-mm (256 x 128 x 512)": (lambda: heavy_tailed(256, 128, 512, 1), "h200-scaled-mm", 512),
    "zero-mean, h200-scaled-mm (128 x 128 x 512)": (lambda: random(128, 128, 512, 2, 0.0), "h200-scaled-mm", 512),
    "mean 1, deepseek-v3 (64 x 64 x 1024)": (lambda: random(64, 64, 1024, 3, 1.0), "deepseek-v3", 512),
}


def truth(a, b, acc):
    ref = a @ b.t()
    err = matmul(a, b.t(), acc) - ref
    den = ref.abs().sum()
    return ((torch.sign(ref) * err).sum() / den).item(), (err.sum() / den).item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print(f"CI coverage of the whole GEMM's bias over {args.seeds} sampling seeds (alpha 0.01: "
          "each CI at 99.5%, 32 groups)")
    for label, (make, acc, samples) in CASES.items():
        if args.only and args.only not in label:
            continue
        a, b = make()
        B, O = truth(a, b, acc)
        cov_b = cov_o = missed = 0
        verdicts: dict[str, int] = {}
        for seed in range(args.seeds):
            r = gemm_bias(a, b, preset=acc, samples=samples, trials=32, seed=seed, promotion=False)
            m = r.metrics
            cov_b += m["ci_low"] <= B <= m["ci_high"]
            cov_o += m["offset_ci_low"] <= O <= m["offset_ci_high"]
            v = m["gemm_verdict"]
            verdicts[v] = verdicts.get(v, 0) + 1
            missed += v in ("exact", "noise") and max(abs(B), abs(O)) > m["tolerance"]
        print(f"  {label}: truth bias {B:+.3g}, offset {O:+.3g}; bias CI covers {rate(cov_b, args.seeds)}, "
              f"offset CI covers {rate(cov_o, args.seeds)}; verdicts {verdicts}; exact/noise past the "
              f"tolerance: {missed}", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
