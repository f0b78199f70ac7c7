"""Expert gradients doubled at every micro-batch (NVIDIA/Megatron-LM #6660), beside its fix.

Megatron-FSDP with optim_grads_params: a gradient buffer whose data-parallel group has a
single rank (expert gradients when EP = DP) is reduced in place at every micro-batch, and
that one-rank reduction rescales the accumulated buffer, so
    buf_k = 2 * buf_{k-1} + g_k,   buf_N ~ 2^N g   after N micro-batches,
while the dense gradients (a group of DP ranks) accumulate correctly. Here EP = DP = 2:
expert e lives on rank e and takes the tokens routed to it from the whole global batch; the
dense layer's gradient is summed over both ranks. With 2 micro-batches the expert gradient
is 2 g_1 + g_2 instead of g_1 + g_2 (about 1.5x when the micro-batches look alike). Fixed:
buf_k = buf_{k-1} + g_k.
"""
from __future__ import annotations

import torch
from trainprobes.reference.bugs.common import all_reduce_grads, piece, reduced
from trainprobes.reference.bugs.data import D, O, token_loss_sum, tokens

MICRO_BATCHES = 2


def route(x: torch.Tensor) -> torch.Tensor:
    """Expert 1 for tokens whose first feature is above its mean (0.5), else expert 0."""
    return (x[..., 0] > 0.5).long()


class TinyMoE(torch.nn.Module):
    """dense(x) + expert_{route(x)}(x), two experts, weights from `seed`."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.dense = torch.nn.Linear(D, O)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(D, O) for _ in range(2)])
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x):
        r = route(x)[..., None]
        return self.dense(x) + torch.where(r == 1, self.experts[1](x), self.experts[0](x))


def model() -> TinyMoE:
    return TinyMoE()


def doubled_expert_grads(model, batch, ctx, fixed: bool = False):
    expert = model.experts[ctx.rank]
    N = tokens(batch)
    buf = [torch.zeros_like(p) for p in expert.parameters()]
    logged = 0.0
    for i in range(MICRO_BATCHES):
        mb = piece(batch, i, MICRO_BATCHES)
        mine = {**mb, "mask": mb["mask"] & (route(mb["input"]) == ctx.rank)}  # tokens sent here
        for p in expert.parameters():
            p.grad = None
        step_loss = token_loss_sum(model(mb["input"]), mine) / N
        step_loss.backward()
        for b, p in zip(buf, expert.parameters()):
            b.mul_(1.0 if fixed else 2.0).add_(p.grad)
        logged = logged + step_loss.detach()
    all_reduce_grads(model.dense.parameters())
    grads = {f"dense.{n}": p.grad.detach().clone() for n, p in model.dense.named_parameters()}
    grads.update({f"experts.{ctx.rank}.{n}": b for (n, _), b in zip(expert.named_parameters(), buf)})
    return {"loss": reduced(logged), "grads": grads}
