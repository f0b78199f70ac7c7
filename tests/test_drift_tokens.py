"""trainprobes.drift.tokens: the one-pass sums, histc's bins and the exact selection equal their
definitions on random inputs, with and without masks, in one block and in many.

References are direct computations over the real tokens: counts, histograms and quantiles must
match exactly (torch.histc for bins, a full sort for order statistics); sums of float32 data
may differ from a float64 reference by their rounding: stated per check below.
"""
import math
from contextlib import contextmanager

import numpy as np
import pytest
import torch
import trainprobes.drift.tokens as tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.drift import DriftMonitor, compare
from trainprobes.drift.inputs import pair
from trainprobes.drift.monitor import COARSE, FINE
from trainprobes.drift.stats import QUANTILES, nearest_rank, quantile_name
from trainprobes.drift.tokens import (
    Bins,
    Histogram,
    Moments,
    Work,
    histogram,
    kl_block,
    order_statistics,
    token_sums,
)

LN10 = math.log(10.0)


@contextmanager
def _blocks(many: bool):
    """A context in which the token pass cuts [G, T] inputs into blocks of a few rows."""
    with pytest.MonkeyPatch.context() as m:
        if many:
            m.setattr(tokens, "BLOCK_ELEMENTS", 700)
            m.setattr(tokens, "CACHE_BLOCK_ELEMENTS", 700)
        yield


def _pair(seed, B=24, T=40, noise=0.02, offset=0.0, masked=False, nan_pad=False, tail=0.0):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(B, T, generator=g) * 6
    x = torch.randn(B, T, generator=g) * noise + offset
    x = torch.where(torch.rand(B, T, generator=g) < tail, x * 100, x)
    infer = (train + x).clamp(max=0)
    mask = None
    if masked:
        mask = torch.rand(B, T, generator=g) > 0.25
        mask[:, 0] = True
        if nan_pad:
            infer = torch.where(mask, infer, float("nan"))
    return train, infer, mask


def _real(t, mask):
    return t.reshape(-1) if mask is None else t[mask]


def _edge_values(lo, hi, count, g):
    """Random values over [lo, hi] and beyond, every bin edge and its float32 neighbours."""
    span = hi - lo
    edges = torch.linspace(lo, hi, count + 1)
    near = [edges]
    up, down = edges.clone(), edges.clone()
    for _ in range(2):
        up, down = torch.nextafter(up, torch.tensor(math.inf)), torch.nextafter(down, torch.tensor(-math.inf))
        near += [up, down]
    rand = torch.rand(4000, generator=g) * span * 1.4 + lo - 0.2 * span
    return torch.cat(near + [rand, torch.tensor([lo, hi], dtype=torch.float32)])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 16), count=st.integers(1, 3000),
       scale=st.sampled_from([1e-6, 1e-2, 1.0, 40.0]), masked=st.booleans())
def test_bins_count_exactly_like_torch_histc(seed, count, scale, masked):
    g = torch.Generator().manual_seed(seed)
    lo = float(torch.randn(1, generator=g)) * scale
    hi = lo + (float(torch.rand(1, generator=g)) + 1e-3) * scale
    v = _edge_values(lo, hi, count, g)
    real = torch.rand(v.shape, generator=g) > 0.3 if masked else torch.ones_like(v, dtype=torch.bool)
    h = Histogram(Bins(lo, hi, count))
    h.add(torch.where(real, v, 0.0), Work(v.numel()), n_pad=int((~real).sum()))
    want = v[real]
    assert torch.equal(h.counts, torch.histc(want, count, lo, hi).long())
    lo32, hi32 = float(np.float32(lo)), float(np.float32(hi))
    assert (h.below, h.above) == (int((want < lo32).sum()), int((want > hi32).sum()))


@pytest.mark.parametrize("many", [False, True], ids=["one block", "many blocks"])
@pytest.mark.parametrize("case", [dict(), dict(masked=True), dict(masked=True, nan_pad=True),
                                  dict(offset=0.03, noise=1e-4, masked=True), dict(tail=0.02, noise=0.05)],
                         ids=["plain", "mask", "nan padding", "offset", "heavy tail"])
