"""The zoo's data, models and the single-device loss: documents of uneven length.

A batch holds B documents (rows) of up to T token positions:
    input  [B, T, D]  token features, x = e + noise * n  (e the all-halves vector)
    target [B, T, O]  y = a_b * c + noise * n            (c = (1, -1, 1, ...))
    mask   [B, T]     True on the first L_b positions (the document's real tokens)
and the loss of a batch is the token mean of the squared error over real tokens,
    loss = sum_{b,t} mask * |f(x) - y|^2 / 2  /  sum mask,
the single-device definition every transform must reproduce. Document b's difficulty a_b
is a function of its length L_b (`Layout`): short documents are the hard ones, as in
language modelling, where early positions carry the highest loss. That correlation is what
makes a normalisation that weights documents by anything but their token count biased (a
mean of per-piece means with i.i.d. tokens is unbiased, only noisier).

Zero-initialised linear models (`linear_model`) make per-token gradients analytic: with
W = 0 the gradient of token (b, t) is -y x^T, whose expectation is -a_b c e^T. A normalisation
that gives piece i (a set of documents) the weight w_i instead of n_i / N then scales the
gradient by (sum_i w_i abar_i) / (sum_b L_b a_b / N), abar_i the token-weighted mean
difficulty of piece i (`normalisation_ratio`); the loss (per token (a_b^2 + noise^2) O / 2 in
expectation) by the same expression with a_b^2 + noise^2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

D, O = 4, 2          # token features, outputs
NOISE = 0.05         # small next to e and c, so per-trial scales sit near their expectation


@dataclass(frozen=True)
class Layout:
    """Per-document lengths and difficulties of a batch (fixed across trials)."""

    lengths: tuple
    difficulty: tuple
    positions: int

    def __post_init__(self):
        if len(self.lengths) != len(self.difficulty):
            raise ValueError(f"lengths={self.lengths!r} and difficulty={self.difficulty!r} "
                             "must have one entry per document")
        if not all(0 < n <= self.positions for n in self.lengths):
            raise ValueError(f"lengths={self.lengths!r} must lie in [1, {self.positions}]")

    @property
    def documents(self) -> int:
        return len(self.lengths)

    def mask(self) -> torch.Tensor:
        return torch.arange(self.positions)[None, :] < torch.tensor(self.lengths)[:, None]


def full(documents: int, positions: int) -> Layout:
    """Every position real, every document of difficulty 1."""
    return Layout((positions,) * documents, (1.0,) * documents, positions)


def documents(layout: Layout, generator: torch.Generator, *, with_previous: bool = False) -> dict:
    """One batch of the layout (module docstring). with_previous adds prev_input and
    prev_target: the batch of the step before, for re-creations of stale weights."""
    B, T = layout.documents, layout.positions
    e = torch.full((D,), 0.5)
    c = torch.tensor([(-1.0) ** i for i in range(O)])
    a = torch.tensor(layout.difficulty, dtype=torch.float32)

    def draw():
        x = e + NOISE * torch.randn(B, T, D, generator=generator)
        y = a[:, None, None] * c + NOISE * torch.randn(B, T, O, generator=generator)
        return x, y
    x, y = draw()
    batch = {"input": x, "target": y, "mask": layout.mask()}
    if with_previous:
        batch["prev_input"], batch["prev_target"] = draw()
    return batch


def token_loss_sum(output: torch.Tensor, batch: dict) -> torch.Tensor:
    """sum over real tokens of |output - target|^2 / 2 (the numerator of the loss)."""
    err = (output - batch["target"].to(output.dtype)).pow(2).sum(-1) / 2
    return (err * batch["mask"].to(err.dtype)).sum()


def tokens(batch: dict) -> torch.Tensor:
    return batch["mask"].sum()


def loss(output: torch.Tensor, batch: dict) -> torch.Tensor:
    """The single-device loss: token mean of the squared error over real tokens."""
    return token_loss_sum(output, batch) / tokens(batch)


def linear_model() -> torch.nn.Module:
    """Linear(D, O) without bias, all weights zero (analytic per-token gradients)."""
    m = torch.nn.Linear(D, O, bias=False)
    with torch.no_grad():
        m.weight.zero_()
    return m


def mlp(hidden: int = 8, seed: int = 0, norm: bool = False) -> torch.nn.Sequential:
    """[LayerNorm(D)] -> Linear(D, hidden) -> GELU -> Linear(hidden, O), weights from `seed`."""
    g = torch.Generator().manual_seed(seed)
    layers = [torch.nn.LayerNorm(D)] if norm else []
    layers += [torch.nn.Linear(D, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, O)]
    m = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def normalisation_ratio(layout: Layout, pieces: list, weights: list, loss: bool = False) -> float:
    """Expected gradient (or, with loss=True, loss) of a normalisation that gives piece i (a
    list of document indices) the weight weights[i] on its token mean, over the
    single-device token mean. Per token of document b the expectation is a_b c e^T for the
    gradient of a zero-initialised linear model and (a_b^2 + NOISE^2) O / 2 for the loss."""
    L = torch.tensor(layout.lengths, dtype=torch.float64)
    a = torch.tensor(layout.difficulty, dtype=torch.float64)
    v = a * a + NOISE ** 2 if loss else a
    truth = (L * v).sum() / L.sum()
    bug = sum(w * (L[p] * v[p]).sum() / L[p].sum() for p, w in zip(pieces, weights))
    return float(bug / truth)
