"""Batch invariance: is a row's output the same bits alone as inside a batch?

`batch_invariance(fn, inputs)` asks it of a row-wise target fn: [b, ...] -> [b, ...] (a
kernel, a layer, a model's log-probs). A kernel whose reduction order or tiling depends on
the batch shape (cuBLAS/oneDNN choosing a GEMM by M, split-K, a remainder tile) gives a
sequence different bits depending on the batch an engine happens to put it in
(batch_invariant_ops: `mm(a[:1], b)` vs `mm(a, b)[:1]`; vLLM tests/v1/determinism: one
prompt alone vs inside a batch).

Algorithm (N input rows, the pool):
  1. Every row alone: fn(inputs[i:i+1]), N calls; the first again: determinism.
  2. For each batch size b and trial t: a batch of b rows drawn from the pool (seeded), one
     watched row w placed first, last, first again (other companions), middle, ... so that
     one row is seen at several positions and with several sets of companions; fn once.
     Every row of every batch is compared with its alone output, bit for bit (or within
     atol). The whole pool in its given order is one more batch (when N >= 2).
  3. The first call of the largest batch is repeated, and so are the first 3 batches that
     differ from the rows alone, each with its first differing row alone: a difference that
     does not reproduce is nondeterminism, not batch variance (TP-C2, batch_invariant None).
Reports which sizes break invariance, the share of differing outputs, the largest and mean
absolute difference, the largest in ulps of the output dtype, and whether the watched row
changed with its companions at a fixed size and position.
"""
from __future__ import annotations

from typing import Callable

import torch
from trainprobes.causality.target import abs_diff, pick
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.result import Result
from trainprobes.validation import check_int, check_number

__all__ = ["batch_invariance", "DEFAULT_SIZES"]

DEFAULT_SIZES = (2, 3, 4, 7, 8, 16, 32)
REPRODUCTIONS = 3  # batches that differ from the rows alone, re-run with one such row alone
_POSITIONS = ("first", "last", "first", "middle")  # the watched row, trial by trial


class _Call:
    """The target, counted, with its output picked and checked: [b, ...] in, [b, ...] out."""

    def __init__(self, fn, output, name):
        self.fn, self.output, self.name, self.n = fn, output, name, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()  # an in-place kernel (fused add + norm) may write into its input
        try:
            with torch.no_grad():
                out = self.fn(x)
        except Exception as e:
            raise TargetError(f"target {self.name!r} raised {type(e).__name__}: {e} (called on "
                              f"a batch of {x.shape[0]} rows of shape {tuple(x.shape[1:])!r})") from e
        self.n += 1
        y = pick(out, self.output, "output", self.name)
        if y.dim() < 1 or y.shape[0] != x.shape[0]:
            raise TargetError(f"target {self.name!r} returned shape {tuple(y.shape)!r} for a batch "
                              f"of {x.shape[0]}; expected one output row per input row")
        return y.detach().cpu()


def _row_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of v's dtype at each row's largest |value| (float64, shaped to broadcast over
    the row): a difference in ulps of the row's scale, so cancellation near zero does not
    read as thousands of ulps."""
    if not v.is_floating_point():
        return torch.ones((v.shape[0],) + (1,) * (v.dim() - 1), dtype=torch.float64)
    fi = torch.finfo(v.dtype)
    a = v.double().abs().nan_to_num(0.0, posinf=0.0).reshape(v.shape[0], -1).amax(-1)
    e = torch.frexp(a.clamp_min(fi.tiny)).exponent.double()  # a = m * 2^e, m in [0.5, 1)
    return (torch.exp2(e - 1) * fi.eps).reshape((v.shape[0],) + (1,) * (v.dim() - 1))


def _diff(alone: torch.Tensor, got: torch.Tensor, atol: float):
    """Per element |difference| (float64, NaN == NaN), differing mask, and the difference
    in ulps of the row's scale."""
    if got.shape != alone.shape:
        raise TargetError(f"a row's output has shape {tuple(got.shape)!r} inside a batch and "
                          f"{tuple(alone.shape)!r} alone")
    d = abs_diff(alone, got)  # equal infinities 0 apart, NaN beside a number infinitely far
    if alone.is_floating_point():
        differ = d > atol
        return d, differ, d / _row_ulp(alone)
    return d, got != alone, d  # integers: the difference is the count of ulps


