"""Reused temporaries, a cheap zero test and a float32 copy that says what it lost, for the
emulated collectives' hot loops."""
from __future__ import annotations

import math

import torch


class Scratch:
    """Buffers reused from one call to the next: a collective makes hundreds of calls of
    one size, and a fresh temporary of a block's size costs page faults on every call. A
    tensor got here is overwritten by the next get() of its name: never return it."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}  # tiny tensors: get() is the cost

    def get(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        key = (name, tuple(shape), dtype, device)
        view = self._views.get(key)
        if view is not None:
            return view
        n, device = math.prod(shape), torch.device(device)  # "cpu" != torch.device("cpu")
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(n, dtype=dtype, device=device)
            self._views = {k: v for k, v in self._views.items() if k[0] != name}
        view = self._views[key] = buf[:n].view(shape)
        return view


def any_nonzero(t: torch.Tensor) -> bool:
    """Whether t has an element that is not 0 (NaN counts), in one min/max pass (faster
    than Tensor.any on floats)."""
    if not t.numel():
        return False
    lo, hi = torch.aminmax(t)
    return not (float(lo) == 0.0 and float(hi) == 0.0)


def float32_copy(x: torch.Tensor, scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, lost) for a float64 x: s = x rounded to float32 and lost = s - x in float64 (0
    where float32 holds x; NaN where x is NaN), both in scratch's buffers "s" and "lost"."""
    s = scratch.get("s", x.shape, torch.float32, x.device).copy_(x)
    return s, scratch.get("lost", x.shape, torch.float64, x.device).copy_(s).sub_(x)
