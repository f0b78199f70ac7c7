"""DDP through its own comm-hook API: the user's hook (or allreduce_hook) wrapped, a sampled
share of buckets checked against an fp64 re-reduction of the same inputs.

    attach_ddp(ddp_model, sentinel, hook=None, state=None)

For each bucket DDP hands the hook, on every rank in the same order:
  1. draws from the sentinel's own generator (seeded alike on every rank, so every rank
     makes the same choice): at a step's first bucket, is the step checked (share `sample`)
     and which `max_per_step` of its buckets; at every bucket, where its window of at most
     `window` elements starts;
  2. if sampled, the window of the rank's bucket input is copied to a new fp64 tensor (never
     a view of DDP's buffer) and all-reduced (sum) on the sentinel's own process group,
     asynchronously, before the user's hook touches the buffer;
  3. the user's hook runs on the bucket, untouched;
  4. when its future completes, the same window of its output is compared with the fp64
     sum / world (DDP's hooks return the mean), and the signed relative error goes to the
     bucket's stream and to the stream of all buckets together. The future DDP gets back carries the hook's own value object.
Anything of the sentinel's that raises in 2 or 4 is logged and counted, never raised into
the step; the user's hook's own errors reach DDP as they would without the sentinel.

The wrapper carries the user's hook's __name__ and __qualname__ (functools.wraps), so DDP
judges it as it would judge the hook: a hook DDP refuses by name (bf16_compress_hook on a
CPU-only torch) is refused with the sentinel too, and DDP's own logging data names the
user's hook. Which hook ran is read back from DDP (`_get_ddp_logging_data()["comm_hook"]`)
and from the wrapper's own count of calls, not from what the user configured.
"""
from __future__ import annotations

import functools
import time
from datetime import timedelta

import torch
from trainprobes.errors import InvalidArgument, InvalidType


def _window_copy(buffer: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """A new fp64 tensor holding buffer[start:start+n]: .to(float64) would return the buffer
    itself when it is already fp64, and the reduction below works in place."""
    return buffer.detach().reshape(-1)[start:start + n].to(torch.float64, copy=True)


def ddp_hook_name(ddp) -> str | None:
    """The comm hook DDP itself has registered (its logging data), None when none is."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception:  # an older torch without it: the wrapper's own record still says
        return None
    name = data.get("comm_hook") if isinstance(data, dict) else None
    return name or None


def attach_ddp(ddp, sentinel, hook=None, state=None):
    """Register `hook` (default: torch's allreduce_hook, the same arithmetic as DDP's
    built-in reduction) on `ddp`, wrapped by `sentinel`. Call it on every rank, once, where
    you would call ddp.register_comm_hook(state, hook). Returns the wrapper."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise InvalidType(f"ddp={type(ddp).__name__} must be a torch DistributedDataParallel "
                          "model (the sentinel attaches through DDP's register_comm_hook)")
    already = ddp_hook_name(ddp)
    if already is not None:
        raise InvalidArgument(f"ddp already has the comm hook {already!r} registered and DDP takes "
                              "only one: pass it as attach_ddp(ddp, sentinel, hook=..., state=...) "
                              "instead of registering it yourself")
    if hook is None:
        hook = default_hooks.allreduce_hook
    if not callable(hook):
        raise InvalidType(f"hook={hook!r} must be a DDP comm hook: a callable (state, bucket) -> Future")
    if sentinel._hook is not None:
        raise InvalidArgument("this sentinel is already attached to a DDP model; make one sentinel "
                              "per model")
    pg = ddp.process_group
    # the sentinel's collectives run on a group of their own, so they never take a slot in
    # the run's group's sequence of collectives
    group = dist.new_group(dist.get_process_group_ranks(pg))
    world = dist.get_world_size(pg)
    timeout = timedelta(seconds=sentinel.timeout)

    @functools.wraps(hook)
    def watched(state_, bucket):
        index = bucket.index()
        buffer = bucket.buffer()
        pending = None
        t0 = time.perf_counter()
        try:
            sentinel._hook_calls += 1
            window = sentinel._choose(buffer.numel())
            if window is not None:
                start, n = window
                ref = _window_copy(buffer, start, n)
                pending = (start, n, ref, dist.all_reduce(ref, group=group, async_op=True))
        except Exception as e:
            sentinel._own_error("sampling a bucket", e)
        sentinel._add_time(time.perf_counter() - t0)
        fut = hook(state_, bucket)
        if pending is None:
            return fut
        numel, step = buffer.numel(), sentinel.steps

        def check(f):
            value = f.value()
            t1 = time.perf_counter()
            try:
                start, n, ref, work = pending
                work.wait(timeout)
                out = value[0] if isinstance(value, (list, tuple)) else value
                low = _window_copy(out, start, n)
                sentinel._record(f"bucket{index}", numel, step, low, ref.div_(world))
            except Exception as e:
                sentinel._own_error("checking a bucket", e)
            sentinel._add_time(time.perf_counter() - t1)
            return value
        return fut.then(check)

    ddp.register_comm_hook(state, watched)
    sentinel._hook = hook
    sentinel._ddp = ddp
    return watched
