"""Weight sync: do the engine's parameters equal the trainer's after the engine's dtype
conversion? Cheap enough for every refit: one checksum per tensor first (each side can
compute its own, in its own process: `checksums`), the full comparison only where the
checksums differ.

Per tensor, A the trainer's value and B the engine's; each status says which side differs
from what:
  exact            B == A cast to B's dtype (round to nearest even, torch's cast), bit for bit
  rounding         the ENGINE's B (in another dtype than A) is not that, but |B - A| <= one
                   ulp of B's dtype at |A| everywhere: the engine's conversion rounded another
                   way (truncation, stochastic rounding, an fp8 scale); in the same dtype there
                   is no conversion, and any difference is a mismatch
  trainer_rounded  the TRAINER's A is in a coarser dtype than B and |A - B| <= one ulp of A's
                   dtype at |B| everywhere: the trainer holds the engine's value rounded (a
                   trainer-side precision loss, e.g. a block cast to bf16): numerics on the
                   trainer's side, not a stale engine weight
  mismatch         the ENGINE's B differs from the trainer's A (cast to B's dtype) beyond one
                   conversion's rounding: a stale or wrong engine tensor (named)
  missing          a name in one side only (a fused qkv, a renamed module): not compared,
                   so never called stale; its effect on the outputs is the stages' to judge
Tied tensors (an lm_head sharing the input embedding) are compared under every name they
carry: a trainer that ties and an engine that holds an equal untied copy have the same
tensors by name (named_parameters drops the alias otherwise, and the copy was "missing").
Checksum: the tensor's bits as integers, summed with weights (index mod 65521) + 1 in
int64 (wrapping): equal tensors give equal sums; any one changed element changes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Checksum:
    dtype: str
    shape: tuple
    digest: int


@dataclass
class TensorSync:
    name: str
    status: str                 # exact / rounding / trainer_rounded / mismatch / missing
    max_abs_diff: float = 0.0
    max_ulps: float = 0.0       # in ulps of the engine's dtype at the trainer's value (of the
                                # trainer's dtype at the engine's value: trainer_rounded)
    frac_mismatched: float = 0.0
    note: str = ""


def checksum(t: torch.Tensor) -> Checksum:
    t = t.detach().contiguous().reshape(-1)
    bits = t.view(_INT[t.element_size()]).to(torch.int64)
    w = torch.arange(bits.numel(), dtype=torch.int64) % 65521 + 1
    return Checksum(str(t.dtype).removeprefix("torch."), tuple(t.shape), int((bits * w).sum()))


@torch.no_grad()
def checksums(module: torch.nn.Module, dtype: torch.dtype | None = None) -> dict:
    """name -> Checksum of every parameter and buffer (cast to `dtype` first when given:
    the trainer's side computes the engine's view of its weights)."""
    out = {}
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers()):
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = checksum(t)
    return out


def _ulp(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    mag = a.abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def _coarser(a: torch.dtype, b: torch.dtype) -> bool:
    return a.is_floating_point and b.is_floating_point and torch.finfo(a).eps > torch.finfo(b).eps


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@torch.no_grad()
def weight_sync(trainer: torch.nn.Module, engine: torch.nn.Module) -> list:
    """[TensorSync] for every parameter of either side, in the trainer's order."""
    pa = dict(trainer.named_parameters(remove_duplicate=False))  # tied: every name (module doc)
    pb = dict(engine.named_parameters(remove_duplicate=False))
    out = []
    for name, a in pa.items():
        b = pb.get(name)
        if b is None:
            out.append(TensorSync(name, "missing", note="not in the engine"))
            continue
        if a.shape != b.shape:
            out.append(TensorSync(name, "mismatch", note=f"shape {tuple(a.shape)} vs {tuple(b.shape)}"))
            continue
        cast = a.to(b.dtype) if a.is_floating_point() else a
        if checksum(cast) == checksum(b) and torch.equal(cast, b):
            out.append(TensorSync(name, "exact"))
            continue
        diff = (b.double() - a.double()).abs()
        ulps = diff / _ulp(a.double(), b.dtype) if b.is_floating_point() else diff
        # one ulp is a conversion's rounding only where there was a conversion: in the same dtype
        # any difference is another value (a refit missed by a one-ulp update: bf16 weights, small lr)
        bad = ulps > 1 if a.dtype != b.dtype else diff > 0
        if bool(bad.any()) and _coarser(a.dtype, b.dtype):
            ulps_a = diff / _ulp(b.double(), a.dtype)
            if bool((ulps_a <= 1).all()):
                out.append(TensorSync(name, "trainer_rounded", float(diff.max()), float(ulps_a.max()), 0.0,
                                      f"the trainer holds the engine's value rounded to {_name(a.dtype)}"))
                continue
        note = ("" if not bool(bad.any()) else
                f"the engine's {_name(b.dtype)} tensor differs from the trainer's (the same dtype: no conversion "
                "to round)" if a.dtype == b.dtype else
                f"the engine's {_name(b.dtype)} tensor differs from the trainer's cast to it by more than one ulp")
        out.append(TensorSync(name, "mismatch" if bool(bad.any()) else "rounding",
                              float(diff.max()), float(ulps.max()), float(bad.double().mean()), note))
    out += [TensorSync(n, "missing", note="not in the trainer") for n in pb if n not in pa]
    return out


@torch.no_grad()
def synced_copy(trainer: torch.nn.Module, engine: torch.nn.Module, names) -> torch.nn.Module:
    """A copy of the engine with the named tensors replaced by the trainer's (cast)."""
    import copy

    fixed = copy.deepcopy(engine)
    pa = dict(trainer.named_parameters(remove_duplicate=False))
    pf = dict(fixed.named_parameters(remove_duplicate=False))
    for n in names:
        if n in pa and n in pf and pa[n].shape == pf[n].shape:
            pf[n].copy_(pa[n].to(pf[n].dtype))
    return fixed
