"""trainprobes.drift.compare and trainprobes.drift.stats: known answers, calibration, formulas, errors."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.drift import compare, stats


def _pair(seed, B=64, T=32, noise=0.02, offset=0.0, seq_offset=0.0):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(B, T, generator=g) * 4
    x = torch.randn(B, T, generator=g) * noise + offset + torch.randn(B, 1, generator=g) * seq_offset
    return train, (train + x).clamp(max=0.0)


def test_zero_mean_noise_is_noisy_not_biased():
    r = compare(*_pair(0))
    assert r.metrics["biased"] is False
    assert r.metrics["drift_verdict"] == "noisy"
    assert r.verdict == "pass" and r.codes == []


@pytest.mark.parametrize("offset", [0.01, -0.01, 0.05])
def test_small_constant_offset_is_biased(offset):
    r = compare(*_pair(1, offset=offset))
    assert r.metrics["biased"] is True and r.metrics["drift_verdict"] == "biased"
    assert r.verdict == "fail" and "TP-D1" in r.codes
    assert r.metrics["mean_log_ratio"] == pytest.approx(offset, abs=2e-3)  # clamping at 0 shifts a few tokens


def test_rare_large_outliers_are_heavy_tailed():
    train, infer = _pair(2, B=64, T=64, noise=0.01)
    g = torch.Generator().manual_seed(3)
    hit = torch.rand(train.shape, generator=g) < 0.002
    sign = torch.where(torch.rand(train.shape, generator=g) < 0.5, -1.0, 1.0)
    infer = torch.where(hit, (train + 4 * sign).clamp(max=0), infer)
    r = compare(train, infer)
    assert r.metrics["heavy_tailed"] is True
    assert r.metrics["drift_verdict"] in ("heavy-tailed", "biased")
    assert "TP-D2" in r.codes
    assert r.metrics["tail_share"] > 0.5 and 0 < r.metrics["frac_ratio_outside"] < 0.01


def test_broad_gaussian_mismatch_is_not_heavy_tailed():
    r = compare(*_pair(4, noise=0.6))
    assert r.metrics["heavy_tailed"] is False  # many tokens outside the band: broad, not a few
    assert r.metrics["frac_ratio_outside"] > 0.1


def test_identical_is_clean():
    train, _ = _pair(5)
    r = compare(train, train.clone())
    assert r.metrics["drift_verdict"] == "clean" and r.metrics["p_value"] == 1.0
    assert r.metrics["k3_kl"] == 0 and r.metrics["max_abs_prob_diff"] == 0


def test_sampling_noise_mean_is_explained_not_biased():
    """Tokens sampled from a noisy q: E[x] = KL(q||p) > 0 but it is noise, not bias."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(400, 16, 50, generator=g) * 3
    p = torch.log_softmax(logits, -1)
    q = torch.log_softmax(logits + torch.randn(logits.shape, generator=g) * 0.03, -1)
    tok = torch.multinomial(q.exp().reshape(-1, 50), 1, generator=g).reshape(400, 16, 1)
    r = compare(p.gather(2, tok).squeeze(2), q.gather(2, tok).squeeze(2))
    assert r.metrics["mean_log_ratio"] > 0  # KL(q||p) is visible in the mean...
    assert r.metrics["biased"] is False  # ...and explained as second-order noise


def test_temperature_mismatch_is_biased():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 32, 50, generator=g) * 3
    p = torch.log_softmax(logits, -1)
    q = torch.log_softmax(logits / 0.7, -1)
    tok = torch.multinomial(q.exp().reshape(-1, 50), 1, generator=g).reshape(64, 32, 1)
    r = compare(p.gather(2, tok).squeeze(2), q.gather(2, tok).squeeze(2))
    assert r.metrics["biased"] is True
    rows = r.evidence["by_probability"]
    assert rows[0]["mean_log_ratio"] > 0 > rows[-1]["mean_log_ratio"]  # sharpening: likely up, rare down


def test_cluster_t_false_positive_rate_near_alpha_with_sequence_correlation():
    """2000 replicates at once: per-sequence offsets (zero mean) correlate tokens. The test over
    sequences keeps its level; a token-level test would not."""
    alpha, R, G, T = 0.05, 2000, 32, 16
    g = torch.Generator().manual_seed(8)
    x = torch.randn(R, G, T, generator=g) * 0.02 + torch.randn(R, G, 1, generator=g) * 0.01
    n = torch.full((R, G), T)
    _, _, _, p, _, _ = stats.cluster_t(x.sum(-1), n, alpha)
    fpr = (p < alpha).double().mean().item()
    assert abs(fpr - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / R)
    _, _, _, p_tok, _, _ = stats.cluster_t(x.reshape(R, G * T), torch.ones(R, G * T), alpha)
    assert (p_tok < alpha).double().mean().item() > 3 * alpha  # ignoring correlation over-rejects


@pytest.mark.slow
def test_compare_false_positive_rate_over_seeds():
    alpha, R = 0.05, 200
    hits = sum(compare(*_pair(100 + s, B=16, T=16, noise=0.05), alpha=alpha).metrics["biased"]
               for s in range(R))
    assert hits / R <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / R)
    assert hits >= 1  # the test is not vacuous: it can reject noise at rate ~alpha


