"""Comm hooks with known verdicts, the controls of the sentinel's tests, benchmark and example.

rounding_bf16_hook      bf16_compress_hook's arithmetic (cast to bf16 rounding to nearest,
                        divide, all-reduce in bf16, cast back): a large but symmetric error at
                        a few ranks, noise. It is trainprobes.transforms' bf16_allreduce_hook:
                        DDP refuses torch's own by name on a CPU-only torch.
truncating_bf16_hook    the same data path, but each cast to bf16 truncates (rounds toward
                        zero): every element loses up to one bf16 ulp toward zero, a bias of
                        about -2^-9 relative on every reduction.
"""
from __future__ import annotations

import torch
from trainprobes.transforms.data_parallel import bf16_allreduce_hook as rounding_bf16_hook

__all__ = ["rounding_bf16_hook", "truncating_bf16_hook", "truncate_to_bf16"]


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
