"""trainprobes.causality.inputs.Perturbed: a packed batch holds exactly the copies a call
alone gets, each a fresh tensor."""
import pytest
import torch
from trainprobes.causality.inputs import Perturbed, replacements

G = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("x", [torch.randint(0, 50, (3, 16), generator=G),
                               torch.randn(2, 16, 5, generator=G), torch.randn(1, 16, 3, generator=G)])
@pytest.mark.parametrize("trials", [1, 3])
def test_batch_is_the_copies_alone_behind_the_head(x, trials):
    R = replacements(x, trials, 50 if not x.is_floating_point() else None, G)
    p = Perturbed(x, R)
    part = [(c, i % trials) for i, c in enumerate([14, 0, 7, 3, 7])]
    head = [x, R[0]]
    got = p.batch(part, head)
    want = torch.cat(head + [p(c, i) for c, i in part])
    assert got.dtype == x.dtype and torch.equal(got, want)
    for c, i in part:
        xc = p(c, i)
        assert torch.equal(xc[:, :c + 1], x[:, :c + 1]) and torch.equal(xc[:, c + 1:], R[i, :, c + 1:])
    assert p(3, 0) is not p(3, 0)  # fresh every time: a target may keep its input
