"""The one link to the causality probe's machinery: perturbation values and the judgement
of a change as structural (data flows) or numerical (rounding noise).

Everything here is causality's rule, applied to a change measured elsewhere (trainprobes/
causality/check.py: `_replacements`, `_noise_tol`, and the precision-scaling test of
`_Run.classify`). Kept in one small module so that the isolation probes follow causality's
public classification API as soon as it exists, without a second copy of the rule.
"""
from __future__ import annotations

import torch
from trainprobes.causality.check import KINDS, NOISE_ULPS, _noise_tol, _replacements
from trainprobes.causality.target import Target, differs, pick

__all__ = ["KINDS", "NOISE_ULPS", "STRUCTURAL", "NUMERICAL", "UNVERIFIED", "Target", "differs",
           "pick", "replacements", "noise_tol", "judge"]

STRUCTURAL, NUMERICAL, UNVERIFIED = 0, 1, 2


def replacements(x: torch.Tensor, vocab: int | None, generator: torch.Generator) -> torch.Tensor:
    """Values of x's shape that differ from x everywhere: other token ids in [0, vocab), or
    fresh Gaussian values with x's per-feature mean and std (causality's perturbation)."""
    return _replacements(x, 1, vocab, generator)[0]


def noise_tol(values: torch.Tensor) -> torch.Tensor:
    """Per leading index of values [N, ...]: NOISE_ULPS ulps of its largest magnitude (>= 1)."""
    return _noise_tol(values.reshape(len(values), -1)).amax(-1) if len(values) else \
        torch.zeros(0, dtype=torch.float64)


def judge(change: torch.Tensor, tol: torch.Tensor, change64: torch.Tensor | None = None,
          tol64: torch.Tensor | None = None) -> torch.Tensor:
    """Kind per change (0 structural, 1 numerical, 2 unverified), from its size `change` in
    the target's precision, the noise tolerance there, and, when an fp64 twin ran, the same
    change in float64.

    The fp64 test is causality's precision-scaling test: rounding noise shrinks by ~2^-29
    from fp32 to fp64, a real dependence does not; structural iff the fp64 change exceeds
    both 1e-3 of the low-precision change and fp64's own noise tolerance. Without a twin a
    change beyond the noise tolerance is structural and one within it stays unverified
    (neither a leak nor excused).
    """
    if change64 is None:
        return torch.where(change > tol, STRUCTURAL, UNVERIFIED)
    return torch.where(change64 > torch.maximum(1e-3 * change, tol64), STRUCTURAL, NUMERICAL)