def test_metric_formulas_against_direct_computation():
    train, infer = _pair(9, B=8, T=50, noise=0.3)
    r = compare(train, infer)
    x = (infer - train).double().reshape(-1)
    rho = torch.exp(-x)
    m = r.metrics
    assert m["mean_log_ratio"] == pytest.approx(x.mean().item(), rel=1e-5, abs=1e-9)
    assert m["k2_kl"] == pytest.approx((x * x).mean().item() / 2, rel=1e-5)
    assert m["k3_kl"] == pytest.approx((rho - 1 - torch.log(rho)).mean().item(), rel=1e-4)
    assert m["k3_kl_reverse"] == pytest.approx((1 - rho + rho * torch.log(rho)).mean().item(), rel=1e-4)
    assert m["chi2_token"] == pytest.approx((rho ** 2).mean().item() - 1, rel=1e-4)
    assert m["ess_token"] == pytest.approx((rho.sum() ** 2 / (rho.numel() * (rho ** 2).sum())).item(), rel=1e-6)
    assert m["frac_ratio_outside"] == pytest.approx(((rho > 2) | (rho < 0.5)).double().mean().item())
    pd = infer.double().exp() - train.double().exp()
    assert m["max_abs_prob_diff"] == pytest.approx(pd.abs().max().item(), rel=1e-5)
    pt, pi = train.double().exp().reshape(-1), infer.double().exp().reshape(-1)
    assert m["prob_pearson"] == pytest.approx(torch.corrcoef(torch.stack([pt, pi]))[0, 1].item(), abs=1e-5)
    seq = torch.exp(-(infer - train).double().sum(1))
    assert m["ess_seq"] == pytest.approx((seq.sum() ** 2 / (8 * (seq ** 2).sum())).item(), rel=1e-6)
    for q in stats.QUANTILES:
        k = min(rho.numel(), max(1, math.ceil(q * rho.numel())))
        assert m[f"ratio_p{stats.quantile_name(q)}"] == pytest.approx(rho.sort().values[k - 1].item(), rel=1e-5)


def test_mask_excludes_padding_even_if_garbage():
    train, infer = _pair(10, offset=0.02)
    mask = torch.ones_like(train, dtype=torch.bool)
    mask[:, 20:] = False
    bad_infer = infer.clone()
    bad_infer[:, 20:] = float("nan")
    r = compare(train, bad_infer, mask=mask)
    ref = compare(train[:, :20], infer[:, :20])
    assert r.metrics["n_tokens"] == 64 * 20
    assert r.metrics["mean_log_ratio"] == pytest.approx(ref.metrics["mean_log_ratio"], rel=1e-6)
    assert r.metrics["p_value"] == pytest.approx(ref.metrics["p_value"], rel=1e-6)


def test_flat_input_with_lengths_tests_over_sequences():
    train, infer = _pair(11, B=10, T=20, seq_offset=0.05)
    lengths = torch.full((10,), 20)
    flat = compare(train.reshape(-1), infer.reshape(-1), lengths=lengths)
    grid = compare(train, infer)
    assert flat.evidence["test_unit"] == "sequence" and flat.metrics["n_units"] == 10
    assert flat.metrics["p_value"] == pytest.approx(grid.metrics["p_value"], rel=1e-9)
    blocks = compare(train.reshape(-1), infer.reshape(-1))
    assert blocks.evidence["test_unit"] == "block"


@pytest.mark.slow
@pytest.mark.parametrize("B,T", [(32, 48), (16, 512)])
def test_flat_stream_without_lengths_holds_its_level_under_per_sequence_offsets(B, T):
    """A flat [N] stream of whole sequences (verl-style packed tokens) with zero-mean noise
    and a per-sequence offset: blocks shorter than a sequence are not independent, so 256 of
    them over-rejected (29% and 50% "biased" at alpha=0.01). Merged until their means are
    uncorrelated, the blocks hold the level; a real offset is still found."""
    rejections = sum(compare(*(v.reshape(-1) for v in _pair(s, B=B, T=T, noise=3e-3,
                                                            seq_offset=3e-3)),
                             clean_tol=0.0).metrics["biased"] for s in range(60))
    assert rejections <= 3  # alpha = 0.01: 0.6 expected, 3 is p < 0.003 under the level
    flat = compare(*(v.reshape(-1) for v in _pair(0, B=B, T=T, noise=3e-3, seq_offset=3e-3)))
    assert flat.evidence["test_unit"] == "block" and flat.metrics["n_units"] < 256
    shifted = compare(*(v.reshape(-1) for v in _pair(1, B=B, T=T, noise=3e-3, seq_offset=3e-3,
                                                       offset=5e-3)))
    assert shifted.metrics["biased"] is True


def test_flat_stream_of_independent_tokens_keeps_256_blocks():
    train, infer = _pair(3, B=64, T=64)
    r = compare(train.reshape(-1), infer.reshape(-1))
    assert r.metrics["n_units"] == 256


