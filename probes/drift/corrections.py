"""Importance-sampling corrections for the train/inference mismatch.

rho = p_train / p_infer = exp(train - infer) per token. Levels:
  token      each token its own rho (TIS, Yao et al. 2025; verl `rollout_is` token mode)
  sequence   rho_seq = prod_t rho_t = exp(sum_t (train - infer)), broadcast to the tokens
  geometric  exp(mean_t (train - infer)): the sequence ratio without its length dependence
             (a per-token 1.1 is 2.6 at 10 tokens and ~13,780 at 100)
Kinds:
  truncated  w = min(rho, cap): bias traded for variance; returns the fraction clipped
  masked     keep w = rho only inside [low, high], drop the rest (IcePop-style band masking;
             TRL's sequence mask): returns the fraction masked and the new mask
Both report the effective sample size fraction ESS = (sum w)^2 / (n sum w^2) over the units
(tokens, or sequences) that keep a weight. Ratios are formed in log space, so sequence-level
products never overflow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from trainprobes.drift.inputs import as_tensor, check_logprobs
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_choice, check_number

LEVELS = ("token", "sequence", "geometric")


@dataclass
class Correction:
    """IS weights shaped like the input (0 where masked out) and what the correction did."""

    kind: str
    level: str
    weights: torch.Tensor
    mask: torch.Tensor
    frac_clipped: float
    frac_masked: float
    ess: float
    n_units: int

    def metrics(self) -> dict:
        return {"kind": self.kind, "level": self.level, "frac_clipped": self.frac_clipped,
                "frac_masked": self.frac_masked, "ess": self.ess, "n_units": self.n_units}


def _log_ratios(train, infer, mask, level):
    check_choice(level, "level", LEVELS)
    train = as_tensor("train_logprobs", train)
    infer = as_tensor("infer_logprobs", infer)
    if train.shape != infer.shape:
        raise InvalidArgument(f"infer_logprobs has shape {tuple(infer.shape)}, expected {tuple(train.shape)}")
    m = torch.ones_like(train, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    if m.shape != train.shape:
        raise InvalidArgument(f"mask has shape {tuple(m.shape)}, expected {tuple(train.shape)}")
    check_logprobs("train_logprobs", train, m)
    check_logprobs("infer_logprobs", infer, m)
    a = torch.where(m, train - infer, 0.0)  # log rho per token
    if level == "token":
        return a, m, a, m
    if train.ndim != 2:
        raise InvalidArgument(f"level={level!r} needs [B, T] log-probs (rows = sequences), got shape "
                              f"{tuple(train.shape)}")
    n = m.sum(1)
    unit_ok = n > 0
    seq = a.double().sum(1)
    if level == "geometric":
        seq = seq / n.clamp(min=1)
    return seq, unit_ok, a, m


def _ess(w: torch.Tensor, keep: torch.Tensor) -> float:
    w = w[keep].double()
    s2 = (w * w).sum().item()
    return (w.sum().item() ** 2) / (w.numel() * s2) if s2 > 0 else 0.0


def _broadcast(unit_w, unit_keep, a, m, level):
    if level == "token":
        return torch.where(unit_keep, unit_w, 0.0).float(), unit_keep
    keep = m & unit_keep[:, None]
    return torch.where(keep, unit_w[:, None].float(), 0.0), keep


def truncated_is(train_logprobs, infer_logprobs, mask=None, *, cap: float = 2.0,
                 level: str = "token") -> Correction:
    """Truncated IS: w = min(rho, cap) at the given level."""
    check_number(cap, "cap", min=0, min_open=True, hint="e.g. 2.0")
    log_r, keep, a, m = _log_ratios(train_logprobs, infer_logprobs, mask, level)
    clipped = (log_r > math.log(cap)) & keep
    w = torch.exp(log_r.clamp(max=math.log(cap)))
    n = int(keep.sum())
    weights, new_mask = _broadcast(w, keep, a, m, level)
    return Correction("truncated", level, weights, new_mask, int(clipped.sum()) / n, 0.0,
                      _ess(w, keep), n)


def masked_is(train_logprobs, infer_logprobs, mask=None, *, low: float = 0.5, high: float = 2.0,
              level: str = "token") -> Correction:
    """Masked IS: keep w = rho where low <= rho <= high, drop the token (or sequence) elsewhere."""
    check_number(low, "low", min=0, hint="the band's lower ratio, e.g. 0.5")
    check_number(high, "high", min=0, min_open=True, finite=False, hint="the band's upper ratio, e.g. 2.0")
    if not low < high:
        raise InvalidArgument(f"band low={low!r}, high={high!r} must satisfy 0 <= low < high, e.g. 0.5, 2.0")
    log_r, keep, a, m = _log_ratios(train_logprobs, infer_logprobs, mask, level)
    log_low = math.log(low) if low > 0 else -math.inf
    inside = (log_r >= log_low) & (log_r <= math.log(high)) & keep
    n = int(keep.sum())
    w = torch.exp(log_r.clamp(max=math.log(high)))
    weights, new_mask = _broadcast(w, inside, a, m, level)
    kept = int(inside.sum())
    return Correction("masked", level, weights, new_mask, 0.0, (n - kept) / n,
                      _ess(w, inside) if kept else 0.0, n)
