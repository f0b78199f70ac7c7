"""Comm hooks with known verdicts, the controls of the sentinel's tests, benchmark and example.

rounding_bf16_hook      bf16_compress_hook's arithmetic (cast to bf16 rounding to nearest,
                        divide, all-reduce in bf16, cast back): a large but symmetric error at
                        a few ranks, noise. It is trainprobes.transforms' bf16_allreduce_hook:
                        DDP refuses torch's own by name on a CPU-only torch.
truncating_bf16_hook    the same data path, but each cast to bf16 truncates (rounds toward
                        zero): every element loses up to one bf16 ulp toward zero, a bias of
                        about -2^-9 relative on every reduction.
TruncatingReduceScatter, RoundingReduceScatter
                        the same two for FSDP2 (FSDPModule.set_custom_reduce_scatter): the
                        inputs and the result cast to bf16 (held in fp32), toward zero or to
                        nearest, the reduction itself in fp32.
"""
from __future__ import annotations

import torch
from trainprobes.transforms.data_parallel import bf16_allreduce_hook as rounding_bf16_hook

__all__ = ["rounding_bf16_hook", "truncating_bf16_hook", "truncate_to_bf16", "TruncatingReduceScatter",
           "RoundingReduceScatter"]


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the bf16 value toward zero, held in fp32 (the low 16 bits cleared)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    return (bits & -65536).view(torch.float32)


def truncating_bf16_hook(process_group, bucket):
    """DDP comm hook: bucket / world truncated to bf16, summed, the sum truncated to bf16."""
    import torch.distributed as dist
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wire = truncate_to_bf16(buffer / dist.get_world_size(group))
    fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

    def back(f):
        buffer.copy_(truncate_to_bf16(f.value()[0]))
        return buffer
    return fut.then(back)


def _reduce_scatter_comm(wire, back):
    """An FSDP2 ReduceScatter that sends wire(input) and writes back(result) to the output."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class Comm(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            import torch.distributed as dist
            out = torch.empty(output_tensor.shape, dtype=torch.float32, device=output_tensor.device)
            dist.reduce_scatter_single(out, wire(input_tensor), group=group, op=op)
            output_tensor.copy_(back(out))
    return Comm


class TruncatingReduceScatter(_reduce_scatter_comm(truncate_to_bf16, truncate_to_bf16)):
    """FSDP2 reduce-scatter: each input truncated to bf16, reduced in fp32, the result
    truncated to bf16: a bias of about -2^-9 relative, the FSDP2 twin of truncating_bf16_hook."""


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


class RoundingReduceScatter(_reduce_scatter_comm(_round_bf16, _round_bf16)):
    """FSDP2 reduce-scatter: the same data path rounding to nearest: a large symmetric error."""
