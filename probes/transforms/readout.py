"""Gradients where the trainer keeps them, under the single-device names.

Per trainable parameter of the wrapped model, in order (every rank walks the same list, so
the collectives below line up):
  1. `main_grad` where it exists and `.grad` is None (Megatron's fp32 gradient buffers:
     the reduced gradient lives there);
  2. a DTensor gradient (fully_shard's shards, parallelize_module's Shard or Partial
     placements): gathered to the full gradient (a Replicate one is taken as this rank
     holds it, so replicas that disagree show);
  3. a plain tensor with a declared Partition(dim, ranks): this rank's piece along `dim`;
     the pieces of `ranks` (None: every rank, in rank order) are gathered and joined, and
     must tile the parameter exactly;
  4. any other plain tensor: the full gradient as this rank holds it.
A parameter with no gradient on this rank is not returned (the probe checks, after trial 0,
that some rank returned every parameter, and names those none did).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.transforms.base import RankContext
from trainprobes.transforms.gather import full_tensor
from trainprobes.transforms.weights import is_dtensor

__all__ = ["Partition", "check_partitions", "read_gradients"]


class Partition(NamedTuple):
    """A plain-tensor shard: this rank holds a piece of the parameter along `dim`; the
    pieces of `ranks` (None: all ranks, in rank order) joined in that order are the whole."""

    dim: int = 0
    ranks: tuple | None = None


def check_partitions(parts) -> dict:
    """{name: Partition} from {name: Partition | (dim, ranks) | dim}."""
    if not isinstance(parts, dict):
        raise InvalidType(f"partitions={parts!r} must map parameter names to Partition(dim, ranks)")
    out = {}
    for name, v in parts.items():
        if isinstance(v, int) and not isinstance(v, bool):
            v = Partition(v)
        elif isinstance(v, (tuple, list)) and not isinstance(v, Partition):
            v = Partition(*v)
        if not isinstance(v, Partition) or not isinstance(v.dim, int) or v.dim < 0:
            raise InvalidArgument(f"partitions[{name!r}]={v!r} must be Partition(dim >= 0, ranks)")
        ranks = None if v.ranks is None else tuple(int(r) for r in v.ranks)
        if ranks is not None and (not ranks or len(set(ranks)) != len(ranks)):
            raise InvalidArgument(f"partitions[{name!r}] ranks={v.ranks!r} must be distinct ranks")
        out[str(name)] = Partition(v.dim, ranks)
    return out


def _joined(piece: torch.Tensor, part: Partition, full_shape: tuple, name: str,
            ctx: RankContext) -> torch.Tensor | None:
    """Step 3: the pieces of part.ranks joined along part.dim (collective over all ranks)."""
    import torch.distributed as dist
    ranks = part.ranks if part.ranks is not None else tuple(range(ctx.world))
    bad = [r for r in ranks if not 0 <= r < ctx.world]
    if bad:
        raise InvalidArgument(f"partitions[{name!r}] names ranks {bad} outside world={ctx.world}")
    mine = ctx.rank in ranks
    if part.dim >= len(full_shape):
        raise InvalidArgument(f"partitions[{name!r}] dim={part.dim}, but the parameter has shape "
                              f"{full_shape}")
    size = torch.tensor([piece.shape[part.dim] if mine and piece is not None else 0], device=ctx.device)
    sizes = [torch.zeros_like(size) for _ in range(ctx.world)]
    dist.all_gather(sizes, size)
    sizes = [int(s.item()) for s in sizes]
    if mine and piece is not None:
        other = tuple(s for i, s in enumerate(piece.shape) if i != part.dim)
        want = tuple(s for i, s in enumerate(full_shape) if i != part.dim)
        if piece.dim() != len(full_shape) or other != want:
            raise InvalidArgument(f"partitions[{name!r}]: rank {ctx.rank} holds a piece of shape "
                                  f"{tuple(piece.shape)}, which is not a slice along dim "
                                  f"{part.dim} of the parameter {full_shape}")
    total = sum(sizes[r] for r in ranks)
    if total != full_shape[part.dim]:
        raise InvalidArgument(f"partitions[{name!r}] does not tile the parameter: the pieces of ranks "
                              f"{list(ranks)} along dim {part.dim} have sizes "
                              f"{[sizes[r] for r in ranks]} (sum {total}); the parameter has "
                              f"{full_shape[part.dim]} (shape {full_shape})")
    width = max(sizes)
    shape = list(full_shape)
    shape[part.dim] = width
    padded = torch.zeros(shape, dtype=torch.float64, device=ctx.device)
    if mine and piece is not None:
        padded.narrow(part.dim, 0, piece.shape[part.dim]).copy_(piece.detach())
    pieces = [torch.empty_like(padded) for _ in range(ctx.world)]
    dist.all_gather(pieces, padded)
    whole = torch.cat([pieces[r].narrow(part.dim, 0, sizes[r]) for r in ranks], part.dim)
    return whole.to(piece.dtype if piece is not None else torch.float32) if mine else None


def read_gradients(wrapped: torch.nn.Module, names: dict, partitions: dict, shapes: dict,
                   ctx: RankContext) -> dict:
    """{single-device name: full gradient} (module docstring); shapes: the single-device
    model's parameter shapes."""
    out = {}
    unknown = sorted(set(partitions) - set(names.values()))
    if unknown:
        raise InvalidArgument(f"partitions name {unknown[:4]}, which are not parameters of the model "
                              f"(its names: {list(names.values())[:6]}...)")
    for n, p in wrapped.named_parameters():
        if n not in names:
            continue
        name = names[n]
        g = p.grad
        main = getattr(p, "main_grad", None)
        if g is None and isinstance(main, torch.Tensor):
            g = main
        if name in partitions:
            if g is not None and is_dtensor(g):
                raise InvalidArgument(f"partitions[{name!r}] declares a plain-tensor shard, but the "
                                      f"gradient is a DTensor: drop the declaration")
            full = _joined(g, partitions[name], tuple(shapes[name]), name, ctx)
            if full is not None:
                out[name] = full
            continue
        if g is None:
            continue
        out[name] = full_tensor(g).clone()
    return out
