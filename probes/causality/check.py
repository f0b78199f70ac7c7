"""Future-perturbation and truncation probes for per-token decisions.

`check(fn, inputs)` asks: does the decision for token t depend on tokens after t?

Algorithm (perturb mode):
  1. Run the target on the inputs x: the baseline.
  2. For each cut c, x_c = x with every position > c replaced by other values (same length, same
     batch shape). Decisions at positions <= c must not change.
  3. The second call folds the checks into the first packed call (cuts.py): x with its even
     rows replaced (isolation), an unperturbed copy of x (the control), and the first x_c.
     The control must reproduce the baseline bit for bit (determinism: else no flip could be
     told from a leak) and so must the odd isolation rows (batch isolation: packing is sound
     only for a batch-isolated target). Only then are the copies judged, so a global leak shows
     at the second evaluation. If anything moved, nothing is judged from that call: the checks
     run as separate calls (x again: TP-C2 if it differs; the isolation rows alone: TP-C3 if
     they move beyond rounding noise) and every cut runs alone at the inputs' shape.
  4. Later cuts are packed as many to a call as measurement says pays (packing.py; the memory
     budget max_batch_tokens is an upper bound), each call with a control copy; the first
     flipped packed cuts are re-run alone and must match exactly, else packing stops (the
     target is batch-variant) and every later cut runs alone.
  5. Classify every flip (b, t, c) (classify.py). At the inputs' shape a deterministic target
     can change a decision at t <= c only if data flows from the future (or the future
     reordered a reduction): structural, unless the routing margin (runner-up gap of
     `scores`, or the size of a float change) is within reduction noise (max(32, T) ulps);
     then the fp64 twin decides (a precision-scaling test), or it stays
     "unverified". The first flipped cuts are re-run once more: a flip that does not repeat
     is nondeterminism (TP-C2), not a leak.
  6. With `scores`, score changes at t <= c where the decision held are judged the same way.
Truncate mode runs the prefix x[:, :c+1] (the inference view) one call per cut, after the
same folded checks (without copies); shapes differ, so every flip goes to the fp64 twin. The
share of earlier decisions that differ is the train/inference decision mismatch. With
pack=False or layout="flat" the checks are separate calls and nothing is packed. The Result
is assembled in summary.py.
"""
from __future__ import annotations

from typing import Callable

import torch
from trainprobes.causality.classify import (
    Judge,
    Kind,
    Nondeterministic,
    Outputs,
    noise_tol,
    reduction_ulps,
)
from trainprobes.causality.cuts import Cuts, timed_call
from trainprobes.causality.inputs import (
    MODES,
    Perturbed,
    as_batched,
    replacements,
    resolve_cuts,
    spread_first,
)
from trainprobes.causality.near_tie import search as near_tie_search
from trainprobes.causality.near_tie import skipped
from trainprobes.causality.records import NOT_TESTED, Findings, Isolation
from trainprobes.causality.summary import Setup, nondeterministic, summarise
from trainprobes.causality.target import Picker, Target, abs_diff, differs
from trainprobes.errors import TargetError
from trainprobes.result import Result
from trainprobes.validation import check_choice, check_int, check_number

__all__ = ["check", "resolve_cuts", "MODES"]


