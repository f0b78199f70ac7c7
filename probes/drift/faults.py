"""Injected faults for engine pairs with a known answer (the localisation demo and tests):
each edits a copy of a model in place, keeping every module's name, so the faulty engine
has the same stages as the healthy one.

  in_dtype(module, dtype)   one module computes in `dtype` (its weights cast, its float
                            inputs cast in, its output cast back): "one block's MLP in bf16",
                            "the router in bf16"
  norm_epsilon(norm, eps)   a norm with another epsilon (HF RMSNorm's variance_epsilon,
                            LayerNorm's eps)
  stale(param, scale, seed) a parameter as a refit that missed it leaves it: the previous
                            step's value, here W + scale * rms(W) * N(0, 1)
  temperature_logprobs(T)   log softmax(logits / T): a side that applies temperature
  top_p_logprobs(p, T)      processed log-probs: the top-p nucleus renormalised, -inf out
"""
from __future__ import annotations

import math

import torch
from trainprobes.errors import InvalidArgument


def in_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    outer = {}

    def pre(m, args, kwargs):
        def cast(v):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                outer.setdefault("dtype", v.dtype)
                return v.to(dtype)
            if isinstance(v, tuple):
                return tuple(cast(t) for t in v)
            return v
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def post(m, args, out):
        back = outer.get("dtype", torch.float32)
        if isinstance(out, torch.Tensor):
            return out.to(back) if out.is_floating_point() else out
        if isinstance(out, tuple):
            return tuple(o.to(back) if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                         for o in out)
        return out

    module.to(dtype)
    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post)
    return module


def norm_epsilon(norm: torch.nn.Module, eps: float) -> torch.nn.Module:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(norm, attr):
            setattr(norm, attr, eps)
            return norm
    raise InvalidArgument(f"{type(norm).__name__} has neither variance_epsilon nor eps")


@torch.no_grad()
def stale(param: torch.nn.Parameter, scale: float = 1e-2, seed: int = 0) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(param.shape, generator=g, dtype=torch.float32)
    param.add_((scale * param.float().pow(2).mean().sqrt() * noise).to(param.dtype))
    return param


def temperature_logprobs(temperature: float):
    def logprobs(logits):
        return torch.log_softmax(logits.float() / temperature, dim=-1)
    logprobs.__qualname__ = f"log_softmax(logits / {temperature:g})"
    return logprobs


def top_p_logprobs(top_p: float, temperature: float = 1.0):
    """vLLM's processed log-probs: temperature, then the smallest prefix (by probability)
    whose mass reaches top_p kept and renormalised (the top token always kept)."""
    def logprobs(logits):
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        s, order = lp.sort(dim=-1, descending=True)
        before = s.exp().cumsum(-1) - s.exp()
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
        return torch.log_softmax(lp.masked_fill(drop, -math.inf), dim=-1)
    logprobs.__qualname__ = f"top_p({top_p:g}) processed log-probs"
    return logprobs