def batch_invariance(fn: Callable, inputs: torch.Tensor, *, sizes=DEFAULT_SIZES, trials: int = 3,
                     seed: int = 0, output=None, atol: float = 0.0,
                     target: str | None = None,
                     progress: Callable[[int, int, str], None] | None = None) -> Result:
    """Probe fn for outputs that depend on the batch a row is computed in.

    fn: [b, ...] -> [b, ...] row-wise (output picks the tensor from a structure: an index,
      a name, or a callable); every call gets its own copy of the rows, so an in-place
      kernel cannot change the pool. inputs: the pool of rows [N, ...], N >= 1.
    sizes: batch sizes to try (>= 2); trials: batches per size (the watched row first,
      last, first with other companions, middle, ...). atol: differences up to it are not
      differences (default 0: bit for bit). progress(done, total, what): after each call.

    Returns a Result (probe "isolation.batch_invariance"): metrics batch_invariant,
    frac_outputs_differ, frac_rows_differ, max_abs_diff, mean_abs_diff, max_ulps,
    breaking_sizes, first_breaking_size, companion_dependent, deterministic, n_evaluations;
    evidence by_size, by_position, examples.
    """
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 1 or inputs.shape[0] < 1:
        raise InvalidArgument(f"inputs must be a Tensor of rows [N, ...] with N >= 1, got "
                              f"{type(inputs).__name__}{tuple(getattr(inputs, 'shape', ()))!r}")
    sizes = sorted({check_int(s, "sizes[...]", min=2, hint="batch sizes to try") for s in sizes})
    if not sizes:
        raise InvalidArgument("sizes=() is empty: give batch sizes >= 2, e.g. (2, 8, 32)")
    trials = check_int(trials, "trials", min=1)
    atol = check_number(atol, "atol", min=0.0)
    name = target or getattr(fn, "__qualname__", None) or type(fn).__name__
    call = _Call(fn, output, name)
    x = inputs.detach()
    N = x.shape[0]
    g = torch.Generator().manual_seed(seed)
    common = dict(probe="isolation.batch_invariance", target=name, seed=seed)

    total = N + 1 + len(sizes) * trials + (N >= 2 and N not in sizes)
    say = progress or (lambda *a: None)
    alone = []
    for i in range(N):  # 1. every row alone
        alone.append(call(x[i:i + 1]))
        say(i + 1, total, "each row alone")
    alone = torch.cat(alone)
    again = call(x[:1])
    if _diff(alone[:1], again, atol)[1].any():
        return _nondeterministic(common, call, "the first row alone", sizes)
    # 2. the batches: (size, watched position, indices)
    plan = []
    for k, b in enumerate(sizes):
        w = k % N  # one watched row per size: seen at several positions, with other companions
        for t in range(trials):
            idx = torch.randint(N, (b,), generator=g)
            pos = {"first": 0, "last": b - 1, "middle": b // 2}[_POSITIONS[t % len(_POSITIONS)]]
            idx[pos] = w
            plan.append((b, t, pos, idx))
    if N >= 2 and N not in sizes:
        plan.append((N, 0, 0, torch.arange(N)))
    rows = []  # per call: (size, trial, watched position, idx, |diff| [b, ...], differ [b], ulps)
    for b, t, pos, idx in plan:
        got = call(x[idx])
        d, differ, ulps = _diff(alone[idx], got, atol)
        rows.append((b, t, pos, idx, got, d, differ, ulps))
        say(N + 1 + len(rows), total, f"batches of {b}")
    # 3. batch variance is told from nondeterminism: the largest batch again, and the first
    # batches that differ from the rows alone again, each with its first differing row
    # alone: a difference that does not reproduce is nondeterminism (an occasional atomic,
    # on either side), not a property of the batch
    differing = [r for r in rows if r[6].any()][:REPRODUCTIONS]
    again = [max(rows, key=lambda r: r[0])] + differing
    for b, t, pos, idx, got, d, differ, ulps in {id(r): r for r in again}.values():
        if _diff(got, call(x[idx]), atol)[1].any():
            return _nondeterministic(common, call, f"a batch of {b}", sizes)
        rows_differ = differ.reshape(b, -1).any(1).nonzero().flatten()
        if len(rows_differ):
            i = int(idx[rows_differ[0]])
            if _diff(alone[i:i + 1], call(x[i:i + 1]), atol)[1].any():
                return _nondeterministic(common, call, f"row {i} alone", sizes)
    return _result(common, call, rows, sizes, N, atol, alone.dtype)


def _all_nan(rows) -> bool:
    """Every output of every batch is NaN (floating outputs only)."""
    return bool(rows) and all(r[4].is_floating_point() and bool(r[4].isnan().all()) for r in rows)


def _nondeterministic(common, call, where, sizes) -> Result:
    return Result(**common, verdict="fail", codes=["TP-C2"],
                  metrics={"batch_invariant": None, "deterministic": False,
                           "n_evaluations": call.n},
                  evidence={"sizes": sizes, "nondeterministic_in": where},
                  message=f"{call.name} gave different outputs for {where} on two identical calls; "
                          f"nondeterminism is not a batch-invariance verdict (seed the target, "
                          f"torch.use_deterministic_algorithms, .eval()) and probe again")


def _result(common, call, rows, sizes, N, atol, dtype) -> Result:
    by_size, examples = [], []
    pos_counts = {k: [0, 0] for k in ("first", "middle", "last", "other")}
    companions = {}  # (size, watched position) -> outputs of the watched row per trial
    n_el = n_el_diff = n_rows = n_rows_diff = 0
    total_abs, max_abs, max_ulps = 0.0, 0.0, 0.0
    for size in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == size]
        el = sum(r[5].numel() for r in mine)
        el_diff = sum(int(r[6].sum()) for r in mine)
        rdiff = sum(int(r[6].reshape(r[6].shape[0], -1).any(1).sum()) for r in mine)
        rws = sum(r[6].shape[0] for r in mine)
        mx = max(float(r[5].max()) if r[5].numel() else 0.0 for r in mine)
        sm = sum(float(r[5].sum()) for r in mine)
        mu = max(float(r[7].max()) if r[7].numel() else 0.0 for r in mine)
        by_size.append({"size": size, "calls": len(mine), "rows": rws, "rows_differ": rdiff,
                        "frac_outputs_differ": el_diff / el if el else 0.0,
                        "max_abs_diff": mx, "mean_abs_diff": sm / el if el else 0.0, "max_ulps": mu})
        n_el, n_el_diff, n_rows, n_rows_diff = n_el + el, n_el_diff + el_diff, n_rows + rws, n_rows_diff + rdiff
        total_abs, max_abs, max_ulps = total_abs + sm, max(max_abs, mx), max(max_ulps, mu)
    for b, t, pos, idx, got, d, differ, ulps in rows:
        row_diff = differ.reshape(b, -1).any(1)
        where = torch.full((b,), 3)
        where[0], where[b - 1] = 0, 2
        if b > 2:
            where[b // 2] = 1
        for k, key in enumerate(("first", "middle", "last", "other")):
            sel = where == k
            pos_counts[key][0] += int(sel.sum())
            pos_counts[key][1] += int((row_diff & sel).sum())
        companions.setdefault((b, pos), []).append(got[pos])
        for r in row_diff.nonzero().flatten()[:max(0, 10 - len(examples))].tolist():
            examples.append({"size": b, "position": r, "row": int(idx[r]),
                             "max_abs_diff": float(d[r].max()), "max_ulps": float(ulps[r].max())})
    dependent = [not all(bool((abs_diff(outs[0], o) <= atol).all()) for o in outs[1:])
                 for outs in companions.values() if len(outs) > 1]
    breaking = [s["size"] for s in by_size if s["rows_differ"]]
    invariant = not breaking
    # every row's outputs alone all NaN, and so in every batch: NaN beside NaN is no
    # difference, so nothing was compared and nothing judged (fail closed: None, never a pass)
    blind = _all_nan(rows)
    if invariant and blind:
        invariant = None
    codes = [] if invariant else ["TP-I2"]
    # batch_invariant False never passes (result.PROBES: the verdict follows the boolean);
    # on a machine's kernels that is a finding about the machine, not a bug in itself
    verdict = "pass" if invariant else "fail"
    metrics = {
        "batch_invariant": invariant, "frac_outputs_differ": n_el_diff / n_el if n_el else 0.0,
        "frac_rows_differ": n_rows_diff / n_rows if n_rows else 0.0, "max_abs_diff": max_abs,
        "mean_abs_diff": total_abs / n_el if n_el else 0.0, "max_ulps": max_ulps,
        "breaking_sizes": breaking, "first_breaking_size": breaking[0] if breaking else None,
        "companion_dependent": any(dependent) if dependent else None,
        "deterministic": True, "n_evaluations": call.n, "n_rows": N, "atol": atol,
    }
    evidence = {"sizes": sizes, "by_size": by_size, "output_dtype": str(dtype),
                "by_position": {k: {"rows": n, "rows_differ": m} for k, (n, m) in pos_counts.items()},
                "examples": examples}
    if invariant is None:
        msg = (f"cannot judge: every output of {call.name} is NaN, alone and in batches of "
               f"{', '.join(map(str, sorted({r[0] for r in rows})))}, and a NaN beside a NaN shows "
               "no difference, so no row was compared; are the weights initialised?")
    elif invariant:
        msg = (f"batch-invariant: every row gave the same bits alone and in batches of "
               f"{', '.join(map(str, sorted({r[0] for r in rows})))} ({n_rows} rows compared)")
    else:
        msg = (f"batch-variant: {n_rows_diff} of {n_rows} rows ({n_el_diff / n_el:.2%} of outputs) "
               f"differ from the row computed alone, at batch sizes {breaking}; largest difference "
               f"{max_abs:.3g} ({max_ulps:.3g} ulps)"
               + ("; the same row at the same position changes with its companions" if any(dependent) else ""))
    return Result(**common, verdict=verdict, codes=codes, metrics=metrics, evidence=evidence, message=msg)
