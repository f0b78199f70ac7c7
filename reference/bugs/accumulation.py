"""Gradient-accumulation normalisation bugs, each beside its fixed twin.

mean_of_means (huggingface/transformers PR #34191, the fix of the 2024 gradient-accumulation
  bug): each micro-batch's loss is its own token mean, divided by the number of micro-batches,
  and data-parallel ranks average: every token of piece i weighs 1 / (pieces * n_i) instead
  of 1 / N. With documents whose difficulty depends on their length the gradient is scaled by
  data.normalisation_ratio (1.25 for LAYOUT). Fixed: each micro-batch's token SUM over the
  global token count N (transformers' num_items_in_batch), ranks summed.
partial_window (modelscope/ms-swift PR #10084): the last accumulation window of an epoch holds
  fewer micro-batches (here 2) than gradient_accumulation_steps (4), and each micro-batch's
  mean loss is still divided by 4: the gradient (and the logged loss) is 2/4 of the
  full-batch reference. Fixed: divide by the window's own size.
"""
from __future__ import annotations

from trainprobes.reference.bugs.common import all_reduce_grads, output, piece, reduced
from trainprobes.reference.bugs.data import Layout, loss, token_loss_sum, tokens

MICRO_BATCHES = 2
# rank r holds documents 4r..4r+3; its micro-batch 0 two short hard ones, 1 two long easy ones
LAYOUT = Layout(lengths=(2, 2, 8, 8, 2, 2, 8, 8), difficulty=(2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0),
                positions=8)
PIECES = [[0, 1], [2, 3], [4, 5], [6, 7]]   # (rank, micro-batch) in order, 2 ranks x 2
CONFIGURED_STEPS, WINDOW = 4, 2             # the partial window: 2 of 4 micro-batches


def mean_of_means(model, batch, ctx, fixed: bool = False):
    mine = piece(batch, ctx.rank, ctx.world)
    N = tokens(batch)  # every rank holds the global batch, so the global count is local
    logged = 0.0
    for i in range(MICRO_BATCHES):
        mb = piece(mine, i, MICRO_BATCHES)
        out = model(mb["input"])
        step_loss = token_loss_sum(out, mb) / N if fixed else loss(out, mb) / MICRO_BATCHES
        step_loss.backward()
        logged = logged + step_loss.detach()
    all_reduce_grads(model.parameters())
    if fixed:
        return output(reduced(logged), model)
    for p in model.parameters():  # DDP averages over ranks
        p.grad.div_(ctx.world)
    return output(reduced(logged) / ctx.world, model)


def partial_window(model, batch, ctx, fixed: bool = False):
    mine = piece(batch, ctx.rank, ctx.world)
    divisor = WINDOW if fixed else CONFIGURED_STEPS
    logged = 0.0
    for i in range(WINDOW):
        mb = piece(mine, i, WINDOW)
        step_loss = loss(model(mb["input"]), mb) / divisor
        step_loss.backward()
        logged = logged + step_loss.detach()
    all_reduce_grads(model.parameters())
    for p in model.parameters():
        p.grad.div_(ctx.world)
    return output(reduced(logged) / ctx.world, model)
