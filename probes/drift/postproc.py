"""What the model's own code does after its last hooked stage (lm_head): a final-logit
soft-cap, a logits scaling, a rescale in forward. No hook sees it, so patching alone would
call such a fault "noise" with every stage exact.

The trainer is run with its lm_head output replaced by the engine's (z_h): the same input to
both sides' post-processing, so z_B - z_h is the post-processing's own difference (zero for
the same code on the same input). Judged per sequence against a rounding floor of
POST_ROUNDINGS unit roundoffs, as a stage is (trainprobes.drift.localize). Then fitted
per position as z_B = s z_h + c_i over the vocabulary: an affine map within the floor is a
temperature (slope s), anything else a post-processing fault.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from trainprobes.drift.localize import StageReport, rel_error, stage_test
from trainprobes.drift.stats import cluster_t
from trainprobes.drift.units import as_units, spans_per_sequence, unit_sums

# the post-processing is a few elementwise ops (scale, tanh, scale): each rounds once
POST_ROUNDINGS = 2.0
ROLE = "post_processing"


@dataclass
class PostProcessing:
    report: StageReport       # the row "after <lm_head>" of the stage table
    affine: bool              # z_B = s z_h + c_i within the floor: a temperature
    slope: float
    slope_ci: tuple


def judge_post(z_b: torch.Tensor, z_h: torch.Tensor, mask: torch.Tensor, *, lm_head: str, u: float,
               margin: float, alpha: float, n_stages: int, free_error: float) -> PostProcessing:
    """z_b, z_h: [B, T, V] the engine's logits and the trainer's with the engine's lm_head
    output; mask [B, T]. n_stages: the rows of the stage table, this one included.
    free_error: the free-running runs' relative logit difference, the row's free column (what
    reaches the logits from every stage before, not this row's own part)."""
    zb, zh = z_b.double(), z_h.double()
    m = mask.double()
    own = torch.where(mask, rel_error(zb, zh), 0.0)
    floor = POST_ROUNDINGS * u
    t = stage_test(own, torch.tensor(floor ** 2, dtype=own.dtype), mask, margin=margin, alpha=alpha,
                   n_tests=n_stages)
    nonfinite = t.nonfinite
    n = m.sum().clamp_min(1).item()
    rep = StageReport(f"after {lm_head}", ROLE, 0, None, (own * m).sum().item() / n, free_error, floor, *t)
    # per position, over the vocabulary: demeaned logits, slope by sequence (the units)
    xh = torch.where(mask[..., None], zh - zh.mean(-1, keepdim=True), 0.0)
    yb = torch.where(mask[..., None], zb - zb.mean(-1, keepdim=True), 0.0)
    ct = cluster_t(unit_sums((xh * yb).sum(-1), mask.shape), unit_sums((xh * xh).sum(-1), mask.shape), alpha)
    s, half = ct.mean.item(), ct.half.item()
    resid = torch.where(mask, rel_error(yb, s * xh), 0.0)
    k = spans_per_sequence(*mask.shape)
    mu = as_units(m, k)
    res_u = ((as_units(resid, k) ** 2 * mu).sum(1) / mu.sum(1).clamp_min(1)).sqrt()[mu.sum(1) > 0]
    affine = (rep.verdict == "beyond" and not nonfinite and math.isfinite(s) and res_u.numel() > 0
              and bool((res_u <= margin * floor).all()) and abs(s - 1) > (half if math.isfinite(half) else math.inf))
    return PostProcessing(rep, affine, s, (s - half, s + half))


# the row of the log-prob functions themselves (judge_logprobs)
LOGPROBS = "log-probs"
LOGPROBS_ROLE = "logprobs"


def judge_logprobs(trainer_logprobs, z: torch.Tensor, e: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                   *, u: float, margin: float, alpha: float, n_stages: int, free_error: float,
                   seed: int = 0) -> StageReport:
    """The two sides' log-prob functions on the SAME logits z [B, T, V] (no numerics of the model
    enter): e [B, T], what remains of the scored token's log-ratio once a temperature and a
    renormalisation are taken out (trainprobes.drift.semantics' numerics part), judged per
    sequence against what one rounding at the nominal precision u does to the trainer's
    function: its logits and its output each jittered by (1 + u d), d uniform in [-1, 1]. An
    engine that computes its log-softmax in bf16, or rounds fp32 logits to bf16 first, drifts
    as much as a bf16 lm_head (0.009 nats a token in the demo's Llama) with every stage exact.
    free_error: the whole drift, mean |log-ratio| of the scored tokens (nats, as own and the
    floor of this row): a temperature or a renormalisation shows there, not in own."""
    g = torch.Generator().manual_seed(seed)
    t = tokens[..., None]
    with torch.no_grad():
        lp = trainer_logprobs(z).double()
        d = torch.rand(z.shape, generator=g, dtype=torch.float64).mul_(2).sub_(1)
        zj = (z.double() * (1 + u * d)).to(z.dtype)
        jit = trainer_logprobs(zj).double().gather(-1, t).squeeze(-1) - lp.gather(-1, t).squeeze(-1)
    lp_t = lp.gather(-1, t).squeeze(-1)
    m = mask.double()
    own = torch.where(mask, e.double().abs(), 0.0)
    floor2 = torch.where(mask, jit ** 2 + (u * lp_t) ** 2, 0.0)
    test = stage_test(own, floor2, mask, margin=margin, alpha=alpha, n_tests=n_stages)
    n = m.sum().clamp_min(1).item()
    mean_own = (own * m).sum().item() / n
    return StageReport(LOGPROBS, LOGPROBS_ROLE, 0, None, mean_own, free_error,
                       (floor2.sqrt() * m).sum().item() / n, *test)
