"""What a check found, as named records handed from the runs to the summary.

A Flips or ScoreChanges record holds the changes of one (cut, trial) as parallel tensors,
one entry per change, so a cut with many flips costs one record, not one object per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from trainprobes.causality.classify import Outputs


class Flips(NamedTuple):
    """Decisions at positions <= cut that changed when the positions after it were perturbed."""
    cut: int
    trial: int
    batch: torch.Tensor     # [n] long: the row of each flip
    position: torch.Tensor  # [n] long: its position (<= cut)
    after: torch.Tensor     # [n, ...]: the decision after the perturbation
    kind: torch.Tensor      # [n] long: classify.Kind values


class ScoreChanges(NamedTuple):
    """Routing scores at positions <= cut that moved while the decision there held."""
    cut: int
    trial: int
    batch: torch.Tensor     # [n] long
    position: torch.Tensor  # [n] long
    change: torch.Tensor    # [n] float64: the largest absolute change of the scores
    kind: torch.Tensor      # [n] long: classify.Kind values (never UNCONFIRMED)


class Isolation(NamedTuple):
    """Batch isolation: does replacing other rows move this row's decisions?"""
    isolated: bool | None   # None: not tested (flat layout), or moves no one could judge
    moved: list             # [[row, position], ...]: the first structural moves
    numerical: int = 0      # moves within rounding noise that the fp64 twin excused
    unverified: int = 0     # moves at near-ties with no twin to judge them
    error: str | None = None  # why a bigger batch could not be run, if it could not

    @property
    def batch_invariant(self) -> bool:
        """Rounding that depends on the other rows: packed copies would not compute what a
        call alone computes."""
        return not (self.numerical or self.unverified)


NOT_TESTED = Isolation(None, [])


@dataclass
class Findings:
    """Everything the summary reads: the baseline, the records, and how the cuts ran."""
    base: Outputs
    isolation: Isolation
    flips: list = field(default_factory=list)          # [Flips]
    score_changes: list = field(default_factory=list)  # [ScoreChanges]
    batch_invariant: bool = True
    packed: bool = False
    packing_error: str | None = None
    packing: dict | None = None  # how many copies went into a call, as measured (packing.py)
    first_flip_eval: int | None = None  # evaluations spent when anything first moved
    fp64_status: str = "not needed"
    n_evaluations: int = 0
    n_confirmations: int = 0  # of those, spent re-checking flips (re-runs, the fp64 twin)
    tokens_evaluated: int = 0
    near_ties: object = None  # near_tie.NearTies, or None where scores make it unneeded
