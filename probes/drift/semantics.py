"""What the two sides' reported log-probs mean, from the log-prob vectors alone: a
temperature applied differently, top-k/top-p renormalisation, raw vs processed log-probs.

Model, per position i over the entries v both sides report finitely (K_i):
    lpB[i, v] = s * lpA[i, v] + c_i + e[i, v]
  temperature      s != 1: log softmax(z / T_B) against log softmax(z / T_A) is affine in
                   the logits with slope s = T_A / T_B (a temperature applied twice: s = 1/T).
                   s is the ratio estimator sum(x y) / sum(x x) of the log-probs demeaned
                   per position, its interval cluster-robust over the units (sequences, or
                   spans of them: trainprobes.drift.units).
  renormalisation  c_i > 0 with entries B drops (-inf): renormalising the kept set adds
                   c_i = -log(mass kept) to every kept log-prob (vLLM RFC #42259), a
                   constant per position. Measured as the mean over K_i of lpB - lpA',
                   lpA' = log softmax(s lpA), and compared with -log(mass of K_i under lpA').
  numerics         e: what is left.
"processed" log-probs show one of the first two; "raw" ones neither. For a sampled token t
the log-ratio x = lpB[t] - lpA[t] splits into (lpA'[t] - lpA[t]) + c_i + e[i, t]: the
temperature part, the renormalisation part, the numerics part.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from trainprobes.drift.stats import cluster_t
from trainprobes.drift.units import unit_sums
from trainprobes.errors import InvalidArgument


@dataclass
class Semantics:
    slope: float                  # s = T_A / T_B
    slope_ci: tuple
    temperature: bool             # s differs from 1 beyond the interval and the tolerance
    renormalised: bool            # B drops entries and adds their log mass back
    frac_positions_renormalised: float
    mean_log_mass_kept: float     # mean over positions of -c_i where renormalised (<= 0)
    mean_offset: float            # mean c_i
    parts: dict                   # "temperature" / "renormalisation" / "numerics" -> [B, T] per token

    def as_metrics(self) -> dict:
        return {"temperature_slope": self.slope, "temperature_slope_ci_low": self.slope_ci[0],
                "temperature_slope_ci_high": self.slope_ci[1], "temperature": self.temperature,
                "renormalised": self.renormalised,
                "frac_positions_renormalised": self.frac_positions_renormalised,
                "mean_log_mass_kept": self.mean_log_mass_kept, "offset": self.mean_offset}


def semantics(lp_a: torch.Tensor, lp_b: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
              *, alpha: float = 0.01, tol: float = 1e-3) -> Semantics:
    """lp_a, lp_b: [B, T, V] log-prob vectors of the trainer and the engine; tokens [B, T]:
    the token scored at each position; mask [B, T] real tokens. tol: smallest |s - 1| (and
    mean c_i, nats) named a component: rounding moves both by less (bf16: ~1e-4)."""
    if lp_a.shape != lp_b.shape or lp_a.ndim != 3:
        raise InvalidArgument(f"log-prob vectors have shapes {tuple(lp_a.shape)} and "
                              f"{tuple(lp_b.shape)}, expected the same [B, T, V]")
    a, b = lp_a.double(), lp_b.double()
    if not bool(torch.isfinite(a[mask]).all()):
        raise InvalidArgument("the trainer's log-probs have non-finite entries on real tokens: the "
                              "trainer's side must be the full (raw) distribution")
    keep = torch.isfinite(b) & mask[..., None]
    k = keep.double()
    nk = k.sum(-1).clamp_min(1)
    x = torch.where(keep, a - (a * k).sum(-1, keepdim=True) / nk[..., None], 0.0)
    y = torch.where(keep, b.nan_to_num(neginf=0.0) - (b.nan_to_num(neginf=0.0) * k).sum(-1, keepdim=True)
                    / nk[..., None], 0.0)
    sxy, sxx = unit_sums((x * y).sum(-1), mask.shape), unit_sums((x * x).sum(-1), mask.shape)
    ct = cluster_t(sxy, sxx, alpha)
    s, half = ct.mean.item(), ct.half.item()
    if not math.isfinite(half):
        half = math.inf
    temperature = abs(s - 1) > tol and abs(s - 1) > half
    s_used = s if temperature else 1.0
    a2 = torch.log_softmax(s_used * a, dim=-1)
    c = torch.where(keep, b.nan_to_num(neginf=0.0) - a2, 0.0).sum(-1) / nk  # [B, T]
    dropped = (~torch.isfinite(b) & mask[..., None]).any(-1)
    log_mass = torch.logsumexp(torch.where(keep, a2, -math.inf), dim=-1)
    m = mask.double()
    n = m.sum().clamp_min(1).item()
    mean_c = (c * m).sum().item() / n
    renorm = bool(dropped.any()) and abs(mean_c) > tol
    t = tokens[..., None]
    temp_part = ((a2.gather(-1, t) - a.gather(-1, t)).squeeze(-1) if temperature
                 else torch.zeros(tokens.shape, dtype=a.dtype))  # not re-normalised: no rounding
    ren_part = c if renorm else torch.zeros_like(c)
    x_tok = (b.gather(-1, t) - a.gather(-1, t)).squeeze(-1)
    parts = {"temperature": torch.where(mask, temp_part, 0.0),
             "renormalisation": torch.where(mask, ren_part, 0.0)}
    parts["numerics"] = torch.where(mask, x_tok - parts["temperature"] - parts["renormalisation"], 0.0)
    frac = (dropped & mask).double().sum().item() / n
    lm = torch.where(dropped, log_mass, 0.0).sum().item() / max(1, int(dropped.sum()))
    return Semantics(s, (s - half, s + half), temperature, renorm, frac, lm if renorm else 0.0,
                     mean_c, parts)
