"""What every watcher of a gradient reduction needs, whichever library reduces (attach_ddp,
attach_fsdp2): the sentinel's own process group, the sampling plan compared across ranks,
and the fp64 sample with its 'taken' flag.

Why a flag rather than a skipped collective: every rank must issue the same fp64
reductions whatever fails where. A rank that skipped one would pair its next reduction
with another rank's current one, and every later sample would be compared with the wrong
reference. A rank that cannot take its sample sends zeros and a 1 in the last element;
every rank sees the sum of flags and leaves that sample out (counted as skipped).
"""
from __future__ import annotations

import struct
import zlib

import torch
from trainprobes.errors import InvalidArgument


def window_copy(buffer: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """A new fp64 tensor holding buffer[start:start+n]: .to(float64) would return the buffer
    itself when it is already fp64, and the reduction works in place."""
    return buffer.detach().reshape(-1)[start:start + n].to(torch.float64, copy=True)


def flagged(sentinel, where: str, n: int, take, device=None) -> torch.Tensor:
    """take(): a new fp64 tensor of n + 1 elements, the sample then 0 (Sentinel._take). If
    it raises, the error is the sentinel's own (counted, never raised) and the tensor is
    zeros (on `device`) with a 1 last: this rank could not, so every rank leaves the
    sample out."""
    try:
        return take()
    except Exception as e:
        sentinel._own_error(where, e)
        out = torch.zeros(n + 1, dtype=torch.float64, device=device)
        out[n] = 1.0
        return out


def own_group(ranks: list):
    """The sentinel's process group, with the same ranks as the group the run reduces over:
    its collectives never take a slot in the run's sequence of collectives, and ranks
    outside a subgroup take no part (use_local_synchronization)."""
    import torch.distributed as dist
    return dist.new_group(ranks, use_local_synchronization=True)


def check_plan(sentinel, reducer: str, group) -> None:
    """Gather every rank's sampling plan (Sentinel.plan and the name of the reduction it
    wraps) on `group`; refuse, on every rank alike, a plan that differs (the ranks would
    draw different samples and pair wrong reductions)."""
    import torch.distributed as dist
    plan = {**sentinel.plan(), "hook": reducer}
    # exact in int64: each field as its 64 bits (floats by their bits, strings by crc32)
    raw = []
    for v in plan.values():
        if isinstance(v, str):
            v = zlib.crc32(v.encode())
        if isinstance(v, float):
            raw.append(struct.unpack("<q", struct.pack("<d", v))[0])
        else:
            raw.append(int(v) - (1 << 64) if int(v) >= 1 << 63 else int(v))
    mine = torch.tensor(raw, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    for i, k in enumerate(plan):
        seen = [int(t[i]) for t in every]
        if len(set(seen)) > 1:
            ranks = dist.get_process_group_ranks(group)
            raise InvalidArgument(
                f"the sentinel's {k} differs between ranks ({k}={plan[k]!r} here, on rank "
                f"{dist.get_rank()}; the {len(set(seen))} distinct values are held by ranks "
                f"{[ranks[j] for j in range(len(seen)) if seen[j] != seen[0]]} against "
                f"{[ranks[j] for j in range(len(seen)) if seen[j] == seen[0]]}): build the "
                "Sentinel with the same arguments and attach the same hook on every rank")
