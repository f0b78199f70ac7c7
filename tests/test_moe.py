"""The tiny MoE block: its mask, its routing, its fp64 twin, its inputs."""
import pytest
import torch
from trainprobes.reference.models.moe import MoEOutput, TinyMoEBlock, causal_block, off_by_one_block


def hidden(B=2, T=12, D=64, seed=0):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("off_by_one", [False, True])
def test_attention_mask(off_by_one):
    m = TinyMoEBlock(off_by_one=off_by_one).attention_mask(5)
    t, s = torch.meshgrid(torch.arange(5), torch.arange(5), indexing="ij")
    assert torch.equal(m, s <= t + int(off_by_one))


@pytest.mark.parametrize("fn, reach", [(causal_block, 0), (off_by_one_block, 1)])
@pytest.mark.parametrize("c", [0, 5, 10])
def test_a_change_after_c_reaches_back_exactly_reach_positions(fn, reach, c):
    x = hidden()
    y = x.clone()
    y[:, c + 1:] += 1.0
    moved = (fn(x).hidden != fn(y).hidden).any(-1).any(0)
    assert moved.nonzero().min().item() == c + 1 - reach


def test_output_fields_and_routing():
    out = causal_block(hidden())
    assert isinstance(out, MoEOutput)
    assert out.hidden.shape == (2, 12, 64) and out.expert_ids.shape == (2, 12, 2)
    assert torch.equal(out.expert_ids, out.router_probs.topk(2, -1).indices)
    assert torch.allclose(out.router_probs.sum(-1), torch.ones(2, 12))


def test_fp64_twin_holds_the_same_weights():
    x = hidden()
    a, b = causal_block(x), causal_block(x.double())
    assert b.hidden.dtype == torch.float64
    assert (a.hidden.double() - b.hidden).abs().max() < 1e-4
    blk32, blk64 = TinyMoEBlock(), TinyMoEBlock(dtype=torch.float64)
    assert torch.equal(blk32.router.double(), blk64.router)


def test_same_seed_same_block_other_seed_other_block():
    x = hidden()
    assert torch.equal(TinyMoEBlock(seed=3)(x).hidden, TinyMoEBlock(seed=3)(x).hidden)
    assert not torch.equal(TinyMoEBlock(seed=3)(x).hidden, TinyMoEBlock(seed=4)(x).hidden)


def test_token_ids():
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    assert causal_block(ids).hidden.shape == (2, 9, 64)


@pytest.mark.parametrize("block, x, exc, match", [
    (TinyMoEBlock(vocab=10), torch.randn(2, 4, 64), TypeError,
     r"x has dtype torch.float32, expected an integer tensor \(token ids \[B, T\]"),
    (TinyMoEBlock(vocab=10), torch.tensor([[1, 10]]), ValueError, r"token ids must be in \[0, 10\)"),
    (TinyMoEBlock(), torch.randn(2, 4, 32), ValueError,
     r"x has shape \(2, 4, 32\), expected \(\*, \*, 64\) \(hidden states \[B, T, 64\]\)"),
])
def test_bad_inputs_are_named(block, x, exc, match):
    with pytest.raises(exc, match=match):
        block(x)


def test_bad_construction():
    with pytest.raises(ValueError, match="divisible by n_heads=3"):
        TinyMoEBlock(d_model=64, n_heads=3)
    with pytest.raises(ValueError, match=r"k=9 must be an int in \[1, 8\] \(experts per token, n_experts=8\)"):
        TinyMoEBlock(k=9)
