"""What a rank is handed and checks, shared by trainprobes.transforms.worker (gradients
gathered to rank 0) and trainprobes.transforms.local (statistics summed on the ranks)."""
from __future__ import annotations

import time
from typing import Iterator, NamedTuple

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.transforms.base import RankContext, StepOutput, Transform
from trainprobes.transforms.step import TrainingStep

# the gradient and loss dtypes a rank reports by index (-1: another); append only
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int8, torch.uint8)


class RankCase(NamedTuple):
    """One probe as the ranks see it: the step (or the import path of a factory of one),
    the transform, the trial seeds, and the caller's sys.path (a rank imports the user's
    modules as the caller did: from the current folder where the command line put it there;
    the forkserver's own path is the one it started with)."""

    step: object
    transform: Transform
    seeds: list
    sys_path: tuple = ()
    local: bool = False       # statistics summed on the ranks (trainprobes.transforms.local)
    replica_tol: float = 0.0


def _import_like_caller(path: tuple) -> None:
    import sys
    for p in reversed(path):
        if p not in sys.path:
            sys.path.insert(0, p)


def resolve_step(spec) -> TrainingStep:
    """A TrainingStep, or "pkg.mod:attr" naming one or a no-argument factory of one."""
    if isinstance(spec, TrainingStep):
        return spec
    from trainprobes.errors import InvalidType, TargetError
    if not isinstance(spec, str):
        raise InvalidType(f"step={spec!r} must be a trainprobes.transforms.TrainingStep or "
                          f"'package.module:attr' naming one (or a function returning one)")
    from trainprobes.targets import call_target, load_target
    obj = load_target(spec, callable_required=False)
    if not isinstance(obj, TrainingStep) and callable(obj):
        obj = call_target(obj, spec, what="the factory (it must return a TrainingStep)")
    if not isinstance(obj, TrainingStep):
        raise TargetError(f"target={spec!r} is a {type(obj).__name__}; it must be a "
                          f"trainprobes.transforms.TrainingStep or a function returning one")
    return obj


def device_of(backend: str, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def _checked(out, names: dict, shapes: dict, ctx: RankContext, label: str, trial: int) -> dict:
    unknown = [n for n in out.grads if n not in names]
    if unknown:
        raise InvalidArgument(f"the step ({label}) returned gradients for {unknown[:5]}, which are not "
                              f"parameters of the model (its names: {list(names)[:6]}...); use "
                              f"the names of model.named_parameters()")
    for n, g in out.grads.items():
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != shapes[n]:
            got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise InvalidArgument(f"the step ({label}) returned a gradient for {n!r} of shape {got} "
                                  f"on rank {ctx.rank}, trial {trial}; the parameter is "
                                  f"{shapes[n]}: gather shards to the full gradient "
                                  f"(trainprobes.transforms.gather.full_gradients)")
    return out.grads


def _coverage(mask: torch.Tensor, names: list, ctx: RankContext, label: str) -> None:
    """Every parameter returned by at least one rank (all ranks raise alike)."""
    import torch.distributed as dist
    union = mask.to(ctx.device, torch.float32)
    dist.all_reduce(union, op=dist.ReduceOp.MAX)
    missing = [n for n, m in zip(names, union.cpu().tolist()) if not m]
    if missing:
        raise InvalidArgument(f"the step ({label}) returned no gradient for {len(missing)} "
                              f"parameter(s) on any rank, e.g. {missing[:5]}: return every "
                              f"parameter's full gradient from the rank(s) that hold it")


class Trial(NamedTuple):
    """One transformed step on one rank: its output, the gradients it returned (checked),
    which parameters those are ([P] bool, in layout order) and the step's seconds."""

    index: int
    out: StepOutput
    grads: dict
    returned: torch.Tensor
    seconds: float


def run_trials(step: TrainingStep, t: Transform, state, seeds: list, names: dict, shapes: dict,
               ctx: RankContext, missing_held: bool = False) -> Iterator[Trial]:
    """The timed trials of one case on this rank, each checked as it comes: known names and
    full shapes; after trial 0 (all ranks together) every parameter returned by some rank;
    on every later trial the same parameters, and a loss on every trial or on none (whether
    a rank reports one is what it returns, never its value: a NaN loss is not a missing one).
    missing_held: a parameter the step holds but left without a gradient (StepOutput.missing)
    counts as returned for these checks (the caller decides: trainprobes.transforms.local);
    else as not returned. Trial.returned is what the step returned with a gradient."""
    from trainprobes.transforms.step import to_device
    first, has_loss = None, None
    for trial, batch in enumerate(step.batches(seeds)):
        batch = to_device(batch, ctx.device)
        start = time.perf_counter()
        out = t.run(state, step, batch, ctx)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds = time.perf_counter() - start
        grads = _checked(out, names, shapes, ctx, t.label, trial)
        missing = getattr(out, "missing", None) or {}
        returned = torch.tensor([n in grads for n in names], dtype=torch.bool)
        listed = returned | torch.tensor([missing_held and n in missing for n in names], dtype=torch.bool)
        if first is None:
            first, has_loss = listed, out.loss is not None
            _coverage(listed, list(names), ctx, t.label)
        elif not torch.equal(listed, first):
            raise InvalidArgument(f"the step ({t.label}) returned other parameters on trial {trial} "
                                  f"than on trial 0 (rank {ctx.rank})")
        elif has_loss != (out.loss is not None):
            raise InvalidArgument(f"the step ({t.label}) returned a loss on some trials and None on "
                                  f"others (trial {trial}, rank {ctx.rank}): return it on every trial "
                                  f"or never")
        yield Trial(trial, out, grads, returned, seconds)
