"""A user's own parallel step, as their trainer has it: UserStep("pkg.mod:fn") or a module.

    UserStep("mypkg.parallel")            the module's `step` and (optional) `setup`
    UserStep("mypkg.parallel:fsdp_step", setup="mypkg.parallel:wrap", precisions=("bf16",))

On every rank, once: the factory's model (TrainingStep.model) goes to ctx.device and
`setup(model, ctx)` wraps it (fully_shard, parallelize_module, DistributedDataParallel, a
pipeline stage, the user's own wrapper); it returns the wrapped model, or None when it
wraps in place (fully_shard does). Per trial: the probe restores the initial weights through
the wrapped model (trainprobes.transforms.weights: into each DTensor's local shard, never by
re-wrapping), clears the gradients, and calls `step(model, batch, ctx)` with the wrapped
model and the global batch. The step returns the loss it would log (a tensor, None, or
{"loss": ...}) and, optionally, {"grads": {name: full gradient}}; without "grads" the probe
reads the gradients where the trainer keeps them (trainprobes.transforms.readout: DTensor
shards, Megatron's `main_grad`, plain shards with a declared partition).

Options: setup (an import path or callable; default: the module's `setup`, else none),
precisions (formats the step uses beyond the model's, e.g. ("bf16",) for a bf16 all-reduce),
param_dtype (the dtype it computes with in place of the weights'), partitions ({name:
Partition(dim, ranks)}, or the module's `partitions`), title.
"""
from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from trainprobes.errors import InvalidArgument, InvalidType, TargetError
from trainprobes.transforms.base import RankContext, StepOutput, Transform, step_loss
from trainprobes.transforms.flat import flat_units
from trainprobes.transforms.readout import Partition, check_partitions, partition_layout, read_gradients
from trainprobes.transforms.weights import (
    check_held,
    clear_gradients,
    name_map,
    restore,
    single_device_name,
    tied_aliases,
    trainable,
)

__all__ = ["UserStep", "Partition"]


def _load(spec, what: str, *, module_ok: bool):
    """A callable (or, where module_ok, a module) from a callable or an import path."""
    if callable(spec) or isinstance(spec, types.ModuleType):
        return spec
    from trainprobes.targets import load_target
    if not isinstance(spec, str):
        raise InvalidType(f"{what}={spec!r} must be 'package.module:function' or a callable")
    # errors name the option (step=, setup=), not "target=": that is another argument
    if ":" not in spec and module_ok:
        from trainprobes.targets import _importable, _not_found
        mod = _importable(spec, spec, what)
        if mod is not None:
            return mod
        if "." not in spec:
            raise _not_found(spec, spec, what)
    return load_target(spec, callable_required=True, label=what)


