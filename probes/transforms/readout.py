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
     must tile the parameter exactly (equal or not: their extents are gathered once, at
     setup, by partition_layout);
  4. any other plain tensor: the full gradient as this rank holds it;
  5. the originals inside an FSDP1 FlatParameter: its sharded gradient gathered over the
     unit's group and cut back into parameters (trainprobes.transforms.flat).
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

__all__ = ["Partition", "Piece", "check_partitions", "partition_layout", "read_gradients"]


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


class Piece(NamedTuple):
    """Where each rank's piece of a declared partition lies: `sizes[r]` is rank r's extent
    along `dim` (0 where it holds none), joined in the order of `ranks`; the pieces may be
    unequal (a 5 / 3 split) but must tile the parameter."""

    dim: int
    ranks: tuple
    sizes: tuple

    def offset(self, rank: int) -> int:
        return sum(self.sizes[r] for r in self.ranks[:self.ranks.index(rank)])


def partition_layout(held: dict, partitions: dict, shapes: dict, ctx: RankContext) -> dict:
    """{name: Piece} for every declared partition (collective: one all_gather of the
    pieces' extents). held: {single-device name: parameter} this rank holds. Refuses,
    naming the parameter, a piece that is not a slice along `dim`, a rank outside the world
    or left out of `ranks` while holding a piece, and pieces that do not tile the parameter."""
    import torch.distributed as dist
    mine = []
    for name, part in partitions.items():
        full = tuple(shapes[name])
        ranks = part.ranks if part.ranks is not None else tuple(range(ctx.world))
        bad = [r for r in ranks if not 0 <= r < ctx.world]
        if bad:
            raise InvalidArgument(f"partitions[{name!r}] names ranks {bad} outside world={ctx.world}")
        if part.dim >= len(full):
            raise InvalidArgument(f"partitions[{name!r}] dim={part.dim}, but the parameter has shape {full}")
        p = held.get(name)
        if p is None:
            mine.append(0)
            continue
        if is_dtensor(p):
            raise InvalidArgument(f"partitions[{name!r}] declares a plain-tensor shard, but the "
                                  f"parameter is a DTensor (its gradient is read whole): drop the declaration")
        other = tuple(x for i, x in enumerate(p.shape) if i != part.dim)
        want = tuple(x for i, x in enumerate(full) if i != part.dim)
        if p.dim() != len(full) or other != want:
            raise InvalidArgument(f"partitions[{name!r}]: rank {ctx.rank} holds a piece of shape "
                                  f"{tuple(p.shape)}, which is not a slice along dim {part.dim} of "
                                  f"the parameter {full}")
        if ctx.rank not in ranks:
            raise InvalidArgument(f"partitions[{name!r}] leaves rank {ctx.rank} out of ranks "
                                  f"{list(ranks)}, yet it holds a piece: list every rank that holds one")
        mine.append(int(p.shape[part.dim]))
    if not partitions:
        return {}
    local = torch.tensor(mine, dtype=torch.int64, device=ctx.device)
    every = [torch.empty_like(local) for _ in range(ctx.world)]
    dist.all_gather(every, local)
    every = torch.stack([e.cpu() for e in every])                        # [world, partitions]
    out = {}
    for k, (name, part) in enumerate(partitions.items()):
        ranks = part.ranks if part.ranks is not None else tuple(range(ctx.world))
        sizes = tuple(int(x) for x in every[:, k])
        total = sum(sizes[r] for r in ranks)
        want = shapes[name][part.dim]
        if total != want:
            raise InvalidArgument(
                f"partitions[{name!r}] does not tile the parameter: the pieces of ranks "
                f"{list(ranks)} along dim {part.dim} have sizes {[sizes[r] for r in ranks]} (sum "
                f"{total}); the single-device parameter has {want} there (shape "
                f"{tuple(shapes[name])})")
        out[name] = Piece(part.dim, ranks, sizes)
    return out


def _joined(piece: torch.Tensor | None, layout: Piece, full_shape: tuple,
            ctx: RankContext) -> torch.Tensor | None:
    """Step 3: the pieces of layout.ranks joined along layout.dim (collective over all
    ranks; pieces padded to the largest); the whole on the ranks that hold a piece."""
    import torch.distributed as dist
    shape = list(full_shape)
    shape[layout.dim] = max(layout.sizes)
    padded = torch.zeros(shape, dtype=torch.float64, device=ctx.device)
    if piece is not None:
        padded.narrow(layout.dim, 0, piece.shape[layout.dim]).copy_(piece.detach())
    pieces = [torch.empty_like(padded) for _ in range(ctx.world)]
    dist.all_gather(pieces, padded)
    whole = torch.cat([pieces[r].narrow(layout.dim, 0, layout.sizes[r]) for r in layout.ranks], layout.dim)
    return whole.to(piece.dtype) if piece is not None else None


def read_gradients(wrapped: torch.nn.Module, names: dict, layouts: dict, shapes: dict,
                   ctx: RankContext, units: list = ()) -> dict:
    """{single-device name: full gradient} (module docstring); layouts: partition_layout's
    {name: Piece}; shapes: the single-device model's parameter shapes. A rank may hold a
    subset of the parameters (a pipeline stage): every rank still joins every declared
    partition, in one order, so the collectives line up."""
    from trainprobes.transforms.flat import read_flat
    from trainprobes.transforms.weights import trainable
    out, pieces = {}, {}
    for unit in units:
        out.update(read_flat(unit, names))
    for n, p in trainable(wrapped, units):
        if n not in names or p is None:
            continue
        name = names[n]
        g = p.grad
        main = getattr(p, "main_grad", None)
        if g is None and isinstance(main, torch.Tensor):
            g = main
        if name in layouts:
            if g is not None and is_dtensor(g):
                raise InvalidArgument(f"partitions[{name!r}] declares a plain-tensor shard, but the "
                                      f"gradient is a DTensor: drop the declaration")
            pieces[name] = g
            continue
        if g is None:
            continue
        out[name] = full_tensor(g).clone()
    for name, layout in layouts.items():
        if pieces.get(name) is not None and tuple(pieces[name].shape)[layout.dim] != layout.sizes[ctx.rank]:
            raise InvalidArgument(f"partitions[{name!r}]: rank {ctx.rank}'s gradient has shape "
                                  f"{tuple(pieces[name].shape)}, its parameter piece "
                                  f"{layout.sizes[ctx.rank]} along dim {layout.dim}")
        full = _joined(pieces.get(name), layout, tuple(shapes[name]), ctx)
        if full is not None:
            out[name] = full
    return out