def check(fn: Callable, inputs: torch.Tensor, *, mode: str = "perturb", cuts=None, trials: int = 1,
          seed: int = 0, atol: float = 0.0, decision: Picker = None, scores: Picker = None,
          layout: str = "batched", vocab: int | None = None, fp64=None,
          margin_tol: float | None = None, pack: bool | int = True, max_batch_tokens: int = 65536,
          max_verify: int | None = None, max_leaks: int = 200, target: str | None = None,
          near_ties: int = 32, progress: Callable[[int, int], None] | None = None) -> Result:
    """Probe fn for decisions that depend on future tokens. Returns a Result (probe
    "causality.check") with metrics causal, n_leaks, flip_rate, mismatch_rate (truncate),
    n_evaluations, tokens_evaluated, ... and evidence leaks, flip_rate_by_position,
    leak_distances, leak_map, cuts, seed.

    inputs: token ids [B, T] (long) or floats [B, T, D]; layout="flat" for [T] / [T, D]
      with fn taking one sequence without a batch axis.
    decision / scores: how to pick the decision (and optionally routing scores [B, T, E],
      used for margins) out of fn's output: None (the output), an index, a name, or a
      callable. Integer decisions are compared exactly, float decisions with atol.
    fp64: None (auto twin), False, or a callable computing the same thing in float64.
    pack: True (copies per call chosen by measuring, up to max_batch_tokens), False (every
      call at the inputs' shape), or a number of copies per call (reproducible evaluations).
    margin_tol: absolute score gap below which a flip may be rounding noise; default
      max(32, T) ulps of the score's magnitude (a reordered reduction over T positions).
    near_ties: for a target that returns decisions only (no scores) on float inputs, how
      many decisions before the cuts to bring to a tie by bisection on the input before
      the future is perturbed (near_tie.py): a leak too small to flip a choice at random
      inputs' margins flips one there. They sit in min(B, near_ties) windows before spread
      cuts, bisected in one row, so the search costs ~22 calls of one row and 3 of two rows
      per window however many there are. 0: off (the Result then says what it cannot rule
      out).
    """
    mode = check_choice(mode, "mode", MODES)
    trials = check_int(trials, "trials", min=1, hint="perturbations per cut")
    atol = check_number(atol, "atol", min=0, finite=False)
    seed = check_int(seed, "seed")
    if not isinstance(pack, bool):
        pack = check_int(pack, "pack", min=1, hint="True (copies per call measured), False, or copies per call")
    max_batch_tokens = check_int(max_batch_tokens, "max_batch_tokens", min=1)
    max_leaks = check_int(max_leaks, "max_leaks", min=0, hint="leak records kept in the evidence")
    near_ties = check_int(near_ties, "near_ties", min=0, hint="decisions brought to a tie (0: off)")
    if max_verify is not None:
        max_verify = check_int(max_verify, "max_verify", min=0, hint="re-runs and fp64 calls")
    if margin_tol is not None:
        margin_tol = check_number(margin_tol, "margin_tol", min=0)
    if vocab is not None:
        vocab = check_int(vocab, "vocab", min=2, hint="the vocabulary size of token-id inputs")
    name = target or getattr(fn, "__qualname__", None) or type(fn).__name__
    tgt = Target(fn, name, decision=decision, scores=scores, layout=layout)
    x = as_batched(inputs, layout)
    g = torch.Generator().manual_seed(seed)
    cut_list = resolve_cuts(cuts, x.shape[1], mode, g)
    trials = trials if mode == "perturb" else 1
    R = replacements(x, trials, vocab, g)
    setup = Setup(mode=mode, layout=layout, atol=atol, shape=list(x.shape), input_dtype=str(x.dtype),
                  cuts=cut_list, trials=trials, max_leaks=max_leaks)
    common = dict(probe="causality.check", target=name, seed=seed)

    base, baseline_s = timed_call(tgt, x)
    judge = Judge(tgt, x, base, atol=atol, margin_tol=margin_tol, fp64=fp64, max_verify=max_verify)
    run = Cuts(judge, tgt, Perturbed(x, R), atol=atol, baseline_s=baseline_s, progress=progress)
    tasks = [(c, i) for c in cut_list for i in range(trials)]
    try:
        copies = run.plan(pack=pack, mode=mode, layout=layout, max_batch_tokens=max_batch_tokens,
                          n_tasks=len(tasks))
        iso, done = None, 0
        if copies is not None:  # determinism and isolation ride along in the first call
            tasks = spread_first(tasks, copies)
            iso, done = run.fold(tasks[:copies], R)
        if iso is None:  # as separate calls: no fold, or the fold moved and must say why
            _deterministic(judge)
            iso = run.after_checks(_batch_isolation(judge, R, layout))
        run.run(tasks, mode, start=done)
        ties = _near_ties(judge, tgt, R, cut_list, iso, run, mode=mode, layout=layout,
                          points=near_ties, max_batch_tokens=max_batch_tokens)
    except Nondeterministic as e:
        return nondeterministic(common, setup, name, e.where, e.count, tgt.n_evaluations,
                                tgt.tokens_evaluated)
    found = Findings(base=judge.base, isolation=iso, flips=run.flips, score_changes=run.score_changes,
                     batch_invariant=run.batch_invariant, packed=run.packed,
                     packing_error=run.pack_error, packing=run.packing_evidence(),
                     first_flip_eval=run.first_flip_eval, fp64_status=judge.fp64_status,
                     n_evaluations=tgt.n_evaluations, n_confirmations=judge.confirmations,
                     tokens_evaluated=tgt.tokens_evaluated, near_ties=ties)
    return summarise(common, setup, found)


def _near_ties(judge: Judge, tgt: Target, R, cuts, iso: Isolation, run: Cuts, *, mode: str,
               layout: str, points: int, max_batch_tokens: int):
    """The near-tie search where it can add something, else why it did not run (None when
    the target gives scores: every score that moves is judged already)."""
    if tgt.scores is not None or judge.base.decision.is_floating_point():
        return None  # scores (or float decisions) show any move without a tie
    if points == 0:
        return skipped("turned off (near_ties=0)")
    if any(((f.kind == Kind.STRUCTURAL) | (f.kind == Kind.UNCONFIRMED)).any() for f in run.flips):
        return skipped("not needed: decisions flipped at random inputs")
    if mode != "perturb":
        return skipped("truncate mode changes the shape: a tie would not survive it")
    if not judge.x.is_floating_point():
        return skipped("token ids cannot be moved continuously towards a tie")
    if layout != "batched" or iso.isolated is not True:
        return skipped("copies share a call only for a batch-isolated target with a batch axis")
    # every bisection call is one row, however many ties it carries (near_tie.py): more
    # points cost no more calls, only longer windows before each cut. Where the cuts
    # measured that calls bigger than the inputs cost more per row than calls alone, the
    # search's calls hold no more rows than the inputs do
    alone = run.sizer is not None and run.sizer.state == "alone"
    return near_tie_search(judge, tgt, R, cuts, points=points, max_batch_tokens=max_batch_tokens,
                           rows_per_call=judge.x.shape[0] if alone else None)


