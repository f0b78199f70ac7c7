"""A small step to try the transforms on: documents of uneven length, a LayerNorm MLP.

    trainprobes transforms --target trainprobes.transforms.demo:step --transform fsdp2

model: Sequential(LayerNorm(4), Linear(4, 8), GELU, Linear(8, 4), Linear(4, 2)), weights from
seed 0; batch: 8 documents of 8 positions with lengths 2..8 and difficulty 8 / length
(trainprobes.reference.bugs.data.documents); loss: the token mean of the squared error.
Plans that fit it: TP {"1": "colwise", "3": "rowwise"}; sequence parallel {"0": "sequence",
"1": "colwise-from-sequence", "3": "rowwise"}; pipelines of up to 5 stages.
"""
from __future__ import annotations

import functools

import torch
from trainprobes.reference.bugs import data
from trainprobes.transforms.step import TrainingStep

LENGTHS = (2, 2, 8, 8, 4, 4, 6, 6)
LAYOUT = data.Layout(LENGTHS, tuple(8.0 / n for n in LENGTHS), positions=8)
TP_PLAN = {"1": "colwise", "3": "rowwise"}
SP_PLAN = {"0": "sequence", "1": "colwise-from-sequence", "3": "rowwise"}

__all__ = ["step", "model", "TP_PLAN", "SP_PLAN"]


def model() -> torch.nn.Sequential:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.LayerNorm(data.D), torch.nn.Linear(data.D, 8), torch.nn.GELU(),
                            torch.nn.Linear(8, 4), torch.nn.Linear(4, data.O))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        m[0].weight.add_(1.0)  # a LayerNorm scale near 1
    return m


step = TrainingStep(model=model, batch=functools.partial(data.documents, LAYOUT), loss=data.loss,
                    tokens=data.tokens, name="demo")
