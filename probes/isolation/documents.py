"""Document isolation: in a packed row, does any document's output depend on another's tokens?

`documents(fn, tokens, lengths)` asks it of a target `fn(tokens, packing) -> [B, L, ...]`
(logits, hidden states or decisions per token), where `packing` (trainprobes.isolation.Packing)
gives the convention the target reads: position ids, document ids, cu_seqlens or a 4-D mask.

Algorithm (d documents over all rows):
  1. Run the target twice on the inputs; outputs must agree bit for bit, else the target is
     nondeterministic (TP-C2) and no change could be told from a leak.
  2. For each document s, replace its tokens by other values (same length, same positions,
     same packing) and run once: d evaluations, d + 2 in all. With batched=True the d
     perturbed copies and two unperturbed ones go into one call instead, beside one call
     alone (sound only for a batch-isolated target: both unperturbed copies must reproduce
     the call alone, else one call per document follows, d + 3 in all).
  3. Leak matrix: for every (source s, affected a != s), the largest and mean absolute change
     of a's outputs. A document in another row counts too (a batch-isolation leak).
  4. Judge every changed token of another document with the causality probe's public
     classification (trainprobes.causality.classify_changes): the fp64 twin reruns the
     perturbations that moved another document, and a change that shrinks by the fp32 ->
     fp64 precision ratio is rounding noise (numerical), one that does not is structural.
     Every change goes to the twin (same_shape=False), not only the near-ties: with
     data-dependent tiling (grouped expert matmuls sized by tokens per expert) another
     document's tokens change the arithmetic, and a near-tie routing flip turns 1 ulp into
     a large change. Without a twin: beyond reduction noise (max(32, L) ulps over a row of
     L positions) structural, within it unverified; a twin with substituted kernels settles
     near-ties (32 ulps) only. A
     document pair takes its worst token's kind. The first 3 perturbations with a
     structural or unverified change run once more and must reproduce (else TP-C2): a
     leak reproduces, an occasional nondeterministic call does not.
  5. Within-document causality: trainprobes.causality.check on the packed row, with the
     packing tiled to whatever batch it builds.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from trainprobes.causality.classify import REPRODUCTIONS, Kind, Outputs, classify_changes
from trainprobes.causality.inputs import replacements
from trainprobes.causality.target import Target, abs_diff, differs
from trainprobes.errors import InvalidType, TargetError
from trainprobes.isolation.packing import Packing
from trainprobes.isolation.target import Packed, Twin
from trainprobes.result import Result
from trainprobes.validation import check_bool, check_number, check_type

__all__ = ["documents"]


class _Nondeterministic(Exception):
    def __init__(self, where, count):
        self.where, self.count = where, count


def _batched(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TargetError(f"tokens is a {type(x).__name__}, expected a Tensor: token ids [B, L] "
                          f"(long) or floats [B, L, D]")
    want = 3 if x.is_floating_point() else 2
    if x.dim() == want - 1:
        x = x[None]
    if x.dim() != want or x.shape[1] < 2:
        raise TargetError(f"tokens has dtype {x.dtype} and shape {tuple(x.shape)!r}, expected "
                          f"token ids [B, L] / [L] or floats [B, L, D] / [L, D] with L >= 2")
    return x.detach()


def documents(fn: Callable, tokens: torch.Tensor, lengths, *, output=None, seed: int = 0,
              vocab: int | None = None, fp64=None, atol: float = 0.0, batched: bool = False,
              causal: bool = True, cuts=None, target: str | None = None,
              progress: Callable[[int, int, str], None] | None = None) -> Result:
    """Probe fn for outputs of one packed document that depend on another's tokens.

    fn(tokens, packing) -> per-token outputs [B, L, ...] (or a structure; `output` picks
    the tensor: an index, a name such as "logits", or a callable).
    tokens: token ids [B, L] (or [L]) or floats [B, L, D]; lengths: document lengths per row
      ([5, 7, 4], [[5, 7], [8, 4]]) or a Packing (Packing.from_doc_ids / from_position_ids
      / from_cu_seqlens read the other conventions).
    vocab: replacement ids are drawn from [0, vocab) (default: max id + 1).
    fp64: a callable fn64(tokens, packing) computing in float64, False for none, or None
      (an nn.Module target is deep-copied and cast to float64).
    atol: changes up to atol are not changes (default 0: bit for bit).
    batched: one call holding the d perturbed copies, checked against one call alone
      (valid for batch-isolated targets; otherwise it falls back to one call per document).
    causal / cuts: also run trainprobes.causality.check on the packed row (cuts as there).
    progress(done, total, what): after each call of the target (d + 2 of them), then the
      causality check's (cut, trial) pairs on top.

    Returns a Result (probe "isolation.documents"): metrics isolated, n_documents, n_leaks,
    n_numerical, n_unverified, n_blind_tokens (all-NaN outputs), max_leak,
    max_cross_change, causal, n_evaluations (d + 2; 2 when batched, d + 3 when batching
    fell back; a leak found costs up to 3 re-runs, or the batched call once more),
    n_fp64_evaluations, causality_evaluations; evidence leak_max and leak_mean (source x
    affected matrices), leak_kind, leaks, self_change, documents.
    """
    atol = check_number(atol, "atol", min=0.0)
    check_bool(batched, "batched")
    check_bool(causal, "causal")
    x = _batched(tokens)
    packing = Packing.of(lengths)
    if (packing.batch, packing.length) != tuple(x.shape[:2]):
        raise TargetError(f"lengths describe {packing.batch} row(s) of length {packing.length}, "
                          f"but tokens have shape {tuple(x.shape)!r}")
    name = target or getattr(fn, "__qualname__", None) or type(fn).__name__
    check_type(str, name, "target")
    if fp64 is not None and fp64 is not False and not callable(fp64):
        raise InvalidType(f"fp64={fp64!r} must be None (auto), False (none) or a callable "
                          f"fn64(tokens, packing) computing in float64")
    docs = packing.documents
    D, B = len(docs), packing.batch
    tgt = Target(Packed(_counted(fn, D + 2, progress), packing, name), name, decision=output)
    twin = Twin(fn, fp64, packing, name, output)
    g = torch.Generator().manual_seed(seed)
    R = replacements(x, 1, vocab, g)[0].to(x.device)
    gid = packing.global_doc_ids()  # [B, L] on the CPU, where outputs are compared
    common = dict(probe="isolation.documents", target=name, seed=seed)

    def perturbed(s: int) -> torch.Tensor:
        m = (gid == s).to(x.device).view(B, packing.length, *([1] * (x.dim() - 2)))
        return torch.where(m, R, x)

    try:
        ev = _evaluate(tgt, x, perturbed, D, batched, atol)
        # 4. every change of another document judged; a leak must reproduce
        kind, fp64_max = _judge(ev.y0, ev.ys, gid, D, twin, x, perturbed, atol)
        _reproduce(ev, kind, atol)
    except _Nondeterministic as e:
        return Result(**common, verdict="fail", codes=["TP-C2"],
                      metrics={"isolated": None, "deterministic": False, "n_documents": D,
                               "n_nondeterministic": e.count, "n_evaluations": tgt.n_evaluations},
                      evidence={"nondeterministic_positions": e.where, "shape": list(x.shape),
                                "lengths": [list(r) for r in packing.lengths]},
                      message=f"{name} gave different outputs on the same packed input at "
                              f"{e.count} tokens (first (row, position): {e.where[:3]}); "
                              f"nondeterminism is not an isolation verdict: make the target "
                              f"deterministic (.eval(), fixed seeds) and probe again")
    y0, ys, fallback = ev.y0, ev.ys, ev.fallback
    batched = batched and fallback is None
    n_eval = tgt.n_evaluations
    leak_max, leak_mean = _matrices(y0, ys, gid, D)
    moved = leak_max > atol
    # a token whose outputs are all NaN hides any leak that leaves it NaN: blind
    blind = (y0.isnan().reshape(*y0.shape[:2], -1).all(-1) if y0.is_floating_point()
             else torch.zeros(y0.shape[:2], dtype=torch.bool))
    sub = None
    if causal:
        from trainprobes.causality import check
        sub = check(Packed(fn, packing, name), x, cuts=cuts, seed=seed, vocab=vocab,
                    decision=output, fp64=twin.packed if twin.packed is not None else False,
                    atol=atol, target=name,
                    progress=None if progress is None else
                    lambda d, t: progress(D + 2 + d, D + 2 + t, "within-row causality"))
    r = _result(common, packing, docs, leak_max, leak_mean, kind, moved, fp64_max,
                twin.status, n_eval, twin.n_evaluations, sub, batched, x, blind & (D > 1))
    if fallback is not None:
        r.evidence["batched_fallback"] = fallback
    return r


def _counted(fn, total: int, progress):
    """fn, saying progress(calls so far, total, what) after each call (a leak's reruns
    count past total: the count stops there)."""
    if progress is None:
        return fn
    calls = [0]

    def call(x, packing):
        out = fn(x, packing)
        calls[0] += 1
        progress(min(calls[0], total), total, "the target on each perturbed document")
        return out
    return call


# Kind -> severity, so that a document's worst token decides: structural > unverified > numerical
_SEVERITY = torch.tensor([2, 0, 1, 2])
_FROM_SEVERITY = torch.tensor([Kind.NUMERICAL, Kind.UNVERIFIED, Kind.STRUCTURAL])


def _judge(y0, ys, gid, D, twin: Twin, x, perturbed, atol):
    """[D, D] Kind per (source, affected) pair (-1 where nothing moved) and the fp64 change
    matrix (None without a twin run). Every changed token of another document is classified
    by causality's classify_changes: with a faithful twin all of them go to the fp64 test
    (same_shape=False: another document's tokens change data-dependent arithmetic, and a
    near-tie routing flip makes 1 ulp large); a substituted twin settles near-ties only."""
    kind = torch.full((D, D), -1, dtype=torch.long)
    fp64_max = None
    base = Outputs(y0)
    for s in range(D):  # a loop over documents, not elements
        changed = differs(y0, ys[s], atol) & (gid != s)
        if not changed.any():
            continue
        where = changed.nonzero(as_tuple=True)
        got = {}

        def pair(s=s):
            got["pair"] = twin.pair(x, perturbed(s), y0)
            return got["pair"]
        kinds = classify_changes(where, base, Outputs(ys[s]), fp64=pair, atol=atol,
                                 same_shape=bool(twin.substituted),
                                 twin_settles_reduction=not twin.substituted)
        worst = torch.full((D,), -1, dtype=torch.long).scatter_reduce(
            0, gid[where], _SEVERITY[kinds], "amax", include_self=True)
        kind[s] = torch.where(worst >= 0, _FROM_SEVERITY[worst.clamp_min(0)], -1)
        if got.get("pair") is not None:
            # NaN: a source the twin never ran (its changes were judged by size alone), which
            # is no fp64 change of 0
            fp64_max = torch.full((D, D), float("nan"), dtype=torch.float64) if fp64_max is None else fp64_max
            fp64_max[s] = _matrices(got["pair"][0].decision, got["pair"][1].decision[None], gid, D)[0][0]
    return kind, fp64_max


class _Evaluated(NamedTuple):
    y0: torch.Tensor          # the baseline outputs
    ys: torch.Tensor          # [D, B, L, ...]: outputs with document s perturbed
    fallback: str | None      # why a batched evaluation fell back to calls alone
    again: Callable           # again(sources) -> those outputs computed once more, the same way
    one_call: bool            # again is the one batched call (all sources at no extra cost)


def _evaluate(tgt, x, perturbed, D, batched, atol) -> _Evaluated:
    y0, _ = tgt(x)
    fallback = None
    if batched:
        # the copies share one call, so they are sound only for a batch-isolated target; no
        # single call can show that (a batch-wide statistic shifts every copy alike and
        # hides a leak between rows), but the unperturbed copies, first and last, must
        # reproduce the call alone
        xs = torch.cat([x] + [perturbed(s) for s in range(D)] + [x])

        def batch(sources=None):
            y = tgt(xs)[0]
            y = y.reshape(D + 2, x.shape[0], *y.shape[1:])
            return y if sources is None else y[1:-1][sources]
        y = batch()
        moved = differs(y0, y[0], atol) | differs(y0, y[-1], atol)
        if not moved.any():
            return _Evaluated(y0, y[1:-1], None, batch, True)
        fallback = (f"the unperturbed rows changed inside the batch of {D + 2} copies at "
                    f"{int(moved.sum())} tokens (first (row, position): {moved.nonzero()[:3].tolist()}): "
                    f"not batch-isolated (or batch-variant), so one call per document instead")
    y1, _ = tgt(x)
    _same(y0, y1, atol)

    def alone(sources):
        return torch.stack([tgt(perturbed(s))[0] for s in sources])  # one call per document
    return _Evaluated(y0, alone(range(D)), fallback, alone, False)


def _reproduce(ev: _Evaluated, kind: torch.Tensor, atol) -> None:
    """Compute the perturbations whose changes would fail the target (structural or
    unverified) once more (batched: the one call again; alone: the first REPRODUCTIONS of
    them): a leak reproduces, an occasional nondeterministic call, which the two baseline
    calls missed, does not: TP-C2. A passing target costs nothing more."""
    bad = ((kind == Kind.STRUCTURAL) | (kind == Kind.UNVERIFIED)).any(1).nonzero().flatten().tolist()
    if bad:
        sources = bad if ev.one_call else bad[:REPRODUCTIONS]
        _same(ev.ys[sources].flatten(0, 1), ev.again(sources).flatten(0, 1), atol)


def _same(a, b, atol):
    d = differs(a, b, atol)
    if d.any():
        raise _Nondeterministic(d.nonzero()[:10].tolist(), int(d.sum()))


def _token_change(y0, y):
    """[..., B, L] largest and summed |change| over the trailing (feature) axes, float64."""
    lead = y.dim() - y0.dim()
    d = abs_diff(y0, y)  # equal infinities: no change; to or from NaN / inf: infinite
    d = d.reshape(*d.shape[:lead + 2], -1)
    return d.amax(-1), d.sum(-1), d.shape[-1]


def _matrices(y0, ys, gid, D):
    """leak_max[s, a], leak_mean[s, a]: change of document a's outputs in ys[s] (one row per
    perturbed input) against the baseline y0."""
    mx, sm, F = _token_change(y0, ys)       # [n, B, L]
    n = mx.shape[0]
    idx = gid.reshape(1, -1).expand(n, -1)
    leak_max = torch.zeros(n, D, dtype=torch.float64).scatter_reduce(
        1, idx, mx.reshape(n, -1), "amax", include_self=True)
    total = torch.zeros(n, D, dtype=torch.float64).scatter_add(1, idx, sm.reshape(n, -1))
    sizes = torch.bincount(gid.reshape(-1), minlength=D).double() * F
    return leak_max, total / sizes[None, :]


def _or_none(m, s, a):
    """m[s, a] as a float, None where m is None or the entry was never measured (NaN)."""
    if m is None or bool(m[s, a].isnan()):
        return None
    return float(m[s, a])


def _result(common, packing, docs, leak_max, leak_mean, kind, moved, fp64_max, fp64_status,
            n_eval, n64, sub, batched, x, blind) -> Result:
    D = len(docs)
    gdoc = [(d.row, d.start, d.length) for d in docs]
    n_struct = int((kind == Kind.STRUCTURAL).sum())
    n_num = int((kind == Kind.NUMERICAL).sum())
    n_unver = int((kind == Kind.UNVERIFIED).sum())
    self_change = leak_max.diagonal()
    leaks = []
    for s, a in (kind >= 0).nonzero().tolist():  # one record per (source, affected) pair
        rs, ra = docs[s], docs[a]
        leaks.append({"source": s, "affected": a, "kind": Kind(int(kind[s, a])).label,
                      "direction": ("other row" if rs.row != ra.row else
                                    "forward" if rs.start < ra.start else "backward"),
                      "max_change": float(leak_max[s, a]), "mean_change": float(leak_mean[s, a]),
                      "fp64_change": _or_none(fp64_max, s, a)})
    leaks.sort(key=lambda r: (r["kind"] != "structural", -r["max_change"]))
    n_blind = int(blind.sum())
    blind_docs = sorted(set(packing.global_doc_ids()[blind].tolist()))
    isolated = (False if n_struct else None if n_unver or n_blind else True)
    # isolation unknown never passes (result.PROBES: None only beside fail): a leak within
    # rounding noise is not excluded until a twin settles it, nor one into NaN outputs
    causal = sub.metrics.get("causal") if sub is not None else None
    codes = []
    if n_struct or n_unver or n_blind:
        codes.append("TP-I1")
    if sub is not None and "TP-C1" in sub.codes and causal is False:
        codes.append("TP-C1")
    dead = [i for i in range(D) if not moved[i, i]]
    verdict = "fail" if codes else ("warn" if dead or (sub is not None and sub.verdict == "warn")
                                    else "pass")
    struct_max = float(leak_max[kind == Kind.STRUCTURAL].max()) if n_struct else 0.0
    cross_max = float(leak_max.masked_fill(torch.eye(D, dtype=torch.bool), 0.0).max()) if D > 1 else 0.0
    metrics = {
        "isolated": isolated, "n_documents": D, "n_leaks": n_struct, "n_numerical": n_num,
        "n_unverified": n_unver, "n_blind_tokens": n_blind, "max_leak": struct_max,
        "max_cross_change": cross_max,
        "deterministic": True, "causal": causal, "n_evaluations": n_eval,
        "n_fp64_evaluations": n64, "fp64": fp64_status, "batched": batched,
        "causality_evaluations": sub.metrics.get("n_evaluations") if sub is not None else 0,
    }
    evidence = {
        "shape": list(x.shape), "input_dtype": str(x.dtype),
        "lengths": [list(r) for r in packing.lengths],
        "documents": [{"index": i, "row": r, "start": s, "length": n} for i, (r, s, n) in enumerate(gdoc)],
        "leak_max": leak_max.tolist(), "leak_mean": leak_mean.tolist(),
        "leak_kind": [[None if k < 0 else Kind(k).label for k in row] for row in kind.tolist()],
        "fp64_change": None if fp64_max is None else [[None if v != v else v for v in row]
                                                      for row in fp64_max.tolist()],
        "leaks": leaks, "self_change": self_change.tolist(), "unmoved_documents": dead,
        "blind_documents": blind_docs,
    }
    if sub is not None:
        evidence["causality"] = {"verdict": sub.verdict, "codes": sub.codes, "message": sub.message,
                                 "metrics": {k: v for k, v in sub.metrics.items()
                                             if not isinstance(v, (list, dict))},
                                 "leaks": sub.evidence.get("leaks", [])[:20]}
    if n_struct:
        top = leaks[0]
        msg = (f"{n_struct} of {D * (D - 1)} (source, affected) document pairs leak; largest: "
               f"document {top['source']} -> {top['affected']} ({top['direction']}), output change "
               f"{top['max_change']:.3g}" + (f" (fp64 {top['fp64_change']:.3g})"
                                             if top["fp64_change"] is not None else ""))
    else:
        msg = f"{D} documents isolated: no document's output depends on another's tokens"
        if n_num:
            msg += f" ({n_num} pairs moved within rounding noise, excused by the fp64 twin)"
        if n_unver:
            why = (f"the fp64 twin is {fp64_status}" if fp64_status.startswith("unavailable")
                   else "pass fp64=")
            msg = (f"{n_unver} document pairs moved within rounding noise and no fp64 twin could "
                   f"settle them ({why}); isolation unknown")
        if n_blind:
            msg = (f"the outputs of documents {blind_docs[:5]} are NaN at {n_blind} tokens, where "
                   f"a leak that leaves them NaN cannot show; isolation unknown"
                   + (f"; and {n_unver} pairs moved within rounding noise, unsettled" if n_unver else ""))
    if dead:
        msg += (f"; perturbing documents {dead[:5]} changed not even their own outputs: the "
                f"outputs may not depend on the tokens")
    if sub is not None and causal is False:
        msg += f"; within-row causality: {sub.message}"
    return Result(**common, verdict=verdict, codes=codes, metrics=metrics, evidence=evidence,
                  message=msg)
