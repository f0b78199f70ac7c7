"""The gradients one rank returned on a trial, as one flat tensor per dtype: what
trainprobes.transforms.local fingerprints, checks for inf/NaN, keeps (for replicas that
disagree) and compares with the truth, a few vectorised operations per trial instead of a
dozen per parameter (the per-parameter loop was the probe's largest cost per rank beyond
the truth on a DDP step).

A Flat holds one trial's parameters of one dtype, in layout order: `values` (a fresh copy,
so a gradient buffer the next step reuses cannot change what was kept), the parameters'
layout indices and names, and their sizes (the segments of `values`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Flat", "flatten", "fingerprint", "fingerprints", "not_finite"]

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # 8 bytes: two words


def _words(x: torch.Tensor) -> torch.Tensor:
    """x's bits as signed integers of at most 32 bits (an 8-byte value is two words), so a
    word times a weight (< 2^31) never wraps: as 64-bit words, a sign bit times an even
    weight is 2^63 w = 0 mod 2^64, and fp64's -g had g's fingerprint."""
    return x.contiguous().view(_BITS[x.element_size()])


class Flat(NamedTuple):
    values: torch.Tensor   # [N] in the gradients' own dtype, on the CPU
    index: list            # layout index of each parameter
    names: list
    sizes: list            # elements of each parameter: the segments of values


def flatten(grads: dict, names: dict) -> list:
    """[Flat] of one trial: the returned gradients ({name: tensor}) grouped by dtype, each
    group in layout order (names: {name: layout index})."""
    groups: dict = {}
    for n, i in names.items():
        if n in grads:
            groups.setdefault(grads[n].dtype, []).append((i, n))
    out = []
    for members in groups.values():
        xs = [grads[n].detach().to("cpu").reshape(-1) for _, n in members]
        out.append(Flat(torch.cat(xs), [i for i, _ in members], [n for _, n in members],
                        [x.numel() for x in xs]))
    return out


def _weights(n: int) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.int64) * 2654435761 % (2 ** 31 - 1) + 1


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """[T] int64: a weighted sum of the bits of each trial's values (any changed bit changes
    it, barring a 2^-62 collision); x [T, numel] in its own dtype."""
    v = _words(x).to(torch.int64)
    return (v * _weights(v.shape[1])).sum(1)  # int64 arithmetic wraps: still a function of every bit


_WEIGHTS: dict = {}


def _flat_weights(sizes: tuple) -> torch.Tensor:
    """[N] fingerprint weights restarting at each parameter (built once per layout)."""
    if sizes not in _WEIGHTS:
        _WEIGHTS.clear()
        _WEIGHTS[sizes] = torch.cat([_weights(k) for k in sizes])
    return _WEIGHTS[sizes]


def fingerprints(f: Flat) -> torch.Tensor:
    """[len(f.names)] int64: fingerprint() of each parameter, from the flat values at once."""
    v = _words(f.values)
    sizes = [k * (f.values.element_size() // v.element_size()) for k in f.sizes]  # words per parameter
    terms = v * _flat_weights(tuple(sizes))  # promoted to int64 (wrapping: a function of every bit)
    return torch.stack([c.sum() for c in terms.split(sizes)])


def _finite(x: torch.Tensor) -> bool:
    """No inf or NaN in x: its least and greatest values are finite (amin/amax propagate
    NaN; one pass, where isfinite().all() is a bool tensor and a second pass)."""
    if x.numel() == 0 or not x.is_floating_point():
        return True
    lo, hi = torch.aminmax(x if x.element_size() > 1 else x.double())  # no 1-byte float kernels
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def not_finite(f: Flat) -> torch.Tensor:
    """[len(f.names)] bool: the parameters holding an inf or NaN (in their own dtype)."""
    if _finite(f.values):
        return torch.zeros(len(f.sizes), dtype=torch.bool)
    return torch.tensor([not _finite(c) for c in f.values.split(f.sizes)])
