"""FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) flat parameters, read and
restored under the single-device names.

FSDP1 flattens the parameters of each wrapped unit into one FlatParameter (its handle's
`flat_param`): the originals in `_fqns` order, each `_numels_with_padding` long (entries
where `_is_padding_mask` is set are alignment padding), right-padded to a multiple of the
group size and cut into equal shards, one per rank of the handle's process group
(`_sharded_size`; NO_SHARD keeps it whole). After the backward, `flat_param.grad` is this
rank's shard of the reduced gradient, under use_orig_params=True and False alike (the
original parameters are views into it, or are not parameters at all).

  read:    all_gather the shards over the handle's group, drop the right padding, split
           at the numels, drop alignment padding, view each piece as its parameter;
  restore: lay the initial weights out the same way and copy this rank's shard into
           `_local_shard` (what the flat parameter and any original views hold between
           steps; mixed precision casts from it at the next unshard), or into the flat
           parameter itself before FSDP1's lazy init.
Both walk the handles in module order on every rank of a group, so the collectives pair.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Flat", "flat_units", "read_flat", "restore_flat"]


class Flat(NamedTuple):
    """One FSDP1 unit: its handle, the wrapped model's names of its original parameters
    (in `_fqns` order) and the ids of every tensor that stands for them (the flat
    parameter, and the original views under use_orig_params=True)."""

    handle: object
    names: tuple
    ids: frozenset


def flat_units(wrapped: torch.nn.Module) -> list:
    """[Flat] of every FSDP1 unit in `wrapped`, in module order ([] without FSDP1)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without FSDP1
        return []
    out = []
    for path, m in wrapped.named_modules():
        handle = getattr(m, "_handle", None) if isinstance(m, FullyShardedDataParallel) else None
        if handle is None:
            continue
        fp = handle.flat_param
        prefix = f"{path}._fsdp_wrapped_module." if path else "_fsdp_wrapped_module."
        ids = {id(fp)} | {id(p) for p in (getattr(fp, "_params", None) or [])}
        out.append(Flat(handle, tuple(prefix + f for f in fp._fqns), frozenset(ids)))
    return out


def _layout(fp) -> list:
    """[(start, numel, index of the original or None for padding)] along the unsharded flat."""
    out, at, k = [], 0, 0
    for numel, pad in zip(fp._numels_with_padding, fp._is_padding_mask):
        out.append((at, numel, None if pad else k))
        at += numel
        k += 0 if pad else 1
    return out


def _group(handle):
    import torch.distributed as dist
    pg = handle.process_group
    return pg, dist.get_world_size(pg), dist.get_rank(pg)


def read_flat(unit: Flat, names: dict) -> dict:
    """{single-device name: full gradient} of one unit (collective over its group); names:
    {wrapped name: single-device name}. An unreached unit (no gradient on any rank of the
    group) gives zeros, as PyTorch's None is a zero gradient."""
    import torch.distributed as dist
    fp = unit.handle.flat_param
    shard = fp.grad if fp.grad is not None else torch.zeros(fp._sharded_size, dtype=fp.dtype, device=fp.device)
    if unit.handle.uses_sharded_strategy:
        pg, world, _ = _group(unit.handle)
        pieces = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(pieces, shard.detach().contiguous(), group=pg)
        whole = torch.cat(pieces)
    else:
        whole = shard.detach()
    out = {}
    for start, numel, k in _layout(fp):
        if k is not None:
            out[names[unit.names[k]]] = whole[start:start + numel].view(fp._shapes[k]).clone()
    return out


@torch.no_grad()
def restore_flat(unit: Flat, initial: dict, names: dict) -> None:
    """This rank's shard of the initial weights into the unit's flat parameter."""
    fp = unit.handle.flat_param
    layout = _layout(fp)
    total = layout[-1][0] + layout[-1][1] if layout else 0
    if unit.handle.uses_sharded_strategy:
        _, world, rank = _group(unit.handle)
        size = fp._sharded_size.numel()
        flat = torch.zeros(size * world, dtype=fp.dtype, device=fp.device)
    else:
        rank, size = 0, total
        flat = torch.zeros(total, dtype=fp.dtype, device=fp.device)
    for start, numel, k in layout:
        if k is not None:
            flat[start:start + numel].copy_(initial[names[unit.names[k]]].reshape(-1))
    # _local_shard appears at FSDP1's lazy init (the first forward); until then the flat
    # parameter's own data is the shard
    target = getattr(fp, "_local_shard", None) if unit.handle.uses_sharded_strategy else None
    (fp.data if target is None else target).copy_(flat[rank * size:(rank + 1) * size])
