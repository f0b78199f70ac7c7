"""Full gradients from sharded and split models, for custom steps.

    full_gradients(module)      {name: full gradient} of every parameter with a .grad:
                                DTensor gradients (FSDP2 shards, tensor-parallel Shard or
                                Partial placements) are gathered, plain tensors copied
    local_gradients(module)     {name: .grad} as this rank holds it, Replicate DTensors
                                as their local value (what each replica really holds)

A pipeline stage needs no gathering: return the stage's own parameters' gradients from
its rank (names as in the full model); the probe joins every rank's names into the full
gradient and checks that replicated names agree across ranks.

full_gradients is collective (every rank must call it, on the same parameters in the same
order). FSDP1's FlatParameter is not unflattened here: use FSDP2 (fully_shard).
"""
from __future__ import annotations

import torch

__all__ = ["full_gradients", "local_gradients", "full_tensor"]


def _is_dtensor(t) -> bool:
    return hasattr(t, "placements") and hasattr(t, "full_tensor")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded or partial DTensor gathered (collective), a replicated
    one as this rank holds it, a plain tensor as it is."""
    if not _is_dtensor(t):
        return t.detach()
    from torch.distributed.tensor import Replicate
    if all(isinstance(p, Replicate) for p in t.placements):
        return t.to_local().detach()  # no collective: each replica keeps its own value
    return t.full_tensor().detach()


def full_gradients(module: torch.nn.Module, prefix: str = "") -> dict:
    return {prefix + n: full_tensor(p.grad).clone() for n, p in module.named_parameters()
            if p.grad is not None}


def local_gradients(module: torch.nn.Module, prefix: str = "") -> dict:
    return {prefix + n: (p.grad.to_local() if _is_dtensor(p.grad) else p.grad).detach().clone()
            for n, p in module.named_parameters() if p.grad is not None}
