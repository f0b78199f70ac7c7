"""trainprobes.reference.bugs: the zoo's arithmetic, without ranks (the probe's verdicts on
it are in test_transforms_zoo.py)."""
import pytest
import torch
from trainprobes.reference.bugs import ZOO, bug, data
from trainprobes.reference.bugs.accumulation import LAYOUT, PIECES
from trainprobes.reference.bugs.parallel import LOCAL_LAYOUT, LOCAL_PIECES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_entry_cites_its_source_and_knows_its_verdict():
    assert len(ZOO) == 13 and len({b.name for b in ZOO}) == 13
    for b in ZOO:
        assert b.url.startswith("https://github.com/") and ("#" in b.source or "PipeDream" in b.source)
        assert b.expected in ("biased", "inconsistent") and b.where and b.world == 2
    assert bug("sp_layernorm").expected == "inconsistent"
    with pytest.raises(KeyError, match="no zoo entry 'nope'"):
        bug("nope")


def test_normalisation_ratios_by_hand():
    # mean of 4 micro-batch means: difficulties 2, 1, 2, 1 -> 1.5; token mean (4*2*2 + 4*8*1)/40 = 1.2
    assert data.normalisation_ratio(LAYOUT, PIECES, [0.25] * 4) == pytest.approx(1.5 / 1.2)
    sq = 0.05 ** 2  # the loss: a^2 + noise^2 per token
    assert data.normalisation_ratio(LAYOUT, PIECES, [0.25] * 4, loss=True) == \
        pytest.approx(((4 + sq) + (1 + sq)) / 2 / ((8 * (4 + sq) + 32 * (1 + sq)) / 40))
    # ranks with local counts: (3 + 1) / 2 = 2 against (8*3 + 24*1) / 32 = 1.5
    assert data.normalisation_ratio(LOCAL_LAYOUT, LOCAL_PIECES, [0.5, 0.5]) == pytest.approx(4 / 3)
    # token-weighted pieces (n_i / N) give the truth whatever the layout
    n = LAYOUT.mask().sum(1).double()
    weights = [float(n[p].sum() / n.sum()) for p in PIECES]
    assert data.normalisation_ratio(LAYOUT, PIECES, weights) == pytest.approx(1.0, abs=1e-15)


def test_batches_are_seeded_and_short_documents_are_harder():
    b1 = data.documents(LAYOUT, torch.Generator().manual_seed(3))
    b2 = data.documents(LAYOUT, torch.Generator().manual_seed(3))
    assert all(torch.equal(b1[k], b2[k]) for k in b1)
    assert b1["mask"].sum(1).tolist() == list(LAYOUT.lengths)
    size = b1["target"].abs().mean((1, 2))
    assert size[0] > 1.5 * size[2]  # length 2, difficulty 2 vs length 8, difficulty 1
    with pytest.raises(ValueError, match="lengths"):
        data.Layout((0, 2), (1.0, 1.0), 4)


def test_the_loss_is_the_token_mean_over_real_tokens():
    b = data.documents(data.Layout((1, 2), (1.0, 1.0), 3), torch.Generator().manual_seed(0))
    out = torch.zeros(2, 3, data.O)
    by_hand = sum((b["target"][i, t] ** 2).sum() / 2 for i, t in ((0, 0), (1, 0), (1, 1))) / 3
    assert data.loss(out, b) == pytest.approx(by_hand.item())


def test_zero_initialised_models_make_gradients_analytic():
    m = data.linear_model()
    assert not m.weight.any()
    b = data.documents(data.full(2, 4), torch.Generator().manual_seed(0))
    data.loss(m(b["input"]), b).backward()
    expected = -(b["target"].reshape(-1, data.O).T @ b["input"].reshape(-1, data.D)) / 8
    assert torch.allclose(m.weight.grad, expected)
