"""A tiny MoE transformer block (pre-norm causal self-attention, then a top-k softmax MoE FFN)
whose attention mask can be made off-by-one, to probe causality end to end.

With `off_by_one=True` position t also attends to t+1 (the classic `triu(diagonal=2)` slip
instead of `diagonal=1`). One block, so a perturbation starting at position c+1 reaches
exactly position c: the leak positions are known exactly.

Experts are evaluated densely (every expert on every token, then gathered), which is exact
for the chosen experts and keeps the block vectorised; it is a reference, not a kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from trainprobes.errors import InvalidArgument
from trainprobes.reference.routing import topk_softmax
from trainprobes.validation import check_int, check_tensor

__all__ = ["MoEOutput", "TinyMoEBlock", "causal_block", "off_by_one_block"]


class MoEOutput(NamedTuple):
    hidden: torch.Tensor         # [B, T, D] block output
    expert_ids: torch.Tensor     # [B, T, k] experts chosen per token
    router_probs: torch.Tensor   # [B, T, E] routing scores the choice was taken from


class TinyMoEBlock(nn.Module):
    """x [B, T, D] float (or [B, T] token ids when vocab is given) -> MoEOutput.

    Weights are drawn from `seed`, so two blocks built with the same arguments are identical.
    """

    def __init__(self, d_model: int = 64, n_heads: int = 2, n_experts: int = 8, k: int = 2,
                 d_ff: int = 128, vocab: int | None = None, off_by_one: bool = False,
                 seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_experts", n_experts),
                            ("d_ff", d_ff)):
            check_int(value, name, min=1)
        if d_model % n_heads:
            raise InvalidArgument(f"d_model={d_model!r} must be divisible by n_heads={n_heads!r}")
        check_int(k, "k", min=1, max=n_experts, hint=f"experts per token, n_experts={n_experts}")
        self.d_model, self.n_heads, self.k, self.off_by_one = d_model, n_heads, k, off_by_one
        g = torch.Generator().manual_seed(seed)

        def w(*shape, fan_in):
            # drawn in fp32 then cast, so an fp64 block holds the fp32 block's weights exactly
            return nn.Parameter((torch.randn(*shape, generator=g) / fan_in ** 0.5).to(dtype))

        self.embed = w(vocab, d_model, fan_in=1) if vocab else None
        self.qkv = w(d_model, 3 * d_model, fan_in=d_model)
        self.proj = w(d_model, d_model, fan_in=d_model)
        self.router = w(d_model, n_experts, fan_in=d_model)
        self.w_in = w(n_experts, d_model, d_ff, fan_in=d_model)
        self.w_out = w(n_experts, d_ff, d_model, fan_in=d_ff)

    def attention_mask(self, T: int, device=None) -> torch.Tensor:
        """[T, T] bool, True where query t may attend to key s: s <= t (s <= t+1 when off-by-one)."""
        pos = torch.arange(T, device=device)
        return pos[None, :] <= pos[:, None] + int(self.off_by_one)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        if self.embed is not None:
            check_tensor(x, "x", kind="integer", ndim=2,
                         hint="token ids [B, T] for a block with an embedding")
            if x.numel() and (x.min() < 0 or x.max() >= self.embed.shape[0]):
                raise InvalidArgument(f"token ids must be in [0, {self.embed.shape[0]}), got "
                                      f"[{int(x.min())}, {int(x.max())}]")
            h = self.embed[x]
        else:
            check_tensor(x, "x", kind="floating", shape=(None, None, self.d_model),
                         hint=f"hidden states [B, T, {self.d_model}]")
            h = x.to(self.qkv.dtype)
        B, T, D = h.shape
        H = self.n_heads
        # 1. causal self-attention (pre-norm), mask applied before the softmax
        q, k, v = (_norm(h) @ self.qkv).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / (D // H) ** 0.5
        att = att.masked_fill(~self.attention_mask(T, h.device), float("-inf")).softmax(-1)
        h = h + (att @ v).transpose(1, 2).reshape(B, T, D) @ self.proj
        # 2. router: top-k softmax per token
        u = _norm(h)
        ids, probs = topk_softmax(u @ self.router, self.k)
        weights = probs.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        # 3. experts, densely: [B, T, E, D], then gather the chosen k
        y = torch.einsum("btef,efd->bted",
                         torch.nn.functional.gelu(torch.einsum("btd,edf->btef", u, self.w_in)),
                         self.w_out)
        chosen = y.gather(2, ids[..., None].expand(B, T, self.k, D))
        return MoEOutput(h + (weights[..., None] * chosen).sum(2), ids, probs)


def _norm(h: torch.Tensor) -> torch.Tensor:
    """RMS norm over features (per token: causal)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def _block_for(x: torch.Tensor, off_by_one: bool) -> TinyMoEBlock:
    if x.dtype == torch.long:
        return TinyMoEBlock(vocab=1000, off_by_one=off_by_one)
    return TinyMoEBlock(d_model=x.shape[-1], off_by_one=off_by_one, dtype=x.dtype)


def causal_block(x: torch.Tensor) -> MoEOutput:
    """Import-path target: a fixed-seed causal block. Token ids [B, T] (vocab 1000) or
    hidden states [B, T, D] (runs in x's dtype, so fp64 input runs the block in fp64)."""
    return _block_for(x, False)(x)


def off_by_one_block(x: torch.Tensor) -> MoEOutput:
    """Import-path target: the same block with the off-by-one attention mask (t sees t+1)."""
    return _block_for(x, True)(x)
