"""Fully sharded data parallelism on torch's FSDP2 (fully_shard).

FSDP2(param_dtype=None, reduce_dtype=None, reshard_after_forward=True,
      normalization="token-weighted")
    fully_shard on every direct child that holds parameters, then on the root, over a 1-D
    mesh of all ranks, with MixedPrecisionPolicy(param_dtype, reduce_dtype): the forward
    and backward run with the parameters cast to param_dtype, the gradients are
    reduce-scattered in reduce_dtype (None: param_dtype), and each rank keeps a Shard(0)
    slice, gathered here with DTensor.full_tensor(). FSDP2 averages over ranks, so pieces
    are weighted as for DDP (trainprobes.transforms.data_parallel).
The truth's weights are first rounded to param_dtype: computing with rounded weights is
the contract of mixed precision; what is judged is everything else (activations in
param_dtype, the reduction in reduce_dtype).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from trainprobes.reference.formats import get_format
from trainprobes.transforms.base import (
    RankContext,
    StepOutput,
    Transform,
    check_divisible,
    check_normalization,
    check_split_loss,
    piece_weights,
    reduce_loss,
    split,
    with_zeros,
    zero_grads,
)
from trainprobes.transforms.gather import full_gradients
from trainprobes.validation import check_bool

__all__ = ["FSDP2"]


def torch_dtype(name: str | None, what: str) -> torch.dtype | None:
    """A torch dtype from a format name ("bf16", "fp32", ...), naming the option."""
    if name is None:
        return None
    from trainprobes.errors import InvalidArgument
    try:
        fmt = get_format(name)
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgument(f"{what}={name!r}: {e}") from None
    if fmt.torch_dtype is None:
        raise InvalidArgument(f"{what}={name!r} has no torch dtype to compute in; use fp32, "
                              f"bf16, fp16 or fp64")
    return fmt.torch_dtype


@dataclass(frozen=True)
class FSDP2(Transform):
    name: ClassVar[str] = "fsdp2"
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    normalization: str = "token-weighted"

    def __post_init__(self):
        torch_dtype(self.param_dtype, "param_dtype")
        torch_dtype(self.reduce_dtype, "reduce_dtype")
        check_bool(self.reshard_after_forward, "reshard_after_forward")
        check_normalization(self.normalization)

    def dtypes(self) -> tuple:
        return tuple(d for d in (self.param_dtype, self.reduce_dtype or self.param_dtype) if d)

    def weight_dtype(self) -> torch.dtype | None:
        return torch_dtype(self.param_dtype, "param_dtype")

    def check(self, step, world, batch, model) -> None:
        check_divisible(batch, world, 1, "micro_batches")
        check_split_loss(step, batch, lambda b: split(b, world), 0, self.name, self.normalization)

    def setup(self, step, ctx: RankContext):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        policy = MixedPrecisionPolicy(param_dtype=self.weight_dtype(),
                                      reduce_dtype=torch_dtype(self.reduce_dtype, "reduce_dtype"))
        model = step.model().to(ctx.device)
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh, mp_policy=policy,
                            reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=self.reshard_after_forward)
        return model

    def run(self, model, step, batch, ctx: RankContext) -> StepOutput:
        pieces = split(batch, ctx.world)
        weights = piece_weights(step, batch, pieces, self.normalization)
        mine = pieces[ctx.rank]
        loss = step.loss(step.forward(model, mine), mine)
        (loss * (weights[ctx.rank] * ctx.world)).backward()
        grads = with_zeros(model, full_gradients(model), ctx)
        zero_grads(model)
        logged = (weights[ctx.rank] * loss.detach()).float()
        return StepOutput(reduce_loss(logged, ctx), grads)
