"""The plugin's assert_gemm_unbiased: passes an unbiased GEMM, fails a biased one (and
reproduces it as a control with expect="biased"), and fails closed on an inconclusive one."""
pytest_plugins = ["pytester"]

CASES = """
import torch

def e4m3(seed, mean):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(32, 1024, generator=g) + mean).to(torch.float8_e4m3fn).double()

POSITIVE = e4m3(1, 1.0), e4m3(2, 1.0)
ZERO_MEAN = e4m3(12, 0.0), e4m3(13, 0.0)

def test_fp32_accumulation(trainprobes):
    trainprobes.assert_gemm_unbiased(*POSITIVE, preset="fp32", samples=256, trials=16)

def test_truncating_accumulator(trainprobes):
    trainprobes.assert_gemm_unbiased(*POSITIVE, preset="h200-scaled-mm", samples=256, trials=16,
                                     promotion=False)

def test_truncating_accumulator_known(trainprobes):
    trainprobes.assert_gemm_unbiased(*POSITIVE, preset="h200-scaled-mm", samples=256, trials=16,
                                     promotion=False, expect="biased")

def test_too_few_samples(trainprobes):
    trainprobes.assert_gemm_unbiased(*ZERO_MEAN, preset="h200-scaled-mm", samples=64, trials=8)
"""


def test_assert_gemm_unbiased(pytester):
    pytester.makepyfile(test_gemm=CASES)
    out = pytester.runpytest("-p", "no:cacheprovider", "--trainprobes-report", "r.json")
    out.assert_outcomes(passed=2, failed=2)
    out.stdout.fnmatch_lines(["*biased GEMM: numerics.gemm on 'fprop*h200-scaled-mm*' -> fail*"])
    # the inconclusive sample: not a pass, and said to be a cannot-judge
    out.stdout.fnmatch_lines(["*biased GEMM: numerics.gemm on * -> error*", "*cannot judge*"])