@dataclass(frozen=True)
class UserStep(Transform):
    name: ClassVar[str] = "step"
    step: object = None
    setup_fn: object = None
    precisions: tuple = ()
    param_dtype: str | None = None
    partitions: object = None
    title: str | None = None

    def __post_init__(self):
        if self.step is None:
            raise InvalidArgument("step=None: name your parallel step, 'package.module:step' or a "
                                  "module exposing step(model, batch, ctx) (and setup(model, ctx))")
        if isinstance(self.precisions, str):
            object.__setattr__(self, "precisions", tuple(p for p in self.precisions.split("+") if p))
        object.__setattr__(self, "precisions", tuple(self.precisions))
        from trainprobes.reference.formats import get_format
        from trainprobes.transforms.sharded import torch_dtype
        object.__setattr__(self, "precisions", tuple(get_format(p, "precisions").name
                                                     for p in self.precisions))
        torch_dtype(self.param_dtype, "param_dtype")

    # -- what the step is ------------------------------------------------------------------
    def resolve(self) -> tuple:
        """(step fn, setup fn or None, partitions dict) from the options and the module."""
        obj = _load(self.step, "step", module_ok=True)
        module = obj if isinstance(obj, types.ModuleType) else None
        fn = getattr(module, "step", None) if module else obj
        if module is not None and not callable(fn):
            raise TargetError(f"step={self.step!r} is a module without a callable `step`: define "
                              f"step(model, batch, ctx) in it (and optionally setup(model, ctx)), "
                              f"or name the function, 'package.module:function'")
        setup = self.setup_fn
        if setup is None and module is not None:
            setup = getattr(module, "setup", None)
        if setup is not None:
            setup = _load(setup, "setup", module_ok=False)
        parts = self.partitions
        if parts is None and module is not None:
            parts = getattr(module, "partitions", None)
        return fn, setup, check_partitions(parts or {})

    @property
    def options(self) -> dict:
        return {"step": _describe(self.step), "setup": _describe(self.setup_fn),
                "precisions": list(self.precisions), "param_dtype": self.param_dtype,
                "partitions": {k: [v.dim, v.ranks] for k, v in check_partitions(self.partitions or {}).items()},
                "title": self.title}

    @property
    def label(self) -> str:
        return self.title or _describe(self.step)

    def dtypes(self) -> tuple:
        return self.precisions

    def weight_dtype(self):
        from trainprobes.transforms.sharded import torch_dtype
        return torch_dtype(self.param_dtype, "param_dtype")

    def check(self, step, world, batch, model) -> None:
        self.resolve()  # an import path that does not load is refused before any rank starts

    # -- on the ranks ----------------------------------------------------------------------
    def setup(self, step, ctx: RankContext):
        fn, setup, parts = self.resolve()
        model = step.model().to(ctx.device)
        # by parameter and buffer name, not state_dict(): a state-dict hook may rename or
        # split what it saves (torchtitan's fused QKV saves wq, wk, wv)
        initial = {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
        proxy = [n for n, p in model.named_parameters() if p.requires_grad]
        aliases = tied_aliases(model)
        wrapped = model
        if setup is not None:
            out, failure = None, None
            try:
                out = setup(model, ctx)
            except Exception as e:  # noqa: BLE001 - the user's setup: any failure is theirs
                failure = f"{type(e).__name__}: {e}"
            _agree_on_setup(failure, _describe(setup), ctx)
            if out is not None:
                if not isinstance(out, torch.nn.Module):
                    raise InvalidType(f"setup {_describe(setup)} returned {type(out).__name__} on rank "
                                      f"{ctx.rank}; it must return the wrapped torch.nn.Module (or None "
                                      f"when it wraps in place)")
                wrapped = out
        what = f"setup {_describe(setup)}" if setup else "the model"
        units = flat_units(wrapped)
        names = name_map(wrapped, proxy, what, units, aliases)
        check_held(names, proxy, what, ctx)
        unknown = sorted(set(parts) - set(proxy))
        if unknown:
            raise InvalidArgument(f"partitions name {unknown[:4]}, which are not parameters of the "
                                  f"model (its names: {proxy[:6]}...)")
        shapes = {n: tuple(initial[n].shape) for n in proxy}
        held = {names[n]: p for n, p in trainable(wrapped, units) if p is not None}
        layouts = partition_layout(held, parts, shapes, ctx)
        # the parameters this rank holds, by single-device name, with their dtypes: one whose
        # gradient a step leaves None is reported missing, not dropped unseen
        dtypes = {names[n]: (p.dtype if p is not None else initial[names[n]].dtype)
                  for n, p in trainable(wrapped, units) if n in names}
        return {"fn": fn, "model": wrapped, "initial": initial, "names": names, "layouts": layouts,
                "shapes": shapes, "units": units, "aliases": aliases, "dtypes": dtypes}

    def run(self, state, step, batch, ctx: RankContext) -> StepOutput:
        model = state["model"]
        restore(model, state["initial"], state["names"], state["layouts"], ctx.rank, state["units"])
        clear_gradients(model)
        out = state["fn"](model, batch, ctx)
        loss, grads = _split(out, self.label)
        missing = {}
        if grads is None:
            grads = read_gradients(model, state["names"], state["layouts"], state["shapes"], ctx,
                                   state["units"])
            missing = {n: state["dtypes"][n] for n in state["dtypes"]
                       if n not in grads and n not in state["layouts"]}
        else:
            grads = _single_device_names(grads, set(state["shapes"]), state["aliases"], self.label, ctx)
        return StepOutput(step_loss(loss, self.label, ctx), dict(grads), missing)


def _single_device_names(grads: Mapping, proxy: set, aliases: dict, label: str, ctx) -> dict:
    """The returned gradients under the single-device names (as the wrapper spells them, or
    a tied parameter's other name); two spellings of one parameter are refused, naming both:
    keeping either would judge one and drop the other unseen."""
    out, spelled = {}, {}
    for n, g in grads.items():
        m = single_device_name(n, proxy, aliases)
        if m in out:
            raise InvalidArgument(f"step {label} returned two gradients for parameter {m!r} on rank "
                                  f"{ctx.rank}, as {spelled[m]!r} and {n!r}: return each parameter once")
        out[m], spelled[m] = g, n
    return out


def _agree_on_setup(failure: str | None, name: str, ctx: RankContext) -> None:
    """A rank whose setup raised raises at once, naming itself, and enters no collective:
    its peers may be inside one the setup began (DDP's parameter broadcast), and a
    collective of ours there would pair with theirs and blame the wrong rank. The launcher
    reports a deliberate error (this one) before its peers' crashes in that collective.
    Ranks whose setup ran agree that every rank's did before the first step."""
    if failure is not None:
        raise InvalidArgument(f"setup {name} raised on rank {ctx.rank} of {ctx.world}: {failure}")
    import torch.distributed as dist
    every = [None] * ctx.world
    dist.all_gather_object(every, failure)


def _split(out, label: str) -> tuple:
    """(loss, grads or None) from what a step returned."""
    if isinstance(out, StepOutput):
        return out.loss, out.grads
    if out is None or isinstance(out, (torch.Tensor, float, int)):
        return out, None
    if isinstance(out, Mapping):
        grads = out.get("grads")
        if grads is not None and not isinstance(grads, Mapping):
            raise InvalidType(f"step {label} returned grads of type {type(grads).__name__}; expected "
                              f"a dict name -> gradient tensor (or no 'grads': the probe reads them "
                              f"from the model)")
        return out.get("loss"), grads
    raise InvalidType(f"step {label} returned {type(out).__name__}; it must return the loss (a "
                      f"tensor or None), or {{'loss': ..., 'grads': {{name: gradient}}}}")


def _describe(fn) -> str | None:
    if fn is None or isinstance(fn, str):
        return fn
    if isinstance(fn, types.ModuleType):
        return fn.__name__
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"

