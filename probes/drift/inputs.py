"""Check and shape token log-prob pairs: [N] or [B, T], optional mask, optional lengths.

Everything downstream works on a padded [G, T] layout whose rows are the independent units
of the bias test (sequences, or contiguous blocks of a flat stream), with a mask of real
tokens when there is padding.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from trainprobes.errors import InvalidArgument, InvalidType

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
UNITS = ("sequence", "block")


class Layout(NamedTuple):
    """A validated pair laid out as [G, T] rows (the units of the bias test).

    mask is None when every entry is a real token; row_n counts the real tokens per row (int32,
    None with no mask) and n_tokens all of them. finite_pad is True when every entry, padding
    included, is a valid log-prob (finite, <= 0 up to the tolerance).
    """

    train: torch.Tensor
    infer: torch.Tensor
    mask: torch.Tensor | None
    unit: str
    n_tokens: int
    finite_pad: bool
    row_n: torch.Tensor | None = None


def as_tensor(name: str, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach()
    else:
        try:
            t = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidType(f"{name} must be a tensor or array of log-probs, got "
                              f"{type(value).__name__} ({e})") from None
    if not (t.is_floating_point()):
        raise InvalidType(f"{name} has dtype {t.dtype}, expected a float tensor of log-probs")
    if t.ndim not in (1, 2) or t.numel() == 0:
        raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected a non-empty [N] or [B, T]")
    return t.to(device="cpu", dtype=torch.float32).contiguous()


def _valid(lo: torch.Tensor, hi: torch.Tensor) -> bool:
    lo, hi = lo.item(), hi.item()
    return math.isfinite(lo) and math.isfinite(hi) and hi <= POSITIVE_TOLERANCE


def check_logprobs(name: str, lp: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Raise naming the first masked-in entry that is not a log-probability (finite, <= 0).

    Returns True when every entry, padding included, is valid (one aminmax: the usual case),
    False when only the masked-in ones are. The search for the culprit runs only on failure.
    """
    if _valid(*torch.aminmax(lp)):
        return True
    view = lp if mask is None else torch.where(mask, lp, -1.0)
    if mask is not None and _valid(*torch.aminmax(view)):
        return False
    bad = ~torch.isfinite(view) | (view > POSITIVE_TOLERANCE)
    where = tuple(int(i) for i in bad.nonzero()[0])
    idx = ", ".join(map(str, where))
    v = lp[where].item()
    raise InvalidArgument(f"{name}[{idx}] = {v!r} is not a log-probability (finite and <= 0); "
                          f"{int(bad.sum())} such entries. Pass log-probs (not probs or logits), and "
                          f"mask out padding with mask=")


