"""The trainer's step as one device defines it, for the [[transforms]] audits here.

A TrainingStep is three callables: the model (the same initial weights on every call), a
batch drawn from a generator (every tensor with the sample axis first) and the loss of the
whole batch. trainprobes runs it once in fp64 on one process (the truth) and under each
transform on real ranks, and says whether the transform computes the same step.

The batch holds 8 documents of uneven length (2 to 8 real tokens of 8); short documents are
harder (their targets are larger), as early positions are in language modelling. The loss
is the token mean over real tokens, so a normalisation that averages per-micro-batch means
weighs the short documents too much.
"""
import torch
from trainprobes.transforms import TrainingStep

LENGTHS = (2, 2, 8, 8, 4, 4, 6, 6)
D, OUT = 8, 4


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every call
    return torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.Linear(D, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, OUT))


def batch(generator: torch.Generator) -> dict:
    lengths = torch.tensor(LENGTHS)
    mask = torch.arange(8)[None, :] < lengths[:, None]
    x = torch.randn(len(LENGTHS), 8, D, generator=generator)
    difficulty = (8.0 / lengths)[:, None, None]
    y = difficulty * (1.0 + 0.1 * torch.randn(len(LENGTHS), 8, OUT, generator=generator))
    return {"input": x, "target": y, "mask": mask}


def loss(output: torch.Tensor, batch: dict) -> torch.Tensor:
    err = (output - batch["target"]).pow(2).sum(-1) / 2
    mask = batch["mask"].to(err.dtype)
    return (err * mask).sum() / mask.sum()


def step() -> TrainingStep:
    return TrainingStep(model=model, batch=batch, loss=loss, name="trainer.step")
