"""Check and shape token log-prob pairs: [N] or [B, T], optional mask, optional lengths.

Everything downstream works on a padded [G, T] layout whose rows are the independent units
of the bias test (sequences, or contiguous blocks of a flat stream), plus the flat selection
of real tokens.
"""
from __future__ import annotations

import math

import torch

# log-probs computed in fp32 can come out a hair above 0 for a token of probability ~1
POSITIVE_TOLERANCE = 1e-4
DEFAULT_BLOCKS = 256
# batch means need blocks longer than the correlation: a flat stream of sequences cut into
# blocks shorter than a sequence shares a per-sequence offset between neighbouring blocks and
# the test over-rejects (measured: 29% "biased" at alpha=0.01 for 32 x 48 tokens in 256 blocks,
# 50% for 16 x 512). Blocks are merged in pairs while their means are positively correlated
# at lag 1 (z = r1 sqrt(G) > LAG1_Z, one-sided), down to MIN_BLOCKS (Fishman's batch-means
# batch-size rule: grow the batches until the lag-1 correlation of their means vanishes).
MIN_BLOCKS = 8
LAG1_Z = 2.0


def as_tensor(name: str, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach()
    else:
        try:
            t = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{name} must be a tensor or array of log-probs, got "
                            f"{type(value).__name__} ({e})") from None
    if not (t.is_floating_point()):
        raise TypeError(f"{name} has dtype {t.dtype}, expected a float tensor of log-probs")
    if t.ndim not in (1, 2) or t.numel() == 0:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected a non-empty [N] or [B, T]")
    return t.to(device="cpu", dtype=torch.float32)


def check_logprobs(name: str, lp: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Raise naming the first masked-in entry that is not a log-probability (finite, <= 0).
    Two cheap reductions when all is well; the search runs only on failure."""
    lo, hi = torch.aminmax(lp)  # fast path: padding usually holds valid values too
    if math.isfinite(lo.item()) and math.isfinite(hi.item()) and hi.item() <= POSITIVE_TOLERANCE:
        return
    view = lp if mask is None else torch.where(mask, lp, -1.0)
    lo, hi = torch.aminmax(view)
    if math.isfinite(lo.item()) and math.isfinite(hi.item()) and hi.item() <= POSITIVE_TOLERANCE:
        return
    bad = ~torch.isfinite(view) | (view > POSITIVE_TOLERANCE)
    where = tuple(int(i) for i in bad.nonzero()[0])
    idx = ", ".join(map(str, where))
    v = lp[where].item()
    raise ValueError(f"{name}[{idx}] = {v!r} is not a log-probability (finite and <= 0); "
                     f"{int(bad.sum())} such entries. Pass log-probs (not probs or logits), and mask "
                     f"out padding with mask=")


def row_counts(mask: torch.Tensor) -> torch.Tensor:
    """True entries per row of a bool [G, T] (as int32: a bool .sum() widens to int64, slowly)."""
    return mask.view(torch.uint8).sum(1, dtype=torch.int32)


def _lag1_correlated(train, infer, m) -> bool:
    """True when the means of x = infer - train over consecutive blocks [G, T] are positively
    correlated at lag 1 (z = r1 sqrt(G) > LAG1_Z): the blocks are not independent units."""
    x = torch.where(m, infer.double() - train.double(), 0.0)
    k = m.sum(1)
    ok = k > 0
    means = x.sum(1)[ok] / k[ok]
    G = means.numel()
    if G < 2 * MIN_BLOCKS:
        return False
    d = means - means.mean()
    den = float(torch.dot(d, d))
    if den == 0.0:
        return False
    r1 = float(torch.dot(d[:-1], d[1:])) / den
    return r1 * math.sqrt(G) > LAG1_Z


def pair(train, infer, mask=None, lengths=None, blocks: int = DEFAULT_BLOCKS):
    """Validate and lay out a train/infer pair.

    Returns (train [G, T], infer [G, T], mask [G, T] bool, unit) where unit says what a row is:
    "sequence" (rows of a [B, T] input, or `lengths` splitting a flat input) or "block"
    (a flat input without lengths, cut into `blocks` contiguous blocks: batch means, which keep
    short-range correlation inside a block; halved while neighbouring block means correlate).
    """
    train = as_tensor("train_logprobs", train)
    infer = as_tensor("infer_logprobs", infer)
    if train.shape != infer.shape:
        raise ValueError(f"infer_logprobs has shape {tuple(infer.shape)}, expected "
                         f"{tuple(train.shape)} like train_logprobs")
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.shape != train.shape:
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(train.shape)} "
                             f"like train_logprobs")
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("mask must be boolean or 0/1, got other values")
            mask = mask.bool()
        if not bool(mask.any()):
            raise ValueError("mask selects no tokens; nothing to compare")
    check_logprobs("train_logprobs", train, mask)
    check_logprobs("infer_logprobs", infer, mask)
    if train.ndim == 2:
        if lengths is not None:
            raise ValueError("lengths= is for flat [N] inputs; a [B, T] input's rows are its sequences")
        m = torch.ones_like(train, dtype=torch.bool) if mask is None else mask
        return train, infer, m, "sequence"
    n = train.numel()
    m = torch.ones(n, dtype=torch.bool) if mask is None else mask
    if lengths is not None:
        lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
        if lengths.numel() == 0 or int(lengths.min()) < 1 or int(lengths.sum()) != n:
            raise ValueError(f"lengths must be positive and sum to the {n} tokens, got "
                             f"{lengths.numel()} lengths summing to {int(lengths.sum())}")
        unit = "sequence"
        rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        cols = torch.arange(n) - starts[rows]
        G, T = lengths.numel(), int(lengths.max())
    else:  # contiguous blocks: pad to G * T and view, no index scatter over every token
        G = min(blocks, n)
        while True:
            T = -(-n // G)
            G = -(-n // T)
            pad = G * T - n
            grid = tuple(torch.cat([v, torch.full((pad,), fill, dtype=v.dtype)]).view(G, T)
                         for v, fill in ((train, 0.0), (infer, 0.0), (m, False)))
            if G // 2 < MIN_BLOCKS or not _lag1_correlated(*grid):
                return grid + ("block",)
            G //= 2
    out = []
    for v, fill in ((train, 0.0), (infer, 0.0), (m, False)):
        grid = torch.full((G, T), fill, dtype=v.dtype)
        grid[rows, cols] = v
        out.append(grid)
    return out[0], out[1], out[2], unit
