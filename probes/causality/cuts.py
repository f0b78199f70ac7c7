"""Evaluating the cuts: alone at the inputs' shape, as truncated prefixes, or packed.

Packing many perturbed copies into one call is sound only for a batch-isolated,
deterministic target, and only while the packed call computes what a call alone computes.

The first call after the baseline folds the checks into the first packed call:
  rows = [isolation rows | x (the control) | perturbed copies...]
The isolation rows are x with its even rows replaced (one replaced row when B == 1). The
control must reproduce the baseline (decisions within atol, scores bit for bit): that is the
determinism check, and it also shows the packed call computes what a call alone computes,
with other rows before and after it. The odd isolation rows must reproduce the baseline too:
the batch-isolation check. Only if both hold are the copies judged, so a global leak (expert
choice, probability dropping, sequence normalisation) shows at the second evaluation. If
anything moved, nothing is judged from that call: check.py runs the checks as separate calls
(a repeat of x, then the isolation call) to say which (TP-C2, TP-C3, or batch-variant
arithmetic), and every cut runs alone.

Later packed calls carry the control too; the first flipped packed copies are re-run alone
and must match exactly; else packing stops (batch-variant) and every later cut runs alone.
How many copies go into a call is measured (packing.py), under the memory budget: each call
or cut alone is timed with the probe's own work on it (building the copies, comparing the
outputs), which is what a cut costs, but without the confirmations of flips (re-runs, the
fp64 twin), which cost the same however the cuts are run.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from trainprobes.causality.classify import REPRODUCTIONS, Judge, Kind, Outputs, change_size
from trainprobes.causality.inputs import Perturbed
from trainprobes.causality.packing import ALL_AT_ONCE, START, Sizer
from trainprobes.causality.records import Flips, Isolation, ScoreChanges
from trainprobes.causality.target import Target, differs, same
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


def timed_call(tgt: Target, batch: torch.Tensor) -> tuple[Outputs, float]:
    """The target on batch, and the seconds it took (outputs come back on the CPU, so a
    device has finished)."""
    t0 = time.perf_counter()
    out = Outputs(*tgt(batch))
    return out, time.perf_counter() - t0


class Cuts:
    """The cuts of one check: each (cut, trial) evaluated and its changes classified into
    `flips` and `score_changes` records (records only for cuts that changed something)."""

    def __init__(self, judge: Judge, tgt: Target, perturbed: Perturbed, *, atol: float,
                 baseline_s: float, progress: Callable[[int, int], None] | None = None):
        self.judge, self.tgt, self.perturbed, self.atol = judge, tgt, perturbed, atol
        self.baseline_s = baseline_s  # the baseline call's seconds: a first estimate of a cut alone
        self.progress = progress
        self.flips: list[Flips] = []
        self.score_changes: list[ScoreChanges] = []
        self.first_flip_eval: int | None = None
        self.batch_invariant = True
        self.pack_error: str | None = None  # why a bigger batch could not be evaluated
        self.fold_moved: str | None = None  # why the first packed call was not trusted
        self.packing = False
        self.packed = False  # some packed copies were judged
        self.sizer: Sizer | None = None
        self.confirming_s = 0.0  # seconds spent confirming flips, kept out of the sizer's timings
        x = perturbed.x
        self.B, self.T = x.shape[:2]
        self.pos = torch.arange(self.T)  # decisions come back on the CPU

    # -- the plan -----------------------------------------------------------------------
    def plan(self, *, pack, mode: str, layout: str, max_batch_tokens: int, n_tasks: int) -> int | None:
        """Decide how the check runs. Returns the number of copies the first call carries
        next to the folded checks, or None: no folded call (one sequence without a batch axis,
        pack=False, or a budget too small even for the checks), the checks run as calls alone.
        pack: True (measure), False, or a fixed number of copies per call."""
        if layout != "batched" or pack is False:
            return None
        blocks = max_batch_tokens // (self.B * self.T)  # copies of x a call may hold
        cap = blocks - 1  # next to the control
        self.packing = mode == "perturb"
        fixed = None if pack is True else pack
        if self.packing and fixed is None and cap < MIN_CHUNK and n_tasks > 1:
            # the control copy would cost more than 1/MIN_CHUNK on top: calls alone are cheaper
            self.pack_error = (f"max_batch_tokens={max_batch_tokens} fits {max(cap, 0)} perturbed "
                               f"copies of {self.B}x{self.T} per call, fewer than {MIN_CHUNK}: "
                               f"one call per cut")
            self.packing = False
        if blocks < 2:
            self.packing = False
            return None
        if not self.packing:
            return 0
        self.sizer = Sizer(cap, baseline_s=self.baseline_s, fixed=fixed)
        first = fixed or (n_tasks if n_tasks <= ALL_AT_ONCE else START)
        return min(first, blocks - 2, n_tasks)

    def fold(self, part: list, R: torch.Tensor) -> tuple[Isolation | None, int]:
        """The first packed call, with the determinism and isolation checks folded in (see
        the module's docstring). Returns (the isolation it showed, the number of tasks of part
        it judged), or (None, 0) if the checks must run as separate calls."""
        x, B = self.perturbed.x, self.B
        if B == 1:
            iso = R[0].to(x.device)
        else:
            iso = x.clone()
            iso[0::2] = R[0, 0::2].to(x.device)
        while True:
            t0, confirming = time.perf_counter(), self.confirming_s
            try:
                out = Outputs(*self.tgt(self.perturbed.batch(part, [iso, x])))
                break
            except TargetError as e:
                if not (out_of_memory(e) and part):
                    self.pack_error = str(e)  # e.g. a target compiled for its own batch size
                    self.packing = False
                    return None, 0
                if not self.sizer.shrink(len(part)):
                    self.packing = False
                    self.pack_error = f"out of memory with {len(part)} copies per call: one call per cut"
                part = part[:len(part) // 2] if self.packing else []
        moved = self._moved(out, B)
        if moved:
            self.fold_moved = (f"the first packed call (with the determinism control and the "
                               f"isolation rows) moved outputs a call alone gave, at (row, "
                               f"position) {moved[:3]}: the checks ran as separate calls and "
                               f"no packed copy was judged")
            return None, 0
        if part:
            self._judge_copies(part, out, 2 * B)
            self.sizer.packed(len(part), 2, self._since(t0, confirming))
        return Isolation(True, []), len(part)

    def _moved(self, out: Outputs, B: int) -> list:
        """Where the control (rows B..2B-1) or an odd isolation row differs from the baseline:
        decisions beyond atol, scores in any bit. [[row of x, position], ...]"""
        y0, s0 = self.judge.base
        rows = torch.cat([torch.arange(1, B, 2), torch.arange(B)]) if B > 1 else torch.arange(1)
        picked = torch.cat([torch.arange(1, B, 2), torch.arange(B, 2 * B)]) if B > 1 else torch.arange(1, 2)
        moved = differs(out.decision[picked], y0[rows], self.atol)
        if s0 is not None:
            moved |= differs(out.scores[picked], s0[rows], 0.0)
        return [[int(rows[k]), t] for k, t in moved.nonzero()[:10].tolist()]

    def after_checks(self, iso: Isolation) -> Isolation:
        """After the checks ran as separate calls: packing only for an isolated, batch-invariant
        target whose first packed call (if any) was trusted."""
        self.batch_invariant = iso.batch_invariant
        if iso.error:
            self.pack_error = iso.error
        if self.fold_moved:
            # packed rows computed otherwise than the same rows alone, though the target
            # is deterministic: batch-variant, or (one sequence) isolation unknown
            self.pack_error = self.fold_moved
            self.packing = False
            if iso.isolated:
                self.batch_invariant = False
                if self.B == 1:
                    iso = iso._replace(isolated=None)
        self.packing = bool(self.packing and iso.isolated and self.batch_invariant)
        return iso

    def run(self, tasks: list, mode: str, start: int = 0) -> None:
        """Evaluate the (cut, trial) pairs from tasks[start]: packed while packing holds and
        pays, else one call each."""
        with torch.no_grad():  # once for every call (Target skips its own then)
            self._run(tasks, mode, start)

    def _run(self, tasks: list, mode: str, start: int) -> None:
        j = start
        if start and self.progress is not None:
            self.progress(start, len(tasks))
        while j < len(tasks):
            n = self.sizer.next() if self.packing and len(tasks) - j > 1 else 0
            if n:
                part = tasks[j:j + n]
                if not self._packed(part):
                    continue  # packing stopped or the chunk shrank: the same cuts again
            else:
                part = tasks[j:j + 1]
                c, i = part[0]
                if mode == "perturb":
                    self.alone(c, i)
                else:
                    self.truncated(c)
            j += len(part)
            if self.progress is not None:
                self.progress(j, len(tasks))

    def packing_evidence(self) -> dict | None:
        """What the sizer measured and chose; None if no packed call was made."""
        return self.sizer.evidence() if self.sizer is not None and self.sizer.sizes else None

    # -- one cut ------------------------------------------------------------------------
    def _since(self, t0: float, confirming: float) -> float:
        """Seconds since t0, less the confirmations of flips spent since then."""
        return time.perf_counter() - t0 - (self.confirming_s - confirming)

    def note_flip(self) -> None:
        if self.first_flip_eval is None:
            self.first_flip_eval = self.tgt.n_evaluations

    def judged(self, out: Outputs, c: int, xc, same_shape: bool = True, trial: int = 0) -> Flips | None:
        """The flips of out (the run of xc) against the baseline at positions <= c, classified
        (None if no decision flipped); score changes where the decision held are recorded on
        the side."""
        y0, s0 = self.judge.base.decision[:, :out.decision.shape[1]], self.judge.base.scores
        if same(y0[:, :c + 1], out.decision[:, :c + 1]) and (
                out.scores is None or same(s0[:, :c + 1], out.scores[:, :c + 1])):
            return None  # the common case, one pass each: nothing at or before the cut moved
        d = differs(y0, out.decision, self.atol)
        d[:, c + 1:] = False
        flipped = bool(d.any())
        if not flipped and (out.scores is None or not self._scores_moved(out.scores, c)):
            return None  # within atol, or a NaN that stayed a NaN
        t0 = time.perf_counter()
        if flipped:
            self.note_flip()
        b, t = d.nonzero(as_tuple=True)
        kind = self.judge.flips(xc, (b, t), out, same_shape)
        moved = out.scores is not None and self._score_changes(out.scores, c, xc, d, same_shape, trial)
        if flipped or moved:  # the first flip of any kind: make sure the target repeats itself
            self.judge.reproduce(xc, out)
        self.confirming_s += time.perf_counter() - t0
        return Flips(c, trial, b, t, out.decision[b, t], kind) if flipped else None

    def _scores_moved(self, sc: torch.Tensor, c: int) -> bool:
        return bool(differs(self.judge.base.scores[:, :sc.shape[1]], sc, 0.0)[:, :c + 1].any())

    def _score_changes(self, sc, c, xc, flipped, same_shape, trial) -> bool:
        """Scores at positions <= c that moved while the decision did not: the future reaches
        the router even where this sample crossed no tie (an off-by-one mask shows up here
        at every cut). Same shape: a change beyond reduction noise (max(32, T) ulps) is
        structural, a smaller one goes to the fp64 scaling test. Shape changed (truncate): only the fp64 test can tell, so
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

    def _keep(self, flips: Flips | None) -> None:
        if flips is not None:
            self.flips.append(flips)

    def alone(self, c: int, trial: int = 0) -> None:
        """The perturbed input run alone at the inputs' shape (timed while the sizer decides)."""
        timing = self.sizer is not None and self.sizer.deciding()
        t0, confirming = time.perf_counter() if timing else 0.0, self.confirming_s
        xc = self.perturbed(c, trial)
        self._keep(self.judged(Outputs(*self.tgt(xc)), c, xc, trial=trial))
        if timing:
            self.sizer.alone(self._since(t0, confirming))

    def truncated(self, c: int) -> None:
        """The inference view: the prefix x[:, :c+1] alone."""
        xc = self.perturbed.x[:, :c + 1].contiguous()  # real blocks .view() their input
        self._keep(self.judged(Outputs(*self.tgt(xc)), c, xc, same_shape=False))

    def confirm(self, xc, c: int, packed_mask, packed: Outputs, trial: int = 0) -> bool:
        """Re-run a packed cut alone at the inputs' shape and keep its flips, classified;
        whether the packed call gave exactly the same output. Past the verification budget
        the packed flips are kept as 'unconfirmed'."""
        if self.judge.verify_left <= 0:
            b, t = packed_mask.nonzero(as_tuple=True)
            kind = torch.full((len(b),), Kind.UNCONFIRMED, dtype=torch.long)
            self.flips.append(Flips(c, trial, b, t, packed.decision[b, t], kind))
            return True
        self.judge.verify_left -= 1
        self.judge.confirmations += 1
        out, seconds = timed_call(self.tgt, xc)
        self.confirming_s += seconds
        # faithful: the packed copy computed what the call alone computes, everywhere
        faithful = not differs(out.decision, packed.decision, self.atol).any() and (
            out.scores is None or torch.equal(out.scores, packed.scores))
        self._keep(self.judged(out, c, xc, trial=trial))
        return faithful

    # -- packed calls --------------------------------------------------------------------
    def _packed(self, part: list) -> bool:
        """One packed call for the (cut, trial) pairs of part, with the control in front.
        False if nothing was judged from it (packing stopped, or the chunk shrank)."""
        t0, confirming = time.perf_counter(), self.confirming_s
        try:
            out = Outputs(*self.tgt(self.perturbed.batch(part, [self.perturbed.x])))
        except TargetError as e:
            if out_of_memory(e) and self.sizer.shrink(len(part)):
                return False  # memory budget too generous for this target: retry smaller
            # a target that takes only its own batch size (static shapes, compiled graphs)
            # is probed one call per cut instead
            self.pack_error = str(e)
            self.packing = False
            return False
        y0, s0 = self.judge.base
        # the control must reproduce the baseline (scores bit for bit): else the packed call
        # computes differently from the inputs' shape, and packing stops
        dec = out.decision[:self.B]
        if not same(dec, y0) and differs(dec, y0, self.atol).any() or (
                out.scores is not None and not torch.equal(out.scores[:self.B], s0)):
            self.batch_invariant = self.packing = False
            return False
        self._judge_copies(part, out, self.B)
        self.sizer.packed(len(part), 1, self._since(t0, confirming))
        return True

    def _judge_copies(self, part: list, out: Outputs, skip: int) -> None:
        """Judge the copies of a packed call (rows from `skip` on, one block of B per copy)."""
        y0, s0 = self.judge.base
        self.packed = True
        outs = out.decision[skip:].reshape(len(part), *y0.shape)
        scs = out.scores[skip:].reshape(len(part), *s0.shape) if out.scores is not None else None
        # every copy against the baseline at once, [copies, B, T], positions <= its cut: a
        # screen by != in the outputs' own dtype (one pass, a superset of what differs finds:
        # it also flags a NaN that stayed a NaN, and changes within atol), then differs on
        # the few copies it flags
        moved = _unequal(outs, y0)
        if scs is not None:
            moved |= _unequal(scs, s0)
        cuts = torch.tensor([c for c, _ in part])
        moved &= (self.pos[None, :] <= cuts[:, None])[:, None, :]
        for n in moved.flatten(1).any(1).nonzero().flatten().tolist():
            c, i = part[n]
            copy = Outputs(outs[n], scs[n] if scs is not None else None)
            if not self._changed(copy, c):
                continue
            if not self._packed_copy(c, i, copy):
                # packing changed the answer: batch-variant; the rest of this chunk alone
                self.batch_invariant = self.packing = False
                for c2, i2 in part[n + 1:]:
                    self.alone(c2, i2)
                break

    def _changed(self, out: Outputs, c: int) -> bool:
        """Whether a decision (beyond atol) or a score (any bit) at or before c differs from
        the baseline."""
        y0, s0 = self.judge.base
        d = differs(y0, out.decision, self.atol)
        if out.scores is not None:
            d |= differs(s0, out.scores, 0.0)
        return bool(d[:, :c + 1].any())

    def _packed_copy(self, c: int, i: int, out: Outputs) -> bool:
        """Judge one packed copy that moved at or before its cut; False if re-running it
        alone gave other outputs."""
        self.note_flip()
        # Packed flips are taken as they stand only after the first REPRODUCTIONS
        # flipped cuts were re-run alone and gave exactly the same flips.
        if self.judge.reproduced >= REPRODUCTIONS:
            self._keep(self.judged(out, c, self.perturbed(c, i), trial=i))
            return True
        d = differs(self.judge.base.decision, out.decision, self.atol) & (self.pos <= c)
        return self.confirm(self.perturbed(c, i), c, d, out, i)


def _unequal(outs: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """[copies, B, T] bool: where each copy [copies, B, T, ...] is not equal to base [B, T, ...]."""
    ne = outs != base[None]
    return ne.flatten(3).any(-1) if ne.dim() > 3 else ne
