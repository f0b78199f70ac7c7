"""Expert parallelism: experts split over the ranks, tokens sent to their expert's rank and
back with all-to-all.

A MoE layer that follows the protocol below runs unchanged on one device and, with
`ExpertsOnRanks(layer, rank, world)` installed, with its experts split over the ranks:

    class Layer(nn.Module):        # the protocol
        experts: nn.ModuleList     # E experts, E a multiple of the world size
        def route(self, x) -> index        # [N] expert of each of N tokens (top-1)
        def expert_outputs(self, x, index) -> y   # [N, out]: experts[index[n]](x[n])

Rank r owns experts r*E/w ... (r+1)*E/w - 1. expert_outputs on a rank (its own tokens):
  1. sort its tokens by expert; count them per expert; all_to_all_single the counts (no
     autograd), so each rank knows how many tokens each peer sends per owned expert;
  2. all_to_all_single the sorted tokens (with autograd: the backward sends the tokens'
     gradients back to their rank), uneven splits;
  3. apply each owned expert to the tokens received for it, in (source rank, expert) order;
  4. all_to_all_single the outputs back (autograd) and undo the sort.
gloo runs all_to_all_single on CPU tensors, uneven splits included. No verdicts here.
"""
from __future__ import annotations

import torch

__all__ = ["local_expert_outputs", "ExpertsOnRanks", "owned"]


def local_expert_outputs(experts, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The single-device expert part: experts[index[n]](x[n]) for every token n."""
    out = None
    for e, expert in enumerate(experts):
        sel = index == e
        y = expert(x[sel])
        if out is None:
            out = x.new_zeros(x.shape[0], y.shape[-1])
        out = out.index_put((sel.nonzero().squeeze(-1),), y)
    return out


def owned(n_experts: int, rank: int, world: int) -> range:
    if n_experts % world:
        raise ValueError(f"{n_experts} experts do not split evenly over {world} ranks")
    k = n_experts // world
    return range(rank * k, (rank + 1) * k)


class ExpertsOnRanks:
    """expert_outputs over all-to-all (module docstring); `lose_remote_grad` re-creates
    NVIDIA-NeMo/Automodel PR #1260's bug: the tokens' gradients from experts on other
    ranks never come back (each token keeps only its own rank's experts' share)."""

    def __init__(self, experts, rank: int, world: int, group=None, lose_remote_grad: bool = False):
        self.experts, self.rank, self.world, self.group = experts, rank, world, group
        self.mine = owned(len(experts), rank, world)
        self.lose_remote_grad = lose_remote_grad

    def __call__(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        E, k = len(self.experts), len(self.mine)
        order = torch.argsort(index, stable=True)
        counts = torch.bincount(index, minlength=E)                               # [E] sent
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)               # step 1
        send = counts.view(self.world, k).sum(1).tolist()
        recv = received.view(self.world, k)                                       # [source, own expert]
        tokens = x[order]
        if self.lose_remote_grad:
            tokens = _remote_detached(tokens, send, self.rank)
        got = _AllToAll.apply(tokens, recv.sum(1).tolist(), send, self.group)   # step 2
        outs, at = [], 0
        for src in range(self.world):                                             # step 3
            for j, e in enumerate(self.mine):
                n = int(recv[src, j])
                outs.append(self.experts[e](got[at:at + n]))
                at += n
        y = torch.cat(outs) if outs else got
        back = _AllToAll.apply(y, send, recv.sum(1).tolist(), self.group)       # step 4
        return back[torch.argsort(order)]


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single along dim 0 with uneven splits; backward: the same exchange
    of the gradients, the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        import torch.distributed as dist
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _remote_detached(tokens: torch.Tensor, send: list, rank: int) -> torch.Tensor:
    """The tokens bound for other ranks cut from the graph (Automodel #1260's missing
    reduce-scatter); those kept on this rank keep their gradient."""
    parts, at = [], 0
    for r, n in enumerate(send):
        piece = tokens[at:at + n]
        parts.append(piece if r == rank else piece.detach())
        at += n
    return torch.cat(parts)
