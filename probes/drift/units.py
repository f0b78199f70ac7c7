"""The independent units of localisation's tests and intervals (trainprobes.drift.localize,
.decompose, .semantics, .postproc).

With MIN_SEQUENCES sequences or more, each sequence is a unit: the tests and intervals speak
for other sequences like them. With fewer, down to one, each sequence is cut into contiguous
spans of tokens, about SPAN_UNITS units in all (batch means, as for one long autocorrelated
series): the tests and intervals then speak for the tokens given, not for other sequences.
What they cannot show is how the drift varies from one sequence to another (a fault met
only on another prompt's path). Repeating one sequence B times made B identical units and
zero-width intervals; such a batch is refused (localize_layers). The unit count is a
function of the shape [B, L] alone, so every test of one run cuts the same way.
"""
from __future__ import annotations

import math

import torch

# fewest sequences that are the units themselves: at B = 2 (1 degree of freedom) a one-sided
# t of 85 gives p = 0.0037, above 0.01 / 7 stages, so a bf16 MLP (ratio ~3,000) would be noise
MIN_SEQUENCES = 4
SPAN_UNITS = 8   # units wanted from fewer sequences (the CLI's default --sequences)
MIN_SPAN = 2     # fewest tokens in a span
MIN_UNITS = 2    # fewest units an interval can be estimated from


def spans_per_sequence(B: int, L: int) -> int:
    """How many spans each of B sequences of L positions is cut into (1: the sequences are the units)."""
    if B >= MIN_SEQUENCES:
        return 1
    return max(1, min(math.ceil(SPAN_UNITS / max(B, 1)), L // MIN_SPAN))


def n_units(B: int, L: int) -> int:
    return B * spans_per_sequence(B, L)


def as_units(t: torch.Tensor, k: int) -> torch.Tensor:
    """[B, L, ...] -> [B * k, ceil(L / k), ...]: each row cut into k contiguous spans, the last
    padded with zeros (False for a mask), so per-unit sums are sums over dim 1."""
    if k == 1:
        return t
    B, L = t.shape[:2]
    w = math.ceil(L / k)
    pad = w * k - L
    if pad:
        t = torch.cat([t, torch.zeros((B, pad, *t.shape[2:]), dtype=t.dtype)], dim=1)
    return t.reshape(B * k, w, *t.shape[2:])


def unit_sums(t: torch.Tensor, mask_shape: tuple) -> torch.Tensor:
    """Per-unit sums [units] of per-token values t [B, L] (already masked)."""
    return as_units(t, spans_per_sequence(*mask_shape)).sum(1)


def describe(B: int, L: int) -> str:
    """What the units are, for a Result's message and evidence."""
    k = spans_per_sequence(B, L)
    if k == 1:
        return f"{B} sequences"
    return (f"{B * k} spans of about {math.ceil(L / k)} tokens of {B} sequence{'s' if B > 1 else ''} (fewer than "
            f"{MIN_SEQUENCES} sequences: tests and intervals speak for these tokens; how the drift varies "
            "from one sequence to another is not shown)")
