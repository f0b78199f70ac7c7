"""A tiny decoder-only transformer LM with two engines that compute the same math differently.

training engine  `train_logprobs`: one full-sequence forward over a RIGHT-padded batch of
                 prompt+completion, in fp32 or bf16, log-softmax at the temperature the
                 trainer applies (1.0 unless told).
inference engine `generate`: prefill then incremental KV-cache decode over LEFT-padded
                 micro-batches (a different batch composition), in bf16 by default, sampling
                 with temperature / top-p and reporting the sampled tokens' log-probs the way
                 vLLM does: "raw" (the model's distribution, vLLM's default `raw_logprobs`)
                 or "processed" (after temperature and top-p, the distribution actually
                 sampled from; vLLM `logprobs_mode="processed_logprobs"`).

Same weights, same positions, same masks: at fp32 on both sides the two engines differ only
by reduction order (different GEMM shapes), so any larger drift comes from precision or from
a mismatch in what is reported. No probing here; trainprobes.drift measures the drift.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from trainprobes.errors import InvalidArgument
from trainprobes.validation import (
    check_choice,
    check_int,
    check_number,
    check_seed,
    check_tensor,
    check_type,
)

LOGPROB_MODES = ("raw", "processed")


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 128
    logit_scale: float = 4.0  # peaked next-token distributions, like a trained LM (entropy ~ 1-3 nats)
    eos_id: int = 0


class TinyLM(torch.nn.Module):
    """Pre-LayerNorm decoder with learned absolute positions; weights drawn from `seed`."""

    def __init__(self, config: LMConfig = LMConfig(), seed: int = 0):
        super().__init__()
        c = self.config = config
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
            check_int(getattr(c, name), name, min=1)
        if c.d_model % c.n_heads:
            raise InvalidArgument(f"d_model={c.d_model!r} must be a multiple of n_heads={c.n_heads!r}")
        g = torch.Generator().manual_seed(check_seed(seed))

        def w(*shape, std):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * std)

        d = c.d_model
        self.tok = w(c.vocab_size, d, std=1.0)
        self.pos = w(c.max_len, d, std=0.5)
        self.layers = torch.nn.ModuleList()
        for _ in range(c.n_layers):
            layer = torch.nn.Module()
            layer.ln1 = torch.nn.LayerNorm(d)
            layer.ln2 = torch.nn.LayerNorm(d)
            layer.qkv = w(3 * d, d, std=d ** -0.5)
            layer.proj = w(d, d, std=(2 * d * c.n_layers) ** -0.5)
            layer.up = w(4 * d, d, std=d ** -0.5)
            layer.down = w(d, 4 * d, std=(8 * d * c.n_layers) ** -0.5)
            self.layers.append(layer)
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = w(c.vocab_size, d, std=c.logit_scale * d ** -0.5)

    def forward(self, tokens, positions, key_mask, cache=None):
        """Logits for `tokens` [B, L] at `positions` [B, L].

        key_mask [B, Lk] marks real (non-pad) keys over the cache plus these tokens; attention
        is causal within the new tokens and sees every cached key. `cache` is a list of
        (k, v) per layer, each [B, H, Lc, dh]; the updated cache is returned.
        """
        c = self.config
        B, L = tokens.shape
        H, dh = c.n_heads, c.d_model // c.n_heads
        dtype = self.tok.dtype
        h = self.tok[tokens] + self.pos[positions]
        Lc = 0 if cache is None else cache[0][0].shape[2]
        # causal over the new tokens, full over the cache, and never onto padding
        causal = torch.ones(L, Lc + L, dtype=torch.bool).tril(Lc)
        allowed = causal[None, None] & key_mask[:, None, None, :]
        new_cache = []
        for i, layer in enumerate(self.layers):
            x = layer.ln1(h)
            q, k, v = (x @ layer.qkv.T).view(B, L, 3, H, dh).permute(2, 0, 3, 1, 4)
            if cache is not None:
                k = torch.cat([cache[i][0], k], dim=2)
                v = torch.cat([cache[i][1], v], dim=2)
            new_cache.append((k, v))
            scores = (q @ k.transpose(-1, -2)) * dh ** -0.5
            scores = scores.masked_fill(~allowed, torch.finfo(dtype).min)
            att = torch.softmax(scores.float(), dim=-1).to(dtype)
            h = h + (att @ v).transpose(1, 2).reshape(B, L, -1) @ layer.proj.T
            h = h + F.gelu(layer.ln2(h) @ layer.up.T) @ layer.down.T
        return self.ln_f(h) @ self.head.T, new_cache


_ENGINE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_dtype(name, dtype):
    check_choice(dtype, name, _ENGINE_DTYPES, hint="use torch.float32 or torch.bfloat16")


def _check_sampling(temperature, top_p):
    check_number(temperature, "temperature", min=0, min_open=True,
                 hint="greedy is not a distribution: use a small temperature such as 1e-3")
    check_number(top_p, "top_p", min=0, max=1, min_open=True)


def _token_list(name, seqs, vocab_size):
    check_type((list, tuple), seqs, name, hint="a non-empty list of 1-D token id tensors")
    if not seqs:
        raise InvalidArgument(f"{name}=[] is empty; pass a non-empty list of 1-D token id tensors")
    out = []
    for i, s in enumerate(seqs):
        s = torch.as_tensor(s, dtype=torch.long)
        if s.ndim != 1 or s.numel() == 0:
            raise InvalidArgument(f"{name}[{i}] has shape {tuple(s.shape)}, expected a non-empty "
                                  f"1-D tensor")
        if int(s.min()) < 0 or int(s.max()) >= vocab_size:
            raise InvalidArgument(f"{name}[{i}] has token ids outside [0, {vocab_size}): "
                                  f"min {int(s.min())}, max {int(s.max())}")
        out.append(s)
    return out


def _processed_logprobs(logits, temperature, top_p):
    """Log-probs of the distribution sampled from: logits / T, then the top-p nucleus
    renormalised (tokens outside get -inf). Steps as in vLLM's sampler: temperature first,
    then sort descending, keep the smallest prefix whose mass reaches top_p."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_lp, order = lp.sort(dim=-1, descending=True)
        mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
        drop_sorted = mass_before >= top_p  # the top token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        lp = torch.log_softmax(lp.masked_fill(drop, -math.inf), dim=-1)
    return lp


