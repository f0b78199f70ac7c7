"""trainprobes.drift.inputs: the Layout of a pair, counts per row and column, block grids."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.drift.inputs import LAG1_Z, MIN_BLOCKS, column_counts, pair, row_counts
from trainprobes.errors import InvalidArgument, InvalidType


@settings(max_examples=30, deadline=None)
@given(G=st.integers(1, 600), T=st.integers(1, 1100), p=st.sampled_from([0.0, 0.3, 1.0]),
       seed=st.integers(0, 2 ** 16))
def test_row_and_column_counts_are_exact(G, T, p, seed):
    """Spans of 255 summed in uint8 cannot overflow; any shape, all true or all false."""
    m = torch.rand(G, T, generator=torch.Generator().manual_seed(seed)) >= p
    assert torch.equal(row_counts(m).long(), m.sum(1))
    assert torch.equal(column_counts(m).long(), m.sum(0))


def test_layout_drops_an_all_true_mask_and_says_whether_padding_is_valid():
    t = -torch.rand(4, 6)
    lay = pair(t, t, torch.ones(4, 6, dtype=torch.bool))
    assert lay.mask is None and lay.n_tokens == 24 and lay.finite_pad and lay.unit == "sequence"
    m = torch.ones(4, 6, dtype=torch.bool)
    m[:, 4:] = False
    bad = t.clone()
    bad[:, 4:] = float("nan")
    lay = pair(t, bad, m)
    assert lay.n_tokens == 16 and not lay.finite_pad and lay.mask is m


def _old_block_count(train, infer, n, blocks=256):
    """The earlier grid loop, kept as the reference: rebuild the grid at every halving."""
    G = min(blocks, n)
    while True:
        T = -(-n // G)
        G = -(-n // T)
        pad = G * T - n
        tr, inf = (torch.cat([v, torch.zeros(pad)]).view(G, T) for v in (train, infer))
        m = torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)]).view(G, T)
        x = torch.where(m, inf.double() - tr.double(), 0.0)
        k = m.sum(1)
        means = x.sum(1)[k > 0] / k[k > 0]
        g = means.numel()
        corr = False
        if g >= 2 * MIN_BLOCKS:
            d = means - means.mean()
            den = float(torch.dot(d, d))
            corr = den > 0 and float(torch.dot(d[:-1], d[1:])) / den * math.sqrt(g) > LAG1_Z
        if G // 2 < MIN_BLOCKS or not corr:
            return G
        G //= 2


@pytest.mark.parametrize("B,T,seq", [(32, 48, 0.01), (16, 512, 0.01), (64, 64, 0.0), (7, 1001, 0.02)])
def test_flat_stream_gets_the_block_count_of_the_rebuild_loop(B, T, seq):
    g = torch.Generator().manual_seed(B)
    train = -torch.rand(B * T, generator=g) * 3
    infer = (train + 0.003 * torch.randn(B * T, generator=g)
             + (seq * torch.randn(B, 1, generator=g)).expand(B, T).reshape(-1)).clamp(max=0)
    lay = pair(train, infer)
    assert lay.unit == "block" and lay.train.shape[0] == _old_block_count(train, infer, B * T)


@pytest.mark.parametrize("args, error, match", [
    ((torch.zeros(3), torch.zeros(4)), InvalidArgument, r"infer_logprobs has shape \(4,\)"),
    (("x", torch.zeros(3)), InvalidType, "train_logprobs must be a tensor"),
    ((torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool)), InvalidArgument, "selects no tokens"),
])
def test_errors_are_trainprobes_errors_that_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        pair(*args)
