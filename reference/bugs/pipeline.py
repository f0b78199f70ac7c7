"""Pipeline-parallel bugs on two stages (GPipe order), each beside its fixed twin.

The model is data.mlp(): stage 0 = children 0-1 (Linear, GELU) on rank 0, stage 1 = child 2
(Linear) and the loss on rank 1; activations and their gradients travel by send/recv.

repeated_scaling (deepspeedai/DeepSpeed PR #8154, issue #8152): every stage's output hook
  divides the incoming gradient by gradient_accumulation_steps; the last stage does so
  correctly, and each earlier stage divides the already-scaled gradient again, so stage s
  (counted from the last, 0) gets 1/GAS^(s+1). With 2 stages and GAS = 4 the first stage's
  gradients are 1/4 of the reference. Fixed: scale once, at the last stage.
stale_weights (PipeDream-style asynchronous pipelining; a delay injector in marin PR #6423):
  stage 0 computes its forward and backward with the weights it had before the previous
  optimizer step, w + lr * g_prev (weight stashing keeps the two passes consistent, but
  old): the gradient belongs to other weights. Away from a stationary point consecutive
  gradients correlate, so the difference has a consistent sign over batches. Fixed: a
  synchronous pipeline (flush before the update), current weights.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from trainprobes.reference.bugs.common import output, piece
from trainprobes.reference.bugs.data import loss

GAS = 4
LR = 0.2


def gpipe(model, batch, ctx, micro: int, scale_twice: bool = False):
    """One GPipe step: every forward, then every backward; returns the mean micro-batch
    loss on the last stage (None on the first). Each micro-batch loss is divided by
    `micro` at the last stage; scale_twice divides the gradient again at stage 0."""
    first, last = model[:2], model[2:]
    if ctx.rank == 0:
        acts = []
        for i in range(micro):
            h = first(piece(batch, i, micro)["input"])
            dist.send(h.detach().contiguous(), 1)
            acts.append(h)
        for h in acts:
            g = torch.empty_like(h)
            dist.recv(g, 1)
            h.backward(g / micro if scale_twice else g)
        return None
    rows, T = batch["input"].shape[0] // micro, batch["input"].shape[1]
    hs, losses = [], []
    for i in range(micro):
        h = torch.empty(rows, T, model[0].out_features, device=batch["input"].device)
        dist.recv(h, 0)
        h.requires_grad_()
        hs.append(h)
        losses.append(loss(last(h), piece(batch, i, micro)))
    for h, step_loss in zip(hs, losses):
        (step_loss / micro).backward()
        dist.send(h.grad.contiguous(), 0)
    return torch.stack([x.detach() for x in losses]).mean()


def repeated_scaling(model, batch, ctx, fixed: bool = False):
    return output(gpipe(model, batch, ctx, GAS, scale_twice=not fixed), model)


def stale_weights(model, batch, ctx, fixed: bool = False):
    if not fixed:
        previous = {"input": batch["prev_input"], "target": batch["prev_target"], "mask": batch["mask"]}
        gpipe(model, previous, ctx, 1)
        with torch.no_grad():
            for p in model[:2].parameters():  # only stage 0 lags; the last stage is current
                if p.grad is not None:
                    p.add_(LR * p.grad)       # undo the last SGD step: the older version
        model.zero_grad(set_to_none=True)
    return output(gpipe(model, batch, ctx, 1), model)
