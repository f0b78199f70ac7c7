"""Default-suite families in a second Python process, so an audit uses a second core: the
checks are Python-heavy, so threads would only take turns holding the GIL.

    python -m trainprobes.audit.worker --families collectives --seed 0 [--quick] [--threads 1]

prints {"results": [Result.to_dict(), ...], "timings": [...]} on stdout. Results travel as
JSON (exact round trip, nothing unpickled). The audit starts it through
trainprobes.audit.remote.worker_check, by module name, so the suite and this entry point
never import each other.
"""
from __future__ import annotations

import argparse
import json
import sys

from trainprobes.result import to_jsonable


def main(argv=None) -> int:
    from trainprobes.audit.run import run_suite
    from trainprobes.audit.suites import default_suite

    ap = argparse.ArgumentParser(prog="python -m trainprobes.audit.worker")
    ap.add_argument("--families", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parent", type=int, default=None,
                    help="the audit's pid: this worker dies with it (even by SIGKILL)")
    ap.add_argument("--deadline", type=float, default=3600.0, help="seconds before it gives up")
    args = ap.parse_args(argv)
    if args.parent is not None:
        from trainprobes.lifetime import die_with
        die_with(args.parent, args.deadline, group=False)  # ranks it launches watch it in turn
    import torch
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    checks, _ = default_suite(seed=args.seed, quick=args.quick,
                              families=args.families.split(","), in_process=True)
    results, timings = run_suite(checks)
    json.dump({"results": [r.to_dict() for r in results], "timings": to_jsonable(timings)},
              sys.stdout)
    return 0


if __name__ == "__main__":
    from trainprobes.exits import guarded
    sys.exit(guarded("trainprobes.audit.worker", main))