def _count(u: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum of a 0/1 uint8 [G, T] along dim (0 or 1), as int32. Spans of up to 255 entries are
    summed in uint8 (they cannot overflow), then the spans in int32: summing in int32
    directly converts every entry first, ~10x slower. Spans divide the dimension when a
    divisor >= 128 allows (one reduction), else 255-spans plus the rest (two)."""
    n = u.shape[dim]
    span = next((s for s in range(min(n, 255), 127, -1) if n % s == 0), 255)
    q = n // span * span
    spans = u.narrow(dim, 0, q).unflatten(dim, (q // span, span)).sum(dim + 1, dtype=torch.uint8)
    out = spans.sum(dim, dtype=torch.int32)
    return out + u.narrow(dim, q, n - q).sum(dim, dtype=torch.uint8) if q < n else out


def row_counts(mask: torch.Tensor) -> torch.Tensor:
    """True entries per row of a bool [G, T] (int32)."""
    return _count(mask.view(torch.uint8), 1)


def column_counts(mask: torch.Tensor) -> torch.Tensor:
    """True entries per column of a bool [G, T] (int32)."""
    return _count(mask.view(torch.uint8), 0)


def _lag1_correlated(sums: torch.Tensor, counts: torch.Tensor) -> bool:
    """True when the means of consecutive blocks (sums, counts: [G]) are positively correlated
    at lag 1 (z = r1 sqrt(G) > LAG1_Z): the blocks are not independent units."""
    ok = counts > 0
    means = sums[ok] / counts[ok]
    G = means.numel()
    if G < 2 * MIN_BLOCKS:
        return False
    d = means - means.mean()
    den = float(torch.dot(d, d))
    if den == 0.0:
        return False
    r1 = float(torch.dot(d[:-1], d[1:])) / den
    return r1 * math.sqrt(G) > LAG1_Z


def _block_grid(train, infer, mask, n: int, blocks: int):
    """Cut a flat stream into G contiguous blocks of T = ceil(n / G) (the last padded), G
    halved while neighbouring block means correlate (judged on x in float64, formed once)."""
    G = min(blocks, n)
    T = -(-n // G)
    G = -(-n // T)
    x = infer.double() - train.double()
    if mask is not None:
        x = torch.where(mask, x, 0.0)
    cnt = torch.ones(n, dtype=torch.float64) if mask is None else mask.double()
    while G // 2 >= MIN_BLOCKS:
        pad = G * T - n
        s = torch.nn.functional.pad(x, (0, pad)).view(G, T).sum(1)
        c = torch.nn.functional.pad(cnt, (0, pad)).view(G, T).sum(1)
        if not _lag1_correlated(s, c):
            break
        G //= 2
        T = -(-n // G)
        G = -(-n // T)
    pad = G * T - n
    m = torch.ones(n, dtype=torch.bool) if mask is None else mask
    grid = [torch.nn.functional.pad(v, (0, pad), value=fill).view(G, T)
            for v, fill in ((train, 0.0), (infer, 0.0))]
    return grid[0], grid[1], (torch.nn.functional.pad(m, (0, pad), value=False).view(G, T)
                              if pad or mask is not None else None)


def pair(train, infer, mask=None, lengths=None, blocks: int = DEFAULT_BLOCKS) -> Layout:
    """Validate and lay out a train/infer pair as a Layout.

    unit says what a row is: "sequence" (rows of a [B, T] input, or `lengths` splitting a flat
    input) or "block" (a flat input without lengths, cut into `blocks` contiguous blocks: batch
    means, which keep short-range correlation inside a block; halved while neighbouring block
    means correlate).
    """
    train = as_tensor("train_logprobs", train)
    infer = as_tensor("infer_logprobs", infer)
    if train.shape != infer.shape:
        raise InvalidArgument(f"infer_logprobs has shape {tuple(infer.shape)}, expected "
                              f"{tuple(train.shape)} like train_logprobs")
    n_tokens = train.numel()
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.shape != train.shape:
            raise InvalidArgument(f"mask has shape {tuple(mask.shape)}, expected {tuple(train.shape)} "
                                  f"like train_logprobs")
        if mask.dtype != torch.bool:
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise InvalidArgument("mask must be boolean or 0/1, got other values")
            mask = mask.bool()
        mask = mask.contiguous()
        rows = row_counts(mask if mask.ndim == 2 else mask.view(1, -1))  # one pass: the count and the rows
        n_tokens = int(rows.sum())
        if n_tokens == 0:
            raise InvalidArgument("mask selects no tokens; nothing to compare")
        if n_tokens == mask.numel():
            mask = None
    finite_pad = check_logprobs("train_logprobs", train, mask)
    finite_pad &= check_logprobs("infer_logprobs", infer, mask)
    if train.ndim == 2:
        if lengths is not None:
            raise InvalidArgument("lengths= is for flat [N] inputs; a [B, T] input's rows are its sequences")
        return Layout(train, infer, mask, "sequence", n_tokens, finite_pad, None if mask is None else rows)
    n = train.numel()
    if lengths is None:  # contiguous blocks: pad to G * T and view, no index scatter over every token
        t, i, m = _block_grid(train, infer, mask, n, blocks)
        return Layout(t, i, m, "block", n_tokens, finite_pad, None if m is None else row_counts(m))
    lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
    if lengths.numel() == 0 or int(lengths.min()) < 1 or int(lengths.sum()) != n:
        raise InvalidArgument(f"lengths must be positive and sum to the {n} tokens, got "
                              f"{lengths.numel()} lengths summing to {int(lengths.sum())}")
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(n) - starts[rows]
    G, T = lengths.numel(), int(lengths.max())
    out = []
    m = torch.ones(n, dtype=torch.bool) if mask is None else mask
    for v, fill in ((train, 0.0), (infer, 0.0), (m, False)):
        grid = torch.full((G, T), fill, dtype=v.dtype)
        grid[rows, cols] = v
        out.append(grid)
    return Layout(out[0], out[1], out[2], "sequence", n_tokens, finite_pad, row_counts(out[2]))
