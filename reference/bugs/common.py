"""What every zoo step shares: the step contract, data-parallel pieces, reductions.

A zoo step is a custom step for trainprobes.transforms.Custom, run on every rank inside an
initialised process group:

    step(model, batch, ctx) -> {"loss": tensor or None, "grads": {name: full gradient}}

model is the factory's model on ctx.device; batch is the whole global batch (every rank
draws it from the trial's seed); ctx has rank, world and device. A rank returns the
gradients it holds in full (replicated ones on every rank that holds them, a pipeline
stage's on its rank) and the loss it would log.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def piece(batch: dict, index: int, parts: int) -> dict:
    """The index-th of `parts` equal slices of the documents (rows) of a batch."""
    n = next(iter(batch.values())).shape[0]
    if n % parts:
        raise ValueError(f"{n} documents do not split into {parts} equal pieces")
    size = n // parts
    return {k: v[index * size:(index + 1) * size] for k, v in batch.items()}


def positions(batch: dict, index: int, parts: int) -> dict:
    """The index-th of `parts` equal spans of token positions (context/sequence parallel)."""
    T = batch["mask"].shape[1]
    if T % parts:
        raise ValueError(f"{T} positions do not split into {parts} equal spans")
    size = T // parts
    return {k: v[:, index * size:(index + 1) * size] for k, v in batch.items()}


def grads(model: torch.nn.Module, prefix: str = "") -> dict:
    """{name: .grad} of the parameters that received one (detached copies)."""
    return {prefix + n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def all_reduce_grads(params, op=dist.ReduceOp.SUM) -> None:
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=op)


def reduced(value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """value summed (or op) over every rank, without touching autograd."""
    out = value.detach().clone()
    dist.all_reduce(out, op=op)
    return out


def output(loss, model) -> dict:
    return {"loss": None if loss is None else loss.detach(), "grads": grads(model)}
