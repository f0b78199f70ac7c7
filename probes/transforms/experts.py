"""Expert parallelism: the experts of every MoE layer split over the ranks, tokens sent to
their expert's rank and back with all-to-all (trainprobes.reference.expert_parallel, on
torch.distributed.all_to_all_single; gloo runs it on CPU tensors, uneven splits included).

ExpertParallel(normalization="token-weighted")
    EP = DP: rank r takes an equal share of the samples and owns experts r*E/w .. of each
    MoE layer; a MoE layer is a module with `experts` (an nn.ModuleList, E a multiple of
    the world size), `route(x) -> [N] expert index` and `expert_outputs(x, index) -> [N,
    out]`, which its forward calls (trainprobes.reference.expert_parallel documents the
    protocol; reference.bugs.expert_parallel has a model that follows it). Each rank's
    loss is weighted by its share of the loss units, the dense gradients are all-reduced;
    an expert's gradient arrives whole on its owner through the all-to-all's backward and
    is returned from there alone.
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
    check_divisible,
    check_normalization,
    check_split_loss,
    piece_weights,
    reduce_loss,
    split,
    zero_grads,
)

__all__ = ["ExpertParallel", "moe_layers"]


def moe_layers(model: torch.nn.Module) -> dict:
    """{name: layer} of the modules that follow the MoE protocol (module docstring)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(getattr(m, "experts", None), torch.nn.ModuleList)
            and callable(getattr(m, "route", None)) and callable(getattr(m, "expert_outputs", None))}


@dataclass(frozen=True)
class ExpertParallel(Transform):
    name: ClassVar[str] = "ep"
    normalization: str = "token-weighted"

    def __post_init__(self):
        check_normalization(self.normalization)

    def check(self, step, world, batch, model) -> None:
        check_divisible(batch, world, 1, "parts")
        check_split_loss(step, batch, lambda b: split(b, world), 0, self.name, self.normalization)
        layers = moe_layers(model)
        if not layers:
            raise InvalidArgument(
                "expert parallelism found no MoE layer: it splits modules with `experts` (an "
                "nn.ModuleList), `route(x) -> expert index` and `expert_outputs(x, index)` "
                "(trainprobes.reference.expert_parallel)")
        odd = {n: len(m.experts) for n, m in layers.items() if len(m.experts) % world}
        if odd:
            raise InvalidArgument(f"MoE layers {odd} hold expert counts not divisible by world={world}: "
                                  f"every rank owns an equal number of experts")

    def setup(self, step, ctx: RankContext):
        from trainprobes.reference.expert_parallel import ExpertsOnRanks, owned
        model = step.model().to(ctx.device)
        experts, mine = set(), set()
        for name, layer in moe_layers(model).items():
            layer.expert_outputs = ExpertsOnRanks(layer.experts, ctx.rank, ctx.world)
            prefix = f"{name}.experts." if name else "experts."
            keep = owned(len(layer.experts), ctx.rank, ctx.world)
            for e, expert in enumerate(layer.experts):
                for n, _ in expert.named_parameters():
                    experts.add(f"{prefix}{e}.{n}")
                    if e in keep:
                        mine.add(f"{prefix}{e}.{n}")
        return {"model": model, "experts": experts, "mine": mine}

    def run(self, state, step, batch, ctx: RankContext) -> StepOutput:
        import torch.distributed as dist
        model = state["model"]
        pieces = split(batch, ctx.world)
        weight = piece_weights(step, batch, pieces, self.normalization)[ctx.rank]
        loss = step.loss(step.forward(model, pieces[ctx.rank]), pieces[ctx.rank])
        (loss * weight).backward()
        grads = {}
        for n, p in model.named_parameters():  # every rank, one order
            if not p.requires_grad or (n in state["experts"] and n not in state["mine"]):
                continue
            g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            if n not in state["experts"]:
                dist.all_reduce(g)  # dense: each rank's share summed
            grads[n] = g
        zero_grads(model)
        return StepOutput(reduce_loss(loss.detach() * weight, ctx), grads)