def test_compare_counts_quantiles_and_histogram_are_exact(case, many):
    train, infer, mask = _pair(1, **case)
    with _blocks(many):
        r = compare(train, infer, mask=mask)
    m, ev = r.metrics, r.evidence
    x = _real(infer - train, mask)  # float32, as the inputs
    n = x.numel()
    assert m["n_tokens"] == n
    assert m["n_ratio_outside"] == int((x.abs() > math.log(2.0)).sum())
    s = x.sort().values
    for q in QUANTILES:  # rho_(k) = exp(-x_(n + 1 - k)): the selected float32 value itself
        assert m[f"ratio_p{quantile_name(q)}"] == math.exp(-s[n - nearest_rank(q, n)].item()), q
    h = ev["log_ratio_histogram"]
    lo, hi = h["edges"][0], h["edges"][-1]
    assert h["counts"] == torch.histc(x, 64, lo, hi).long().tolist()
    assert (h["below"], h["above"]) == (int((x < lo).sum()), int((x > hi).sum()))
    bucket = (_real(infer, mask) * (-2.0 / LN10)).floor().clamp(0, 9).long()
    counts = torch.bincount(bucket, minlength=10)
    assert [row["n"] for row in ev["by_probability"]] == [c for c in counts.tolist() if c]
    cols = (torch.ones_like(train, dtype=torch.bool) if mask is None else mask).sum(0)
    assert sum(row["n"] for row in ev["by_position"]) == n
    assert [row["n"] for row in ev["by_position"]] == [int(cols[row["start"]:row["end"]].sum())
                                                       for row in ev["by_position"]]


@pytest.mark.parametrize("many", [False, True], ids=["one block", "many blocks"])
@pytest.mark.parametrize("case", [dict(), dict(masked=True, nan_pad=True), dict(offset=0.03, noise=1e-4),
                                  dict(noise=1e-7, masked=True), dict(tail=0.02, noise=0.05)],
                         ids=["plain", "nan padding", "offset", "tiny", "heavy tail"])
def test_compare_sums_match_float64_definitions(case, many):
    """Tolerances: relative 1e-6 for mean, std and the first-order sums (float32 data summed in
    blocks into float64); 1e-4 for k3, whose float32 terms cancel; skewness and excess
    kurtosis within 1e-4 (absolute, they are O(1)); probabilities 1e-6."""
    train, infer, mask = _pair(2, **case)
    with _blocks(many):
        m = compare(train, infer, mask=mask).metrics
    x = _real(infer - train, mask).double()
    pt, pi = _real(train, mask).double().exp(), _real(infer, mask).double().exp()
    rho = torch.exp(-x)
    d = x - x.mean()
    m2, m3, m4 = (d ** 2).mean().item(), (d ** 3).mean().item(), (d ** 4).mean().item()
    close = dict(rel=1e-6, abs=1e-15)
    assert m["k1_kl"] == pytest.approx(x.mean().item(), rel=1e-6, abs=1e-12)
    assert m["std_log_ratio"] == pytest.approx(math.sqrt(m2), **close)
    assert m["mean_abs_log_ratio"] == pytest.approx(x.abs().mean().item(), **close)
    assert m["k3_kl"] == pytest.approx((rho - 1 - torch.log(rho)).mean().item(), rel=1e-4, abs=1e-15)
    assert m["chi2_token"] == pytest.approx((rho ** 2).mean().item() - 1, rel=1e-5, abs=1e-12)
    assert m["mean_abs_prob_diff"] == pytest.approx((pi - pt).abs().mean().item(), rel=1e-5, abs=1e-12)
    assert m["max_abs_prob_diff"] == pytest.approx((pi - pt).abs().max().item(), rel=1e-5, abs=1e-12)
    if m2 > 1e-12:
        assert m["skewness"] == pytest.approx(m3 / m2 ** 1.5, abs=1e-4)
        assert m["excess_kurtosis"] == pytest.approx(m4 / m2 ** 2 - 3, abs=1e-4 * (1 + abs(m4 / m2 ** 2)))
    assert m["prob_pearson"] == pytest.approx(torch.corrcoef(torch.stack([pt, pi]))[0, 1].item(), abs=1e-6)


@pytest.mark.parametrize("many", [False, True], ids=["one block", "many blocks"])
@pytest.mark.parametrize("masked", [False, True])
def test_monitor_histograms_are_torch_histc_of_the_real_tokens(many, masked):
    mon = DriftMonitor()
    fine = torch.zeros(FINE[2], dtype=torch.long)
    coarse = torch.zeros(COARSE[2], dtype=torch.long)
    low = 0
    with _blocks(many):
        for step, noise in enumerate((0.01, 0.03, 3.0)):
            train, infer, mask = _pair(10 + step, noise=noise, masked=masked, nan_pad=masked)
            mon.update(train, infer, mask)
            a = _real(train - infer, mask)  # histc over a = -x, flipped into x order (FINE, COARSE)
            fine += torch.histc(a, FINE[2], -FINE[1], -FINE[0]).long().flip(0)
            coarse += torch.histc(a, COARSE[2], -COARSE[1], -COARSE[0]).long().flip(0)
            low += int((a > -COARSE[0]).sum())
    assert torch.equal(mon.fine.long(), fine) and torch.equal(mon.coarse.long(), coarse)
    assert mon.sums["n_low"] == low


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 16), n=st.integers(1, 3000), masked=st.booleans(),
       width=st.sampled_from([1e-6, 1e-3, 0.1, 10.0]))
