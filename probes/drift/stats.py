"""Statistics of the train/inference log-prob mismatch, and the verdict.

Notation (per real token t, sampled by the inference engine from q = infer, rescored by the
trainer as p = train):
    x   = log q(t) - log p(t)              the log-ratio, "infer - train"
    rho = p(t) / q(t) = exp(-x)            the importance ratio a trainer applies
With t ~ q, Schulman's estimators of KL(q || p) = KL(infer || train) are
    k1 = x,  k2 = x^2 / 2,  k3 = (rho - 1) - log rho = expm1(-x) + x  (>= 0),
and E_q[rho] = 1 exactly, so E[rho^2] - 1 = chi^2(p || q).

The sums come from one pass over the tokens (trainprobes.drift.tokens); order statistics from
a histogram-guided exact selection. Nothing sorts the whole data.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from scipy import stats as sps
from trainprobes.drift.inputs import Layout
from trainprobes.drift.tokens import BLOCK_ELEMENTS, Bins, TokenSums, Work, histogram, x_blocks
from trainprobes.drift.tokens import order_statistics as select_ranks

QUANTILES = (0.001, 0.01, 0.05, 0.5, 0.95, 0.99, 0.999)
# exact quantiles: 2048 = 32 x 64 selection bins, so the 64-bin evidence histogram is their sum
SELECT_BINS = 2048
EVIDENCE_BINS = 64

# name -> formula and the direction of the divergence it estimates (docs/drift.md repeats this)
METRICS = {
    "n_tokens": "real (masked-in) tokens",
    "n_units": "independent units of the bias test (sequences, or blocks of a flat stream)",
    "mean_log_ratio": "mean x = mean(log q - log p); k1 estimate of KL(infer || train) when tokens are sampled from infer",
    "ci_low": "lower end of the (1 - alpha) cluster-robust t interval for mean_log_ratio",
    "ci_high": "upper end of that interval",
    "p_mean": "two-sided p-value of H0 E[x] = 0, t-test over units (ratio estimator, cluster-robust SE, df = units - 1)",
    "p_excess": "two-sided p-value of H0 E[x - x^2/2] = 0 over units: zero-mean noise in the SAMPLING distribution gives E[x] = E[x^2]/2 + O(x^3)",
    "p_value": "max(p_mean, p_excess): intersection-union test; biased iff p_value < alpha",
    "min_detectable_bias": "smallest |mean_log_ratio| the t-test detects at alpha with 80% power (trainprobes.power): what a pass rules out",
    "std_log_ratio": "standard deviation of x over tokens",
    "mean_abs_log_ratio": "mean |x|",
    "max_abs_log_ratio": "max |x|",
    "k1_kl": "mean x; estimates KL(infer || train); unbiased, noisy, can be negative",
    "k2_kl": "mean x^2 / 2; estimates KL(infer || train) to second order; biased, low variance",
    "k3_kl": "mean (rho - 1 - log rho); estimates KL(infer || train); unbiased and >= 0",
    "k3_kl_reverse": "mean rho * ((1/rho - 1) + log rho) = mean(1 - rho + rho log rho); importance-weighted k3 of KL(train || infer)",
    "chi2_token": "mean rho^2 - 1; estimates chi^2(train || infer) = E_q[(p/q)^2] - 1",
    "excess_kurtosis": "m4 / m2^2 - 3 of x (0 for Gaussian noise)",
    "mean_ratio": "mean rho; should be ~1 (E_q[p/q] = 1 when tokens are sampled from infer)",
    "min_ratio": "min rho over tokens",
    "max_ratio": "max rho over tokens",
    "ess_token": "(sum rho)^2 / (n sum rho^2), in (0, 1]: effective sample size fraction of token IS",
    "frac_ratio_outside": "fraction of tokens with rho outside [1/C, C]",
    "tail_share": "share of sum x^2 carried by tokens with rho outside [1/C, C]",
    "mean_abs_prob_diff": "mean |p_infer - p_train| (probability space)",
    "max_abs_prob_diff": "max |p_infer - p_train|",
    "prob_pearson": "Pearson correlation of p_train and p_infer over tokens",
    "seq_mean_log_ratio": "mean over sequences of the summed x (log of the sequence ratio q/p)",
    "ess_seq": "ESS fraction of sequence IS weights prod rho",
    "chi2_seq": "mean over sequences of (prod rho)^2 - 1 (inf when it overflows float64)",
    "frac_seq_ratio_outside": "fraction of sequences with prod rho outside [1/C, C]",
    "frac_seq_geo_ratio_outside": "fraction of sequences with the geometric-mean ratio exp(-mean x) outside [1/C, C]",
}



class ClusterTest(NamedTuple):
    """A cluster-robust t-test of a mean over tokens, units as clusters (float64 tensors)."""

    mean: torch.Tensor
    se: torch.Tensor
    t: torch.Tensor
    p: torch.Tensor          # two-sided; NaN with fewer than 2 units
    half: torch.Tensor       # half-width of the (1 - alpha) interval
    units: torch.Tensor


def _student(m, ss, G, N, alpha: float) -> ClusterTest:
    """From the ratio estimate m, the residual sum of squares ss = sum (S_i - m n_i)^2, G units
    and N tokens: cluster-robust variance G/(G-1) * ss / N^2, Student t with G - 1 df."""
    se = (G / (G - 1).clamp(min=1) * ss).sqrt() / N
    df = (G - 1).clamp(min=1)
    t = torch.where(se > 0, m / se, torch.where(m == 0, 0.0, math.inf * m.sign()))
    p = torch.as_tensor(2 * sps.t.sf(t.abs().numpy(), df.numpy()), dtype=torch.float64)
    p = torch.where(G >= 2, p, torch.full_like(p, math.nan))
    half = torch.as_tensor(sps.t.ppf(1 - alpha / 2, df.numpy()), dtype=torch.float64) * se
    return ClusterTest(m, se, t, p, half, G)


def cluster_t(sums: torch.Tensor, counts: torch.Tensor, alpha: float) -> ClusterTest:
    """Mean over tokens with units as independent clusters, vectorised over leading dims.

    sums, counts: [..., G] per-unit sums of the statistic and token counts (units with 0
    tokens are ignored). Ratio estimator m = sum S / sum n; residuals S_i - m n_i formed
    directly (no cancellation).
    """
    sums, counts = sums.double(), counts.double()
    used = counts > 0
    G = used.sum(-1).double()
    N = counts.sum(-1)
    m = sums.sum(-1) / N
    resid = torch.where(used, sums - m[..., None] * counts, 0.0)
    return _student(m, (resid * resid).sum(-1), G, N, alpha)


def cluster_t_from_sums(s: float, s2: float, sn: float, n2: float, G: int, N: float,
                        alpha: float) -> ClusterTest:
    """cluster_t from running sums over units (a stream keeps no unit): s = sum S_i,
    s2 = sum S_i^2, sn = sum S_i n_i, n2 = sum n_i^2, via
    sum (S_i - m n_i)^2 = s2 - 2 m sn + m^2 n2."""
    f = lambda v: torch.tensor(float(v), dtype=torch.float64)  # noqa: E731
    m = s / N
    return _student(f(m), f(max(s2 - 2 * m * sn + m * m * n2, 0.0)), f(G), f(N), alpha)


def nearest_rank(q: float, n: int) -> int:
    """The nearest-rank definition of the q-quantile of n values: rank ceil(q n) in [1, n]."""
    return min(n, max(1, math.ceil(q * n)))


def quantile_name(q: float) -> str:
    """0.001 -> "0.1": the percent in the metric key ratio_p{name}."""
    return f"{q * 100:g}"


def ratio_from_x(v: float) -> float:
    """rho = exp(-x), inf past float64's range."""
    return math.exp(-v) if -v < 709 else math.inf


