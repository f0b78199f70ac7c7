"""How often numerics.gemm calls a round-to-nearest accumulator biased on random data.

A 13-bit nearest-even accumulator (exact fused sums of 32 products, rounded once) on
16 x 16 x 512 GEMMs of random e4m3 operands, 256 sampled outputs in 16 groups, one seed per
run: the count of runs called biased at the default tolerance and at tolerance 0 (the
t-test alone). docs/gemm.md quotes the figures. Run: python benchmarks/gemm_false_positives.py
"""
import torch
from trainprobes.numerics.gemm import gemm_bias
from trainprobes.reference.gemm import PRESETS

NEAREST = PRESETS["h200-scaled-mm"].with_(rounding="nearest", alignment="sum")


def e4m3(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.float8_e4m3fn).double()


def main(seeds: int = 200) -> None:
    at_default = at_zero = 0
    for seed in range(seeds):
        a, b = e4m3(16, 512, seed=2 * seed), e4m3(16, 512, seed=2 * seed + 1)
        r = gemm_bias(a, b, preset=NEAREST, samples=256, trials=16, seed=seed, tolerance=0.0,
                      promotion=False)
        at_zero += r.metrics["biased"]
        at_default += r.metrics["p_value"] < 0.01 and abs(r.metrics["relative_bias"]) >= 1e-4
    print(f"{seeds} seeds: biased at tolerance 1e-4 (default): {at_default}; at tolerance 0: {at_zero}")


if __name__ == "__main__":
    main()
