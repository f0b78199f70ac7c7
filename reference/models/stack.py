"""A tiny residual stack in plain torch (no transformers): embedding, blocks of
pre-norm MLP + token-mixing causal mean, final norm, head. Each block is an nn.Module in one
ModuleList, called through its forward, so activation patching (trainprobes.drift.localize)
sees it as an HF decoder would be seen. Weights are drawn from `seed`."""
from __future__ import annotations

import torch
from torch import nn


class StackBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)      # causal mean over positions, then a projection
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, hidden_states):
        h = self.norm(hidden_states)
        L = h.shape[1]
        w = torch.ones(L, L, dtype=h.dtype).tril()
        mixed = (w / w.sum(1, keepdim=True)) @ h
        return hidden_states + self.mix(mixed) + self.mlp(h)


class TinyStack(nn.Module):
    """forward(input_ids, attention_mask=None) -> logits [B, L, vocab]."""

    def __init__(self, vocab: int = 64, d: int = 32, n_blocks: int = 3, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(StackBlock(d) for _ in range(n_blocks))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
        self.vocab = vocab

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))
