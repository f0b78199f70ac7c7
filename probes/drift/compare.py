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
"""
from __future__ import annotations

import math

import torch
from trainprobes.drift import inputs, stats
from trainprobes.power import min_detectable_effect
from trainprobes.result import Result

DRIFT_VERDICTS = ("clean", "noisy", "biased", "heavy-tailed")


def _check_options(alpha, clip, clean_tol, noise_kl_max, tail_frac, tail_share_min, kl_warn, thresholds,
                   min_bias=0.0):
    if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
        raise ValueError(f"alpha={alpha!r} must be in (0, 1), e.g. 0.01")
    if not (isinstance(clip, (int, float)) and clip > 1 and math.isfinite(clip)):
        raise ValueError(f"clip={clip!r} must be a finite ratio > 1 (the band is [1/clip, clip]), e.g. 2.0")
    for name, v in (("clean_tol", clean_tol), ("noise_kl_max", noise_kl_max), ("kl_warn", kl_warn),
                    ("min_bias", min_bias)):
        if not (isinstance(v, (int, float)) and v >= 0):
            raise ValueError(f"{name}={v!r} must be a number >= 0")
    for name, v in (("tail_frac", tail_frac), ("tail_share_min", tail_share_min)):
        if not (isinstance(v, (int, float)) and 0 < v <= 1):
            raise ValueError(f"{name}={v!r} must be in (0, 1]")
    if thresholds is not None:
        if not isinstance(thresholds, dict):
            raise TypeError(f"thresholds={thresholds!r} must be a dict metric -> max allowed |value|")
        unknown = [k for k in thresholds if k not in stats.METRICS]
        if unknown:
            raise ValueError(f"thresholds names unknown metrics {unknown!r}; known: {sorted(stats.METRICS)}")


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
    _check_options(alpha, clip, clean_tol, noise_kl_max, tail_frac, tail_share_min, kl_warn, thresholds,
                   min_bias)
    train, infer, m, unit = inputs.pair(train_logprobs, infer_logprobs, mask, lengths)
    x2d = infer - train
    xz = torch.where(m, x2d, 0.0)
    if int(torch.count_nonzero(m)) == m.numel():
        x, tr, inf = x2d.reshape(-1), train.reshape(-1), infer.reshape(-1)
    else:  # one nonzero, three gathers
        keep = m.reshape(-1).nonzero().squeeze(1)
        x, tr, inf = (t.reshape(-1).index_select(0, keep) for t in (x2d, train, infer))

    metrics, evidence = stats.token_metrics(tr, inf, x, clip)
    # the bias test over units: sums of x and of u = x - x^2/2 per row
    seq_n = inputs.row_counts(m)
    seq_sum = xz.sum(1)
    xz2 = xz * xz
    seq_u = seq_sum - xz2.sum(1) / 2
    mean, se, t, p_mean, half, G = (v.item() for v in stats.cluster_t(seq_sum, seq_n, alpha))
    _, _, t_u, p_excess, _, _ = (v.item() for v in stats.cluster_t(seq_u, seq_n, alpha))
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
    if unit == "sequence":
        metrics.update(stats.sequence_metrics(seq_sum, seq_n, clip))
    evidence["by_probability"] = stats.by_probability(inf, x)
    if unit == "sequence":
        evidence["by_position"] = stats.by_position(xz, xz2, m)
    evidence["test_unit"] = unit
    return _verdict(metrics, evidence, alpha=alpha, clean_tol=clean_tol, tail_frac=tail_frac,
                    tail_share_min=tail_share_min, kl_warn=kl_warn, thresholds=thresholds,
                    probe="drift.compare", target=target)


def classify(metrics: dict, *, alpha: float, clean_tol: float, tail_frac: float,
             tail_share_min: float) -> tuple:
    """(drift_verdict, biased, heavy_tailed, reason) from the metrics; shared with the monitor."""
    p = metrics["p_value"]
    significant = bool(math.isfinite(p) and p < alpha)
    tiny = abs(metrics["mean_log_ratio"]) < metrics.get("min_bias", 0.0)
    biased = significant and not tiny
    frac, share = metrics["frac_ratio_outside"], metrics["tail_share"]
    heavy = bool(0 < frac <= tail_frac and share >= tail_share_min)
    mean, lo, hi = metrics["mean_log_ratio"], metrics.get("ci_low"), metrics.get("ci_high")
    if biased:
        ci = f" [{lo:.3g}, {hi:.3g}]" if lo is not None else ""
        why = ("and the excess over the x^2/2 that small sampling noise gives is significant too"
               if metrics["k2_kl"] <= metrics.get("noise_kl_max", 0.0) else
               f"and k2 {metrics['k2_kl']:.3g} is too large for rounding noise")
        reason = (f"mean log-ratio (infer - train) {mean:.3g}{ci} nats/token is not zero-mean noise "
                  f"(p = {p:.2g} < alpha {alpha:g}, {why})")
        label = "biased"
    elif heavy:
        reason = (f"{frac:.2%} of tokens have an importance ratio outside [1/C, C] and carry "
                  f"{share:.0%} of the squared log-ratio (max |log-ratio| "
                  f"{metrics['max_abs_log_ratio']:.3g})")
        label = "heavy-tailed"
    elif metrics["std_log_ratio"] <= clean_tol and frac == 0:
        reason = (f"log-ratios have std {metrics['std_log_ratio']:.2g} <= {clean_tol:g} nats and no "
                  f"ratio outside the band")
        if significant:
            reason += (f"; a significant bias {mean:.2g} nats/token lies below min_bias "
                       f"{metrics['min_bias']:g} (p = {p:.2g})")
        label = "clean"
    else:
        why = ("bias untestable with one sequence (pass more rows, or lengths=)" if not math.isfinite(p)
               else "no significant bias" if p >= alpha
               else f"a significant bias below min_bias {metrics['min_bias']:g} nats/token" if tiny
               else "mean explained by noise")
        reason = (f"zero-mean mismatch, {why} (p = {p:.2g}); std {metrics['std_log_ratio']:.3g} nats, "
                  f"k3 KL(infer||train) {metrics['k3_kl']:.3g}")
        label = "noisy"
    return label, biased, heavy, reason


def _verdict(metrics, evidence, *, alpha, clean_tol, tail_frac, tail_share_min, kl_warn,
             thresholds, probe, target) -> Result:
    label, biased, heavy, reason = classify(metrics, alpha=alpha, clean_tol=clean_tol,
                                            tail_frac=tail_frac, tail_share_min=tail_share_min)
    metrics.update({"biased": biased, "heavy_tailed": heavy, "drift_verdict": label})
    codes, verdict = [], "pass"
    if biased:
        codes.append("TP-D1")
        verdict = "fail"
    if heavy:
        codes.append("TP-D2")
        verdict = "fail" if verdict == "fail" else "warn"
    over = {k: metrics[k] for k, v in (thresholds or {}).items()
            if isinstance(metrics.get(k), (int, float)) and not abs(metrics[k]) <= v}
    if over:
        codes.append("TP-D3")
        verdict = "fail"
        reason += "; over threshold: " + ", ".join(f"{k} = {v:.3g} > {thresholds[k]:g}" for k, v in over.items())
    elif label == "noisy" and metrics["k3_kl"] > kl_warn:
        codes.append("TP-D3")
        verdict = "warn" if verdict == "pass" else verdict
        reason += f"; k3_kl {metrics['k3_kl']:.3g} > kl_warn {kl_warn:g}"
    evidence["thresholds"] = dict(thresholds or {})
    return Result(probe=probe, target=target, verdict=verdict, metrics=metrics, evidence=evidence,
                  seed=None, codes=codes, message=f"{label}: {reason}")
