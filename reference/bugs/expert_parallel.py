"""Expert-parallel bugs on a real expert-parallel forward (tokens to their expert's rank and
back with all_to_all_single: trainprobes.reference.expert_parallel), each beside its fixed
twin. EP = DP = 2; four experts, two per rank; each rank takes half the documents.

ep_expert_grad_scale (NVIDIA/Megatron-LM PR #5956): each rank's loss is its own token mean
  (x ep the global share, all ranks holding equal token counts) and the dense gradients are
  averaged over ranks; an expert's gradient, which gathers every rank's contribution
  through the all-to-all, must be divided by the expert-parallel size too, and is not:
  every expert's gradient x ep, the dense ones exact.
ep_lost_remote_grad (NVIDIA-NeMo/Automodel PR #1260): the dispatch's backward does not
  return the gradients of tokens from the experts on other ranks (there: an all-gather
  whose backward sliced instead of reduce-scattering), so each token's input gradient
  keeps only its own rank's experts' share: the layers before the MoE get a gradient with
  a piece missing; the experts and the head are exact.
"""
from __future__ import annotations

import torch
from trainprobes.reference.bugs.common import output, piece, reduced
from trainprobes.reference.bugs.data import D, O, token_loss_sum, tokens
from trainprobes.reference.expert_parallel import ExpertsOnRanks, local_expert_outputs

H, EXPERTS = 8, 4


class MoE(torch.nn.Module):
    """x [B, T, D] -> tanh(proj) -> head(h) + experts[route(h)](h), top-1 by a fixed router
    (buffers: routing is not trained here); the expert-parallel protocol's three members."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.proj = torch.nn.Linear(D, H)
        self.head = torch.nn.Linear(H, O)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(H, O) for _ in range(EXPERTS)])
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.register_buffer("router", torch.randn(H, EXPERTS, generator=g))
        # the zoo's tokens sit close to one point (data.documents): route on where each lies
        # around it, so the four experts all get tokens
        with torch.no_grad():
            self.register_buffer("center", torch.tanh(self.proj(torch.full((D,), 0.5))))

    def route(self, h):
        return ((h - self.center) @ self.router).argmax(-1)

    def expert_outputs(self, h, index):
        return local_expert_outputs(self.experts, h, index)

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        flat = h.reshape(-1, H)
        return self.head(h) + self.expert_outputs(flat, self.route(flat)).reshape(*h.shape[:-1], O)


def model() -> MoE:
    return MoE(seed=3)  # a seed whose router gives each of the four experts about a quarter of the tokens


def _ep_forward(model, batch, ctx, lose_remote_grad=False):
    model.expert_outputs = ExpertsOnRanks(model.experts, ctx.rank, ctx.world,
                                          lose_remote_grad=lose_remote_grad)
    mine = piece(batch, ctx.rank, ctx.world)
    return model(mine["input"]), mine


def _grads(model, ctx, expert_scale=1.0):
    """Dense gradients summed over ranks; this rank's experts' as they arrived (x expert_scale)."""
    out = output(None, model)["grads"]
    keep = {f"experts.{e}." for e in range(ctx.rank * EXPERTS // ctx.world, (ctx.rank + 1) * EXPERTS // ctx.world)}
    grads = {}
    for n, g in out.items():
        if n.startswith("experts."):
            if any(n.startswith(k) for k in keep):
                grads[n] = g * expert_scale
        else:
            grads[n] = reduced(g)
    return grads


def ep_expert_grad_scale(model, batch, ctx, fixed: bool = False):
    out, mine = _ep_forward(model, batch, ctx)
    local_mean = token_loss_sum(out, mine) / tokens(mine)
    local_mean.backward()
    grads = {n: g / ctx.world if not n.startswith("experts.") else g
             for n, g in _grads(model, ctx, 1.0 / ctx.world if fixed else 1.0).items()}
    return {"loss": reduced(local_mean.detach()) / ctx.world, "grads": grads}


def ep_lost_remote_grad(model, batch, ctx, fixed: bool = False):
    out, mine = _ep_forward(model, batch, ctx, lose_remote_grad=not fixed)
    step_loss = token_loss_sum(out, mine) / reduced(tokens(mine).float())
    step_loss.backward()
    return {"loss": reduced(step_loss.detach()), "grads": _grads(model, ctx)}
