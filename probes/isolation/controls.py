"""Targets whose isolation verdicts are known from their mechanism: the probes' controls,
importable by path for the CLI, the audit and users' own tests.

Packed documents (fn(tokens, packing) -> per-token outputs [B, L, 16], vocabulary 50):
  block_diagonal   attention within the document, causal: isolated
  causal_over_row  one causal mask over the whole row (the missing document mask): earlier
                   documents leak forward
  bidirectional    no mask at all: leaks both ways, and reads the future
  rounding_noise   block_diagonal plus (y + t) - t with t the row's total: isolated in exact
                   arithmetic, while other documents change the rounding (as data-dependent
                   tiling does): rounding noise that the fp64 twin must excuse
Batch invariance (fn(rows [b, 256]) -> [b, 64], rows from integer_rows):
  exact_matmul     integer-valued operands: every partial sum is exact in fp32 (|sum| < 2^24),
                   so any order, tiling or kernel gives the same bits: invariant
  split_by_batch   the reduction split into as many chunks as the batch has rows, each
                   partial sum rounded to bf16 (split-K chosen by M): variant at every size
"""
from __future__ import annotations

import torch

__all__ = ["PackedAttention", "block_diagonal", "causal_over_row", "bidirectional", "rounding_noise",
           "exact_matmul", "split_by_batch", "integer_rows", "VOCAB"]

VOCAB, WIDTH = 50, 16


class PackedAttention(torch.nn.Module):
    """Embedding plus one attention layer over a packed row; `mask` says which keys a query
    sees: "block" (same document, causal), "causal" (whole row, causal), "none"."""

    def __init__(self, mask: str = "block", seed: int = 0, noise: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, WIDTH, generator=g))
        self.wq, self.wk, self.wv = (torch.nn.Parameter(torch.randn(WIDTH, WIDTH, generator=g) / 4)
                                     for _ in range(3))
        self.mask, self.noise = mask, noise

    def forward(self, tokens, packing):
        h = self.emb[tokens]
        s = (h @ self.wq) @ (h @ self.wk).transpose(1, 2)
        L = tokens.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=tokens.device).tril()
        if self.mask == "block":
            ids = packing.doc_ids(tokens.device)
            allowed = (ids[:, :, None] == ids[:, None, :]) & causal
        elif self.mask == "causal":
            allowed = causal.expand(len(tokens), L, L)
        else:
            allowed = torch.ones(len(tokens), L, L, dtype=torch.bool, device=tokens.device)
        y = h + s.masked_fill(~allowed, float("-inf")).softmax(-1) @ (h @ self.wv)
        if self.noise:
            t = y.sum(1, keepdim=True)  # its ulp stays within 32 ulps of y: noise-sized
            y = (y + t) - t
        return y


def block_diagonal(seed: int = 0) -> PackedAttention:
    return PackedAttention("block", seed)


def causal_over_row(seed: int = 0) -> PackedAttention:
    return PackedAttention("causal", seed)


def bidirectional(seed: int = 0) -> PackedAttention:
    return PackedAttention("none", seed)


def rounding_noise(seed: int = 0) -> PackedAttention:
    return PackedAttention("block", seed, noise=True)


def _weights() -> torch.Tensor:
    return torch.randint(-8, 8, (256, 64), generator=torch.Generator().manual_seed(0)).float()


def integer_rows(seed: int = 0, n: int = 6) -> torch.Tensor:
    """[n, 256] integer-valued float rows in [-8, 8)."""
    return torch.randint(-8, 8, (n, 256), generator=torch.Generator().manual_seed(seed)).float()


def exact_matmul(rows: torch.Tensor) -> torch.Tensor:
    return rows @ _weights().to(rows.device)


def split_by_batch(rows: torch.Tensor) -> torch.Tensor:
    w = _weights().to(rows.device)
    parts = torch.tensor_split(torch.arange(rows.shape[1]), rows.shape[0])
    return sum((rows[:, k] @ w[k]).bfloat16().float() for k in parts)
