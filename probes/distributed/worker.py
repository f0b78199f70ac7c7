"""What each rank runs: real torch.distributed collectives on seeded inputs.

Launched locally by trainprobes.distributed.launcher, or under torchrun:

    torchrun --nproc-per-node 4 -m trainprobes.distributed.worker --dtype bf16 --op sum --json

(reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; rank 0 gathers every
rank's result, compares it with the emulator and the fp64 reference, and prints the Result).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from trainprobes.distributed.case import COLLECTIVES, OPS, Case
from trainprobes.distributed.inputs import DATA, reveal_input, torch_dtype, wire_input
from trainprobes.distributed.launcher import torchrun_ranks
from trainprobes.distributed.predict import result_from_outputs
from trainprobes.validation import parse_choice, parse_int

__all__ = ["Case", "COLLECTIVES", "OPS", "run_collective", "cases_task", "reveal_task"]


def _reduce_op(op: str):
    import torch.distributed as dist
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN}[op]


def run_collective(case: Case, rank: int, world: int, device: str) -> torch.Tensor | None:
    """Run one real collective on this rank; return its output on the CPU (None where the
    collective leaves this rank nothing: reduce on a non-root rank)."""
    import torch.distributed as dist
    x = wire_input(case.data, rank, case.numel, case.seed, case.dtype).to(device)
    if case.collective == "all_reduce":
        dist.all_reduce(x, op=_reduce_op(case.op))
        out = x
    elif case.collective == "reduce_scatter":
        out = torch.empty(case.numel // world, dtype=x.dtype, device=device)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(out, x, op=_reduce_op(case.op))
    elif case.collective == "all_gather":
        out = torch.empty(case.numel * world, dtype=x.dtype, device=device)
        # torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to *_single
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x)
    else:
        dist.reduce(x, dst=case.root, op=_reduce_op(case.op))
        out = x if rank == case.root else None
    return None if out is None else out.cpu()


def _device(backend: str, rank: int) -> str:
    return f"cuda:{rank}" if backend == "nccl" else "cpu"


def cases_task(rank: int, world: int, cases: list, backend: str) -> list:
    """Launcher task: every case in order on this rank (one process group for all)."""
    return [run_collective(c, rank, world, _device(backend, rank)) for c in cases]


def reveal_task(rank: int, world: int, numel: int, dtype: str, collective: str, big: float,
                tiny: float, backend: str) -> torch.Tensor | None:
    """Launcher task for trainprobes.distributed.reveal: one real run per pair of ranks.

    Returns uint8[pairs, numel]: result / tiny per element (how many ranks were added after
    the pair met), or None on ranks the collective leaves nothing.
    """
    import torch.distributed as dist
    device = _device(backend, rank)
    rows = []
    for i in range(world):
        for j in range(i + 1, world):
            x = reveal_input(rank, numel, (i, j), dtype, big, tiny).to(device)
            if collective == "reduce":
                dist.reduce(x, dst=0)
            else:
                dist.all_reduce(x)
            rows.append((x.double().cpu() / tiny).round().clamp(0, 255).to(torch.uint8))
    if collective == "reduce" and rank != 0:
        return None
    return torch.stack(rows) if rows else torch.zeros(0, numel, dtype=torch.uint8)


def _gather_to_root(out: torch.Tensor | None, case: Case, rank: int, world: int,
                    device: str) -> list | None:
    """Every rank's output at rank 0 as tensors (torch.distributed.gather of raw bytes: no
    pickling, unlike gather_object), a has-output flag last. A rank without output
    (reduce off the root) sends zeros and a flag of 0. Returns the list on rank 0, None elsewhere."""
    import torch.distributed as dist
    shape = {"reduce_scatter": case.numel // world, "all_gather": case.numel * world}.get(
        case.collective, case.numel)
    dtype = torch_dtype(case.dtype)
    mine = out if out is not None else torch.zeros(shape, dtype=dtype)
    payload = torch.cat([mine.reshape(-1).contiguous().view(torch.uint8),  # flag last: the
                         torch.tensor([out is not None], dtype=torch.uint8)]).to(device)  # bytes stay aligned
    bufs = [torch.empty_like(payload) for _ in range(world)] if rank == 0 else None
    dist.gather(payload, bufs, dst=0)
    if rank != 0:
        return None
    return [b[:-1].cpu().view(dtype).clone() if bool(b[-1]) else None for b in bufs]


def _torchrun_main(argv=None) -> int:
    """Entry under torchrun: one case, results gathered to rank 0, which prints the Result."""
    import torch.distributed as dist
    p = argparse.ArgumentParser(prog="python -m trainprobes.distributed.worker",
                                description="one real collective under torchrun")
    p.add_argument("--backend", type=parse_choice("backend", ("gloo", "nccl")),
                   default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--collective", type=parse_choice("collective", COLLECTIVES),
                   default="all_reduce")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--op", type=parse_choice("op", OPS), default="sum")
    p.add_argument("--numel", type=parse_int("numel", min=1), default=4096)
    p.add_argument("--data", type=parse_choice("data", tuple(DATA)), default="normal")
    p.add_argument("--seed", type=parse_int("seed", min=0), default=0)
    p.add_argument("--root", type=parse_int("root", min=0), default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    ranks = torchrun_ranks("trainprobes collectives")
    if ranks is None:
        return 2
    rank, world, local = ranks
    case = Case(args.collective, args.dtype, args.op, args.numel, args.data, args.seed,
                args.root).check(world, args.backend)
    device = f"cuda:{local}" if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(args.backend)
    try:
        gathered = _gather_to_root(run_collective(case, rank, world, device), case, rank, world,
                                   device)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        res = result_from_outputs(case, gathered, backend=args.backend, world=world)
        print(json.dumps(res.to_dict(), indent=2) if args.json else res.summary_line())
        return 0 if res.passed else 1
    return 0


if __name__ == "__main__":
    from trainprobes.exits import guarded
    sys.exit(guarded("trainprobes.distributed.worker", _torchrun_main))
