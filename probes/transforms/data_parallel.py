"""Data parallelism on torch's DistributedDataParallel, with gradient accumulation.

DDP(hook=None | "fp16" | "bf16", normalization="token-weighted")
    each rank takes an equal share of the samples; DDP all-reduces the gradients (in
    buckets, averaging). hook="fp16" registers PyTorch's own
    default_hooks.fp16_compress_hook (cast to fp16, divide by the world size, all-reduce in
    fp16, cast back); hook="bf16" registers bf16_allreduce_hook below, the same arithmetic in
    bf16 (PyTorch's bf16_compress_hook refuses non-CUDA devices: "requires CUDA 11+ and
    NCCL 2.10+"; DDP checks hooks by that name, so ours has another).
Accumulation(micro_batches=k, normalization=..., hook=None)
    the same, each rank's share cut into k micro-batches run under no_sync() but the last.

Each piece's loss (rank r, micro-batch i) is multiplied by world * w_i before backward
(trainprobes.transforms.base: w_i from the normalisation; DDP's averaging divides the world
back out), so the gradient is sum_i w_i grad(loss_i); the logged loss sum_i w_i loss_i is
summed over ranks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from trainprobes.transforms.base import (
    RankContext,
    StepOutput,
    Transform,
    check_divisible,
    check_normalization,
    check_parts,
    check_split_loss,
    piece_weights,
    reduce_loss,
    split,
    with_zeros,
    zero_grads,
)
from trainprobes.validation import check_bool, check_choice

HOOKS = (None, "fp16", "bf16")
__all__ = ["DDP", "Accumulation", "bf16_allreduce_hook", "HOOKS"]


def bf16_allreduce_hook(process_group, bucket):
    """DDP communication hook: the bucket cast to bf16 and divided by the world size, summed
    in bf16 by all_reduce, and copied back into the bucket (PyTorch's fp16_compress_hook
    with bf16; torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py)."""
    import torch.distributed as dist
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer
    return fut.then(decompress)


def _forward(ddp, step, piece, ctx: RankContext):
    """DDP's forward; its refusal of parameters the loss did not reach (raised on the next
    forward, its advice on a line the launcher does not show) named as an option to set."""
    try:
        return step.forward(ddp, piece)
    except RuntimeError as e:
        if "find_unused_parameters" not in str(e):
            raise
        from trainprobes.errors import InvalidArgument
        raise InvalidArgument(f"DDP found parameters that received no gradient on rank {ctx.rank} (the "
                              f"loss does not reach them): pass find_unused_parameters=True "
                              f"(ddp:find_unused_parameters=true), or freeze them "
                              f"(requires_grad=False)") from e


@dataclass(frozen=True)
class DDP(Transform):
    name: ClassVar[str] = "ddp"
    hook: str | None = None
    normalization: str = "token-weighted"
    find_unused_parameters: bool = False

    @property
    def parts(self) -> int:
        return 1

    def __post_init__(self):
        check_choice(self.hook, "hook", HOOKS, hint="the gradient all-reduce's compression")
        check_normalization(self.normalization)
        check_bool(self.find_unused_parameters, "find_unused_parameters")

    def dtypes(self) -> tuple:
        return (self.hook,) if self.hook else ()

    def check(self, step, world, batch, model) -> None:
        check_divisible(batch, world, self.parts, "micro_batches")
        check_split_loss(step, batch, lambda b: split(b, world * self.parts), 0, self.name,
                         self.normalization)

    def setup(self, step, ctx: RankContext):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel
        model = step.model().to(ctx.device)
        ddp = DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters)
        if self.hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.hook == "bf16":
            ddp.register_comm_hook(None, bf16_allreduce_hook)
        return ddp

    def run(self, ddp, step, batch, ctx: RankContext) -> StepOutput:
        pieces = split(batch, ctx.world * self.parts)
        weights = piece_weights(step, batch, pieces, self.normalization)
        mine = range(ctx.rank * self.parts, (ctx.rank + 1) * self.parts)
        logged = 0.0
        for j, i in enumerate(mine):
            sync = ddp.no_sync() if j < self.parts - 1 else contextlib.nullcontext()
            with sync:
                loss = step.loss(_forward(ddp, step, pieces[i], ctx), pieces[i])
                (loss * (weights[i] * ctx.world)).backward()
            logged = logged + weights[i] * loss.detach()
        grads = with_zeros(ddp.module, {n: p.grad.detach().clone() for n, p in
                                        ddp.module.named_parameters() if p.grad is not None}, ctx)
        zero_grads(ddp.module)
        return StepOutput(reduce_loss(torch.as_tensor(logged, device=ctx.device), ctx), grads)


@dataclass(frozen=True)
class Accumulation(DDP):
    name: ClassVar[str] = "accumulation"
    micro_batches: int = 2

    @property
    def parts(self) -> int:
        return self.micro_batches

    def __post_init__(self):
        super().__post_init__()
        check_parts(self.micro_batches, "micro_batches")
