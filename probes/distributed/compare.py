"""Compare a real collective's output with the emulator's prediction and the fp64 reference.

Two different questions:
  bitwise agreement  (real vs emulator): do we understand the backend? 1.0 means the
                     emulator predicts every bit on every rank.
  error vs fp64      (real vs reference): what the low-precision arithmetic costs, in ulps of
                     the wire format at the reference value; the signed mean is the bias, with
                     a two-sided z-test of mean = 0 (errors of one run treated as independent).
"""
from __future__ import annotations

import math

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import get_format


def _rows(outputs) -> tuple[torch.Tensor, list[int]]:
    """Stack per-rank outputs (None where a rank got nothing) as float64 [R, N] + rank ids."""
    ranks = [r for r, t in enumerate(outputs) if t is not None]
    if not ranks:
        raise InvalidArgument("outputs has no tensor on any rank: nothing to compare")
    return torch.stack([outputs[r].reshape(-1).to(torch.float64) for r in ranks]), ranks


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise identical values, NaN == NaN, and +0 distinct from -0 (bits, not values)."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    eq = (a == b) & (torch.signbit(a) == torch.signbit(b))
    return eq | both_nan


def bitwise_agreement(real, predicted, dtype: str, show: int = 5) -> dict:
    """Fraction of identical elements over every rank, and the first mismatches.

    real: per-rank outputs (list, None for ranks without output); predicted: the same
    shape per rank, or one tensor every rank should hold.
    """
    r, ranks = _rows(real)
    if isinstance(predicted, torch.Tensor):
        p = predicted.reshape(1, -1).to(torch.float64).expand_as(r)
    else:
        p, _ = _rows([predicted[k] for k in ranks])
    if p.shape != r.shape:
        raise InvalidArgument(f"predicted has shape {tuple(p.shape)}, expected {tuple(r.shape)}")
    same = _same_bits(r, p)
    total = same.numel()
    bad = (~same).nonzero()
    fmt = get_format(dtype)
    out = {"bitwise_match_fraction": float(same.sum()) / total if total else 1.0,
           "mismatched": int(bad.shape[0]), "compared": total, "ranks_compared": ranks,
           "first_mismatches": [], "worst_mismatch": None}
    if bad.shape[0]:
        diff = ((r - p).abs() / fmt.ulp(p)).nan_to_num(nan=math.inf)
        diff = torch.where(same, torch.zeros_like(diff), diff)
        rows = [(int(i), int(j)) for i, j in bad[:show].tolist()]
        w = int(diff.argmax())
        rows_worst = divmod(w, r.shape[1])

        def entry(i, j):
            return {"rank": ranks[i], "index": j, "real": float(r[i, j]),
                    "predicted": float(p[i, j]), "ulp_diff": float(diff[i, j])}
        out["first_mismatches"] = [entry(i, j) for i, j in rows]
        out["worst_mismatch"] = entry(*rows_worst)
    return out


def mismatch_report(agreement: dict) -> str:
    """assert_close-style text: how many differ, the worst, where; '' when all agree."""
    if not agreement["mismatched"]:
        return ""
    n, tot = agreement["mismatched"], agreement["compared"]
    w = agreement["worst_mismatch"]
    lines = [f"Mismatched elements: {n} / {tot} ({100 * n / tot:.1f}%) over ranks "
             f"{agreement['ranks_compared']}",
             f"Greatest difference: {w['ulp_diff']:g} ulp at rank {w['rank']} index "
             f"({w['index']},) (real {w['real']!r}, predicted {w['predicted']!r})",
             "Allowed difference: 0 ulp (bitwise)",
             "First mismatches: " + ", ".join(f"rank {m['rank']} [{m['index']}] "
                                              f"{m['real']!r} vs {m['predicted']!r}"
                                              for m in agreement["first_mismatches"])]
    return "\n".join(lines)


def _like(t: torch.Tensor, r: torch.Tensor, name: str) -> torch.Tensor:
    """t as float64 rows like r: one row (broadcast to every rank) or one per rank."""
    t = t.to(torch.float64)
    if (t.dim() == 1 or t.shape[0] == 1) and t.numel() == r.shape[1]:
        t = t.reshape(1, -1).expand_as(r)
    if t.shape != r.shape:
        raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected {tuple(r.shape)} "
                              f"or ({r.shape[1]},) like the outputs")
    return t


def error_vs_reference(real, reference: torch.Tensor, dtype: str, scale=None) -> dict:
    """Error of the real (or emulated) result against the fp64 reference, in wire ulps.

    e = (real - ref) / ulp_dtype(max(|ref|, scale)). scale is the element's magnitude
    before cancellation (probe.py passes max over ranks of |input|, / world for avg): a
    sum that cancels to ~0 still rounded partial sums of that size, and ulp(0) is the
    smallest subnormal, which would turn one rounding into 10^37 "ulps". Default: |ref|.
    bias = mean(e) with z = bias / (std(e) / sqrt(n)) and a two-sided p-value;
    bias_relative = sum(real - ref) / sum|ref|. Non-finite outputs are counted, left out.
    """
    r, _ = _rows(real) if not isinstance(real, torch.Tensor) else (real.reshape(1, -1), [0])
    ref = _like(reference, r, "reference")
    size = ref.abs() if scale is None else torch.maximum(ref.abs(), _like(scale, r, "scale").abs())
    fmt = get_format(dtype)
    finite = torch.isfinite(r) & torch.isfinite(ref)
    err = ((r - ref) / fmt.ulp(size))[finite]
    n = err.numel()
    out = {"nonfinite": int((~finite).sum()), "n": n}
    if n == 0:
        return {**out, "max_ulp_error": math.nan, "mean_ulp_error": math.nan, "bias": math.nan,
                "bias_z": math.nan, "bias_p": math.nan, "bias_relative": math.nan}
    mean = float(err.mean())
    sd = float(err.std()) if n > 1 else 0.0
    if sd > 0:
        z = mean / (sd / math.sqrt(n))
        p = math.erfc(abs(z) / math.sqrt(2))
    else:
        z, p = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    denom = float(ref[finite].abs().sum())
    return {**out, "max_ulp_error": float(err.abs().max()), "mean_ulp_error": float(err.abs().mean()),
            "bias": mean, "bias_z": z, "bias_p": p,
            "bias_relative": float((r - ref)[finite].sum()) / denom if denom else 0.0}
