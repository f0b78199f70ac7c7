"""Statistics of the train/inference log-prob mismatch, and the verdict.

Notation (per real token t, sampled by the inference engine from q = infer, rescored by the
trainer as p = train):
    x   = log q(t) - log p(t)              the log-ratio, "infer - train"
    rho = p(t) / q(t) = exp(-x)            the importance ratio a trainer applies
With t ~ q, Schulman's estimators of KL(q || p) = KL(infer || train) are
    k1 = x,  k2 = x^2 / 2,  k3 = (rho - 1) - log rho = expm1(-x) + x  (>= 0),
and E_q[rho] = 1 exactly, so E[rho^2] - 1 = chi^2(p || q).

Everything is one pass (or a few) over the tokens: sums, dot products, bincounts and an exact
selection for order statistics; nothing sorts the whole data.
"""
from __future__ import annotations

import math

import torch
from scipy import stats as sps

QUANTILES = (0.001, 0.01, 0.05, 0.5, 0.95, 0.99, 0.999)
LN10 = math.log(10.0)

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


def cluster_t(sums: torch.Tensor, counts: torch.Tensor, alpha: float):
    """Mean over tokens with units as independent clusters, vectorised over leading dims.

    sums, counts: [..., G] per-unit sums of the statistic and token counts (units with 0
    tokens are ignored). Ratio estimator m = sum S / sum n; cluster-robust variance
    G/(G-1) * sum (S_i - m n_i)^2 / (sum n)^2; Student t with G - 1 degrees of freedom.
    Returns (mean, se, t, p_two_sided, ci_halfwidth, G) as float64 tensors.
    """
    sums, counts = sums.double(), counts.double()
    used = counts > 0
    G = used.sum(-1).double()
    N = counts.sum(-1)
    m = sums.sum(-1) / N
    resid = torch.where(used, sums - m[..., None] * counts, 0.0)
    var = G / (G - 1).clamp(min=1) * (resid * resid).sum(-1) / (N * N)
    se = var.sqrt()
    df = (G - 1).clamp(min=1)
    t = torch.where(se > 0, m / se, torch.where(m == 0, 0.0, math.inf * m.sign()))
    p = torch.as_tensor(2 * sps.t.sf(t.abs().numpy(), df.numpy()), dtype=torch.float64)
    p = torch.where(G >= 2, p, torch.full_like(p, math.nan))
    half = torch.as_tensor(sps.t.ppf(1 - alpha / 2, df.numpy()), dtype=torch.float64) * se
    return m, se, t, p, half, G


def order_statistics(x: torch.Tensor, ranks: list, lo: float, hi: float, bins: int = 2048) -> list:
    """Exact order statistics x_(k) (1-based ranks) without a full sort.

    1. bin every value: idx = floor((x - lo) * bins / (hi - lo)), clamped to [-1, bins]
    2. count per bin (bincount) and find the bin holding each rank from the running count
    3. gather only the values of those bins and select inside them (kthvalue)
    The same idx decides counting and gathering, so float rounding at bin edges cannot
    misplace a rank.
    """
    n = x.numel()
    if n <= 1 << 16 or not hi > lo:
        s = x.sort().values
        return [s[k - 1].item() for k in ranks]
    idx = ((x - lo) * (bins / (hi - lo))).floor_().clamp_(-1, bins).add_(1).int()
    cum = torch.bincount(idx, minlength=bins + 2).cumsum(0)
    want = torch.searchsorted(cum, torch.tensor(ranks, dtype=cum.dtype)).clamp_(max=bins + 1)
    table = torch.zeros(bins + 2, dtype=torch.bool)
    table[want] = True
    sel = table[idx]
    xs, bs = x[sel], idx[sel]
    out = []
    for k, b in zip(ranks, want.tolist()):
        below = int(cum[b - 1]) if b > 0 else 0
        out.append(torch.kthvalue(xs[bs == b], k - below).values.item())
    return out


def kl_sums(a: torch.Tensor, e: torch.Tensor, max_abs: float) -> tuple:
    """(sum k3, sum reverse k3) over tokens from a = log rho = -x and e = expm1(a) = rho - 1.

    k3 = e - a elementwise, reverse = 1 - rho + rho log rho = -(e - a) + e a. Near rho = 1 these
    cancel in float32 (expm1(a) - a loses every digit for |a| ~ 1e-7), so for max |a| < 1e-3
    use their series from raw power sums instead:
      k3 = a^2/2 + a^3/6 + a^4/24 + O(a^5),  reverse = a^2/2 + a^3/3 + a^4/8 + O(a^5).
    """
    if max_abs < 1e-3:
        a2 = a * a
        s2, s3, s4 = a2.sum().item(), torch.dot(a2, a).item(), torch.dot(a2, a2).item()
        return s2 / 2 + s3 / 6 + s4 / 24, s2 / 2 + s3 / 3 + s4 / 8
    k3 = (e - a).sum().item()  # elementwise, so rounding errors are random, not cancelling
    return k3, -k3 + torch.dot(e, a).item()


def _nearest_rank(q: float, n: int) -> int:
    return min(n, max(1, math.ceil(q * n)))


