"""Future-perturbation and truncation probes for per-token decisions.

`check(fn, inputs)` asks: does the decision for token t depend on tokens after t?

Algorithm (perturb mode):
  1. Run the target twice on the inputs. Different decisions (or scores, bit for bit):
     nondeterministic (TP-C2); stop, since no flip could then be told from a leak.
  2. Batch isolation: replace the even rows, compare the odd rows (TP-C3 if they move).
  3. For each cut c, x_c = x with every position > c replaced by other values (same length, same
     batch shape). Decisions at positions <= c must not change. If the target is
     batch-isolated, many x_c are packed into one call, chunked to max_batch_tokens, with an
     unperturbed copy of x as a control; otherwise one call per cut, at the inputs' shape.
  4. Packing must compute what a call alone computes: the control must reproduce the baseline,
     and the first flipped packed cuts are re-run alone and must match exactly; else packing
     stops (the target is batch-variant) and every later cut runs alone.
  5. Classify every flip (b, t, c). At the inputs' shape a deterministic target can change a
     decision at t <= c only if data flows from the future: structural, unless the routing
     margin (runner-up gap of `scores`, or the size of a float change) is within rounding
     noise; then the fp64 twin decides (a precision-scaling test), or it stays "unverified".
     The first flipped cuts are re-run once more: a flip that does not repeat is
     nondeterminism (TP-C2), not a leak.
  6. With `scores`, score changes at t <= c where the decision held are judged the same way.
Truncate mode runs the prefix x[:, :c+1] (the inference view); shapes differ, so every flip
goes to the fp64 twin. The share of earlier decisions that differ is the train/inference
decision mismatch.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from trainprobes.causality.target import Picker, Target, differs, margins
from trainprobes.result import Result
from trainprobes.targets import TargetError

__all__ = ["check", "resolve_cuts", "MODES"]

MODES = ("perturb", "truncate")
NOISE_ULPS = 32  # a score gap within 32 ulps of its magnitude is "near a tie"
REPRODUCTIONS = 3  # flipped cuts re-run to tell nondeterminism from a leak
MIN_CHUNK = 8  # pack only if a call holds >= 8 copies: the control then adds <= 1/8


def resolve_cuts(cuts, T: int, mode: str, generator: torch.Generator) -> list[int]:
    """None: a few evenly spaced cuts (8 in perturb mode, packed in one call; 4 in truncate
    mode, one call each), enough to catch global leaks. "all": 0..T-2 (full certification).
    An int n: n cuts sampled without replacement. A list: those positions."""
    last = T - 2  # a cut at T-1 has no future to perturb
    if cuts is None:
        n = min(8 if mode == "perturb" else 4, last + 1)
        return sorted({round((i + 1) * (last + 1) / (n + 1)) for i in range(n)} - {last + 1}) or [0]
    if isinstance(cuts, str):
        if cuts != "all":
            raise ValueError(f"cuts={cuts!r} must be 'all', an int, a list of positions or None")
        return list(range(last + 1))
    if isinstance(cuts, bool):
        raise ValueError(f"cuts={cuts!r} must be 'all', an int, a list of positions or None")
    if isinstance(cuts, int):
        if cuts < 1:
            raise ValueError(f"cuts={cuts!r} must be >= 1 (the number of sampled cuts)")
        n = min(cuts, last + 1)
        return sorted(torch.randperm(last + 1, generator=generator)[:n].tolist())
    out = sorted({int(c) for c in cuts})
    bad = [c for c in out if not 0 <= c <= last]
    if not out or bad:
        raise ValueError(f"cuts={list(cuts)!r}: positions must be in [0, {last}] for T={T} "
                         f"(a cut c perturbs positions c+1..T-1)")
    return out


def _replacements(x: torch.Tensor, trials: int, vocab: int | None, g: torch.Generator) -> torch.Tensor:
    """[trials, *x.shape] values that differ from x everywhere: other token ids, or fresh
    Gaussian values with x's per-feature mean and std (never a permutation of x's own
    values, which would leave a sequence-wide sum unchanged)."""
    x = x.cpu()  # drawn on the CPU from the seeded generator: same seed, same values anywhere
    if not x.is_floating_point():
        V = vocab if vocab is not None else max(2, int(x.max()) + 1)
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= V):
            raise ValueError(f"vocab={V!r} but inputs hold token ids in [{int(x.min())}, "
                             f"{int(x.max())}]: pass the vocabulary size the ids come from")
        shift = torch.randint(1, V, (trials, *x.shape), generator=g)
        return (x[None] + shift) % V
    flat = x.double().reshape(-1, x.shape[-1]) if x.dim() > 2 else x.double().reshape(-1, 1)
    mean, std = flat.mean(0), flat.std(0).nan_to_num(1.0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    z = torch.randn((trials, *x.shape), generator=g, dtype=torch.float64)
    z = z * (std if x.dim() > 2 else std[0]) + (mean if x.dim() > 2 else mean[0])
    return z.to(x.dtype)


def _noise_tol(values: torch.Tensor) -> torch.Tensor:
    eps = torch.finfo(values.dtype).eps if values.is_floating_point() else 0.0
    return NOISE_ULPS * eps * values.double().abs().clamp_min(1.0)


def check(fn: Callable, inputs: torch.Tensor, *, mode: str = "perturb", cuts=None, trials: int = 1,
          seed: int = 0, atol: float = 0.0, decision: Picker = None, scores: Picker = None,
          layout: str = "batched", vocab: int | None = None, fp64=None,
          margin_tol: float | None = None, pack: bool = True, max_batch_tokens: int = 65536,
          max_verify: int | None = None, max_leaks: int = 200, target: str | None = None,
          progress: Callable[[int, int], None] | None = None) -> Result:
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
    margin_tol: absolute score gap below which a flip may be rounding noise; default
      32 ulps of the score's magnitude.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"trials={trials!r} must be an int >= 1 (perturbations per cut)")
    if not (isinstance(atol, (int, float)) and atol >= 0):
        raise ValueError(f"atol={atol!r} must be a float >= 0")
    if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens={max_batch_tokens!r} must be an int >= 1")
    name = target or getattr(fn, "__qualname__", None) or type(fn).__name__
    tgt = Target(fn, name, decision=decision, scores=scores, layout=layout)
    x = _as_batched(inputs, layout)
    B, T = x.shape[:2]
    g = torch.Generator().manual_seed(seed)
    cut_list = resolve_cuts(cuts, T, mode, g)
    trials = trials if mode == "perturb" else 1
    R = _replacements(x, trials, vocab, g)
    run = _Run(tgt, x, atol, margin_tol, fp64, max_verify)

    common = dict(probe="causality.check", target=name, seed=seed)
    try:
        # 1. determinism: decisions and scores, bit for bit
        y0, s0 = run.base
        y1, s1 = tgt(x)
        nondet = differs(y0, y1, atol)
        if s0 is not None:
            nondet |= differs(s0, s1, 0.0)
        if nondet.any():
            raise _Nondeterministic(nondet.nonzero()[:10].tolist(), int(nondet.sum()))
        # 2. batch isolation: replace the even rows, the odd rows must not move. Watching
        # the odd rows means every watched row has a replaced row before it (and, past
        # B=2, after it): batch-major priority (capacity granted in flattened order, row 0
        # first) makes a row depend on the rows before it, which row 0 has none of.
        isolated, iso_where = None, []
        if B >= 2 and layout == "batched":
            xi = x.clone()
            xi[0::2] = R[0, 0::2].to(x.device)
            yi, si = tgt(xi)
            moved = differs(y0[1::2], yi[1::2], atol)
            if moved.any():
                run.reproduce(xi, yi, si)
                moved = run.isolation_moves(xi, yi, si, moved)
            isolated = not bool(moved.any()) if run.iso_unverified == 0 else None
            iso_where = [[2 * b + 1, t] for b, t in moved.nonzero()[:10].tolist()]
        elif layout == "batched":
            # one sequence: add a second row. If row 0 moves, the cause (another row, or the
            # batch shape) cannot be told apart: isolation stays unknown and nothing is packed.
            try:
                yi, _ = tgt(torch.cat([x, R[0].to(x.device)]))
                isolated = True if not differs(y0, yi[:1], atol).any() else None
            except TargetError as e:  # takes one sequence only: probe one call per cut
                run.pack_error = str(e)
        # 3. cuts
        flips, packed_used = _cuts(run, tgt, x, R, mode, cut_list, trials, pack, isolated,
                                   max_batch_tokens, atol, progress)
    except _Nondeterministic as e:
        return Result(**common, verdict="fail", codes=["TP-C2"],
                      metrics={"causal": None, "deterministic": False,
                               "n_nondeterministic": e.count,
                               "n_evaluations": tgt.n_evaluations,
                               "tokens_evaluated": tgt.tokens_evaluated},
                      evidence={"nondeterministic_positions": e.where, "mode": mode,
                                "shape": list(x.shape)},
                      message=f"{name} gave different outputs on the same input at {e.count} "
                              f"tokens (first (batch, position): {e.where[:3]}); nondeterminism "
                              f"is not a causality verdict: make the target deterministic "
                              f"(.eval() for dropout and router jitter, fixed seeds, "
                              f"torch.use_deterministic_algorithms) and probe again")
    return _result(common, run, tgt, mode, x, cut_list, trials, flips, isolated, iso_where,
                   packing_used=packed_used, max_leaks=max_leaks, atol=atol, layout=layout)


def _cuts(run, tgt, x, R, mode, cut_list, trials, pack, isolated, max_batch_tokens, atol,
          progress):
    """Evaluate every (cut, trial): packed with a control copy when the target is
    batch-isolated, alone at the inputs' shape otherwise. Returns (flips, packed)."""
    B, T = x.shape[:2]
    y0, s0 = run.base
    pos = torch.arange(T)  # decisions come back on the CPU; inputs stay on their device
    pos_dev, R = pos.to(x.device), R.to(x.device)
    tasks = [(c, i) for c in cut_list for i in range(trials)]
    packing = bool(pack and isolated and run.batch_invariant and mode == "perturb")
    packed_used = False
    chunk = max(1, max_batch_tokens // (B * T) - 1)
    if packing and chunk < MIN_CHUNK and len(tasks) > 1:
        # the control copy would cost more than 1/MIN_CHUNK on top: calls alone are cheaper
        run.pack_error = (f"max_batch_tokens={max_batch_tokens} fits {chunk} perturbed copies "
                          f"of {B}x{T} per call, fewer than {MIN_CHUNK}: one call per cut")
        packing = False
    flips = []  # (cut, trial, batch idx, position idx, decisions after, kind)

    def perturbed(c, i):
        m = (pos_dev > c).view(1, T, *([1] * (x.dim() - 2)))
        return torch.where(m, R[i], x)

    j = 0
    while j < len(tasks):
        if packing and len(tasks) - j > 1:
            part = tasks[j:j + chunk]
            try:
                out, sc = tgt(torch.cat([x] + [perturbed(c, i) for c, i in part]))
            except TargetError as e:
                if "out of memory" in str(e).lower() and chunk > 1:
                    chunk //= 2  # memory budget too generous for this target: halve and retry
                    continue
                # a target that takes only its own batch size (static shapes, compiled graphs)
                # is probed one call per cut instead
                run.pack_error = str(e)
                packing = False
                continue
            # the control must reproduce the baseline (scores bit for bit): else the packed
            # call computes differently from the inputs' shape, and packing stops
            if differs(out[:B], y0, atol).any() or (sc is not None and not torch.equal(sc[:B], s0)):
                run.batch_invariant = False
                packing = False
                continue
            packed_used = True
            outs = out[B:].reshape(len(part), B, T, *out.shape[2:])
            scs = sc[B:].reshape(len(part), *s0.shape) if sc is not None else [None] * len(part)
            for n, ((c, i), yc, sc_c) in enumerate(zip(part, outs, scs)):
                d = differs(y0, yc, atol) & (pos <= c)
                moved_scores = sc_c is not None and bool((differs(s0, sc_c, 0.0) & (pos <= c)).any())
                if not d.any() and not moved_scores:
                    continue
                run.note_flip()
                # Packed flips are taken as they stand only after the first REPRODUCTIONS
                # flipped cuts were re-run alone and gave exactly the same flips.
                if run.reproduced >= REPRODUCTIONS:
                    flips.append((c, i, *run.flips(yc, sc_c, c, perturbed(c, i), trial=i)))
                    continue
                kept, faithful = run.confirm(perturbed(c, i), c, d, yc, sc_c, i)
                flips.append((c, i, *kept))
                if not faithful:  # packing changed the answer: batch-variant, stop packing
                    packing = False
                    run.batch_invariant = False
                    for c2, i2 in part[n + 1:]:  # the rest of this chunk, alone
                        flips.append((c2, i2, *run.same_shape(perturbed(c2, i2), c2, i2)))
                    break
            j += len(part)
        else:
            c, i = tasks[j]
            got = (run.same_shape(perturbed(c, i), c, i) if mode == "perturb" else run.truncated(c))
            flips.append((c, i, *got))
            j += 1
        if progress is not None:
            progress(j, len(tasks))
    return flips, packed_used


def _as_batched(inputs, layout: str) -> torch.Tensor:
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"inputs is a {type(inputs).__name__}, expected a Tensor: token ids "
                         f"[B, T] (long) or floats [B, T, D]")
    want = (1, 2) if layout == "flat" else (2, 3)
    ok_dim = inputs.dim() == (want[1] if inputs.is_floating_point() else want[0])
    if not ok_dim or inputs.is_complex():
        shapes = "[T] (long) or [T, D] (float)" if layout == "flat" else "[B, T] (long) or [B, T, D] (float)"
        raise ValueError(f"inputs has dtype {inputs.dtype} and shape {tuple(inputs.shape)!r}, "
                         f"expected {shapes}" + ("; for one sequence without a batch axis pass "
                                                 "layout='flat'" if layout == "batched" else ""))
    x = inputs[None] if layout == "flat" else inputs
    if x.shape[1] < 2 or x.shape[0] < 1:
        raise ValueError(f"inputs has shape {tuple(inputs.shape)!r}: need at least 1 sequence "
                         f"of at least 2 positions")
    return x.detach()


