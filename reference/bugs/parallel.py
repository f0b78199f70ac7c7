"""Sequence-, context- and data-parallel normalisation bugs, each beside its fixed twin.

sp_layernorm (NVIDIA/Megatron-LM #1446, EleutherAI/gpt-neox PR #1257): with sequence
  parallelism each tensor-parallel rank runs the LayerNorm on its own span of positions, so
  the LayerNorm's weight and bias gradients are partial sums that must be all-reduced over
  the group; without that all-reduce the replicas of one replicated parameter hold different
  gradients (each about its own span's share). The matmul weights are complete (the TP
  collectives reduce them; an all-reduce stands in for them here).
cp_eval_loss (huggingface/transformers PR #48167): under context parallelism the reported
  loss, already the global token mean on every rank, is summed over the context-parallel
  group once more: cp_size times the true value. Gradients are right; only the loss is off.
cp_token_count (verl-project/verl #5983, fixed by PR #6049): the token count used for
  token-mean normalisation is reduced over the data-parallel group only, missing the other
  context-parallel ranks' tokens; with DP = 1 and an even split each rank divides by N / cp,
  and the gradients (reduced over DP x CP) and the loss come out cp times too large.
dp_local_tokens (NVIDIA/Megatron-LM #7452): the per-token loss is normalised by each
  data-parallel rank's LOCAL token count and the ranks average, instead of dividing by the
  global count: documents on the rank with fewer tokens weigh more ("a gradient of 14/3
  where the global per-token reference is 4"). With LOCAL_LAYOUT (rank 0: short hard
  documents) the gradient is scaled by data.normalisation_ratio.
"""
from __future__ import annotations

from trainprobes.reference.bugs.common import all_reduce_grads, output, piece, positions, reduced
from trainprobes.reference.bugs.data import Layout, token_loss_sum, tokens

LOCAL_LAYOUT = Layout(lengths=(2, 2, 2, 2, 6, 6, 6, 6), difficulty=(3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0),
                      positions=6)
LOCAL_PIECES = [[0, 1, 2, 3], [4, 5, 6, 7]]


def sp_layernorm(model, batch, ctx, fixed: bool = False):
    mine = positions(batch, ctx.rank, ctx.world)
    step_loss = token_loss_sum(model(mine["input"]), mine) / tokens(batch)
    step_loss.backward()
    norm = list(model[0].parameters())
    all_reduce_grads([p for p in model.parameters() if all(p is not q for q in norm)])
    if fixed:
        all_reduce_grads(norm)
    return output(reduced(step_loss), model)


def cp_eval_loss(model, batch, ctx, fixed: bool = False):
    mine = positions(batch, ctx.rank, ctx.world)
    s = token_loss_sum(model(mine["input"]), mine)
    n = reduced(tokens(mine).to(s.dtype))
    (s / n).backward()
    all_reduce_grads(model.parameters())
    mean = reduced(s) / n  # the global token mean, on every rank
    return output(mean if fixed else reduced(mean), model)


def cp_token_count(model, batch, ctx, fixed: bool = False):
    mine = positions(batch, ctx.rank, ctx.world)
    s = token_loss_sum(model(mine["input"]), mine)
    local = tokens(mine).to(s.dtype)
    count = reduced(local) if fixed else local  # the DP group is this rank alone (DP = 1)
    step_loss = s / count
    step_loss.backward()
    all_reduce_grads(model.parameters())
    return output(reduced(step_loss), model)


def dp_local_tokens(model, batch, ctx, fixed: bool = False):
    mine = piece(batch, ctx.rank, ctx.world)
    s = token_loss_sum(model(mine["input"]), mine)
    count = tokens(batch) / ctx.world if fixed else tokens(mine)
    step_loss = s / count
    step_loss.backward()
    all_reduce_grads(model.parameters())
    for p in model.parameters():  # the data-parallel average
        p.grad.div_(ctx.world)
    return output(reduced(step_loss) / ctx.world, model)
