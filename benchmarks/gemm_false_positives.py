"""How often numerics.gemm calls an unbiased accumulator biased on random data.

Accumulators that are unbiased by mechanism (round to nearest: a 13-bit nearest-even one that
sums each 32-product group exactly and rounds once, and fp32), recipe `exact`, on
64 x 64 x 512 GEMMs of random e4m3 operands (zero-mean, and mean 1: the same-signed data on
which a truncating accumulator is biased), 256 sampled outputs in 16 groups, one seed per run
(the operands and the sample both move with it). A run counts as a false positive when the
probe's own verdict is biased (judge: the CI of the signed bias or of the offset excludes 0
and reaches past the tolerance), at the default tolerance and at tolerance 0 (the t-tests
alone, each at alpha / 2). Each rate comes with its 95%
Clopper-Pearson interval. docs/gemm.md quotes the figures.

    python benchmarks/gemm_false_positives.py [--seeds 200]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _rates import rate  # noqa: E402  (benchmarks/, the script's own folder)
from trainprobes.numerics.gemm import DEFAULT_TOLERANCE, gemm_bias, judge  # noqa: E402
from trainprobes.reference.gemm import PRESETS  # noqa: E402

NEAREST = PRESETS["h200-scaled-mm"].with_(rounding="nearest", alignment="sum")
CASES = {"13-bit nearest, zero-mean": (NEAREST, 0.0), "13-bit nearest, mean 1": (NEAREST, 1.0),
         "fp32, zero-mean": (PRESETS["fp32"], 0.0), "fp32, mean 1": (PRESETS["fp32"], 1.0)}


def e4m3(*shape, seed, mean):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) + mean).to(torch.float8_e4m3fn).double()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=200)
    seeds = ap.parse_args(argv).seeds
    t0 = time.perf_counter()
    print(f"false positives over {seeds} seeds (64 x 64 x 512, 256 of 4096 outputs sampled, sized output by output, 16 groups, alpha 0.01)")
    for label, (acc, mean) in CASES.items():
        hits = {DEFAULT_TOLERANCE: 0, 0.0: 0}
        for seed in range(seeds):
            a, b = e4m3(64, 512, seed=2 * seed, mean=mean), e4m3(64, 512, seed=2 * seed + 1, mean=mean)
            r = gemm_bias(a, b, preset=acc, samples=256, trials=16, seed=seed, promotion=False)
            m = r.metrics
            hits[DEFAULT_TOLERANCE] += m["biased"] is True  # None: inconclusive, not biased
            cis = [(m["ci_low"], m["ci_high"]), (m["offset_ci_low"], m["offset_ci_high"])]
            hits[0.0] += judge(False, cis, 0.0) == "biased"
        print(f"  {label:28} tolerance {DEFAULT_TOLERANCE:g} (default): {rate(hits[DEFAULT_TOLERANCE], seeds)}; "
              f"tolerance 0: {rate(hits[0.0], seeds)}", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
