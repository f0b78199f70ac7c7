"""Which tokens carry the drift: by the trainer's probability of the token (low-probability
tokens drift most), by position, by sequence, and the heaviest tokens, with their text when
a tokenizer is given (anything with .decode([id]) or .convert_ids_to_tokens)."""
from __future__ import annotations

import math

import torch


def _rows(x, mask, groups) -> list:
    out = []
    for label, sel in groups:  # loop over a handful of groups
        sel = sel & mask
        n = int(sel.sum())
        if n:
            v = x[sel]
            out.append({**label, "n": n, "mean_log_ratio": v.mean().item(),
                        "mean_abs_log_ratio": v.abs().mean().item(),
                        "share_sq": (v * v).sum().item() / max((x[mask] ** 2).sum().item(), 1e-300)})
    return out


def carriers(x: torch.Tensor, mask: torch.Tensor, lp_train: torch.Tensor, tokens: torch.Tensor,
             tokenizer=None, top: int = 10, spans: int = 8) -> dict:
    """x, mask, lp_train (the trainer's log-prob of each scored token), tokens: [B, T]."""
    B, T = x.shape
    p = lp_train.exp()
    buckets = []
    for b in range(8):  # half-decades: p in (10^-(b+1)/2, 10^-b/2], the last everything below
        hi, lo = 10 ** (-b / 2), (0.0 if b == 7 else 10 ** (-(b + 1) / 2))
        buckets.append(({"p_high": hi, "p_low": lo}, (p <= hi) & (p > lo)))
    edges = torch.linspace(0, T, min(spans, T) + 1).round().long().tolist()
    pos = torch.arange(T).expand(B, T)
    by_pos = [({"start": a, "end": b}, (pos >= a) & (pos < b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    m = mask.double()
    seq = ((x.abs() * m).sum(1) / m.sum(1).clamp_min(1)).tolist()
    flat = torch.where(mask, x.abs(), -1.0).reshape(-1)
    k = min(top, int(mask.sum()))
    heavy = []
    if k:
        vals, idx = flat.topk(k)
        for v, i in zip(vals.tolist(), idx.tolist()):
            if v <= 0:
                break
            b, t = divmod(i, T)
            tid = int(tokens[b, t])
            row = {"sequence": b, "position": t, "token_id": tid, "log_ratio": x[b, t].item(),
                   "p_train": p[b, t].item()}
            if tokenizer is not None:
                row["text"] = _text(tokenizer, tid)
            heavy.append(row)
    return {"by_probability": _rows(x, mask, buckets), "by_position": _rows(x, mask, by_pos),
            "by_sequence_mean_abs": [v if math.isfinite(v) else None for v in seq],
            "heaviest_tokens": heavy}


def _text(tokenizer, tid: int) -> str:
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return str(tokenizer.convert_ids_to_tokens(tid))
    return str(tokenizer.decode([tid]))
