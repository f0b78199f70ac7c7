"""Tensor (and sequence) parallelism on DTensor's parallelize_module.

TensorParallel(plan={"1": "colwise", "3": "rowwise"}, shard_input=None, sequence_dim=1)
    parallelize_module(model, mesh, {name: style}) over a 1-D mesh of all ranks, styles
        colwise                ColwiseParallel()    weight sharded on its output features
        rowwise                RowwiseParallel()    on its input features; output Replicate
        sequence               SequenceParallel()   replicated weights (LayerNorm), input and
                                                    output sharded on the sequence dimension
        colwise-from-sequence  ColwiseParallel(input_layouts=Shard(1))
        rowwise-to-sequence    RowwiseParallel(output_layouts=Shard(1))
    Every rank runs the whole batch; with shard_input (default: when the plan holds a
    "sequence" style) each rank feeds its span of batch[input] along sequence_dim, as
    SequenceParallel expects. The model's output must come back whole (end the plan with a
    rowwise layer); every rank computes the loss and backward. Gradients are gathered with
    DTensor.full_tensor() (Shard and Partial placements reduced; a Replicate gradient is
    taken as each rank holds it, so replicas that disagree show).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.transforms.base import RankContext, StepOutput, Transform, with_zeros, zero_grads
from trainprobes.transforms.gather import full_gradients
from trainprobes.validation import check_choice, check_int

STYLES = ("colwise", "rowwise", "sequence", "colwise-from-sequence", "rowwise-to-sequence")
__all__ = ["TensorParallel", "STYLES"]


def _style(name: str):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    return {"colwise": lambda: ColwiseParallel(), "rowwise": lambda: RowwiseParallel(),
            "sequence": lambda: SequenceParallel(),
            "colwise-from-sequence": lambda: ColwiseParallel(input_layouts=Shard(1)),
            "rowwise-to-sequence": lambda: RowwiseParallel(output_layouts=Shard(1))}[name]()


@dataclass(frozen=True)
class TensorParallel(Transform):
    name: ClassVar[str] = "tp"
    plan: tuple = ()
    shard_input: bool | None = None
    sequence_dim: int = 1

    def __post_init__(self):
        plan = self.plan
        if isinstance(plan, dict):
            plan = tuple(plan.items())
        try:
            plan = tuple((str(k), str(v)) for k, v in plan)
        except (TypeError, ValueError):
            raise InvalidArgument(f"plan={self.plan!r} must map module names to styles, e.g. "
                                  f"{{'1': 'colwise', '3': 'rowwise'}}") from None
        if not plan:
            raise InvalidArgument("plan={} is empty: name the modules to parallelise, e.g. "
                                  "{'1': 'colwise', '3': 'rowwise'}")
        for _, style in plan:
            check_choice(style, "plan style", STYLES)
        object.__setattr__(self, "plan", plan)
        if self.shard_input is not None and not isinstance(self.shard_input, bool):
            raise InvalidArgument(f"shard_input={self.shard_input!r} must be None (auto), True or False")
        check_int(self.sequence_dim, "sequence_dim", min=0)

    @property
    def options(self) -> dict:
        return {**super().options, "plan": dict(self.plan)}

    @property
    def sharded_input(self) -> bool:
        return any(s == "sequence" for _, s in self.plan) if self.shard_input is None else self.shard_input

    def check(self, step, world, batch, model) -> None:
        modules = dict(model.named_modules())
        for name, style in self.plan:
            if name not in modules:
                raise InvalidArgument(f"plan names module {name!r}, which the model does not have; "
                                      f"its modules: {[n for n in modules if n][:12]}")
            m = modules[name]
            if style.startswith(("colwise", "rowwise")) and not isinstance(m, (torch.nn.Linear,
                                                                               torch.nn.Embedding)):
                raise InvalidArgument(f"plan style {style!r} on {name!r} ({type(m).__name__}) needs "
                                      f"an nn.Linear or nn.Embedding")
            size = (m.weight.shape[0] if style.startswith("colwise") else m.weight.shape[1]) \
                if style != "sequence" else None
            if size is not None and size % world:
                raise InvalidArgument(f"plan style {style!r} shards {name!r} over {size} features, "
                                      f"not divisible by world={world}")
        if self.sharded_input:
            if step.call is not None:
                raise InvalidArgument("shard_input splits batch[input_key]; a step with call(model, "
                                      "batch) shards its own inputs (UserStep)")
            x = batch[step.input_key]
            if x.dim() <= self.sequence_dim or x.shape[self.sequence_dim] % world:
                raise InvalidArgument(f"shard_input splits batch[{step.input_key!r}] of shape "
                                      f"{tuple(x.shape)} along sequence_dim={self.sequence_dim} "
                                      f"into world={world} equal spans: not possible")

    def setup(self, step, ctx: RankContext):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module
        mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        plain = step.model().to(ctx.device)
        model = parallelize_module(step.model().to(ctx.device), mesh,
                                   {name: _style(style) for name, style in self.plan})
        return {"model": model, "plain": plain}

    def run(self, state, step, batch, ctx: RankContext) -> StepOutput:
        model = state["model"]
        if self.sharded_input:
            out = model(batch[step.input_key].chunk(ctx.world, dim=self.sequence_dim)[ctx.rank])
        else:
            out = step.forward(model, batch)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out  # keeps autograd
        if "shape" not in state:  # once: the output must come back whole
            with torch.no_grad():
                state["shape"] = tuple(step.forward(state.pop("plain"), batch).shape)
        if tuple(out.shape) != state["shape"]:
            raise InvalidArgument(f"the plan leaves the model's output sharded: shape "
                                  f"{tuple(out.shape)} on rank {ctx.rank}, one device gives "
                                  f"{state['shape']}; end the plan with a rowwise layer")
        loss = step.loss(out, batch)
        loss.backward()
        grads = with_zeros(model, full_gradients(model), ctx)
        zero_grads(model)
        return StepOutput(loss.detach(), grads)
