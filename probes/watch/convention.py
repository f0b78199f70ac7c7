"""A batch's packing convention: how the batch the model receives says where its documents
are, and what the model is told to attend to. Not its token values or its lengths, which
change every batch; the same convention checked once is checked for good.

    convention_of(batch, model=None) -> Convention   (a NamedTuple; .text for the logs)
    document_starts(batch) -> [B, L] bool tensor or None

What it reads (transformers 5.25: DataCollatorWithFlattening returns input_ids, labels and
position_ids restarting at each example, and on request seq_idx [1, N] and the flash-attention
kwargs cu_seq_lens_q/_k (int32 offsets) and max_length_q/_k (python ints)):

1. every key with its kind: a tensor's dtype and rank (never its shape), else the type name
   (max_length_q is an int whose value changes every batch);
2. attention_mask: absent (or None), 2-D all ones (the collator trap beside restarting
   position ids), 2-D with padding, 2-D of document numbers (axolotl's packing: 1, 1, 2,
   2, 2, 3, ..., 0 for padding; packed by itself), or 4-D, where whether the mask lets the first token of
   each document see an earlier token, or the last token before it a later one (crosses),
   or neither (blocks) is part of the convention: a block-diagonal mask and a full causal
   one are both "4-D" (only the rows at document boundaries are read, the boundaries every
   convention declares: restarting position ids, seq_idx, cu_seq_lens; a [1, ...] mask is
   read against every row);
3. position_ids: absent, monotone within each row, or restarting inside a row (a restart on
   a padding token, attention_mask 0, or just after one, does not count: HF fills padding
   positions with 1, and a left-padded row's first real token is at 0), or
   unread (present, but not a [B, L] / [L] tensor: a list, multimodal RoPE's [3, B, L]);
4. the attention implementation the model's config names (config._attn_implementation):
   flash and flex attention read packed position ids, eager and sdpa read the mask; and
   config.use_cache (with a cache, 5.25's mask builder does not look for packed position
   ids); a bool, str or None argument (use_cache=False) is a switch: its value counts.

Cost: the value-dependent parts (2 and 3) are a few element-wise ops on the mask and the
position ids and one read back of 4 booleans (a device sync on an accelerator).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from trainprobes.errors import InvalidArgument

# keys whose presence alone says the batch is packed (flash-attention varlen, Mamba's seq_idx)
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")


class Convention(NamedTuple):
    keys: tuple             # ((key, kind), ...) sorted by key
    mask: str               # absent | 2d-ones | 2d-padded | 2d-ids | 4d | 4d-blocks | 4d-crosses | 4d-mixed | <n>d
    positions: str          # absent | monotone | restart | unread
    boundaries: tuple       # the BOUNDARY_KEYS present
    attention: str | None   # the model's config._attn_implementation, if it has one
    use_cache: bool | None  # the model's config.use_cache: with a cache, transformers 5.25
                            # does not read packed position ids into the mask

    @property
    def packed(self) -> bool:
        """The batch declares more than one document in a row somewhere."""
        return self.positions == "restart" or bool(self.boundaries) or self.mask == "2d-ids"

    @property
    def text(self) -> str:
        keys = ",".join(f"{k}:{v}" for k, v in self.keys)
        return (f"mask={self.mask} positions={self.positions} boundaries="
                f"{'+'.join(self.boundaries) or 'none'} attention={self.attention} "
                f"use_cache={self.use_cache} keys=[{keys}]")


def _kind(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}[{v.dim()}d]"
    if v is None or isinstance(v, (bool, str)):  # a switch (use_cache=False), not data
        return f"{type(v).__name__}={v}"
    return type(v).__name__


def _restarts(batch: Mapping) -> torch.Tensor | None:
    """[B, L - 1] bool, for positions 1 .. L - 1: a position id that does not grow by one
    from the token before, on a token the 2-D mask keeps, after one it keeps (HF's left
    padding, [1, 1, 0, 1, 2], drops to 0 at the first real token: no boundary)."""
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() not in (1, 2) or pos.shape[-1] < 1:
        return None
    pos = pos[None] if pos.dim() == 1 else pos
    r = pos.diff(dim=1) != 1
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == pos.shape:
        keep = mask.to(device=pos.device) != 0
        r &= keep[:, 1:] & keep[:, :-1]
    return r


def _interior_starts(batch: Mapping, B: int, L: int, device, strict: bool = False) -> torch.Tensor:
    """[B, L] bool on `device`: where a document starts inside a row (column 0 False), by
    every convention the batch holds: restarting position ids, seq_idx changing,
    cu_seq_lens_q offsets over the flattened batch, a 2-D mask's document number changing. strict: position ids of another shape
    raise (else they are not read here)."""
    starts = torch.zeros(B, L, dtype=torch.bool, device=device)
    r = _restarts(batch)
    if r is not None:
        if tuple(r.shape) == (B, L - 1):
            starts[:, 1:] |= r.to(device)
        elif strict:
            raise InvalidArgument(f"position_ids has {r.shape[0]} rows of {r.shape[1] + 1}, "
                                  f"input_ids {B} of {L}")
    m = batch.get("attention_mask")
    if isinstance(m, torch.Tensor) and m.dim() == 2 and tuple(m.shape) == (B, L):
        m = m.to(device)  # document numbers (axolotl): a change between two kept tokens
        starts[:, 1:] |= (m[:, 1:] != m[:, :-1]) & (m[:, 1:] != 0) & (m[:, :-1] != 0)
    seq = batch.get("seq_idx")
    if isinstance(seq, torch.Tensor) and seq.numel() == B * L:
        seq = seq.reshape(B, L).to(device)
        starts[:, 1:] |= seq[:, 1:] != seq[:, :-1]
    for key in ("cu_seq_lens_q", "cu_seqlens"):
        cu = batch.get(key)
        if isinstance(cu, torch.Tensor) and cu.dim() == 1:
            flat = torch.zeros(B * L + 1, dtype=torch.bool, device=device)
            flat[cu.to(device).long().clamp(0, B * L)] = True  # no read back: offsets 0, B * L drop
            starts |= flat[:B * L].view(B, L)
            break
    starts[:, 0] = False
    return starts


def _rows(batch: Mapping) -> int | None:
    for key in ("input_ids", "position_ids"):
        v = batch.get(key)
        if isinstance(v, torch.Tensor) and v.dim() == 2:
            return v.shape[0]
    return None


def convention_of(batch: Mapping, model=None) -> Convention:
    """The batch's Convention (see the module docstring)."""
    if not isinstance(batch, Mapping):
        raise InvalidArgument(f"batch is a {type(batch).__name__}; a packing convention is read "
                              "from a dict of tensors (input_ids, attention_mask, position_ids, ...)")
    keys = tuple(sorted((str(k), _kind(v)) for k, v in batch.items()))
    boundaries = tuple(k for k in BOUNDARY_KEYS if batch.get(k) is not None)
    restarts = _restarts(batch)
    mask = batch.get("attention_mask")
    flags = []  # device booleans, read back once: [restart, ones, blocks, crosses]
    flags.append(restarts.any() if restarts is not None else None)
    B = _rows(batch)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if mask.dtype == torch.bool:
            flags.append(mask.all())
        else:  # one pass: 0/1, or document numbers 1, 2, ... (axolotl's packing), 0 padding
            lo, hi = torch.aminmax(mask)
            flags += [lo > 0, hi > 1]
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4 and B is not None \
            and mask.shape[-1] == mask.shape[-2] and mask.shape[0] in (1, B):
        # at each document start s (by every convention the batch declares): may row s see a
        # column before s, or row s - 1 (the last token of the document before) a column
        # from s on? Only those rows are read, not the whole [L, L] mask. bool: True
        # attends; float: additive, 0 attends (HF's min-value fill blocks)
        L = mask.shape[-1]
        b, s_at = _interior_starts(batch, B, L, mask.device).nonzero(as_tuple=True)
        b = b if mask.shape[0] == B else torch.zeros_like(b)  # a [1, ...] mask serves every row
        first, last = mask[b, :, s_at, :], mask[b, :, s_at - 1, :]  # [N, H, L]
        if mask.dtype != torch.bool:
            first, last = first == 0, last == 0
        before = torch.arange(L, device=mask.device) < s_at[:, None, None]
        cross = (first & before).any(-1) | (last & ~before).any(-1)  # [N, H]
        flags += [None, (~cross).any(), cross.any()]
    read = [f for f in flags if f is not None]
    vals = iter(torch.stack(read).cpu().tolist() if read else [])
    got = [next(vals) if f is not None else None for f in flags]
    if batch.get("position_ids") is None:
        positions = "absent"
    else:  # present but not a [B, L] / [L] tensor: unknown, never "absent"
        positions = "unread" if got[0] is None else ("restart" if got[0] else "monotone")
    if not isinstance(mask, torch.Tensor):
        kind = "absent" if mask is None else type(mask).__name__
    elif mask.dim() == 2:
        kind = "2d-ids" if len(got) == 3 and got[2] else "2d-ones" if got[1] else "2d-padded"
    elif mask.dim() == 4 and len(got) == 4:
        blocks, crosses = got[2], got[3]
        kind = {(True, True): "4d-mixed", (True, False): "4d-blocks",
                (False, True): "4d-crosses"}.get((blocks, crosses), "4d")
    else:
        kind = f"{mask.dim()}d"
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    cache = getattr(config, "use_cache", None)
    return Convention(keys, kind, positions, boundaries,
                      attention if isinstance(attention, str) else None,
                      cache if isinstance(cache, bool) else None)


def document_starts(batch: Mapping) -> torch.Tensor | None:
    """[B, L] bool on the CPU: where a document starts, by every convention the batch holds
    (restarting position ids, seq_idx changing, cu_seq_lens_q offsets over the flattened
    batch), together: a boundary any of them declares is one the check must test. None when
    no row holds two documents. Column 0 is always a start."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    B, L = ids.shape
    starts = _interior_starts(batch, B, L, "cpu", strict=True)
    starts[:, 0] = True
    return starts if bool((starts.sum(1) > 1).any()) else None
