"""In-run sentinels (docs/watch.md): sampled checks attached to a live training run through
each library's own extension point, changing no bit of it.

    Sentinel          the checks, their streams, looks and Results; .step() per step
    attach_ddp        DDP's register_comm_hook: the user's hook wrapped, buckets sampled
    attach_fsdp2      FSDP2's set_custom_reduce_scatter: the run's reduce-scatter wrapped,
                      reduce-scatters sampled
    SentinelCallback  transformers.TrainerCallback: attaches to the Trainer's DDP model,
                      steps the sentinel, sends its numbers to Trainer.log
    SentinelFinding   raised by step() on a finding when stop_on_finding=True (exit 1)
    watch_routers     MoE routers' decisions causality-checked on the run's micro-batches
    watch_updates     sampled weight updates and gradient accumulation against fp64
    watch_gemms       a sampled Linear call's wgrad (fprop, dgrad) under an FP8 recipe and
                      an accumulator preset, on the run's own operands
    watch_packing     packed-document isolation on the run's own batches, once per packing
                      convention (a forward pre-hook; checks at sentinel.step())
    SentinelLightning lightning Callback: the same as SentinelCallback for a Lightning run
"""
from trainprobes.watch.ddp import attach_ddp
from trainprobes.watch.fsdp import attach_fsdp2
from trainprobes.watch.gemm import watch_gemms
from trainprobes.watch.packing_watch import watch_packing
from trainprobes.watch.router import watch_routers
from trainprobes.watch.sentinel import Sentinel, SentinelFinding
from trainprobes.watch.updates import watch_updates

__all__ = ["Sentinel", "SentinelFinding", "attach_ddp", "attach_fsdp2", "SentinelCallback",
           "SentinelLightning", "watch_gemms", "watch_packing", "watch_routers", "watch_updates"]


def __getattr__(name):
    if name == "SentinelCallback":  # transformers is an optional dependency
        from trainprobes.watch.trainer import SentinelCallback
        return SentinelCallback
    if name == "SentinelLightning":  # so is lightning
        from trainprobes.watch.lightning import SentinelLightning
        return SentinelLightning
    raise AttributeError(f"module 'trainprobes.watch' has no attribute {name!r}")
