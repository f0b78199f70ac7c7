"""The wrapped model's parameters under their single-device names, and the initial weights
put back through the wrapper on every trial (never by re-wrapping it).

Wrappers rename: DistributedDataParallel adds `module.`, torch.compile `_orig_mod.`, FSDP1
`_fsdp_wrapped_module.`, activation checkpointing `_checkpoint_wrapped_module.`; fully_shard
and parallelize_module keep the names and turn the parameters into DTensors. name_map strips
those segments and checks that what remains is the proxy's names, one to one.

restore copies each initial tensor into the parameter as the wrapper holds it: a DTensor
gets its local shard (distribute_tensor with src_data_rank=None: every rank cuts its own
piece from the full tensor it already has, no communication), a plain tensor the whole.
"""
from __future__ import annotations

import torch
from trainprobes.errors import InvalidArgument

WRAPPER_SEGMENTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module",
                    "_forward_module")

__all__ = ["single_device_name", "name_map", "restore", "clear_gradients", "is_dtensor"]


def is_dtensor(t) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def single_device_name(name: str, proxy: set) -> str:
    """`name` as the single-device model spells it: wrapper segments removed one at a time,
    stopping at the first spelling that is a proxy name (a model may have its own child
    called `module`: DDP over it gives `module.module.0.weight`, which is `module.0.weight`).
    Wrappers nest anywhere (FSDP1 or checkpointing around a block), so when no prefix-strip
    is a proxy name, every wrapper segment is dropped as the last resort."""
    parts = name.split(".")
    while True:
        if ".".join(parts) in proxy:
            return ".".join(parts)
        i = next((k for k, seg in enumerate(parts[:-1]) if seg in WRAPPER_SEGMENTS), None)
        if i is None:
            return ".".join(parts)
        parts = parts[:i] + parts[i + 1:]


def name_map(wrapped: torch.nn.Module, proxy: list, what: str) -> dict:
    """{wrapped name: proxy name} for every trainable parameter, or InvalidArgument naming
    the parameters missing, duplicated or left over, with what was found instead."""
    import difflib
    want = set(proxy)
    out, seen = {}, {}
    for n, p in wrapped.named_parameters():
        if not p.requires_grad:
            continue
        m = single_device_name(n, want)
        out[n] = m
        seen.setdefault(m, []).append(n)
    twice = {m: ns for m, ns in seen.items() if len(ns) > 1}
    missing = [n for n in proxy if n not in seen]
    extra = [n for n, m in out.items() if m not in want]
    if twice or missing or extra:
        parts = []
        if missing:
            found = [f"{n!r} (closest found: {difflib.get_close_matches(n, extra or list(out), 1)})"
                     for n in missing[:4]]
            parts.append(f"missing {len(missing)} parameter(s) of the single-device model: {', '.join(found)}")
        if extra:
            parts.append(f"{len(extra)} parameter(s) the single-device model does not have: {extra[:4]}")
        if twice:
            parts.append(f"parameters found twice: {dict(list(twice.items())[:3])}")
        raise InvalidArgument(
            f"{what}: the wrapped model's parameters do not match the model's (names as in "
            f"model.named_parameters(), wrapper prefixes {WRAPPER_SEGMENTS} stripped): "
            + "; ".join(parts) + ". Wrap the model the setup is given (not a copy or a new one), "
            "keep its parameter names, and return every parameter it trains")
    return out


def _check_shape(p, full: torch.Tensor, name: str) -> None:
    shape = tuple(p.shape)  # a DTensor's shape is the global one
    if shape != tuple(full.shape):
        raise InvalidArgument(f"parameter {name!r} of the wrapped model has shape {shape}; the "
                              f"single-device model's is {tuple(full.shape)}: the wrapper changed "
                              f"the parameter (a flattened or padded parameter cannot be restored)")


def _piece(p, full: torch.Tensor, part, name: str, rank: int, world: int) -> torch.Tensor:
    """This rank's equal piece of `full` along a declared partition (what it holds)."""
    ranks = part.ranks if part.ranks is not None else tuple(range(world))
    if rank not in ranks:
        raise InvalidArgument(f"partitions[{name!r}] leaves rank {rank} out of ranks {list(ranks)}, "
                              f"yet it holds the parameter: list every rank that holds a piece")
    size = p.shape[part.dim] if p.dim() > part.dim else -1
    if p.dim() != full.dim() or size * len(ranks) != full.shape[part.dim]:
        raise InvalidArgument(f"partitions[{name!r}] does not tile the parameter: rank {rank} holds "
                              f"{tuple(p.shape)}, and {len(ranks)} pieces of that size along dim "
                              f"{part.dim} do not make the single-device {tuple(full.shape)}")
    return full.narrow(part.dim, ranks.index(rank) * size, size)


@torch.no_grad()
def restore(wrapped: torch.nn.Module, initial: dict, names: dict, partitions: dict | None = None,
            rank: int = 0, world: int = 1) -> None:
    """Every trainable parameter of `wrapped` set to its initial value (module docstring);
    a plain shard with a declared partition gets its piece."""
    partitions = partitions or {}
    for n, p in wrapped.named_parameters():
        if n not in names:
            continue
        full = initial[names[n]]
        if names[n] in partitions and not is_dtensor(p):
            p.copy_(_piece(p, full, partitions[names[n]], names[n], rank, world).to(p.device, p.dtype))
            continue
        _check_shape(p, full, names[n])
        if is_dtensor(p):
            from torch.distributed.tensor import distribute_tensor
            piece = distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None)
            p.to_local().copy_(piece.to_local())
        else:
            p.copy_(full.to(p.device, p.dtype))
    # buffers (running statistics a step may move) by name, where the wrapper kept them plain
    proxy = set(initial)
    for n, b in wrapped.named_buffers():
        m = single_device_name(n, proxy)
        if m in initial and not is_dtensor(b) and tuple(b.shape) == tuple(initial[m].shape):
            b.copy_(initial[m].to(b.device, b.dtype))


def clear_gradients(wrapped: torch.nn.Module) -> None:
    """.grad to None (optimizer.zero_grad's default), Megatron's main_grad to zero in place
    (its buffer is shared by the parameters of a bucket)."""
    for p in wrapped.parameters():
        p.grad = None
        main = getattr(p, "main_grad", None)
        if isinstance(main, torch.Tensor):
            main.zero_()
