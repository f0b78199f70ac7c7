"""torchrun, keeping the exit-code contract: 0 pass, 1 a finding, 2 bad usage or cannot
judge, 3 an internal error.

    python -m trainprobes.transforms.launch --nproc-per-node 8 [torchrun options] -- \\
        --target mypkg.train:step --step mypkg.parallel --json

Plain torchrun folds every child's non-zero exit into its own 1 (torch.distributed.run
raises ChildFailedError; Python exits 1), so under it a bad usage (2) or a crash (3) reads
as a finding, and a finding on the node holding rank 0 makes the other nodes' agents wait
for a rendezvous that never closes. Here torch's own launcher runs
`-m trainprobes.transforms.torchrun` with two additions, per node:

  1. every rank writes its outcome (global rank, contract code) to a record in a folder
     this launcher made; a rank that finished its probe (pass or finding) exits 0, so the
     agents shut down as after any clean run;
  2. a rank that could not judge (2) or broke (3) exits RECORDED + code: torchrun tears
     the other ranks down, and this launcher reads the code back from the failures.

A SIGINT (Ctrl-C) or SIGTERM to this launcher: torchrun's agent stops the ranks, and this
launcher exits 130 (143) with one line, as any interrupted command does, not 3.

The node whose records hold rank 0 exits with rank 0's code; the others exit 0 when their
ranks finished. A refusal (2) is read from the failing rank's record as well as its exit
code: its peers may crash in the collective it left and be seen failing first; the node
where it happened says 2 (another node sees only its own ranks). What the contract cannot
read is 3: a child that exited outside it (a
signal, an uncaught error before the entry ran), or a clean run without every local
rank's record.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

from trainprobes.errors import InvalidArgument

RECORD_DIR = "TRAINPROBES_RANK_RECORDS"   # set by this launcher for the ranks it starts
RECORDED = 64                              # a failing rank exits RECORDED + its contract code

__all__ = ["main", "finish_rank", "node_code"]


def finish_rank(rank: int, code: int) -> int:
    """The exit code of a rank of the torchrun entry: its contract code as it is, or under
    this launcher its record written and 0 (a finished probe) / RECORDED + code."""
    folder = os.environ.get(RECORD_DIR)
    if not folder:
        return code
    with open(os.path.join(folder, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "code": code}, f)
    return 0 if code in (0, 1) else RECORDED + code


def node_code(records: list, failures: list | None, local_ranks: int) -> tuple:
    """(exit code, why) of this node from its ranks' records ({"rank", "code"}) and, when
    torchrun failed, the children's exit codes (module docstring)."""
    if failures is not None:
        # a rank records its code before it exits: a refusal's peer may crash in the
        # collective it left (connection reset) and be seen failing first
        mine = {c - RECORDED for c in failures if RECORDED < c <= RECORDED + 3}
        mine |= {int(r["code"]) for r in records}
        for code in (2, 3):  # a deliberate refusal names the cause; peers' crashes follow it
            if code in mine:
                return code, f"a rank exited {code}"
        return 3, f"ranks exited outside the contract (exit codes {sorted(set(failures))})"
    if len(records) < local_ranks:
        return 3, f"{local_ranks - len(records)} of {local_ranks} local rank(s) left no record"
    for r in records:
        if r["rank"] == 0:
            return int(r["code"]), "rank 0's verdict"
    return 0, "ranks finished"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise InvalidArgument("usage: python -m trainprobes.transforms.launch [torchrun options] -- "
                              "--target PKG.MOD:STEP [--step ... | --transform ...] [probe options]: "
                              "the torchrun options and the probe's are separated by --")
    cut = argv.index("--")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    args = get_args_parser().parse_args(argv[:cut] + ["--module", "trainprobes.transforms.torchrun",
                                                      *argv[cut + 1:]])
    with tempfile.TemporaryDirectory(prefix="trainprobes-ranks-") as folder:
        os.environ[RECORD_DIR] = folder
        failures, stopped = None, None
        try:
            run(args)
        except ChildFailedError as e:
            failures = [f.exitcode for f in e.failures.values()]
        except SignalException as e:
            # torchrun's agent turns SIGINT / SIGTERM into this once it has stopped its
            # ranks (SIGKILL after its shutdown timeout): an interrupt, not an internal error
            stopped = e.sigval
        finally:
            del os.environ[RECORD_DIR]
        records = []
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                records.append(json.load(f))
    if stopped == signal.SIGINT:
        raise KeyboardInterrupt  # trainprobes.exits.guarded: one line, exit 130
    if stopped is not None:
        print(f"trainprobes.transforms.launch: stopped by {signal.Signals(stopped).name}; torchrun "
              f"stopped the ranks", file=sys.stderr)
        return 128 + int(stopped)
    local = _local_ranks(args.nproc_per_node)
    code, why = node_code(records, failures, local)
    if code == 3:
        print(f"trainprobes.transforms.launch: exit 3 ({why}): see the ranks' errors above",
              file=sys.stderr)
    return code


def _local_ranks(nproc: str) -> int:
    """torchrun's --nproc-per-node as a count ("auto", "cpu", "gpu" resolve as it does)."""
    if nproc.isdigit():
        return int(nproc)
    import torch
    if nproc == "gpu" or (nproc == "auto" and torch.cuda.is_available()):
        return torch.cuda.device_count()
    return os.cpu_count() or 1


if __name__ == "__main__":
    from trainprobes.exits import guarded
    sys.exit(guarded("trainprobes.transforms.launch", main))