@dataclass
class Rollout:
    """What the inference engine returns: prompts, completions [B, T] (pad 0 past the end),
    the sampled tokens' reported log-probs [B, T] (0.0 past the end) and mask [B, T]."""

    prompts: list
    completions: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor


@torch.no_grad()
def generate(model: TinyLM, prompts, *, max_new_tokens: int = 32, temperature: float = 1.0,
             top_p: float = 1.0, dtype=torch.bfloat16, batch_size: int = 3,
             logprobs: str = "raw", seed: int = 0, stop_at_eos: bool = True) -> Rollout:
    """The inference engine: left-padded micro-batches of `batch_size`, prefill, then one
    KV-cache decode step per token, sampling from logits / temperature with top-p.

    logprobs: "raw" reports log softmax(logits) (vLLM's default); "processed" reports the
    log-prob under the distribution sampled from (after temperature and top-p).
    """
    _check_dtype("dtype", dtype)
    _check_sampling(temperature, top_p)
    check_choice(logprobs, "logprobs", LOGPROB_MODES)
    check_int(batch_size, "batch_size", min=1)
    check_seed(seed)
    c = model.config
    prompts = _token_list("prompts", prompts, c.vocab_size)
    longest = max(len(p) for p in prompts)
    check_int(max_new_tokens, "max_new_tokens", min=1, max=max(1, c.max_len - longest),
              hint=f"max_len {c.max_len} minus the longest prompt {longest}")
    if longest >= c.max_len:
        raise InvalidArgument(f"prompts: the longest prompt has {longest} tokens, leaving no room "
                              f"below max_len={c.max_len}")
    engine = _cast(model, dtype)
    gen = torch.Generator().manual_seed(seed)
    toks, lps, masks = [], [], []
    for start in range(0, len(prompts), batch_size):  # loop over micro-batches
        chunk = prompts[start:start + batch_size]
        B, P = len(chunk), max(len(p) for p in chunk)
        ids = torch.zeros(B, P, dtype=torch.long)
        key_mask = torch.zeros(B, P, dtype=torch.bool)
        for b, p in enumerate(chunk):  # left padding
            ids[b, P - len(p):] = p
            key_mask[b, P - len(p):] = True
        positions = (key_mask.cumsum(1) - 1).clamp(min=0)
        logits, cache = engine(ids, positions, key_mask)
        last = logits[:, -1]
        next_pos = positions[:, -1] + 1
        alive = torch.ones(B, dtype=torch.bool)
        out_t, out_lp, out_m = [], [], []
        for _ in range(max_new_tokens):  # loop over decode steps
            proc = _processed_logprobs(last, temperature, top_p)
            tok = torch.multinomial(proc.exp(), 1, generator=gen).squeeze(1)
            report = proc if logprobs == "processed" else torch.log_softmax(last.float(), dim=-1)
            out_t.append(torch.where(alive, tok, 0))
            out_lp.append(torch.where(alive, report.gather(1, tok[:, None]).squeeze(1), 0.0))
            out_m.append(alive.clone())
            if stop_at_eos:
                alive = alive & (tok != c.eos_id)
            key_mask = torch.cat([key_mask, torch.ones(B, 1, dtype=torch.bool)], dim=1)
            logits, cache = engine(tok[:, None], next_pos[:, None], key_mask, cache)
            last = logits[:, -1]
            next_pos = next_pos + 1
        toks.append(torch.stack(out_t, 1))
        lps.append(torch.stack(out_lp, 1))
        masks.append(torch.stack(out_m, 1))
    return Rollout(prompts, torch.cat(toks), torch.cat(lps), torch.cat(masks))


