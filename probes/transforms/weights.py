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

__all__ = ["single_device_name", "tied_aliases", "name_map", "check_held", "restore", "clear_gradients", "is_dtensor"]


def is_dtensor(t) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def tied_aliases(model: torch.nn.Module) -> dict:
    """{alias: single-device name} of the trainable parameters the model holds under several
    names (a head tied to the embedding): named_parameters() lists each once, under its
    first name, but a pipeline stage that keeps only the head holds it as `head.weight`."""
    first, out = {}, {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            out[n] = first.setdefault(id(p), n)
    return {a: n for a, n in out.items() if a != n}


def single_device_name(name: str, proxy: set, aliases: dict | None = None) -> str:
    """`name` as the single-device model spells it: wrapper segments removed one at a time,
    stopping at the first spelling that is a proxy name (a model may have its own child
    called `module`: DDP over it gives `module.module.0.weight`, which is `module.0.weight`)
    or another name of a tied parameter (aliases: tied_aliases, mapped to the proxy's).
    Wrappers nest anywhere (FSDP1 or checkpointing around a block), so when no prefix-strip
    is a proxy name, every wrapper segment is dropped as the last resort."""
    aliases = aliases or {}
    parts = name.split(".")
    while True:
        spelled = ".".join(parts)
        if spelled in proxy:
            return spelled
        if spelled in aliases:
            return aliases[spelled]
        i = next((k for k, seg in enumerate(parts[:-1]) if seg in WRAPPER_SEGMENTS), None)
        if i is None:
            return spelled
        parts = parts[:i] + parts[i + 1:]


def trainable(wrapped: torch.nn.Module, units: list = ()) -> list:
    """[(name, parameter or None)] of what `wrapped` trains: its trainable parameters, the
    originals inside FSDP1 flat parameters in their place (units:
    trainprobes.transforms.flat.flat_units; None: held inside a flat parameter)."""
    flat = set().union(*(u.ids for u in units)) if units else set()
    out = [(n, p) for n, p in wrapped.named_parameters() if p.requires_grad and id(p) not in flat]
    return out + [(n, None) for u in units for n in u.names]


def name_map(wrapped: torch.nn.Module, proxy: list, what: str, units: list = (),
             aliases: dict | None = None) -> dict:
    """{wrapped name: proxy name} for every trainable parameter this rank holds, or
    InvalidArgument naming the parameters duplicated or the model does not have, with the
    closest names missing. A rank may hold a subset (a pipeline stage deletes the other
    stages' layers, keeping its names): check_held then checks, over all ranks, that each
    parameter is held somewhere."""
    import difflib
    want = set(proxy)
    out, seen = {}, {}
    for n, _ in trainable(wrapped, units):
        m = single_device_name(n, want, aliases)
        out[n] = m
        seen.setdefault(m, []).append(n)
    twice = {m: ns for m, ns in seen.items() if len(ns) > 1}
    extra = [n for n, m in out.items() if m not in want]
    if twice or extra:
        missing = [n for n in proxy if n not in seen]
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


def check_held(names: dict, proxy: list, what: str, ctx) -> None:
    """Every parameter of the single-device model held by some rank (collective: a MAX
    all-reduce of this rank's [parameters] mask); else InvalidArgument naming those none holds."""
    import torch.distributed as dist
    mine = set(names.values())
    mask = torch.tensor([float(n in mine) for n in proxy], device=ctx.device)
    dist.all_reduce(mask, op=dist.ReduceOp.MAX)
    missing = [n for n, m in zip(proxy, mask.cpu().tolist()) if not m]
    if missing:
        raise InvalidArgument(f"{what}: no rank holds {len(missing)} parameter(s) of the single-device "
                              f"model, e.g. {missing[:5]} (rank {ctx.rank} holds {sorted(mine)[:4]}...): "
                              f"wrap the model the setup is given, keep its parameter names, and keep "
                              f"every parameter on some rank")


def _check_shape(p, full: torch.Tensor, name: str) -> None:
    shape = tuple(p.shape)  # a DTensor's shape is the global one
    if shape != tuple(full.shape):
        raise InvalidArgument(f"parameter {name!r} of the wrapped model has shape {shape}; the "
                              f"single-device model's is {tuple(full.shape)}: the wrapper changed "
                              f"the parameter (a flattened or padded parameter cannot be restored)")


@torch.no_grad()
def restore(wrapped: torch.nn.Module, initial: dict, names: dict, layouts: dict | None = None,
            rank: int = 0, units: list = ()) -> None:
    """Every trainable parameter of `wrapped` set to its initial value (module docstring);
    a plain shard with a declared partition gets its piece (layouts: {name:
    trainprobes.transforms.readout.Piece}), an FSDP1 unit its flat shard."""
    from trainprobes.transforms.flat import restore_flat
    layouts = layouts or {}
    for unit in units:
        restore_flat(unit, initial, names)
    for n, p in trainable(wrapped, units):
        if n not in names or p is None:
            continue
        full = initial[names[n]]
        if names[n] in layouts:
            piece = layouts[names[n]]
            part = full.narrow(piece.dim, piece.offset(rank), piece.sizes[rank])
            p.copy_(part.to(p.device, p.dtype))
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
