"""What each rank runs: real torch.distributed collectives on seeded inputs.

Launched locally by trainprobes.distributed.launcher, or under torchrun:

    torchrun --nproc-per-node 4 -m trainprobes.distributed.worker --dtype bf16 --op sum --json

(reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; rank 0 gathers every
rank's result, compares it with the emulator and the fp64 reference, and prints the Result).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import torch
from trainprobes.distributed.inputs import DATA, DTYPES, reveal_input, torch_dtype, wire_input

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "reduce")
OPS = ("sum", "avg", "max", "min")
_REDUCING = ("all_reduce", "reduce_scatter", "reduce")


@dataclass(frozen=True)
class Case:
    """One collective call: what to run, on which data. Validated before any process starts."""

    collective: str = "all_reduce"
    dtype: str = "fp32"
    op: str = "sum"
    numel: int = 4096
    data: str = "normal"
    seed: int = 0
    root: int = 0

    def check(self, world: int, backend: str) -> "Case":
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world={world!r} must be an int >= 1 (the number of ranks)")
        if self.collective not in COLLECTIVES:
            raise ValueError(f"collective={self.collective!r} is unknown; expected one of "
                             f"{list(COLLECTIVES)}")
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r} is unknown; expected one of {list(OPS)}")
        if self.data not in DATA:
            raise ValueError(f"data={self.data!r} is unknown; expected one of {list(DATA)}")
        for name in ("numel", "seed", "root"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "numel" else 0):
                raise ValueError(f"{name}={v!r} must be an int >= {1 if name == 'numel' else 0}")
        if self.root >= world:
            raise ValueError(f"root={self.root!r} must be a rank in [0, {world})")
        if self.collective == "reduce_scatter" and self.numel % world:
            raise ValueError(f"numel={self.numel!r} with collective='reduce_scatter' must be "
                             f"divisible by world={world}, e.g. {world * max(1, self.numel // world)}")
        if backend == "gloo" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} with backend='gloo': gloo has no float8 "
                             f"reduction (gloo: 'Invalid scalar type'); use backend='emulated' "
                             f"or one of {list(DTYPES)}")
        if backend == "emulated":
            from trainprobes.reference.formats import get_format
            get_format(self.dtype)  # any format trainprobes.reference.formats knows
        else:
            torch_dtype(self.dtype)
        return self

    @property
    def label(self) -> str:
        return f"{self.collective}[{self.dtype},{self.op},n={self.numel},{self.data}]"


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


def _torchrun_main(argv=None) -> int:
    """Entry under torchrun: one case, results gathered to rank 0, which prints the Result."""
    import torch.distributed as dist
    p = argparse.ArgumentParser(prog="python -m trainprobes.distributed.worker",
                                description="one real collective under torchrun")
    p.add_argument("--backend", choices=("gloo", "nccl"),
                   default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--collective", choices=COLLECTIVES, default="all_reduce")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--op", choices=OPS, default="sum")
    p.add_argument("--numel", type=int, default=4096)
    p.add_argument("--data", choices=list(DATA), default="normal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        print(f"environment variables {missing} are not set: run under torchrun, or use "
              f"`trainprobes collectives` to launch local ranks", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    case = Case(args.collective, args.dtype, args.op, args.numel, args.data, args.seed,
                args.root).check(world, args.backend)
    if args.backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(args.backend)
    try:
        out = run_collective(case, rank, world, f"cuda:{local}" if args.backend == "nccl" else "cpu")
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        from trainprobes.distributed.probe import result_from_outputs
        res = result_from_outputs(case, gathered, backend=args.backend, world=world)
        print(json.dumps(res.to_dict(), indent=2) if args.json else res.summary_line())
        return 0 if res.passed else 1
    return 0


if __name__ == "__main__":
    sys.exit(_torchrun_main())
