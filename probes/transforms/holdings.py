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

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    v = x.contiguous().view(_BITS[x.element_size()]).to(torch.int64)
    return (v * _weights(v.shape[1])).sum(1)  # int64 arithmetic wraps: still a function of every bit


class _Segments(NamedTuple):
    weights: torch.Tensor  # [N] fingerprint weights, restarting at each parameter
    owner: torch.Tensor    # [N] the segment of each element


_SEGMENTS: dict = {}


def _segments(sizes: tuple) -> _Segments:
    if sizes not in _SEGMENTS:  # one entry per layout (per dtype group): built once per case
        _SEGMENTS.clear()
        _SEGMENTS[sizes] = _Segments(torch.cat([_weights(k) for k in sizes]),
                                     torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)))
    return _SEGMENTS[sizes]


def fingerprints(f: Flat) -> torch.Tensor:
    """[len(f.names)] int64: fingerprint() of each parameter, from the flat values at once
    (integer sums wrap modulo 2^64, so the order of the additions does not matter)."""
    seg = _segments(tuple(f.sizes))
    v = f.values.view(_BITS[f.values.element_size()]).to(torch.int64)
    return torch.zeros(len(f.sizes), dtype=torch.int64).index_add_(0, seg.owner, v * seg.weights)


def not_finite(f: Flat) -> torch.Tensor:
    """[len(f.names)] bool: the parameters holding an inf or NaN (in their own dtype; via
    fp64 where a 1-byte dtype has no isfinite kernel)."""
    x = f.values if f.values.element_size() > 1 else f.values.double()
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return torch.zeros(len(f.sizes), dtype=torch.bool)
    return torch.stack([~c.all() for c in finite.split(f.sizes)])