def order_statistics(x: torch.Tensor, ranks: list, lo: float, hi: float, bins: int = SELECT_BINS) -> list:
    """Exact order statistics x_(k) (1-based ranks) of a flat tensor without a full sort:
    bin by histc over [lo, hi], then select inside the bins that hold the ranks."""
    n = x.numel()
    if n <= 1 << 16 or not np.float32(hi) > np.float32(lo):
        s = x.sort().values
        return [s[k - 1].item() for k in ranks]
    x = x.contiguous()

    def blocks():
        return ((x[i:i + BLOCK_ELEMENTS], None, 0) for i in range(0, n, BLOCK_ELEMENTS))  # loop over blocks
    return select_ranks(blocks, ranks, histogram(blocks(), Bins(lo, hi, bins)))


def quantiles_and_histogram(layout: Layout, mean: float, std: float, x_min: float, x_max: float,
                            work: Work | None = None) -> tuple:
    """Exact ratio quantiles rho_(k) = exp(-x_(n + 1 - k)) and the 64-bin histogram of x over
    the bulk range [max(x_min, mean - 10 std), min(x_max, mean + 10 std)] (widened by 1e-12
    when empty). Two passes: counts in 2048 bins, then a selection inside the bins holding
    the ranks. work: buffers shared with the caller's other passes.
    Returns (metrics, histogram evidence)."""
    n = layout.n_tokens
    lo, hi = max(x_min, mean - 10 * std), min(x_max, mean + 10 * std)
    if not hi > lo:
        lo, hi = lo - 1e-12, hi + 1e-12
    if not np.float32(hi) > np.float32(lo):  # still one float32: widen by one float32 step each side
        lo = float(np.nextafter(np.float32(lo), np.float32(-np.inf)))
        hi = float(np.nextafter(np.float32(hi), np.float32(np.inf)))
    work = work or Work()
    hist = histogram(x_blocks(layout, work), Bins(lo, hi, SELECT_BINS), work)
    ranks = [n + 1 - nearest_rank(q, n) for q in QUANTILES]
    xq = select_ranks(lambda: x_blocks(layout, work), ranks, hist, work)
    metrics = {f"ratio_p{quantile_name(q)}": ratio_from_x(v) for q, v in zip(QUANTILES, xq)}
    counts = hist.counts.view(EVIDENCE_BINS, SELECT_BINS // EVIDENCE_BINS).sum(1)
    evidence = {"edges": torch.linspace(lo, hi, EVIDENCE_BINS + 1).tolist(), "counts": counts.tolist(),
                "below": hist.below, "above": hist.above, "x_min": x_min, "x_max": x_max}
    return metrics, evidence


def token_metrics(s: TokenSums, clip: float) -> dict:
    """Token-level metrics from the sums of one pass (with shape=True)."""
    n, sh = s.n, s.shape
    mo = sh.moments
    mean, m2, m3, m4 = mo.mean, mo.m2 / n, mo.m3 / n, mo.m4 / n
    sq_total = (m2 + mean * mean) * n
    p = sh.p
    ctt = p["tt"] / n - (p["t"] / n) ** 2
    cii = p["ii"] / n - (p["i"] / n) ** 2
    cti = p["ti"] / n - p["t"] * p["i"] / n / n
    pearson = cti / math.sqrt(ctt * cii) if ctt > 0 and cii > 0 else math.nan
    return {
        "n_tokens": n,
        "std_log_ratio": math.sqrt(max(m2, 0.0)),
        "mean_abs_log_ratio": sh.abs_sum / n,
        "max_abs_log_ratio": max(-s.x_min, s.x_max),
        "k1_kl": mean,
        "k2_kl": (m2 + mean * mean) / 2,
        "k3_kl": max(s.k3 / n, 0.0),
        "k3_kl_reverse": s.rev / n + 0.0,  # + 0.0: no "-0" in reports
        "skewness": m3 / m2 ** 1.5 if m2 > 0 else 0.0,
        "excess_kurtosis": m4 / (m2 * m2) - 3 if m2 > 0 else 0.0,
        **ratio_metrics(n, s.se, s.see, s.x_min, s.x_max),
        "frac_ratio_outside": s.n_out / n,
        "n_ratio_outside": s.n_out,
        "tail_share": s.tail_sq / sq_total if sq_total > 0 else 0.0,
        "mean_abs_prob_diff": s.adp / n,
        "max_abs_prob_diff": s.adp_max,
        "prob_pearson": max(-1.0, min(1.0, pearson)) if math.isfinite(pearson) else pearson,
    }


def ratio_metrics(n: float, se: float, see: float, x_min: float, x_max: float) -> dict:
    """Importance-ratio metrics from sum e and sum e^2 (e = rho - 1) and the extremes of x."""
    return {
        "chi2_token": (2 * se + see) / n,
        "mean_ratio": 1 + se / n,
        "min_ratio": math.exp(-x_max),
        "max_ratio": ratio_from_x(x_min),
        "ess_token": (n + se) ** 2 / (n * (n + 2 * se + see)) if n + 2 * se + see > 0 else 0.0,
    }


def by_probability(s: TokenSums) -> list:
    """Bias and spread of x by the inference probability of the token, in half-decades:
    bucket b holds p in (10^-(b+1)/2, 10^-b/2], the last one everything smaller."""
    sh = s.shape
    B = sh.bucket_n.numel()
    rows = []
    for b, (k, s1, s2) in enumerate(zip(sh.bucket_n.tolist(), sh.bucket_s1.tolist(), sh.bucket_s2.tolist())):
        if k == 0:
            continue
        mean = s1 / k
        std = math.sqrt(max(s2 / k - mean * mean, 0.0))
        rows.append({"p_high": 10 ** (-b / 2), "p_low": 0.0 if b == B - 1 else 10 ** (-(b + 1) / 2),
                     "n": k, "mean_log_ratio": mean, "std_log_ratio": std})
    return rows


def by_position(s: TokenSums, groups: int = 16) -> list:
    """Bias and spread of x by position in the sequence, in up to `groups` equal spans."""
    sh = s.shape
    T = sh.col_sum.numel()
    edges = torch.linspace(0, T, min(groups, T) + 1).round().long().tolist()
    n, s1, s2 = sh.col_n.double(), sh.col_sum, sh.col_sq
    rows = []
    for a, b in zip(edges[:-1], edges[1:]):  # loop over spans
        k = int(n[a:b].sum())
        if b <= a or k == 0:
            continue
        mean = (s1[a:b].sum() / k).item()
        var = max((s2[a:b].sum() / k).item() - mean * mean, 0.0)
        rows.append({"start": a, "end": b, "n": k, "mean_log_ratio": mean, "std_log_ratio": math.sqrt(var)})
    return rows


def sequence_metrics(seq_sum: torch.Tensor, seq_n: torch.Tensor, clip: float) -> dict:
    """Sequence-level IS: rho_seq = exp(-sum x) and the geometric mean exp(-mean x)."""
    used = seq_n > 0
    s, k = seq_sum[used].double(), seq_n[used].double()
    G = s.numel()
    a = -s  # log rho_seq
    lse1, lse2 = torch.logsumexp(a, 0).item(), torch.logsumexp(2 * a, 0).item()
    log_c = math.log(clip)
    chi2_log = lse2 - math.log(G)
    return {
        "n_sequences": G,
        "seq_mean_log_ratio": s.mean().item(),
        "ess_seq": math.exp(2 * lse1 - math.log(G) - lse2),
        "chi2_seq": math.exp(chi2_log) - 1 if chi2_log < 709 else math.inf,
        "frac_seq_ratio_outside": (a.abs() > log_c).double().mean().item(),
        "frac_seq_geo_ratio_outside": ((a / k).abs() > log_c).double().mean().item(),
    }
