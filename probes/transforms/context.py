"""Context parallelism: every sequence cut into `world` spans of positions, attention over
the whole sequence through all-gathered keys and values (trainprobes.reference.
context_parallel: torch's own experimental context_parallel has no CPU kernel).

ContextParallel(normalization="token-weighted", seq_key=None, seq_dim=1)
    rank r takes span r of every batch tensor whose axis seq_dim has the sequence's length
    (that of batch[seq_key], default the input), runs the forward with
    F.scaled_dot_product_attention made context-parallel (causal or unmasked attention),
    weights its span's loss by its share of the loss units (token-weighted: the span's
    tokens over the batch's, counted by the step's tokens(); the loss and the token count
    are taken over the whole CP group, the two places the published bugs sit) and
    all-reduces the gradients over the group. The model must take positions from the batch
    (position ids are a batch tensor with a sequence axis, cut with the rest), not build
    them from its input's length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.transforms.base import (
    RankContext,
    StepOutput,
    Transform,
    check_normalization,
    check_split_loss,
    piece_weights,
    reduce_loss,
    zero_grads,
)
from trainprobes.validation import check_int

__all__ = ["ContextParallel"]


@dataclass(frozen=True)
class ContextParallel(Transform):
    name: ClassVar[str] = "cp"
    normalization: str = "token-weighted"
    seq_key: str | None = None
    seq_dim: int = 1

    def __post_init__(self):
        check_normalization(self.normalization)
        check_int(self.seq_dim, "seq_dim", min=1, hint="the sequence axis of the batch's tensors")

    def _length(self, step, batch) -> int:
        key = self.seq_key or step.input_key
        v = batch.get(key)
        if not isinstance(v, torch.Tensor) or v.dim() <= self.seq_dim:
            raise InvalidArgument(f"context parallelism cuts batch[{key!r}] along seq_dim={self.seq_dim}, "
                                  f"but it is {type(v).__name__ if v is None else tuple(v.shape)}: name "
                                  f"the batch tensor with a sequence axis (seq_key=)")
        return int(v.shape[self.seq_dim])

    def check(self, step, world, batch, model) -> None:
        n = self._length(step, batch)
        if n % world:
            raise InvalidArgument(f"the sequence has {n} positions, not divisible by world={world}: every "
                                  f"rank needs an equal span (a multiple of {world} positions)")
        from trainprobes.reference.context_parallel import span
        check_split_loss(step, batch, lambda b: [span(b, r, world, n, self.seq_dim) for r in range(world)],
                         self.seq_dim, self.name, self.normalization)

    def setup(self, step, ctx: RankContext):
        return step.model().to(ctx.device)

    def run(self, model, step, batch, ctx: RankContext) -> StepOutput:
        from trainprobes.reference.context_parallel import AllGatherAttention, span
        n = self._length(step, batch)
        spans = [span(batch, r, ctx.world, n, self.seq_dim) for r in range(ctx.world)]
        weight = piece_weights(step, batch, spans, self.normalization)[ctx.rank]
        mine = spans[ctx.rank]
        with AllGatherAttention(ctx.rank, ctx.world):
            out = step.forward(model, mine)
            # every rank runs the backward (its attention's collectives pair with its peers'),
            # a span without loss units included
            loss = step.loss(out, mine) if weight else None
            term = loss * weight if weight else _zero(out)
            term.backward()
        grads = {k: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for k, p in model.named_parameters() if p.requires_grad}
        import torch.distributed as dist
        for g in grads.values():  # every rank, every parameter, in the model's order
            dist.all_reduce(g)
        zero_grads(model)
        logged = torch.zeros((), device=ctx.device) if loss is None else loss.detach() * weight
        return StepOutput(reduce_loss(logged, ctx), grads)


def _zero(out):
    """0 through the whole graph of `out` (a tensor or a tuple of them)."""
    parts = out if isinstance(out, (tuple, list)) else (out,)
    return sum(t.sum() * 0.0 for t in parts if isinstance(t, torch.Tensor))
