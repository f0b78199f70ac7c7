"""Pipeline parallelism on torch.distributed.pipelining.

Pipeline(schedule="1f1b", micro_batches=4, split=None, normalization="token-weighted")
    the model (an nn.Sequential: its forward is its children in order) is cut into stages
    of consecutive children, split[s] naming stage s's children (None: as even as the
    children allow). gpipe and 1f1b run one stage per rank (ScheduleGPipe, Schedule1F1B);
    interleaved-1f1b two per rank, stage s on rank s % world (ScheduleInterleaved1F1B).
    The schedule cuts the batch into micro_batches and, by default (scale_grads=True),
    divides the accumulated gradients by their number; each micro-batch's loss is
    multiplied by micro_batches * w_i (trainprobes.transforms.base) so the gradient is
    sum_i w_i grad(loss_i). The loss function gets the micro-batch's sample indices as
    its target and reads their rows of the batch. Each rank returns its stages' gradients;
    the last stage's rank the loss.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.transforms.base import (
    RankContext,
    StepOutput,
    Transform,
    check_divisible,
    check_normalization,
    check_parts,
    check_split_loss,
    piece_weights,
    split,
    with_zeros,
    zero_grads,
)
from trainprobes.transforms.step import rows, samples
from trainprobes.validation import check_choice

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
__all__ = ["Pipeline", "SCHEDULES", "stages"]


def stages(children: list, count: int, split_: tuple | None) -> list:
    """Children per stage: split_ checked to cover the children once, in order; or even."""
    if split_ is None:
        if len(children) < count:
            raise InvalidArgument(f"the model has {len(children)} children {children}, too few for "
                                  f"{count} pipeline stages")
        bounds = [round(i * len(children) / count) for i in range(count + 1)]
        return [children[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    parts = [list(s) for s in split_]
    if len(parts) != count:
        raise InvalidArgument(f"split={split_!r} names {len(parts)} stages; this schedule on this "
                              f"world runs {count}")
    flat = [c for p in parts for c in p]
    if any(not p for p in parts) or flat != children:
        missing = [c for c in children if c not in flat]
        extra = [c for c in flat if c not in children]
        raise InvalidArgument(f"split={split_!r} does not cover the model's children {children} "
                              f"once each, in order (missing {missing}, unknown {extra}, or "
                              f"repeated/out of order/empty stages)")
    return parts


@dataclass(frozen=True)
class Pipeline(Transform):
    name: ClassVar[str] = "pp"
    schedule: str = "1f1b"
    micro_batches: int = 4
    split: tuple | None = None
    normalization: str = "token-weighted"

    def __post_init__(self):
        check_choice(self.schedule, "schedule", SCHEDULES)
        check_parts(self.micro_batches, "micro_batches")
        check_normalization(self.normalization)
        if self.split is not None:
            if isinstance(self.split, (str, bytes)) or not all(
                    isinstance(s, (list, tuple)) for s in self.split):
                raise InvalidArgument(f"split={self.split!r} must list each stage's child names, "
                                      f"e.g. [['0', '1'], ['2', '3']]")
            object.__setattr__(self, "split", tuple(tuple(str(c) for c in s) for s in self.split))

    @property
    def per_rank(self) -> int:
        return 2 if self.schedule == "interleaved-1f1b" else 1

    def check(self, step, world, batch, model) -> None:
        if step.call is not None:
            raise InvalidArgument("Pipeline feeds batch[input_key] to its first stage; a step with "
                                  "call(model, batch) needs your own pipeline step (UserStep)")
        if not isinstance(model, torch.nn.Sequential):
            raise InvalidArgument(f"Pipeline cuts an nn.Sequential into stages of its children; the "
                                  f"model is a {type(model).__name__} (wrap its layers in one, or "
                                  f"probe your own pipeline with Custom(fn))")
        stages([n for n, _ in model.named_children()], world * self.per_rank, self.split)
        check_divisible(batch, 1, self.micro_batches, "micro_batches")
        check_split_loss(step, batch, lambda b: split(b, self.micro_batches), 0, self.name,
                         self.normalization)
        if self.per_rank > 1 and self.micro_batches % world:
            raise InvalidArgument(f"micro_batches={self.micro_batches} with schedule "
                                  f"'interleaved-1f1b' must be a multiple of world={world}")

    def setup(self, step, ctx: RankContext):
        from torch.distributed import pipelining as pp
        model = step.model().to(ctx.device)
        count = ctx.world * self.per_rank
        plan = stages([n for n, _ in model.named_children()], count, self.split)
        ids = [s for s in range(count) if s % ctx.world == ctx.rank]
        built = [pp.PipelineStage(torch.nn.Sequential(OrderedDict((c, getattr(model, c)) for c in plan[s])),
                                  s, count, ctx.device) for s in ids]
        state = {"model": model, "first": 0 in ids, "last": count - 1 in ids, "batch": None,
                 "weights": None, "children": {c for s in ids for c in plan[s]}}

        def loss_fn(output, index):
            # the micro-batch's sample indices (the schedule split them like the input)
            piece = rows(state["batch"], index)
            i = int(index[0]) // index.numel()
            return step.loss(output, piece) * (state["weights"][i] * self.micro_batches)

        cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
               "interleaved-1f1b": pp.ScheduleInterleaved1F1B}[self.schedule]
        state["schedule"] = cls(built if self.per_rank > 1 else built[0],
                                n_microbatches=self.micro_batches, loss_fn=loss_fn)
        return state

    def run(self, state, step, batch, ctx: RankContext) -> StepOutput:
        pieces = split(batch, self.micro_batches)
        state["batch"], state["weights"] = batch, piece_weights(step, batch, pieces, self.normalization)
        n = samples(batch)
        losses = [] if state["last"] else None
        args = (batch[step.input_key],) if state["first"] else ()
        target = torch.arange(n, device=ctx.device) if state["last"] else None
        state["schedule"].step(*args, target=target, losses=losses)
        model = state["model"]
        grads = with_zeros(model, {k: p.grad.detach().clone() for k, p in model.named_parameters()
                                   if p.grad is not None}, ctx,
                           held=lambda k: k.split(".", 1)[0] in state["children"])
        zero_grads(model)
        loss = torch.stack([x.detach() for x in losses]).sum() / self.micro_batches if losses else None
        return StepOutput(loss, grads)