def _deterministic(judge: Judge) -> None:
    """Run the inputs again: decisions within atol and scores bit for bit, else TP-C2."""
    y0, s0 = judge.base
    y1, s1 = judge.tgt(judge.x)
    nondet = differs(y0, y1, judge.atol)
    if s0 is not None:
        nondet |= differs(s0, s1, 0.0)
    if nondet.any():
        raise Nondeterministic(nondet.nonzero()[:10].tolist(), int(nondet.sum()))


def _batch_isolation(judge: Judge, R: torch.Tensor, layout: str) -> Isolation:
    """Replace the even rows, the odd rows must not move. Watching the odd rows means every
    watched row has a replaced row before it (and, past B=2, after it): batch-major priority
    (capacity granted in flattened order, row 0 first) makes a row depend on the rows before
    it, which row 0 has none of. With two rows, row 1 has nothing after it, so a second call
    replaces row 1 and watches row 0 (priority to the last row). Moves of decisions, and of
    scores where the decision held (a batch-wide temperature moves the weights, never the
    top-k), are judged like flips at the inputs' shape: a kernel whose tiling depends on the
    data of the whole batch (grouped expert matmuls sized by tokens per expert, as HF MoE
    models run them) moves other rows by an ulp or so: that is batch-variant arithmetic, not
    a sequence reading another."""
    if layout != "batched":
        return NOT_TESTED
    x, (y0, _) = judge.x, judge.base
    if x.shape[0] < 2:
        # one sequence: add a second row. If row 0 moves, the cause (another row, or the
        # batch shape) cannot be told apart: isolation stays unknown and nothing is packed.
        try:
            yi, si = judge.tgt(torch.cat([x, R[0].to(x.device)]))
        except TargetError as e:  # takes one sequence only: probe one call per cut
            return Isolation(None, [], error=str(e))
        moved = differs(y0, yi[:1], judge.atol).any()
        s0 = judge.base.scores
        if s0 is not None and not moved:  # scores too (a batch-wide temperature), beyond
            # what a batch-shape-dependent reduction order can move them
            tol = noise_tol(s0, reduction_ulps(x.shape[1]))
            moved = bool((abs_diff(s0, si[:1]) > tol).any())
        return Isolation(None if moved else True, [])
    where, counts = [], torch.zeros(len(Kind), dtype=torch.long)
    for replaced in ([0, 1] if x.shape[0] == 2 else [0]):
        xi = x.clone()
        xi[replaced::2] = R[0, replaced::2].to(x.device)
        where += _isolation_moves(judge, xi, 1 - replaced, counts)
    numerical, unverified = int(counts[Kind.NUMERICAL]), int(counts[Kind.UNVERIFIED])
    isolated = False if where else (None if unverified else True)
    return Isolation(isolated, where[:10], numerical, unverified)


def _isolation_moves(judge: Judge, xi: torch.Tensor, first: int, counts: torch.Tensor) -> list:
    """Run xi and judge the moves of the rows first, first + 2, ... (decisions, then scores
    where the decision held) against the baseline; counts += their kinds. The structural
    moves: [[row, position], ...]."""
    y0, s0 = judge.base
    out = Outputs(*judge.tgt(xi))
    rows = torch.arange(first, len(xi), 2)
    moved = differs(y0[rows], out.decision[rows], judge.atol)
    smoved = (differs(s0[rows], out.scores[rows], 0.0) & ~moved if s0 is not None
              else torch.zeros_like(moved))
    if not (moved.any() or smoved.any()):
        return []
    judge.reproduce(xi, out)
    where = []
    for m, kinds_of in ((moved, lambda w: judge.flips(xi, w, out)),
                        (smoved, lambda w: judge.score_changes(xi, w, out.scores))):
        if not m.any():
            continue
        k, t = m.nonzero(as_tuple=True)
        kind = kinds_of((rows[k], t))
        counts += torch.bincount(kind, minlength=len(Kind))
        where += [[int(b), int(p)] for b, p in zip(rows[k][kind == Kind.STRUCTURAL].tolist(),
                                                   t[kind == Kind.STRUCTURAL].tolist())]
    return where
