"""Custom transforms: a user's own step, run on every rank inside the process group.

Custom(fn, title=None, precisions=(), param_dtype=None)
    fn(model, batch, ctx) runs on every rank, the model fresh from the factory on ctx.device
    (its initial weights restored before every trial: a step may move them), batch the
    global batch (every rank draws it from the trial's seed), ctx a RankContext (rank,
    world, device, backend). It returns {"loss": tensor or None, "grads": {name: full
    gradient}} (or a StepOutput): the loss it would log, and the gradients this rank holds
    in full. trainprobes.transforms.gather gathers DTensor/FSDP2 shards; a pipeline stage
    returns its own parameters' gradients, and the probe joins the ranks' names (a name
    returned by several ranks is a replica: they must agree). precisions names the formats
    the step uses beyond the model's own (e.g. ("bf16",) for a bf16 all-reduce); param_dtype
    the dtype it computes with in place of the weights' (the truth rounds them first).
This is how a user probes their own trainer, and how the zoo (trainprobes.reference.bugs) is
written.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, ClassVar

from trainprobes.errors import InvalidType
from trainprobes.transforms.base import RankContext, StepOutput, Transform, step_loss, zero_grads

__all__ = ["Custom"]


def _describe(fn) -> str:
    if isinstance(fn, functools.partial):
        kw = ",".join(f"{k}={v}" for k, v in fn.keywords.items())
        return f"{_describe(fn.func)}({kw})" if kw else _describe(fn.func)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass(frozen=True)
class Custom(Transform):
    name: ClassVar[str] = "custom"
    fn: Callable = None
    title: str | None = None
    precisions: tuple = ()
    param_dtype: str | None = None

    def __post_init__(self):
        if not callable(self.fn):
            raise InvalidType(f"fn={self.fn!r} must be callable: fn(model, batch, ctx) -> "
                              f"{{'loss': ..., 'grads': {{name: gradient}}}}")
        object.__setattr__(self, "precisions", tuple(self.precisions))

    @property
    def options(self) -> dict:
        return {"fn": _describe(self.fn), "title": self.title, "precisions": list(self.precisions),
                "param_dtype": self.param_dtype}

    @property
    def label(self) -> str:
        return self.title or _describe(self.fn)

    def dtypes(self) -> tuple:
        return self.precisions

    def weight_dtype(self):
        from trainprobes.transforms.sharded import torch_dtype
        return torch_dtype(self.param_dtype, "param_dtype")

    def setup(self, step, ctx: RankContext):
        model = step.model().to(ctx.device)
        return {"model": model, "initial": {k: v.detach().clone() for k, v in model.state_dict().items()}}

    def run(self, state, step, batch, ctx: RankContext) -> StepOutput:
        model = state["model"]
        model.load_state_dict(state["initial"])  # a step may move the weights (a stale copy)
        zero_grads(model)
        out = self.fn(model, batch, ctx)
        if isinstance(out, StepOutput):
            loss, grads = out
        elif isinstance(out, Mapping) and "grads" in out:
            loss, grads = out.get("loss"), out["grads"]
        else:
            raise InvalidType(f"fn={self.label} returned {type(out).__name__}; it must return "
                              f"{{'loss': tensor or None, 'grads': {{name: gradient}}}} or a StepOutput")
        if not isinstance(grads, Mapping):
            raise InvalidType(f"fn={self.label} returned grads of type {type(grads).__name__}; "
                              f"expected a dict name -> gradient tensor")
        return StepOutput(step_loss(loss, self.label, ctx), dict(grads))