def test_order_statistics_equal_a_sort(seed, n, masked, width):
    """Any range (values below and above it included), ties, blocks with padding."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 0.05).round(decimals=3)  # ties
    real = torch.rand(n, generator=g) > 0.3 if masked else torch.ones(n, dtype=torch.bool)
    real[0] = True
    v = torch.where(real, x, 0.0)
    want = x[real].sort().values
    k = want.numel()
    ranks = sorted({1, k, (k + 1) // 2, max(1, k // 10), k - k // 7})
    lo = float(torch.randn(1, generator=g)) * 0.05
    bins = Bins(lo, lo + width, 64)
    blocks = [(v[i:i + 97], real[i:i + 97], int((~real[i:i + 97]).sum())) for i in range(0, n, 97)]
    hist = histogram(blocks, bins)
    got = order_statistics(lambda: blocks, ranks, hist)
    assert got == [want[r - 1].item() for r in ranks]


@settings(max_examples=30, deadline=None)
@given(parts=st.lists(st.integers(1, 400), min_size=1, max_size=6), seed=st.integers(0, 2 ** 16),
       offset=st.sampled_from([0.0, 0.5, 100.0]))
def test_moments_merge_equals_the_moments_of_the_whole(parts, seed, offset):
    """Central moments of blocks merged (Pebay's formulas) equal those of the concatenation, to
    float64 rounding (relative 1e-9), also far from zero."""
    g = torch.Generator().manual_seed(seed)
    chunks = [torch.randn(p, generator=g, dtype=torch.float64) * 0.01 + offset for p in parts]
    total = Moments()
    for c in chunks:
        d = c - c.mean()
        total.merge(Moments(c.numel(), c.mean().item(), (d ** 2).sum().item(), (d ** 3).sum().item(),
                            (d ** 4).sum().item()))
    x = torch.cat(chunks)
    d = x - x.mean()
    assert total.n == x.numel()
    assert total.mean == pytest.approx(x.mean().item(), rel=1e-12)
    for got, k in ((total.m2, 2), (total.m3, 3), (total.m4, 4)):
        assert got == pytest.approx((d ** k).sum().item(), rel=1e-9, abs=1e-9 * (d.abs() ** k).sum().item())


@pytest.mark.parametrize("scale", [1e-7, 1e-4, 5e-3, 0.3])
def test_kl_per_block_matches_the_whole_tensor_definition(scale):
    """k3 and reverse k3 summed per block (series below |a| < 1e-3, elementwise above, decided per
    block) against float64 over the whole tensor: relative 1e-4 (the earlier one-tensor code's
    tolerance); sum e and sum e^2 (series or from the k3 sum) relative 1e-5, sum e also within
    1e-6 of sum |a| (it can be ~0). Blocks of mixed scale take both branches."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(8, 500, generator=g) * scale
    a[::2] *= 1e-3  # every other block in the series branch
    k3 = rev = se = see = 0.0
    work = Work(500)
    for row in a:
        e = torch.expm1(row)
        s = [torch.dot(row ** p, torch.ones(500)).item() for p in (1, 2, 3, 4)]
        b3, br, be, bee = kl_block(row, e, row.abs().max().item(), s, work)
        k3, rev, se, see = k3 + b3, rev + br, se + be, see + bee
    a64 = a.double()
    rho = a64.exp()
    assert k3 == pytest.approx((rho - 1 - a64).sum().item(), rel=1e-4)
    assert rev == pytest.approx((1 - rho + rho * a64).sum().item(), rel=1e-4)
    assert se == pytest.approx(torch.expm1(a64).sum().item(), rel=1e-5, abs=1e-6 * a64.abs().sum().item())
    assert see == pytest.approx((torch.expm1(a64) ** 2).sum().item(), rel=1e-5)


def test_token_sums_rows_and_counts_are_exact_across_blocks():
    train, infer, mask = _pair(4, B=30, T=17, masked=True, nan_pad=True)
    layout = pair(train, infer, mask)
    with _blocks(True):
        s = token_sums(layout, 2.0, shape=True)
    assert torch.equal(s.row_n, mask.sum(1))
    x = torch.where(mask, infer - train, 0.0).double()
    assert torch.allclose(s.row_sum, x.sum(1), rtol=1e-6, atol=1e-9)
    assert torch.allclose(s.row_sq, (x * x).sum(1), rtol=1e-6, atol=1e-12)
    assert torch.equal(s.shape.col_n, mask.sum(0))
    assert (s.x_min, s.x_max) == (x[mask].min().item(), x[mask].max().item())


def test_bins_refuse_an_empty_range():
    with pytest.raises(ValueError, match=r"Bins\(lo=0.1, hi=0.1"):
        Bins(0.1, 0.1, 8)
