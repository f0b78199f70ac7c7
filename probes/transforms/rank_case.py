"""What a rank is handed and checks, shared by trainprobes.transforms.worker (gradients
gathered to rank 0) and trainprobes.transforms.local (statistics summed on the ranks)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.transforms.base import RankContext, Transform
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
    from trainprobes.targets import load_target
    obj = load_target(spec, callable_required=False)
    if not isinstance(obj, TrainingStep) and callable(obj):
        obj = obj()
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