class _Nondeterministic(Exception):
    """The same input gave different outputs: stop, this is TP-C2, not a leak."""

    def __init__(self, where, count=None):
        self.where, self.count = where, count if count is not None else len(where)


class _Run:
    """Shared state of one check: baseline, fp64 twin (lazy), verification budget."""

    def __init__(self, tgt: Target, x, atol, margin_tol, fp64_spec, max_verify):
        self.tgt, self.x, self.atol, self.margin_tol = tgt, x, atol, margin_tol
        self.base = tgt(x)
        self._fp64_fn = tgt.fp64(fp64_spec)
        self._fp64_base = None
        self._fp64_last = None
        self.score_flips = []  # (cut, trial, batch idx, position idx, |change|, kind)
        self.fp64_status = "not needed" if fp64_spec is not False else "disabled"
        self.verify_left = max_verify if max_verify is not None else float("inf")
        self.batch_invariant = True
        self.reproduced = 0       # flipped cuts seen again on a second call
        self.first_flip_eval = None  # evaluations spent when a decision or score first moved
        self.pack_error = None  # why a bigger batch could not be evaluated, if it could not
        self.iso_numerical = 0   # isolation moves that are rounding noise (fp64 twin)
        self.iso_unverified = 0  # isolation moves within rounding of a tie, no twin to judge

    def note_flip(self):
        if self.first_flip_eval is None:
            self.first_flip_eval = self.tgt.n_evaluations

    def reproduce(self, xc, y, sc):
        """Re-run xc and demand identical output: a leak reproduces, nondeterminism (atomics,
        unseeded sampling) does not. A noise flip at a near-tie repeats by chance half the
        time, so the first REPRODUCTIONS flipped cuts are each re-run once."""
        if self.reproduced >= REPRODUCTIONS:
            return
        y2, s2 = self.tgt(xc)
        moved = differs(y, y2, self.atol)  # as the first determinism check: decisions within
                                            # atol, scores bit for bit
        if sc is not None and s2 is not None:
            moved |= differs(sc, s2, 0.0)
        if moved.any():
            raise _Nondeterministic(moved.nonzero()[:10].tolist())
        self.reproduced += 1

    def isolation_moves(self, xi, yi, si, moved):
        """Judge the odd-row moves of the isolation call like flips at the inputs' shape.
        A kernel whose tiling depends on the data of the whole batch (grouped expert matmuls
        sized by tokens per expert, as HF MoE models run them) moves other rows by an ulp or
        so: that is batch-variant arithmetic, not a sequence reading another. Returns the moves
        that are structural; those within rounding noise that the fp64 twin cannot settle are
        counted in iso_unverified (isolation unknown, verdict warn)."""
        b, t = moved.nonzero(as_tuple=True)
        b = 2 * b + 1
        kind = self.classify(xi, b, t, yi, si, shape_changed=False)
        self.iso_numerical = int((kind == 1).sum())
        self.iso_unverified = int((kind == 2).sum())
        structural = torch.zeros_like(moved)
        structural[b[kind == 0] // 2, t[kind == 0]] = True
        if self.iso_numerical or self.iso_unverified:
            self.batch_invariant = False  # rounding depends on the batch: do not pack
        return structural

    # -- classification -------------------------------------------------------------
    def _tiny(self, b, t, before, after) -> torch.Tensor:
        """Whether each flip sits within rounding noise of a tie: the routing margin of the
        baseline scores, or the size of a float decision's change, within 32 ulps."""
        y0, s0 = self.base
        if s0 is not None:
            m = margins(s0, y0)[b, t]
            tol = (torch.full_like(m, self.margin_tol) if self.margin_tol is not None else
                   _noise_tol(s0.reshape(*s0.shape[:2], -1).amax(-1))[b, t])
            return m <= tol
        if before.is_floating_point():
            return _delta(before, after) <= _noise_tol(before.reshape(len(b), -1)).amax(-1)
        return torch.zeros(len(b), dtype=torch.bool)

    def _fp64(self, xc):
        """Decision and scores of the fp64 twin on xc, or None if there is no usable twin.
        The last answer is kept: decision flips and score changes of one cut share it."""
        if self._fp64_last is not None and self._fp64_last[0] is xc:
            return self._fp64_last[1]
        if self._fp64_fn is None or self.verify_left <= 0:
            return None
        if self._fp64_base is None:
            try:
                base = self.tgt(self.x, self._fp64_fn)
            except TargetError as e:
                self._fp64_fn, self.fp64_status = None, f"unavailable: {e}"
                return None
            floats = [v for v in base if v is not None and v.is_floating_point()]
            if floats and any(v.dtype != torch.float64 for v in floats):
                self._fp64_fn = None
                self.fp64_status = (f"unavailable: the fp64 twin returned {floats[0].dtype}, not "
                                    f"float64 (pass fp64= a callable that computes in float64)")
                return None
            # integer decisions alone cannot show the twin computed in fp64; a twin that did not
            # repeats the fp32 flips and leaves them structural, so trusting it is conservative
            self._fp64_base = base
            self.fp64_status = "used" if floats else "used (integer output: dtype not confirmed)"
        self.verify_left -= 1
        self._fp64_last = (xc, self.tgt(xc, self._fp64_fn))
        return self._fp64_last[1]

    def classify(self, xc, b, t, y, sc, shape_changed: bool) -> torch.Tensor:
        """Kind per flip: 0 structural, 1 numerical, 2 unverified.

        Same shape (perturb): a flip is structural unless it sits at a near-tie. Shape changed
        (truncate): rounding noise of any size is possible, so every flip goes to the fp64 twin
        when there is one. The fp64 test is a precision-scaling test: noise shrinks by ~2^-29
        from fp32 to fp64, a real dependence does not. Structural if in fp64 the decision still
        changes, or the scores (float decision) still move by more than 1e-3 of their fp32 move.
        """
        kind = torch.zeros(len(b), dtype=torch.long)
        if not len(b):
            return kind
        y0, s0 = self.base
        n = y.shape[1]
        ask = torch.ones(len(b), dtype=torch.bool) if shape_changed else self._tiny(b, t, y0[b, t], y[b, t])
        if not ask.any():
            return kind
        tiny = self._tiny(b, t, y0[b, t], y[b, t])
        kind[ask & tiny] = 2
        got = self._fp64(xc)
        if got is None:
            return kind
        (d0, f0), (d1, f1) = self._fp64_base, got
        bi, ti = b[ask], t[ask]
        # integer decisions: does the choice still change in fp64? float ones: scaling test below
        moved = (torch.zeros(len(bi), dtype=torch.bool) if d1.is_floating_point() else
                 differs(d0[:, :n], d1, self.atol)[bi, ti])
        for v0, v1, w0, w1 in ((f0, f1, s0, sc), (d0, d1, y0, y)):
            if v0 is None or not v0.is_floating_point() or w1 is None:
                continue
            d64 = _delta(v0[:, :n][bi, ti], v1[bi, ti])
            d32 = _delta(w0[:, :n][bi, ti], w1[bi, ti])
            tol64 = _noise_tol(v0[:, :n][bi, ti].reshape(len(bi), -1)).amax(-1)
            moved |= d64 > torch.maximum(1e-3 * d32, tol64)
        kind[ask] = torch.where(moved, 0, 1)
        return kind

    # -- the ways a cut is evaluated ---------------------------------------------------
    def flips(self, y, sc, c, xc, shape_changed=False, trial=0):
        """Flips of output (y, sc) against the baseline at positions <= c, classified."""
        y0 = self.base[0][:, :y.shape[1]]
        d = differs(y0, y, self.atol)
        d[:, c + 1:] = False
        if d.any():
            self.note_flip()
        b, t = d.nonzero(as_tuple=True)
        kind = self.classify(xc, b, t, y, sc, shape_changed)
        moved = sc is not None and self._score_changes(sc, c, xc, d, shape_changed, trial)
        if len(b) or moved:  # the first flip of any kind: make sure the target repeats itself
            self.reproduce(xc, y, sc)
        return b, t, y[b, t], kind

    def _score_changes(self, sc, c, xc, flipped, shape_changed, trial):
        """Scores at positions <= c that moved while the decision did not: the future reaches
        the router even where this sample crossed no tie (an off-by-one mask shows up here
        at every cut). Same shape: a change beyond 32 ulps is structural, a smaller one goes
        to the fp64 scaling test. Shape changed (truncate): only the fp64 test can tell, so
        without a twin score changes are not judged."""
        s0 = self.base[1][:, :sc.shape[1]]
        ds = differs(s0, sc, 0.0) & ~flipped
        ds[:, c + 1:] = False
        if not ds.any():
            return False
        b, t = ds.nonzero(as_tuple=True)
        delta = _delta(s0[b, t], sc[b, t])
        tiny = delta <= _noise_tol(s0[b, t].reshape(len(b), -1)).amax(-1)
        ask = torch.ones_like(tiny) if shape_changed else tiny
        kind = torch.where(ask, 2, 0)
        got = self._fp64(xc) if ask.any() else None
        if got is not None and got[1] is not None:
            f0, f1 = self._fp64_base[1][:, :sc.shape[1]], got[1]
            d64 = _delta(f0[b, t], f1[b, t])
            tol64 = _noise_tol(f0[b, t].reshape(len(b), -1)).amax(-1)
            kind = torch.where(ask, torch.where(d64 > torch.maximum(1e-3 * delta, tol64), 0, 1), kind)
        elif shape_changed:
            return False
        self.note_flip()
        self.score_flips.append((c, trial, b, t, delta, kind))
        return True

    def same_shape(self, xc, c, trial=0):
        """Perturbed inputs run alone at the inputs' shape."""
        y, sc = self.tgt(xc)
        return self.flips(y, sc, c, xc, trial=trial)

    def confirm(self, xc, c, packed_mask, packed_y, packed_sc, trial=0):
        """Re-run a packed cut alone at the inputs' shape: (its flips, classified; whether the
        packed call gave exactly the same output). Past the verification budget the packed
        flips are kept as 'unconfirmed'."""
        if self.verify_left <= 0:
            b, t = packed_mask.nonzero(as_tuple=True)
            return (b, t, packed_y[b, t], torch.full((len(b),), 3, dtype=torch.long)), True
        self.verify_left -= 1
        y, sc = self.tgt(xc)
        # faithful: the packed copy computed what the call alone computes, everywhere
        faithful = not differs(y, packed_y, self.atol).any() and (
            sc is None or torch.equal(sc, packed_sc))
        return self.flips(y, sc, c, xc, trial=trial), faithful

    def truncated(self, c):
        """The inference view: the prefix x[:, :c+1] alone."""
        xc = self.x[:, :c + 1].contiguous()  # real blocks .view() their input
        y, sc = self.tgt(xc)
        return self.flips(y, sc, c, xc, shape_changed=True)


def _brief(v) -> str:
    """A decision for a message: ids and masks (up to 16) whole, float vectors abridged."""
    if isinstance(v, list) and (len(v) > 16 or len(v) > 4 and any(isinstance(u, float) for u in v)):
        return "[" + ", ".join(f"{u:.4g}" if isinstance(u, float) else str(u) for u in v[:3]) + \
            f", ...] ({len(v)} values)"
    return str(v)


def _delta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per flip: the largest absolute change over the trailing axes."""
    return (a.double() - b.double()).abs().reshape(len(a), -1).nan_to_num(float("inf")).amax(-1) \
        if len(a) else torch.zeros(0, dtype=torch.float64)


KINDS = ("structural", "numerical", "unverified", "unconfirmed")


def _result(common, run, tgt, mode, x, cut_list, trials, flips, isolated, iso_where, *,
            packing_used, max_leaks, atol, layout) -> Result:
    B, T = x.shape[:2]
    y0, s0 = run.base
    cuts_t = torch.tensor(cut_list)
    # comparisons per position: every (cut >= t, trial, row)
    compared = B * trials * (cuts_t[None, :] >= torch.arange(T)[:, None]).sum(1)
    n_compared = int(compared.sum())
    counts = torch.zeros(4, dtype=torch.long)
    by_pos = torch.zeros(T, dtype=torch.long)
    dist = {}
    leak_map = {}
    leaks, numerical = [], []
    n_inference = 0
    mg_all = margins(s0, y0) if s0 is not None else None
    for c, i, b, t, after, kind in flips:
        counts += torch.bincount(kind, minlength=4)
        n_inference += int((t == c).sum())
        real = kind != 1                   # recorded in "leaks" (unverified ones too)
        leak = (kind == 0) | (kind == 3)   # counted as leaks: map, distances, flip rate
        by_pos += torch.bincount(t[leak], minlength=T)
        for d, n in zip(*torch.unique(c + 1 - t[leak], return_counts=True)):
            dist[int(d)] = dist.get(int(d), 0) + int(n)
        for p, n in zip(*torch.unique(t[leak], return_counts=True)):
            leak_map[(c, int(p))] = leak_map.get((c, int(p)), 0) + int(n)
        # records for the first max_leaks of each list only (a loop over cuts, not elements)
        for dest, sel in ((leaks, real), (numerical, ~real)):
            for k in sel.nonzero().flatten()[:max_leaks - len(dest)].tolist():
                dest.append({"batch": int(b[k]), "position": int(t[k]), "cut": c, "trial": i,
                             "distance": c + 1 - int(t[k]), "before": y0[b[k], t[k]].tolist(),
                             "after": after[k].tolist(), "kind": KINDS[int(kind[k])],
                             "margin": float(mg_all[b[k], t[k]]) if mg_all is not None else None})
    leaks.sort(key=lambda r: (r["cut"], r["trial"], r["batch"], r["position"]))
    n_struct, n_num, n_unver, n_unconf = (int(v) for v in counts)
    # unconfirmed: a packed flip past the verification budget, after earlier packed flips
    # of this target were confirmed: counted as a leak. unverified: a same-shape flip at a
    # near-tie that no fp64 twin could settle: neither a leak nor excused (verdict warn).
    n_leaks = n_struct + n_unconf
    n_flips = n_leaks + n_num + n_unver
    score_counts = torch.zeros(3, dtype=torch.long)
    score_leaks, score_map = [], {}
    for c, i, b, t, delta, kind in run.score_flips:
        score_counts += torch.bincount(kind, minlength=3)
        for p, n in zip(*torch.unique(t[kind == 0], return_counts=True)):
            score_map[(c, int(p))] = score_map.get((c, int(p)), 0) + int(n)
        for k in (kind != 1).nonzero().flatten()[:max_leaks - len(score_leaks)].tolist():
            score_leaks.append({"batch": int(b[k]), "position": int(t[k]), "cut": c, "trial": i,
                                "distance": c + 1 - int(t[k]), "change": float(delta[k]),
                                "kind": KINDS[int(kind[k])]})
    n_score_leaks, n_score_num, n_score_unver = (int(v) for v in score_counts)
    n_unver += n_score_unver + run.iso_unverified
    causal = n_leaks == 0 and n_score_leaks == 0
    codes = []
    if not causal:
        codes.append("TP-C1")
    if isolated is False:
        codes.append("TP-C3")
    verdict = "fail" if codes else ("warn" if n_unver else "pass")
    if n_unver and "TP-C1" not in codes:
        codes.append("TP-C1")
    metrics = {
        "causal": causal, "n_leaks": n_leaks, "n_structural": n_struct,
        "n_numerical": n_num, "n_unverified": n_unver, "n_unconfirmed": n_unconf,
        "n_flips": n_flips, "n_score_leaks": n_score_leaks, "n_score_numerical": n_score_num,
        "flip_rate": n_leaks / n_compared if n_compared else 0.0,
        "n_compared": n_compared, "n_cuts": len(cut_list), "trials": trials,
        "deterministic": True, "batch_isolated": isolated, "batch_invariant": run.batch_invariant,
        "packed": packing_used and run.batch_invariant,
        "n_evaluations": tgt.n_evaluations, "tokens_evaluated": tgt.tokens_evaluated,
        "evaluations_to_first_flip": run.first_flip_eval,
        "first_leak_position": min((r["position"] for r in leaks), default=None),
        "min_leak_distance": min(dist, default=None), "max_leak_distance": max(dist, default=None),
        "fp64": run.fp64_status,
    }
    if mode == "truncate":
        metrics["mismatch_rate"] = n_flips / n_compared if n_compared else 0.0
        metrics["inference_mismatch_rate"] = n_inference / (B * len(cut_list))
    rate = (by_pos.double() / compared.clamp_min(1)).where(compared > 0, torch.nan)
    evidence = {
        "mode": mode, "layout": layout, "atol": atol, "shape": list(x.shape),
        "input_dtype": str(x.dtype), "decision_shape": list(y0.shape),
        "cuts": cut_list, "leaks": leaks, "numerical_flips": numerical,
        "flip_rate_by_position": [None if math.isnan(v) else v for v in rate.tolist()],
        "leak_distances": {str(k): v for k, v in sorted(dist.items())},
        "leak_map": [[c, p, n] for (c, p), n in sorted(leak_map.items())],
        "batch_isolation_moved": iso_where,
        "batch_isolation_numerical": run.iso_numerical,
        "batch_isolation_unverified": run.iso_unverified,
        "packing_error": run.pack_error,
        "score_leaks": score_leaks,
        "score_leak_map": [[c, p, n] for (c, p), n in sorted(score_map.items())],
    }
    what = ("future-dependent decisions" if mode == "perturb" else
            "decisions that differ in the inference view (prefix only)")
    first = leaks[0] if leaks else None
    if not causal and not n_leaks:
        sl = score_leaks[0]
        msg = (f"routing scores at {n_score_leaks} (batch, position, cut) depend on later tokens "
               f"though no decision flipped in this sample (it will at a near-tie); first at "
               f"position {sl['position']} (cut {sl['cut']}, batch {sl['batch']}), change "
               f"{sl['change']:.3g}")
    elif not causal:
        msg = (f"{n_leaks} {what} of {n_compared} compared"
               + (f"; first at position {first['position']} (cut {first['cut']}, batch "
                  f"{first['batch']}): {_brief(first['before'])} -> {_brief(first['after'])}"
                  if first else "")
               + (f"; {n_unconf} from packed calls not re-confirmed" if n_unconf else ""))
    else:
        msg = (f"no {what} in {n_compared} compared over {len(cut_list)} cuts"
               + (f" ({n_num} flips within rounding noise of a tie, excused by re-runs)"
                  if n_num else ""))
        if n_unver:
            msg += (f"; {n_unver} flips at near-ties could not be settled (no fp64 twin: pass "
                    f"fp64= or scores=)")
    if isolated is False:
        msg += f"; decisions of one sequence change with another in the batch (at {iso_where[:3]})"
    return Result(**common, verdict=verdict, codes=codes, metrics=metrics, evidence=evidence,
                  message=msg)
