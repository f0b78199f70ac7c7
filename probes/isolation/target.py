"""A packed-document target as the causality machinery calls it, and its fp64 twin."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from trainprobes.causality.classify import Outputs
from trainprobes.causality.target import Target, abs_diff
from trainprobes.errors import TargetError
from trainprobes.isolation.fp64 import run_in_float64
from trainprobes.isolation.packing import Packing

__all__ = ["Packed", "Twin"]

# Largest relative disagreement between the target and its fp64 twin on the same input that
# rounding of the target's dtype can explain: 1e-3 of the outputs' scale, or 16 ulps where
# the dtype is coarser (bf16: 0.125). Rounding through a model moves outputs by far less than
# a missing mask does (0.06-0.24 of scale in the HF table).
_TWIN_RTOL = 1e-3


def _disagreement(y0: torch.Tensor, y64: torch.Tensor) -> str | None:
    """How the twin's outputs differ from the target's beyond rounding, else None."""
    if y0.shape != y64.shape:
        return f"returns shape {tuple(y64.shape)!r}, the target {tuple(y0.shape)!r}"
    if y0.is_floating_point() != y64.is_floating_point():
        return f"returns {y64.dtype}, the target {y0.dtype}"
    if not y0.is_floating_point():
        # decisions (expert ids, kept/dropped) have no rounding: a twin that decides
        # otherwise on the same input would excuse every decision the target changes
        n = int((y0 != y64).sum())
        return f"makes other decisions at {n} of {y0.numel()}" if n else None
    scale = y0.double().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).amax().clamp_min(1e-30)
    off = float(abs_diff(y0, y64).amax() / scale)
    if off > max(_TWIN_RTOL, 16 * torch.finfo(y0.dtype).eps):
        return f"differs by {off:.3g} (relative to the outputs' scale), beyond {y0.dtype} rounding"
    return None


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


def _twin_builder(fn, spec) -> Callable[[], Callable] | None:
    """What builds the twin, or None where there is none: spec as given, none for False,
    or (None) the target's own `fp64_twin()` where it has one
    (trainprobes.isolation.hf.PackedModel), else a float64 deep copy of an nn.Module target
    called with float inputs cast to float64, float64 inside (run_in_float64). A twin the
    user gives is run as given. Building is left to the first change that
    needs the twin: a float64 copy of a real model takes 2-4x its memory."""
    if spec is False:
        return None
    if isinstance(spec, torch.nn.Module):
        def given():   # the user's float64 module: its kernels without float64 swapped too
            swapped = _float64_kernels(spec)

            def call(x, p):
                return spec(x, p)
            call.substituted = swapped
            return call
        return given
    if callable(spec) and spec is not True:
        return lambda: spec
    own = getattr(fn, "fp64_twin", None)
    if callable(own):
        return own
    if isinstance(fn, torch.nn.Module):
        def deep_copy():
            # float64 inside: the float32 requests its code makes (transformers' softmax,
            # RMSNorm and rotary upcasts) are float64 too, or the twin rounds like float32
            twin = run_in_float64(copy.deepcopy(fn).double())
            swapped = _float64_kernels(twin)

            def call(x, p):
                return twin(x.double() if x.is_floating_point() else x, p)
            call.substituted = swapped
            return call
        return deep_copy
    return None


def _float64_kernels(module) -> list[str]:
    """Swap, in a float64 copy, the kernels that have no float64 version on this machine for
    the eager path of the same function, and name them: grouped expert matmuls
    (torch._grouped_mm refuses float64; transformers' `_experts_implementation`) and CPU
    flex_attention (fp32/fp16/bf16 only in torch 2.13)."""
    swapped = []
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is None:
            continue
        impl = getattr(cfg, "_experts_implementation", None)
        if impl not in (None, "eager"):
            cfg._experts_implementation = "eager"
            swapped.append(f"experts: {impl} -> eager")
        if getattr(cfg, "_attn_implementation", None) == "flex_attention" and hasattr(m, "set_attn_implementation"):
            m.set_attn_implementation("eager")
            swapped.append("attention: flex_attention -> eager")
    return sorted(set(swapped))


_HOW = ("build the twin yourself and pass it: fp64=fn64(tokens, packing) in Python, "
        "--fp64 PKG.MOD:FN on the command line (a float64 copy whose kernels all have float64 "
        "versions, e.g. model.config._experts_implementation = 'eager' for grouped_mm experts)")
# torch._grouped_mm's refusal of float64 ("Expected mat_a to be Float32, BFloat16 or
# Float16 matrix, got Double"): the fix is known, so the message says it first
_GROUPED_MM = ("the twin's experts run torch._grouped_mm, which has no float64 kernel: on its "
               "float64 copy set model.config._experts_implementation = 'eager' (a module "
               "passed as the twin gets this done for it)")


def _unavailable(what: str, e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    fix = _GROUPED_MM if ("mat_a" in text and "Double" in text) or "grouped_mm" in text else _HOW
    kind = "" if isinstance(e, TargetError) else f"{type(e).__name__}: "  # it names its own
    return f"unavailable: {what}{kind}{text}; {fix}"


class Twin:
    """The target in float64, built and run only when a change needs it, and checked to
    really return float64. `substituted` names kernels the twin had to swap (a twin without
    a float64 kernel for flex attention runs eager attention): such a twin settles only
    changes within rounding noise, since a bug in the target's own kernel is absent from it.
    """

    def __init__(self, fn, spec, packing: Packing, name: str, output):
        self._build = _twin_builder(fn, spec)
        self._fn = None
        self.status = "disabled" if spec is False else "not needed"
        # built on the first call: the causality check and pair() call it only for changes
        self.packed = None if self._build is None else Packed(self._call, packing, f"{name} [fp64]")
        self.tgt = None if self._build is None else Target(self.packed, f"{name} [fp64]", decision=output)
        self._base = None

    @property
    def fn(self) -> Callable | None:
        """The twin, built on first use; None where there is none (or building failed)."""
        if self._fn is None and self._build is not None:
            try:
                self._fn = self._build()
            except Exception as e:  # a model that cannot be copied or cast: no twin
                self._build, self.tgt = None, None
                self.status = _unavailable("building the fp64 twin raised ", e)
        return self._fn

    def _call(self, x, packing):
        if self.fn is None:
            raise TargetError(self.status)
        return self.fn(x, packing)

    @property
    def substituted(self) -> list:
        return list(getattr(self.fn, "substituted", None) or [])

    @property
    def n_evaluations(self) -> int:
        return 0 if self.tgt is None else self.tgt.n_evaluations

    def base(self, y0: torch.Tensor) -> torch.Tensor | None:
        """The twin's outputs on the unperturbed input, once; None (and why, in status) when
        there is no usable twin. A twin that disagrees with the target's own outputs y0
        beyond low-precision rounding computes another function (a twin without the leak
        would excuse it): refused, so that the changes stay unexcused (fail closed)."""
        if self.tgt is None:
            if self._build is None and self.status == "not needed":
                self.status = "unavailable: the target is not an nn.Module (pass fp64=fn64(tokens, packing))"
            return None
        if self._base is None:
            try:
                out, _ = self.tgt(self.tgt_input)
            except TargetError as e:  # e.g. a float64 kernel missing: say how to give one
                self.tgt, self.status = None, _unavailable("", e)
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
                               f"unperturbed input it {off}")
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