def test_threshold_over_fails_with_tp_d3():
    r = compare(*_pair(12), thresholds={"k3_kl": 1e-6})
    assert r.verdict == "fail" and "TP-D3" in r.codes and "k3_kl" in r.message


def test_result_round_trips_json():
    from trainprobes.result import Result
    r = compare(*_pair(13))
    back = Result.from_json(r.to_json())
    assert back.metrics["biased"] == r.metrics["biased"]
    assert back.metrics["drift_verdict"] == r.metrics["drift_verdict"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha=1.5), "alpha=1.5"),
    (dict(clip=1.0), "clip=1.0"),
    (dict(thresholds={"nope": 1}), "unknown metrics"),
])
def test_bad_options_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compare(*_pair(14, B=2, T=4), **kwargs)


@pytest.mark.parametrize("mutate, match", [
    (lambda t, i: (t, i[:, :3]), r"infer_logprobs has shape \(4, 3\), expected \(4, 5\)"),
    (lambda t, i: (t, i.index_put_((torch.tensor([2]), torch.tensor([1])), torch.tensor(float("nan")))),
     r"infer_logprobs\[2, 1\] = nan"),
    (lambda t, i: (t.index_put_((torch.tensor([0]), torch.tensor([3])), torch.tensor(0.5)), i),
     r"train_logprobs\[0, 3\] = 0.5 is not a log-probability"),
    (lambda t, i: (t.long(), i), "dtype torch.int64"),
])
def test_bad_inputs_name_the_entry(mutate, match):
    t, i = _pair(15, B=4, T=5)
    t, i = mutate(t.clone(), i.clone())
    with pytest.raises((ValueError, TypeError), match=match):
        compare(t, i)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(65_537, 80_000), seed=st.integers(0, 2 ** 16), tail=st.sampled_from([0.0, 1e-3, 0.05]))
def test_order_statistics_match_sort(n, seed, tail):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.01
    x = torch.where(torch.rand(n, generator=g) < tail, x * 1e4, x)
    x[: n // 10] = x[0]  # ties
    ranks = [1, 7, n // 2, n - 3, n]
    lo, hi = x.mean().item() - 0.1, x.mean().item() + 0.1
    got = stats.order_statistics(x, ranks, lo, hi)
    want = x.sort().values[torch.tensor(ranks) - 1].tolist()
    assert got == want


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2 ** 16), scale=st.sampled_from([1e-7, 1e-3, 0.1, 3.0]))
def test_kl_estimates_are_nonnegative_and_k3_close_to_k2_for_small_mismatch(seed, scale):
    train, infer = _pair(seed, B=4, T=64, noise=scale)
    m = compare(train, infer).metrics
    assert m["k3_kl"] >= 0 and m["k2_kl"] >= 0
    if scale <= 1e-3:
        assert m["k3_kl"] == pytest.approx(m["k2_kl"], rel=0.05, abs=1e-15)


def test_one_sequence_cannot_be_tested_and_says_so():
    train, infer = _pair(16, B=1, T=50, offset=0.05)
    r = compare(train, infer)
    assert math.isnan(r.metrics["p_value"]) and r.metrics["biased"] is False
    assert "untestable with one sequence" in r.message
    assert compare(train.reshape(-1), infer.reshape(-1)).metrics["biased"] is True  # blocks: testable


def _fp32_vs_fp64_engines(seed=0, B=32, T=64, V=32000):
    """The trainer's fp32 log_softmax against an engine that computes in fp64 and reports
    fp32: a real bias of ~5e-7 nats/token (fp32's sum of exponentials runs low)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 3
    tok = torch.randint(0, V, (B, T, 1), generator=g)
    train = torch.log_softmax(logits, -1).gather(-1, tok).squeeze(-1)
    infer = torch.log_softmax(logits.double(), -1).float().gather(-1, tok).squeeze(-1)
    return train.double(), infer.double()


@pytest.mark.slow
def test_significant_bias_below_min_bias_is_reported_not_failed():
    train, infer = _fp32_vs_fp64_engines()
    r = compare(train, infer)
    assert r.metrics["p_mean"] < 0.01 and abs(r.metrics["mean_log_ratio"]) < 1e-5
    assert r.metrics["biased"] is False and r.verdict == "pass"
    assert "below min_bias" in r.message
    strict = compare(train, infer, min_bias=0.0)
    assert strict.metrics["biased"] is True and "TP-D1" in strict.codes


def test_min_bias_does_not_excuse_a_real_offset():
    g = torch.Generator().manual_seed(3)
    train = -torch.rand(64, 32, generator=g, dtype=torch.float64) * 3
    infer = train + 2e-4 + 1e-3 * torch.randn(64, 32, generator=g, dtype=torch.float64)
    r = compare(train, infer)
    assert r.metrics["biased"] is True and "TP-D1" in r.codes


def test_min_bias_must_be_non_negative():
    lp = -torch.rand(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="min_bias"):
        compare(lp, lp, min_bias=-1.0)
