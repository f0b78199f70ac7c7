"""`compare`: is the train/inference log-prob mismatch clean, noisy, biased or heavy-tailed?

The verdict, from the mechanism (notation in trainprobes.drift.stats):
  biased       the mean log-ratio x = log q - log p is not what zero-mean noise gives.
               Noise added to reported log-probs gives E[x] = 0; noise in the distribution
               the tokens were SAMPLED from gives E[x] = KL(q || p) = E[x^2]/2 + O(x^3)
               (from E_q[exp(-x)] = 1). The second explanation holds only for numerics-sized
               noise, k2 = E[x^2]/2 <= noise_kl_max (1e-3 nats: a log-ratio std up to ~0.045;
               bf16 kernels give ~0.02); a larger mismatch is a different distribution, not
               rounding noise. So: biased iff H0 E[x] = 0 is rejected at alpha AND (k2 >
               noise_kl_max OR H0 E[x - x^2/2] = 0 is rejected too: an intersection-union
               test, false-positive rate at most alpha under either kind of small noise).
               Each is a t-test over independent units (sequences) with a cluster-robust
               standard error: tokens of one sequence share a prompt, a batch and a KV cache.
               A significant mean below min_bias nats/token (default 1e-5: 0.01 nats over
               a 1000-token sequence, a sequence ratio within 1%) is reported, not failed:
               fp32 log_softmax against an fp64 one is biased by ~5e-7, real and harmless.
  heavy-tailed a few tokens carry most of the mismatch: 0 < fraction with rho outside [1/C, C]
               <= tail_frac, and those tokens hold >= tail_share_min of sum x^2.
  clean        neither, std(x) <= clean_tol and no ratio outside [1/C, C].
  noisy        neither, but not clean: zero-mean noise (bf16 kernels, reduction order).

Cost: three reads of the tokens (trainprobes.drift.tokens): one for every sum, one to count
per bin, one to gather the few bins that hold the quantile ranks.
"""
from __future__ import annotations

from trainprobes.drift.inputs import pair
from trainprobes.drift.stats import (
    by_position,
    by_probability,
    cluster_t,
    quantiles_and_histogram,
    sequence_metrics,
    token_metrics,
)
from trainprobes.drift.tokens import Work, token_sums
from trainprobes.drift.verdict import DRIFT_VERDICTS, check_options, classify, judge
from trainprobes.power import min_detectable_effect
from trainprobes.result import Result

__all__ = ["compare", "classify", "DRIFT_VERDICTS"]


def compare(train_logprobs, infer_logprobs, *, mask=None, lengths=None, alpha: float = 0.01,
            clip: float = 2.0, clean_tol: float = 1e-3, noise_kl_max: float = 1e-3, tail_frac: float = 0.01,
            tail_share_min: float = 0.5, kl_warn: float = 0.01, thresholds: dict | None = None,
            min_bias: float = 1e-5, target: str = "train vs infer") -> Result:
    """Compare the trainer's and the inference engine's log-probs of the same sampled tokens.

    train_logprobs, infer_logprobs: [N] or [B, T] log-probs (rows of [B, T] are sequences).
    mask: bool like them, True on real tokens. lengths: for a flat [N] stream, the sequence
    lengths (summing to N); without it a flat stream is cut into 256 contiguous blocks
      (fewer while neighbouring blocks correlate).
    alpha: level of the bias test. clip: C of the ratio band [1/C, C].
    clean_tol: largest std of the log-ratio called clean (nats).
    noise_kl_max: largest k2 KL that sampling noise may use to explain a positive mean.
    tail_frac, tail_share_min: the heavy-tail rule (see module doc).
    kl_warn: k3_kl above this turns a noisy pass into a warn (TP-D3).
    thresholds: {metric: max allowed |value|}; any exceeded fails with TP-D3.
    min_bias: smallest |mean log-ratio| (nats/token) called biased; a significant mean
    below it is named in the reason but does not fail (0 fails every significant mean).

    Returns a Result (probe "drift.compare"); metrics["biased"] is the bias verdict and
    metrics["drift_verdict"] one of clean / noisy / biased / heavy-tailed. See stats.METRICS.
    """
    thresholds = check_options(alpha=alpha, clip=clip, clean_tol=clean_tol, noise_kl_max=noise_kl_max,
                               tail_frac=tail_frac, tail_share_min=tail_share_min, kl_warn=kl_warn,
                               min_bias=min_bias, thresholds=thresholds)
    layout = pair(train_logprobs, infer_logprobs, mask, lengths)
    work = Work()  # one set of block buffers for the three passes
    sums = token_sums(layout, clip, shape=True, work=work)
    metrics = token_metrics(sums, clip)
    quantiles, histogram = quantiles_and_histogram(layout, metrics["k1_kl"], metrics["std_log_ratio"],
                                                   sums.x_min, sums.x_max, work)
    metrics.update(quantiles)
    # the bias test over units: sums of x and of u = x - x^2/2 per row
    seq_sum, seq_n = sums.row_sum, sums.row_n
    mean, se, t, p_mean, half, G = (v.item() for v in cluster_t(seq_sum, seq_n, alpha))
    p_excess = cluster_t(seq_sum - sums.row_sq / 2, seq_n, alpha).p.item()
    small_noise = metrics["k2_kl"] <= noise_kl_max
    p_value = max(p_mean, p_excess) if small_noise else p_mean
    metrics.update({
        "mean_log_ratio": mean, "ci_low": mean - half, "ci_high": mean + half, "se_mean": se,
        "t_stat": t, "p_mean": p_mean, "p_excess": p_excess, "p_value": p_value,
        "n_units": int(G), "alpha": alpha, "clip": clip, "noise_kl_max": noise_kl_max,
        "min_bias": min_bias,
        # what a pass rules out: the smallest |mean log-ratio| the t-test finds with 80% power
        "min_detectable_bias": min_detectable_effect(se, G - 1, alpha),
    })
    evidence = {"log_ratio_histogram": histogram, "by_probability": by_probability(sums)}
    if layout.unit == "sequence":
        metrics.update(sequence_metrics(seq_sum, seq_n, clip))
        evidence["by_position"] = by_position(sums)
    evidence["test_unit"] = layout.unit
    return judge(metrics, evidence, alpha=alpha, clean_tol=clean_tol, tail_frac=tail_frac,
                 tail_share_min=tail_share_min, kl_warn=kl_warn, thresholds=thresholds,
                 probe="drift.compare", target=target)
