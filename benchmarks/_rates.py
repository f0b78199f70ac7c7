"""A rate with its exact (Clopper-Pearson) 95% interval, as the GEMM benchmarks print it."""
from scipy import stats


def rate(hits: int, n: int) -> str:
    ci = stats.binomtest(hits, n).proportion_ci(0.95, method="exact")
    return f"{hits}/{n} ({hits / n:.1%}, 95% CI [{ci.low:.1%}, {ci.high:.1%}])"