def token_metrics(train: torch.Tensor, infer: torch.Tensor, x: torch.Tensor, clip: float) -> tuple:
    """Token-level metrics over flat real tokens. Returns (metrics, evidence)."""
    n = x.numel()
    log_c = math.log(clip)
    xmin, xmax = (v.item() for v in torch.aminmax(x))
    mean = x.sum().item() / n
    d = x - mean
    d2 = d * d
    m2 = d2.sum().item() / n
    m3 = torch.dot(d2, d).item() / n
    m4 = torch.dot(d2, d2).item() / n
    ax = x.abs()
    outside = ax > log_c
    n_out = int(outside.sum())
    sq_total = (m2 + mean * mean) * n
    tail_sq = (x[outside] ** 2).sum().item() if n_out else 0.0
    a = x.neg()  # log rho
    e = torch.expm1(a)  # rho - 1, accurate near rho = 1
    se_ = e.sum().item()
    see = torch.dot(e, e).item()
    k3_sum, rev_sum = kl_sums(a, e, max(-xmin, xmax))
    del a
    pt, pi = train.exp(), infer.exp()
    adp = (pi - pt).abs_()
    st, si = pt.sum().item(), pi.sum().item()
    ctt = torch.dot(pt, pt).item() / n - (st / n) ** 2
    cii = torch.dot(pi, pi).item() / n - (si / n) ** 2
    cti = torch.dot(pt, pi).item() / n - st * si / n / n
    pearson = cti / math.sqrt(ctt * cii) if ctt > 0 and cii > 0 else math.nan
    metrics = {
        "n_tokens": n,
        "std_log_ratio": math.sqrt(max(m2, 0.0)),
        "mean_abs_log_ratio": ax.sum().item() / n,
        "max_abs_log_ratio": max(-xmin, xmax),
        "k1_kl": mean,
        "k2_kl": (m2 + mean * mean) / 2,
        "k3_kl": max(k3_sum / n, 0.0),
        "k3_kl_reverse": rev_sum / n + 0.0,  # + 0.0: no "-0" in reports
        "chi2_token": (2 * se_ + see) / n,
        "excess_kurtosis": m4 / (m2 * m2) - 3 if m2 > 0 else 0.0,
        "skewness": m3 / m2 ** 1.5 if m2 > 0 else 0.0,
        "mean_ratio": 1 + se_ / n,
        "min_ratio": math.exp(-xmax),
        "max_ratio": math.exp(-xmin) if -xmin < 709 else math.inf,
        "ess_token": (n + se_) ** 2 / (n * (n + 2 * se_ + see)) if n + 2 * se_ + see > 0 else 0.0,
        "frac_ratio_outside": n_out / n,
        "n_ratio_outside": n_out,
        "tail_share": tail_sq / sq_total if sq_total > 0 else 0.0,
        "mean_abs_prob_diff": adp.sum().item() / n,
        "max_abs_prob_diff": adp.max().item(),
        "prob_pearson": max(-1.0, min(1.0, pearson)) if math.isfinite(pearson) else pearson,
    }
    # exact quantiles of rho: rho_(k) = exp(-x_(n + 1 - k)); the bulk range keeps bins fine
    std = metrics["std_log_ratio"]
    lo, hi = max(xmin, mean - 10 * std), min(xmax, mean + 10 * std)
    ranks = [n + 1 - _nearest_rank(q, n) for q in QUANTILES]
    xq = order_statistics(x, ranks, lo, hi)
    for q, v in zip(QUANTILES, xq):
        metrics[f"ratio_p{_qname(q)}"] = math.exp(-v) if -v < 709 else math.inf
    hist_lo, hist_hi = (lo, hi) if hi > lo else (lo - 1e-12, hi + 1e-12)
    counts = torch.histc(x, bins=64, min=hist_lo, max=hist_hi)
    evidence = {"log_ratio_histogram": {"edges": torch.linspace(hist_lo, hist_hi, 65).tolist(),
                                        "counts": counts.long().tolist(),
                                        "below": int((x < hist_lo).sum()),
                                        "above": int((x > hist_hi).sum())}}
    return metrics, evidence


def _qname(q: float) -> str:
    return f"{q * 100:g}"


def by_probability(infer: torch.Tensor, x: torch.Tensor, buckets: int = 10) -> list:
    """Bias and spread of x by the inference probability of the token, in half-decades:
    bucket b holds p in (10^-(b+1)/2, 10^-b/2], the last one everything smaller."""
    idx = (infer * (-2.0 / LN10)).floor_().clamp_(0, buckets - 1).int()
    n = torch.bincount(idx, minlength=buckets).double()
    # float32 accumulators (index_add_ is one pass; bincount with weights copies to float64):
    # this table is evidence, not a gated metric
    s1 = torch.zeros(buckets).index_add_(0, idx, x).double()
    s2 = torch.zeros(buckets).index_add_(0, idx, x * x).double()
    rows = []
    for b in range(buckets):
        k = int(n[b])
        if k == 0:
            continue
        mean = (s1[b] / k).item()
        var = max((s2[b] / k).item() - mean * mean, 0.0)
        rows.append({"p_high": 10 ** (-b / 2), "p_low": 0.0 if b == buckets - 1 else 10 ** (-(b + 1) / 2),
                     "n": k, "mean_log_ratio": mean, "std_log_ratio": math.sqrt(var)})
    return rows


def by_position(xz: torch.Tensor, xz2: torch.Tensor, mask: torch.Tensor, groups: int = 16) -> list:
    """Bias and spread of x by position in the sequence, in up to `groups` equal spans
    (xz: x with padding zeroed, xz2 = xz * xz)."""
    T = xz.shape[1]
    n = mask.view(torch.uint8).sum(0, dtype=torch.int32).double()
    s1 = xz.sum(0).double()
    s2 = xz2.sum(0).double()
    edges = torch.linspace(0, T, min(groups, T) + 1).round().long().tolist()
    rows = []
    for a, b in zip(edges[:-1], edges[1:]):
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