@torch.no_grad()
def train_logprobs(model: TinyLM, prompts, completions, mask=None, *, dtype=torch.float32,
                   temperature: float = 1.0) -> torch.Tensor:
    """The training engine: one causal forward over RIGHT-padded prompt+completion for the
    whole batch, log softmax(logits / temperature) of each completion token. Returns [B, T]
    like `completions`, 0.0 where `mask` is False."""
    _check_dtype("dtype", dtype)
    _check_sampling(temperature, 1.0)
    c = model.config
    prompts = _token_list("prompts", prompts, c.vocab_size)
    completions = torch.as_tensor(completions, dtype=torch.long)
    check_tensor(completions, "completions", shape=(len(prompts), None), hint="one row per prompt")
    B, T = completions.shape
    mask = torch.ones(B, T, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    check_tensor(mask, "mask", like=(completions.to(torch.bool), "completions"))
    lens = [len(p) for p in prompts]
    L = max(lens) + T
    if L > c.max_len:
        raise InvalidArgument(f"prompt+completion length {L} exceeds max_len={c.max_len}")
    ids = torch.zeros(B, L, dtype=torch.long)
    key_mask = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate(prompts):  # right padding: prompt, completion, pad
        ids[b, :lens[b]] = p
        ids[b, lens[b]:lens[b] + T] = completions[b]
        key_mask[b, :lens[b] + T] = True
    positions = torch.arange(L).expand(B, L)
    logits, _ = _cast(model, dtype)(ids, positions, key_mask)
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    # the logits at position i predict token i + 1
    at = (torch.tensor(lens)[:, None] - 1 + torch.arange(T)[None, :])
    pred = lp.gather(1, at[:, :, None].expand(B, T, lp.shape[-1]))
    out = pred.gather(2, completions[:, :, None]).squeeze(2)
    return torch.where(mask, out, 0.0)


def _cast(model: TinyLM, dtype) -> TinyLM:
    """The engine's copy of the weights in its dtype (the caller's model is left as it is)."""
    if model.tok.dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype)


def random_prompts(n: int, *, vocab_size: int = LMConfig.vocab_size, min_len: int = 2,
                   max_len: int = 12, seed: int = 0) -> list:
    """`n` prompts of varied lengths (so left and right padding really differ), no EOS."""
    check_int(n, "n", min=1)
    check_int(vocab_size, "vocab_size", min=2, hint="token 0 is EOS, prompts use 1..")
    check_int(min_len, "min_len", min=1)
    check_int(max_len, "max_len", min=min_len, hint="at least min_len")
    g = torch.Generator().manual_seed(check_seed(seed))
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(1, vocab_size, (int(k),), generator=g) for k in lens]
