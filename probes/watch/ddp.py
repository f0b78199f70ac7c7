"""DDP through its own comm-hook API: the user's hook (or allreduce_hook) wrapped, a sampled
share of buckets checked against an fp64 re-reduction of the same inputs.

    attach_ddp(ddp_model, sentinel, hook=None, state=None)

For each bucket DDP hands the hook, on every rank in the same order:
  1. draws from the sentinel's own generator (seeded alike on every rank, so every rank
     makes the same choice): at a step's first bucket, is the step checked (share `sample`)
     and which `max_per_step` of its buckets; at every bucket, where its window of at most
     `window` elements starts;
  2. if sampled, the window of the rank's bucket input is copied to a new fp64 tensor (never
     a view of DDP's buffer) with one more element, 0, and all-reduced (sum) on the
     sentinel's own process group (the same ranks as the group the hook reduces over),
     asynchronously, before the user's hook touches the buffer. A rank whose copy fails
     sends zeros and a 1 in that last element: every rank issues the same collectives
     whatever fails where, and every rank sees the 1 and leaves that sample out
     (counted as skipped, never judged). A rank that skipped its collective instead would
     pair its next one with another rank's current one: every later sample compared
     with the wrong reference;
  3. the user's hook runs on the bucket, untouched;
  4. when its future completes, the same window of its output is compared with the fp64
     sum / world (DDP's hooks return the mean), and the signed relative error goes to the
     bucket's stream and to the stream of all buckets together. The future DDP gets back carries the hook's own value object.
Anything of the sentinel's that raises in 2 or 4 is logged and counted, never raised into
the step; the user's hook's own errors reach DDP as they would without the sentinel.

At attach, on every rank: the group the hook reduces over is read from `state` (a
ProcessGroup, or an object with .process_group such as PowerSGDState; None means the
default group, as torch's hooks read it); the sentinel's group is made with the same ranks
(use_local_synchronization: ranks outside a subgroup take no part); then every rank's
sampling plan (Sentinel.plan and the hook's name) is gathered and compared, and a plan
that differs between ranks is refused on every rank, naming the field and the values.
A hook with error feedback (PowerSGDState with use_error_feedback, or error_feedback=True)
carries each step's compression error into the next step, so a per-step signed error is
not a compounding bias: nothing is sampled and the final Result says it cannot judge why.

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

from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.validation import check_bool
from trainprobes.watch.collective import check_plan, flagged, own_group, window_copy


def ddp_hook_name(ddp) -> str | None:
    """The comm hook DDP itself has registered (its logging data), None when none is."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception:  # an older torch without it: the wrapper's own record still says
        return None
    name = data.get("comm_hook") if isinstance(data, dict) else None
    return name or None


def hook_group(ddp, state):
    """The process group a DDP comm hook given `state` reduces over: state itself (torch's
    default hooks), state.process_group (PowerSGDState), the default group for None (as
    torch's hooks read it), else DDP's own group."""
    import torch.distributed as dist
    if isinstance(state, dist.ProcessGroup):
        return state
    group = getattr(state, "process_group", None)
    if isinstance(group, dist.ProcessGroup):
        return group
    return dist.group.WORLD if state is None else ddp.process_group


def error_feedback_of(hook, state, error_feedback) -> str | None:
    """Why the per-step bias test does not apply to `hook` (it has error feedback), or None."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    name = getattr(hook, "__qualname__", repr(hook))
    why = ("carries each step's compression error into the next step (error feedback), so "
           "a per-step signed error is not a compounding bias and the per-step bias test does "
           "not apply")
    if error_feedback is not None:
        check_bool(error_feedback, "error_feedback")
        return f"the hook {name} {why} (error_feedback=True)" if error_feedback else None
    if isinstance(state, PowerSGDState) and state.use_error_feedback:
        return f"the hook {name} {why} (PowerSGDState.use_error_feedback=True)"
    return None


def attach_ddp(ddp, sentinel, hook=None, state=None, error_feedback: bool | None = None):
    """Register `hook` (default: torch's allreduce_hook on DDP's own group, the same
    arithmetic as DDP's built-in reduction) on `ddp`, wrapped by `sentinel`. Call it on
    every rank of DDP's group, once, where you would call ddp.register_comm_hook(state,
    hook). error_feedback: None reads it from state (PowerSGDState.use_error_feedback);
    True says the hook carries its error to the next step (the per-step test then does not
    apply). Returns the wrapper."""
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
        if state is None:  # allreduce_hook would reduce over the default group, not DDP's
            state = ddp.process_group
    if not callable(hook):
        raise InvalidType(f"hook={hook!r} must be a DDP comm hook: a callable (state, bucket) -> Future")
    if sentinel._hook is not None or sentinel._fsdp is not None:
        raise InvalidArgument("this sentinel is already attached to a DDP model; make one sentinel "
                              "per model")
    reduce_over = hook_group(ddp, state)
    ranks = dist.get_process_group_ranks(reduce_over)
    ddp_ranks = dist.get_process_group_ranks(ddp.process_group)
    if sorted(ranks) != sorted(ddp_ranks):
        raise InvalidArgument(
            f"the hook reduces over ranks {ranks} (state={state!r}) but DDP runs on ranks "
            f"{ddp_ranks}: pass the DDP model's group as state, e.g. attach_ddp(ddp, sentinel, "
            "hook=..., state=ddp.process_group)")
    sentinel.not_applicable = error_feedback_of(hook, state, error_feedback)
    # the sentinel's collectives run on a group of their own, so they never take a slot in
    # the run's group's sequence of collectives; same ranks as the hook's group, and ranks
    # outside it (a subgroup) need not call this
    group = own_group(ranks)
    check_plan(sentinel, getattr(hook, "__qualname__", type(hook).__name__), group)
    world = dist.get_world_size(group)
    timeout = timedelta(seconds=sentinel.timeout)

    @functools.wraps(hook)
    def watched(state_, bucket):
        sentinel._hook_calls += 1
        if sentinel.not_applicable is not None:
            return hook(state_, bucket)
        index = bucket.index()
        buffer = bucket.buffer()
        window = pending = None
        t0 = time.perf_counter()
        try:
            window = sentinel._choose(buffer.numel())
        except Exception as e:
            sentinel._own_error("choosing a bucket", e)
        if window is not None:
            start, n = window
            ref = flagged(sentinel, "sampling a bucket", n, lambda: sentinel._take(buffer, start, n))
            try:
                pending = (start, n, ref, dist.all_reduce(ref, group=group, async_op=True))
            except Exception as e:
                sentinel._own_error("reducing a sample", e)
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
                if ref[n].item() != 0:  # some rank sent its flag (or the flag is NaN)
                    sentinel._record(f"bucket{index}", numel, step, None, None, skipped=True)
                else:
                    out = value[0] if isinstance(value, (list, tuple)) else value
                    low = window_copy(out, start, n)
                    sentinel._record(f"bucket{index}", numel, step, low, ref[:n].div_(world))
            except Exception as e:
                sentinel._own_error("checking a bucket", e)
            sentinel._add_time(time.perf_counter() - t1)
            return value
        return fut.then(check)

    ddp.register_comm_hook(state, watched)
    sentinel._hook = hook
    sentinel._ddp = ddp
    sentinel._group = group
    return watched
