"""Context parallelism: each rank of the group holds one span of every sequence, and
attention gathers the keys and values of the whole sequence.

    with AllGatherAttention(rank, world):       # F.scaled_dot_product_attention, CP-aware
        out = model(span(batch, rank, world)["input"])

1. span(): the rank's contiguous span of positions of every tensor with a sequence axis
   (axis `seq_dim`, of the batch's sequence length); scalars and per-sample tensors whole.
2. AllGatherAttention: a TorchFunctionMode (so it sees the call however the model imported
   it) that runs torch.nn.functional.scaled_dot_product_attention on this rank's queries
   against the keys and values of every rank, all-gathered along the sequence with
   autograd (its backward sums each rank's key/value gradients back to their owner),
   masked causally by global position: query i
   of rank r sits at r * span + i. This is the all-gather variant of context parallelism
   (Megatron-LM's cp_comm_type "all_gather", torchtitan's "allgather" rotation): the same
   function as ring attention, without the ring's overlap.
Only causal or unmasked attention is taken (is_causal=True, or no mask at all); an
explicit attn_mask or dropout is refused (their positions are the model's, not the span's).

torch's own torch.distributed.tensor.experimental.context_parallel stops on a CPU: in torch
2.13 `aten._scaled_dot_product_flash_attention_for_cpu` has no sharding strategy
(NotImplementedError at the first attention), and it cannot shard buffers that require
grad. No verdicts here.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["span", "sequence_length", "AllGatherAttention"]


def sequence_length(batch: dict, key: str, seq_dim: int = 1) -> int:
    return int(batch[key].shape[seq_dim])


def span(batch: dict, rank: int, world: int, length: int, seq_dim: int = 1) -> dict:
    """Step 1: this rank's span of `length // world` positions of every tensor whose axis
    `seq_dim` has `length` entries."""
    if length % world:
        raise ValueError(f"a sequence of {length} positions does not split into {world} equal spans")
    n = length // world

    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() > seq_dim and v.shape[seq_dim] == length:
            return v.narrow(seq_dim, rank * n, n)
        return v
    return {k: cut(v) for k, v in batch.items()}


class AllGatherAttention(TorchFunctionMode):
    """Step 2 of the module docstring, for the ranks of `group` (None: the world)."""

    def __init__(self, rank: int, world: int, group=None):
        super().__init__()
        self.rank, self.world, self.group = rank, world, group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = dict(zip(names, args), **kwargs)
        if call.get("attn_mask") is not None or call.get("dropout_p", 0.0):
            raise ValueError("context parallelism takes causal or unmasked attention: an explicit "
                             "attn_mask or dropout_p > 0 cannot be cut into spans")
        q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
        causal = bool(call.pop("is_causal", False))
        call.pop("attn_mask", None)
        k, v = (self._gather(t) for t in (k, v))
        mask = None
        if causal:
            n = q.shape[-2]
            rows = self.rank * n + torch.arange(n, device=q.device)
            mask = torch.arange(k.shape[-2], device=q.device)[None, :] <= rows[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False,
                                                                **call)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return _GatherSequence.apply(t, self.rank, self.world, self.group)


class _GatherSequence(torch.autograd.Function):
    """Every rank's span along dim -2, joined (forward: all_gather); backward: the whole
    gradient summed over ranks (all_reduce), this rank's span of it (a reduce-scatter
    spelled with public collectives)."""

    @staticmethod
    def forward(ctx, t, rank, world, group):
        import torch.distributed as dist
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        ctx.span, ctx.group = (rank * t.shape[-2], t.shape[-2]), group
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(-2, *ctx.span), None, None, None
