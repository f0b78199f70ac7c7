"""MoE routing between two engines on the same tokens: R3's two figures (arXiv 2510.11370:
the fraction of router decisions that differ per layer, and the fraction of tokens that
differ in at least one layer) and how near a tie each flip was.

A token's decision at a router is its top-k expert SET (the order inside the set does not
change the output). The margin of a decision is p_(k) - p_(k+1), the trainer's gap between
the last expert chosen and the first left out: a flip at a margin of rounding size is a
near-tie any numerics can turn; a flip at a wide margin needs a different router.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RouterFlips:
    name: str
    frac_flipped: float          # tokens whose top-k set differs
    n_flipped: int
    median_margin_flipped: float  # the trainer's p_(k) - p_(k+1) at flipped tokens (nan: none)
    max_margin_flipped: float
    median_margin: float         # the same over every token, for scale


@dataclass
class Routing:
    routers: list                 # [RouterFlips] per router, in call order
    frac_tokens_any_layer: float  # tokens whose set differs in at least one layer
    frac_decisions: float         # all decisions (token x router) that differ

    def per_layer(self) -> dict:
        return {r.name: r.frac_flipped for r in self.routers}


def sets_differ(ia: torch.Tensor, ib: torch.Tensor) -> torch.Tensor:
    return (ia.sort(-1).values != ib.sort(-1).values).any(-1)


def _margin(probs: torch.Tensor, k: int) -> torch.Tensor:
    top = probs.topk(min(k + 1, probs.shape[-1]), dim=-1).values
    return top[:, k - 1] - top[:, k] if top.shape[-1] > k else torch.full_like(top[:, 0], float("inf"))


def routing(a: dict, b: dict, mask: torch.Tensor) -> Routing | None:
    """From two recorded runs (trainer a, engine b: name -> [Call]); None without routers."""
    flat = mask.reshape(-1)
    rows, any_flip, n_dec, n_flip = [], torch.zeros_like(flat), 0, 0
    for name, calls in a.items():
        if not calls or calls[0].indices is None or not b.get(name):
            continue
        ia = torch.cat([c.indices for c in calls])
        ib = torch.cat([c.indices for c in b[name]])
        pa = torch.cat([c.probs for c in calls])
        m = flat.repeat(len(calls)) if ia.shape[0] == flat.numel() * len(calls) else torch.ones(
            ia.shape[0], dtype=torch.bool)
        flip = sets_differ(ia, ib) & m
        marg = _margin(pa, ia.shape[-1])
        fm = marg[flip]
        rows.append(RouterFlips(name, flip.sum().item() / max(1, int(m.sum())), int(flip.sum()),
                                fm.median().item() if fm.numel() else float("nan"),
                                fm.max().item() if fm.numel() else float("nan"),
                                marg[m].median().item()))
        if flip.numel() == flat.numel():
            any_flip |= flip
        n_dec += int(m.sum())
        n_flip += int(flip.sum())
    if not rows:
        return None
    return Routing(rows, any_flip[flat].double().mean().item(), n_flip / max(1, n_dec))
