"""A packed-document target as the causality machinery calls it, and its fp64 twin."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from trainprobes.causality.classify import Outputs
from trainprobes.causality.target import Target
from trainprobes.errors import TargetError
from trainprobes.isolation.packing import Packing

__all__ = ["Packed", "Twin"]

# Largest relative disagreement between the target and its fp64 twin on the same input that
# rounding of the target's dtype can explain: 1e-3 of the outputs' scale, or 16 ulps where
# the dtype is coarser (bf16: 0.125). Rounding through a model moves outputs by far less than
# a missing mask does (0.06-0.24 of scale in the HF table).
_TWIN_RTOL = 1e-3


def _disagreement(y0: torch.Tensor, y64: torch.Tensor) -> float | None:
    """The relative disagreement when it is beyond rounding, else None."""
    if not (y0.is_floating_point() and y64.is_floating_point()) or y0.shape != y64.shape:
        return None if y0.shape == y64.shape else float("inf")
    scale = y0.double().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).amax().clamp_min(1e-30)
    off = float(((y0.double() - y64).abs().nan_to_num(float("inf")).amax()) / scale)
    return off if off > max(_TWIN_RTOL, 16 * torch.finfo(y0.dtype).eps) else None


class Packed:
    """fn(tokens, packing) seen as a one-argument target fn(tokens): the packing is tiled to
    the batch it is called with (the causality probe stacks copies along the batch)."""

    def __init__(self, fn, packing: Packing, name: str):
        self.fn, self.packing, self.name = fn, packing, name
        self.__qualname__ = name

    def __call__(self, x):
        B = self.packing.batch
        if x.shape[0] % B:
            raise TargetError(f"target {self.name!r} called with batch {x.shape[0]}, not a "
                              f"multiple of the packing's {B} rows")
        return self.fn(x, self.packing.tile(x.shape[0] // B))


def _twin_fn(fn, spec) -> Callable | None:
    """spec as given, none for False, or (None) the target's own `fp64_twin()` where it has
    one (trainprobes.isolation.hf.PackedModel), else a float64 deep copy of an nn.Module
    target called with float inputs cast to float64."""
    if spec is False:
        return None
    if callable(spec) and spec is not True:
        return spec
    own = getattr(fn, "fp64_twin", None)
    if callable(own):
        return own()
    if isinstance(fn, torch.nn.Module):
        twin = copy.deepcopy(fn).double()
        return lambda x, p: twin(x.double() if x.is_floating_point() else x, p)
    return None


class Twin:
    """The target in float64, built and run only when a change needs it, and checked to
    really return float64. `substituted` names kernels the twin had to swap (a twin without
    a float64 kernel for flex attention runs eager attention): such a twin settles only
    changes within rounding noise, since a bug in the target's own kernel is absent from it.
    """

    def __init__(self, fn, spec, packing: Packing, name: str, output):
        self.fn = _twin_fn(fn, spec)
        self.substituted = list(getattr(self.fn, "substituted", None) or [])
        self.status = "disabled" if spec is False else "not needed"
        self.packed = None if self.fn is None else Packed(self.fn, packing, f"{name} [fp64]")
        self.tgt = None if self.fn is None else Target(self.packed, f"{name} [fp64]", decision=output)
        self._base = None

    @property
    def n_evaluations(self) -> int:
        return 0 if self.tgt is None else self.tgt.n_evaluations

    def base(self, y0: torch.Tensor) -> torch.Tensor | None:
        """The twin's outputs on the unperturbed input, once; None (and why, in status) when
        there is no usable twin. A twin that disagrees with the target's own outputs y0
        beyond low-precision rounding computes another function (a twin without the leak
        would excuse it): refused, so that the changes stay unexcused (fail closed)."""
        if self.tgt is None:
            if self.fn is None and self.status == "not needed":
                self.status = "unavailable: the target is not an nn.Module (pass fp64=fn64(tokens, packing))"
            return None
        if self._base is None:
            try:
                out, _ = self.tgt(self.tgt_input)
            except TargetError as e:
                self.tgt, self.status = None, f"unavailable: {e}"
                return None
            if out.is_floating_point() and out.dtype != torch.float64:
                self.tgt = None
                self.status = (f"unavailable: the fp64 twin returned {out.dtype}, not float64 "
                               f"(pass fp64= a callable that computes in float64)")
                return None
            off = _disagreement(y0, out)
            if off is not None:
                self.tgt = None
                self.status = (f"unavailable: the fp64 twin is not the target's function: on the "
                               f"unperturbed input it differs by {off:.3g} (relative to the "
                               f"outputs' scale), beyond {y0.dtype} rounding")
                return None
            self._base = out
            self.status = "used" + (f" (substituted: {', '.join(self.substituted)})"
                                    if self.substituted else "")
        return self._base

    def pair(self, x: torch.Tensor, xs: torch.Tensor, y0: torch.Tensor):
        """(Outputs of x, Outputs of xs) in float64, or None without a usable twin; y0: the
        target's own outputs of x."""
        self.tgt_input = x
        base = self.base(y0)
        if base is None:
            return None
        return Outputs(base), Outputs(self.tgt(xs)[0])
