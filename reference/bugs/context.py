"""Context-parallel loss-scaling bugs on a real context-parallel forward (causal attention
over all-gathered keys and values: trainprobes.reference.context_parallel), each beside
its fixed twin. CP = 2, DP = 1; each rank holds one span of every document's positions.

cp_loss_scaling (NVIDIA/Megatron-LM #673, #906; fixed in commit 3bdcbbb): each rank's
  loss (its span's summed loss over the CP group's token count) is multiplied by the CP
  size, and the gradients are divided by the data-parallel size only, then summed over
  DP x CP: every gradient x cp. The logged loss is the true token mean.
cp_mtp_loss (NVIDIA/Megatron-LM #3943, PR #3959): with CP the micro-batch count is
  inflated by cp, and the multi-token-prediction loss's scale is not compensated: the MTP
  loss's gradient is divided by cp once more. The MTP head's gradient x 1/cp; the trunk
  it shares with the main head gets a mixture; the main head is exact.
"""
from __future__ import annotations

import torch
from trainprobes.reference.bugs.common import output, reduced
from trainprobes.reference.bugs.data import D, O, token_loss_sum, tokens
from trainprobes.reference.context_parallel import AllGatherAttention, span

H = 8
MTP_WEIGHT = 0.5


class Attention(torch.nn.Module):
    """x [B, T, D] -> one causal attention head (width H) -> tanh -> out [B, T, O], and an MTP
    head on the same features predicting the next position's target; weights from `seed`."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * H)
        self.out = torch.nn.Linear(H, O)
        self.mtp = torch.nn.Linear(H, O)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)            # [B, 1, T, H] each
        h = torch.tanh(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)).squeeze(1)
        return self.out(h), self.mtp(h)


def model() -> Attention:
    return Attention()


def with_next(batch: dict) -> dict:
    """The MTP targets of the whole sequence, made before it is cut into spans (Megatron
    rolls the labels globally): position t predicts target t + 1, the last position none."""
    nxt = torch.roll(batch["target"], -1, dims=1)
    mask = torch.roll(batch["mask"], -1, dims=1).clone()
    mask[:, -1] = False
    return {**batch, "mtp_target": nxt, "mtp_mask": mask & batch["mask"]}


def _mtp_sum(pred, b):
    return token_loss_sum(pred, {"target": b["mtp_target"], "mask": b["mtp_mask"]})


def loss(out, b):
    """The single-device loss: the main token mean plus MTP_WEIGHT times the MTP token mean."""
    main, mtp = out
    return token_loss_sum(main, b) / tokens(b) + MTP_WEIGHT * _mtp_sum(mtp, b) / b["mtp_mask"].sum()


def main_loss(out, b):
    """The main head's token mean alone (one token mean: what a token-weighted split of the
    sequence reproduces exactly)."""
    return token_loss_sum(out[0], b) / tokens(b)


def _span_forward(model, batch, ctx):
    mine = span(batch, ctx.rank, ctx.world, batch["mask"].shape[1])
    with AllGatherAttention(ctx.rank, ctx.world):
        return model(mine["input"]), mine


def _backward_and_reduce(term, model, ctx):
    term.backward()  # the key/value gathers' backward sums each span's share to its owner
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad)


def cp_loss_scaling(model, batch, ctx, fixed: bool = False):
    (main, mtp), mine = _span_forward(model, batch, ctx)
    n, m = reduced(tokens(mine).float()), reduced(mine["mtp_mask"].sum().float())
    local = token_loss_sum(main, mine) / n + MTP_WEIGHT * _mtp_sum(mtp, mine) / m
    scaled = local if fixed else local * ctx.world   # x cp, and the gradients divided by dp = 1 only
    _backward_and_reduce(scaled, model, ctx)
    return output(reduced(local.detach()), model)


def cp_mtp_loss(model, batch, ctx, fixed: bool = False):
    (main, mtp), mine = _span_forward(model, batch, ctx)
    n, m = reduced(tokens(mine).float()), reduced(mine["mtp_mask"].sum().float())
    main_term = token_loss_sum(main, mine) / n
    mtp_term = MTP_WEIGHT * _mtp_sum(mtp, mine) / m
    scaled = mtp_term if fixed else mtp_term / ctx.world   # the MTP scale missing its x cp
    _backward_and_reduce(main_term + scaled, model, ctx)
    return output(reduced((main_term + mtp_term).detach()), model)
