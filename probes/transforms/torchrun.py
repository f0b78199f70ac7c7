"""One transform probe under torchrun, across as many nodes as the user trains on:

    torchrun --nproc-per-node 2 -m trainprobes.transforms.torchrun \\
        --target mypkg.train:step --transform "fsdp2:reduce_dtype=bf16" --json

Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; every rank runs the
transformed steps and computes the fp64 truth of the trials it judges; only statistics are all-reduced
(trainprobes.transforms.local), and rank 0 prints the Result. Each rank exits by the contract
(0 equivalent, 1 not, 2 bad usage or cannot judge, 3 internal error), but plain torchrun
exits 1 whenever a rank exits non-zero: `python -m trainprobes.transforms.launch [torchrun
options] -- [these options]` runs this entry under torch's launcher and exits with the
contract's code (trainprobes.transforms.launch).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist
from trainprobes.distributed.launcher import torchrun_ranks
from trainprobes.transforms.base import RankContext
from trainprobes.transforms.equivalence import Probe, finish, prepare
from trainprobes.transforms.local import run_case_local
from trainprobes.transforms.options import add_probe_options, add_step_options, user_steps
from trainprobes.transforms.registry import parse_transform
from trainprobes.transforms.worker import RankCase, device_of
from trainprobes.validation import parse_choice, parse_number


def main(argv=None) -> int:
    """Entry under torchrun: one probe; rank 0 computes the truth and prints the Result."""
    p = argparse.ArgumentParser(prog="python -m trainprobes.transforms.torchrun",
                                description="one transform probe under torchrun")
    p.add_argument("--target", required=True, metavar="PKG.MOD:STEP")
    p.add_argument("--transform", default=None, metavar="NAME[:OPTIONS]",
                   help="a built-in transform (default ddp), or give --step")
    add_step_options(p)
    p.add_argument("--backend", type=parse_choice("backend", ("gloo", "nccl")),
                   default="nccl" if torch.cuda.is_available() else "gloo")
    add_probe_options(p)
    p.add_argument("--timeout", type=parse_number("timeout", min=0, min_open=True), default=600.0,
                   help="seconds before this rank stops, exit 2 (default 600)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    ranks = torchrun_ranks("trainprobes transforms")
    if ranks is None:
        return 2
    rank, world, local = ranks
    bounded(rank, args.timeout)
    from trainprobes.errors import InvalidArgument
    from trainprobes.targets import search_cwd
    search_cwd()
    mine = user_steps(args)
    if len(mine) > 1 or (mine and args.transform):
        raise InvalidArgument("the torchrun entry runs one probe: give one --step or one --transform")
    transform = mine[0] if mine else parse_transform(args.transform or "ddp")
    probe = Probe(args.target, transform, trials=args.trials, seed=args.seed,
                  alpha=args.alpha, min_effect=args.min_effect, noise_tol=args.noise_tol)
    prep = prepare(probe, world, truth=False)  # every rank refuses bad inputs before any step
    ctx = RankContext(rank, world, device_of(args.backend, local), args.backend)
    if args.backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(args.backend)
    try:
        case = RankCase(probe.step, probe.transform, prep.seeds, (), True, probe.replica_tol)
        out = run_case_local(case, ctx, probe.replica_tol)
        # every rank done with gloo before any tears it down: a rank that destroyed its group
        # while its peer's last collective was in flight aborted at exit (SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    res = finish(prep, out, world=world, backend=args.backend)
    print(json.dumps(res.to_dict(), indent=2) if args.json else res.summary_line())
    return 0 if res.metrics.get("equivalent") is True else 1


def bounded(rank: int, timeout: float) -> None:
    """This rank dies with the agent that started it (torchrun does not take its ranks down
    when it is SIGKILLed: they hung on, orphaned, in a peer's collective) and stops after
    `timeout` seconds, exit 2 by the contract (a setup that never returns, a peer that never
    joins, a run too large for the timeout), its record written under the launcher."""
    import os
    import threading

    from trainprobes.lifetime import die_with
    from trainprobes.transforms.launch import finish_rank
    die_with(os.getppid(), math.inf, group=False)

    def expire():
        print(f"python -m trainprobes.transforms.torchrun: error: rank {rank} did not finish within "
              f"timeout={timeout:g}s (a hang, or a run too large for the timeout: raise --timeout); "
              f"stopped", file=sys.stderr, flush=True)
        os._exit(finish_rank(rank, 2))
    timer = threading.Timer(timeout, expire)
    timer.daemon = True  # a rank that finished exits without waiting for it
    timer.start()


def _stopped_quietly():
    """main(), where a SIGINT that trainprobes.transforms.launch's torchrun agent sends to
    stop the ranks ends this rank with 130 and no line of its own: the launcher says it
    once. Run by plain torchrun, the interrupt is reported as usual."""
    from trainprobes.transforms.launch import RECORD_DIR
    try:
        return main()
    except KeyboardInterrupt:
        if os.environ.get(RECORD_DIR):
            return 130
        raise


if __name__ == "__main__":
    from trainprobes.exits import guarded
    from trainprobes.transforms.launch import finish_rank
    code = finish_rank(int(os.environ.get("RANK", "0")), guarded("trainprobes.transforms.torchrun",
                                                                  _stopped_quietly))
    # The rank's work, output and record are done: leave without the interpreter's teardown,
    # where gloo's C++ threads were at times destroyed still joinable ("terminate called
    # without an active exception", SIGABRT: about 1 run in 18 on a loaded machine), which
    # the launcher could only read as a crash (exit 3) after a finished probe
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
