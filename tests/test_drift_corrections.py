"""trainprobes.drift.corrections: truncated and masked IS at token, sequence and geometric level."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.drift import masked_is, truncated_is


def _pair(seed, B=6, T=40, noise=0.4):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(B, T, generator=g) * 4
    return train, (train + torch.randn(B, T, generator=g) * noise).clamp(max=0)


def _ess(w):
    w = w.double()
    return (w.sum() ** 2 / (w.numel() * (w * w).sum())).item()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2 ** 16), cap=st.sampled_from([1.5, 2.0, 5.0]))
def test_token_truncation_is_min_rho_cap(seed, cap):
    t, i = _pair(seed)
    c = truncated_is(t, i, cap=cap)
    rho = torch.exp(t - i)
    assert torch.allclose(c.weights, rho.clamp(max=cap), rtol=1e-6)
    assert c.frac_clipped == pytest.approx((rho > cap).double().mean().item())
    assert c.ess == pytest.approx(_ess(rho.clamp(max=cap)), rel=1e-6)
    assert c.weights.max() <= cap * (1 + 1e-6)


def test_sequence_level_product_does_not_overflow_and_broadcasts():
    t, i = _pair(1, T=400, noise=2.0)  # sum of log-ratios far beyond float range
    c = truncated_is(t, i, cap=3.0, level="sequence")
    assert torch.isfinite(c.weights).all()
    seq = torch.exp((t - i).double().sum(1)).clamp(max=3.0)
    assert torch.allclose(c.weights, seq[:, None].float().expand_as(t))
    assert c.n_units == 6


def test_geometric_mean_removes_length_dependence():
    # per-token ratio 1.1: the sequence ratio explodes with length, the geometric one does not
    for T in (10, 100):
        t = torch.full((2, T), -1.0)
        i = t - math.log(1.1)
        seq = truncated_is(t, i, cap=1e9, level="sequence")
        geo = truncated_is(t, i, cap=1e9, level="geometric")
        assert seq.weights[0, 0].item() == pytest.approx(1.1 ** T, rel=1e-4)
        assert geo.weights[0, 0].item() == pytest.approx(1.1, rel=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_masked_keeps_only_the_band(level):
    t, i = _pair(2, noise=0.5)
    c = masked_is(t, i, low=0.5, high=2.0, level=level)
    kept = c.weights[c.mask]
    assert ((kept >= 0.5 - 1e-6) & (kept <= 2.0 + 1e-6)).all()
    assert (c.weights[~c.mask] == 0).all()
    units = t.numel() if level == "token" else t.shape[0]
    assert c.n_units == units
    if level == "token":
        rho = torch.exp(t - i)
        assert c.frac_masked == pytest.approx(((rho < 0.5) | (rho > 2)).double().mean().item())


def test_input_mask_is_respected():
    t, i = _pair(3)
    m = torch.zeros_like(t, dtype=torch.bool)
    m[:, :5] = True
    c = truncated_is(t, i, m, cap=2.0)
    assert c.n_units == 30 and (c.weights[~m] == 0).all()


@pytest.mark.parametrize("call, match", [
    (lambda t, i: truncated_is(t, i, cap=-1), "cap=-1"),
    (lambda t, i: masked_is(t, i, low=2, high=1), "low=2, high=1"),
    (lambda t, i: truncated_is(t.reshape(-1), i.reshape(-1), level="sequence"), "needs \\[B, T\\]"),
    (lambda t, i: truncated_is(t, i, level="batch"), "level='batch'"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(*_pair(4))
