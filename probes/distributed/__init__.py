"""Real collectives on torch.distributed (gloo on CPU, NCCL on GPU), predicted bit for bit.

    launch(task, world, backend="gloo", timeout=120.0)      local ranks, reaped on any fault
    run_collective(backend="gloo", world=4, dtype="bf16")  -> Result (real vs emulator, fp64)
    run_collectives([Case(...), ...], backend, world)      -> [Result], one set of ranks
    emulate_collective(world=4096, algorithm="ring")       -> Result, no processes
    reveal_order(backend="gloo", world=4, numel=...)       -> RevealedOrder from crafted inputs

See docs/distributed.md.
"""
from trainprobes.distributed.case import COLLECTIVES, OPS, Case
from trainprobes.distributed.launcher import (
                                         LaunchError,
                                         PortInUse,
                                         WorkerFailed,
                                         WorkerTimeout,
                                         free_port,
                                         launch,
)
from trainprobes.distributed.probe import (
                                         emulate_collective,
                                         result_from_outputs,
                                         run_collective,
                                         run_collectives,
)

__all__ = ["Case", "COLLECTIVES", "OPS", "LaunchError", "PortInUse", "WorkerFailed",
           "WorkerTimeout", "free_port", "launch", "emulate_collective", "result_from_outputs",
           "run_collective", "run_collectives"]
