"""Evaluating the cuts: alone at the inputs' shape, as truncated prefixes, or packed.

Packing many perturbed copies into one call is sound only for a batch-isolated target, and
only while the packed call computes what a call alone computes: every packed call carries an
unperturbed copy of x (the control) that must reproduce the baseline, and the first flipped
packed copies are re-run alone and must match exactly; else packing stops (batch-variant)
and every later cut runs alone.
"""
from __future__ import annotations

from typing import Callable

import torch
from trainprobes.causality.classify import REPRODUCTIONS, Judge, Kind, Outputs, change_size
from trainprobes.causality.inputs import Perturbed
from trainprobes.causality.records import Flips, ScoreChanges
from trainprobes.causality.target import Target, differs
from trainprobes.errors import TargetError

MIN_CHUNK = 8  # pack only if a call holds >= 8 copies: the control then adds <= 1/8

# torch.OutOfMemoryError from torch 2.5 (any device), torch.cuda.OutOfMemoryError before;
# the CPU allocator raises a plain RuntimeError, which is not taken for out-of-memory
OUT_OF_MEMORY = tuple({e for e in (MemoryError, getattr(torch, "OutOfMemoryError", None),
                                   getattr(torch.cuda, "OutOfMemoryError", None)) if e is not None})


def out_of_memory(error: BaseException) -> bool:
    """Whether error, or an exception it was raised from, is an out-of-memory error."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OUT_OF_MEMORY):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class Cuts:
    """The cuts of one check: each (cut, trial) evaluated and its changes classified into
    `flips` and `score_changes` records."""

    def __init__(self, judge: Judge, tgt: Target, perturbed: Perturbed, *, atol: float,
                 batch_invariant: bool = True, pack_error: str | None = None,
                 progress: Callable[[int, int], None] | None = None):
        self.judge, self.tgt, self.perturbed, self.atol = judge, tgt, perturbed, atol
        self.progress = progress
        self.flips: list[Flips] = []
        self.score_changes: list[ScoreChanges] = []
        self.first_flip_eval: int | None = None
        self.batch_invariant = batch_invariant
        self.pack_error = pack_error  # why a bigger batch could not be evaluated
        self.packing = False
        self.packed = False  # some packed call was used
        self.chunk = 1
        x = perturbed.x
        self.B, self.T = x.shape[:2]
        self.pos = torch.arange(self.T)  # decisions come back on the CPU

    def plan_packing(self, *, pack: bool, isolated: bool | None, mode: str,
                     max_batch_tokens: int, n_tasks: int) -> None:
        """Pack only a batch-isolated, batch-invariant target in perturb mode, and only if a
        call can hold MIN_CHUNK copies next to the control."""
        self.packing = bool(pack and isolated and self.batch_invariant and mode == "perturb")
        self.chunk = max(1, max_batch_tokens // (self.B * self.T) - 1)
        if self.packing and self.chunk < MIN_CHUNK and n_tasks > 1:
            # the control copy would cost more than 1/MIN_CHUNK on top: calls alone are cheaper
            self.pack_error = (f"max_batch_tokens={max_batch_tokens} fits {self.chunk} perturbed "
                               f"copies of {self.B}x{self.T} per call, fewer than {MIN_CHUNK}: "
                               f"one call per cut")
            self.packing = False

    def run(self, tasks: list, mode: str) -> None:
        """Evaluate every (cut, trial): packed while packing holds, else one call each."""
        j = 0
        while j < len(tasks):
            if self.packing and len(tasks) - j > 1:
                part = tasks[j:j + self.chunk]
                if not self._packed(part):
                    continue  # packing stopped or the chunk shrank: the same cuts again
            else:
                part = tasks[j:j + 1]
                c, i = part[0]
                self.flips.append(self.alone(c, i) if mode == "perturb" else self.truncated(c))
            j += len(part)
            if self.progress is not None:
                self.progress(j, len(tasks))

    # -- one cut ------------------------------------------------------------------------
    def note_flip(self) -> None:
        if self.first_flip_eval is None:
            self.first_flip_eval = self.tgt.n_evaluations

    def judged(self, out: Outputs, c: int, xc, same_shape: bool = True, trial: int = 0) -> Flips:
        """The flips of out (the run of xc) against the baseline at positions <= c, classified;
        score changes where the decision held are recorded on the side."""
        y0 = self.judge.base.decision[:, :out.decision.shape[1]]
        d = differs(y0, out.decision, self.atol)
        d[:, c + 1:] = False
        if d.any():
            self.note_flip()
        b, t = d.nonzero(as_tuple=True)
        kind = self.judge.flips(xc, (b, t), out, same_shape)
        moved = out.scores is not None and self._score_changes(out.scores, c, xc, d, same_shape, trial)
        if len(b) or moved:  # the first flip of any kind: make sure the target repeats itself
            self.judge.reproduce(xc, out)
        return Flips(c, trial, b, t, out.decision[b, t], kind)

    def _score_changes(self, sc, c, xc, flipped, same_shape, trial) -> bool:
        """Scores at positions <= c that moved while the decision did not: the future reaches
        the router even where this sample crossed no tie (an off-by-one mask shows up here
        at every cut). Same shape: a change beyond 32 ulps is structural, a smaller one goes
        to the fp64 scaling test. Shape changed (truncate): only the fp64 test can tell, so
        without a twin score changes are not judged."""
        s0 = self.judge.base.scores[:, :sc.shape[1]]
        ds = differs(s0, sc, 0.0) & ~flipped
        ds[:, c + 1:] = False
        if not ds.any():
            return False
        b, t = ds.nonzero(as_tuple=True)
        kind = self.judge.score_changes(xc, (b, t), sc, same_shape)
        if kind is None:
            return False
        self.note_flip()
        self.score_changes.append(ScoreChanges(c, trial, b, t, change_size(s0[b, t], sc[b, t]), kind))
        return True

    def alone(self, c: int, trial: int = 0) -> Flips:
        """The perturbed input run alone at the inputs' shape."""
        xc = self.perturbed(c, trial)
        return self.judged(Outputs(*self.tgt(xc)), c, xc, trial=trial)

    def truncated(self, c: int) -> Flips:
        """The inference view: the prefix x[:, :c+1] alone."""
        xc = self.perturbed.x[:, :c + 1].contiguous()  # real blocks .view() their input
        return self.judged(Outputs(*self.tgt(xc)), c, xc, same_shape=False)

    def confirm(self, xc, c: int, packed_mask, packed: Outputs, trial: int = 0):
        """Re-run a packed cut alone at the inputs' shape: (its flips, classified; whether the
        packed call gave exactly the same output). Past the verification budget the packed
        flips are kept as 'unconfirmed'."""
        if self.judge.verify_left <= 0:
            b, t = packed_mask.nonzero(as_tuple=True)
            kind = torch.full((len(b),), Kind.UNCONFIRMED, dtype=torch.long)
            return Flips(c, trial, b, t, packed.decision[b, t], kind), True
        self.judge.verify_left -= 1
        out = Outputs(*self.tgt(xc))
        # faithful: the packed copy computed what the call alone computes, everywhere
        faithful = not differs(out.decision, packed.decision, self.atol).any() and (
            out.scores is None or torch.equal(out.scores, packed.scores))
        return self.judged(out, c, xc, trial=trial), faithful

    # -- packed calls --------------------------------------------------------------------
    def _packed(self, part: list) -> bool:
        """One packed call for the (cut, trial) pairs of part, with the control in front.
        False if nothing was judged from it (packing stopped, or the chunk shrank)."""
        out = self._call_packed(part)
        if out is None:
            return False
        y0, s0 = self.judge.base
        B = self.B
        # the control must reproduce the baseline (scores bit for bit): else the packed call
        # computes differently from the inputs' shape, and packing stops
        if differs(out.decision[:B], y0, self.atol).any() or (
                out.scores is not None and not torch.equal(out.scores[:B], s0)):
            self.batch_invariant = self.packing = False
            return False
        self.packed = True
        outs = out.decision[B:].reshape(len(part), *y0.shape)
        scs = out.scores[B:].reshape(len(part), *s0.shape) if out.scores is not None else [None] * len(part)
        for n, ((c, i), yc, sc) in enumerate(zip(part, outs, scs)):
            if not self._packed_copy(c, i, Outputs(yc, sc)):
                # packing changed the answer: batch-variant; the rest of this chunk alone
                self.batch_invariant = self.packing = False
                self.flips.extend(self.alone(c2, i2) for c2, i2 in part[n + 1:])
                break
        return True

    def _call_packed(self, part: list) -> Outputs | None:
        x = self.perturbed.x
        try:
            return Outputs(*self.tgt(torch.cat([x] + [self.perturbed(c, i) for c, i in part])))
        except TargetError as e:
            if out_of_memory(e) and self.chunk > 1:
                self.chunk //= 2  # memory budget too generous for this target: halve and retry
                return None
            # a target that takes only its own batch size (static shapes, compiled graphs)
            # is probed one call per cut instead
            self.pack_error = str(e)
            self.packing = False
            return None

    def _packed_copy(self, c: int, i: int, out: Outputs) -> bool:
        """Judge one packed copy; False if re-running it alone gave other outputs."""
        y0, s0 = self.judge.base
        before = self.pos <= c
        d = differs(y0, out.decision, self.atol) & before
        moved_scores = out.scores is not None and bool((differs(s0, out.scores, 0.0) & before).any())
        if not d.any() and not moved_scores:
            return True
        self.note_flip()
        # Packed flips are taken as they stand only after the first REPRODUCTIONS
        # flipped cuts were re-run alone and gave exactly the same flips.
        if self.judge.reproduced >= REPRODUCTIONS:
            self.flips.append(self.judged(out, c, self.perturbed(c, i), trial=i))
            return True
        kept, faithful = self.confirm(self.perturbed(c, i), c, d, out, i)
        self.flips.append(kept)
        return faithful
