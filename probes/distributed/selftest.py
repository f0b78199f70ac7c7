"""Tasks that misbehave on purpose, to check that a launcher stops and reaps every rank.

Used by the tests, and handy on a new machine: `launch(raise_task, 2, args=(1,))` must
raise WorkerFailed naming rank 1 and leave no process behind.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from trainprobes.errors import TrainprobesError


class DeliberateFailure(TrainprobesError, RuntimeError):
    """What a self-test task raises on purpose, standing in for a rank's real error."""


def plain_task(rank: int, world: int) -> dict:
    """Plain data of every kind the launcher carries back: tensors, numbers, str, None."""
    import torch
    return {"rank": rank, "tensor": torch.full((3,), float(rank), dtype=torch.bfloat16),
            "nested": [None, 1.5, ("a", True)], 7: b"bytes"}


def object_task(rank: int, world: int):
    """Returns an object the launcher must refuse to carry (it would need unpickling)."""
    return {"rank": rank, "value": DeliberateFailure("not data")}


def echo_task(rank: int, world: int) -> dict:
    """Report who ran: rank, world, pid and the rendezvous environment."""
    return {"rank": rank, "world": world, "pid": os.getpid(),
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                   "MASTER_ADDR", "MASTER_PORT")}}


def print_task(rank: int, world: int) -> int:
    """Print to stdout as a library would, through Python and through the file descriptor."""
    print(f"rank {rank} says hello on stdout", flush=True)
    os.write(1, f"rank {rank} writes to fd 1\n".encode())
    return os.getpid()


def raise_task(rank: int, world: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise DeliberateFailure(f"deliberate failure on rank {rank}")
    time.sleep(60)  # the others wait, as ranks blocked in a collective would
    return rank


def exit_task(rank: int, world: int, bad_rank: int, code: int = 3) -> int:
    """Rank bad_rank dies without a word (like a segfault); the others hang."""
    if rank == bad_rank:
        os._exit(code)
    time.sleep(60)
    return rank


def exit_then_peers_raise_task(rank: int, world: int, bad_rank: int, code: int = 3) -> int:
    """Rank bad_rank dies without a word; the others notice and raise, as ranks whose peer
    vanished mid-collective do ("Connection closed by peer"): the dead rank is the cause."""
    if rank == bad_rank:
        os._exit(code)
    time.sleep(0.3)
    raise DeliberateFailure(f"rank {rank}: peer {bad_rank} closed the connection")


def hang_task(rank: int, world: int, pid_dir: str | None = None) -> int:
    """Every rank hangs; with pid_dir, each first starts a grandchild process (a `sleep`)
    and writes its pid there, so a test can check that the whole tree was killed."""
    if pid_dir is not None:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(pid_dir, f"grandchild{rank}"), "w") as f:
            f.write(str(child.pid))
    while True:
        time.sleep(1)


def gather_task(rank: int, world: int, collective: str) -> list | None:
    """One bf16 case of `collective`, gathered to rank 0 as the torchrun entry does (raw
    bytes, no pickling): rank 0 returns every rank's output (None where a rank has none)."""
    from trainprobes.distributed.case import Case
    from trainprobes.distributed.worker import _gather_to_root, run_collective
    case = Case(collective, "bf16", numel=6, root=0).check(world, "gloo")
    return _gather_to_root(run_collective(case, rank, world, "cpu"), case, rank, world, "cpu")
