"""Default-suite families in a second Python process, so an audit uses a second core: the
checks are Python-heavy, so threads would only take turns holding the GIL.

    python -m trainprobes.audit.worker --families collectives --seed 0 [--quick] [--threads 1]

prints {"results": [Result.to_dict(), ...], "timings": [...]} on stdout. Results travel as
JSON (exact round trip, nothing unpickled). The audit starts it through worker_check(), a
background Check; a worker that dies or prints something else is an error Result (TP-E1)
naming the family, never a silent gap in the report.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from trainprobes.audit.run import Check
from trainprobes.result import Result, to_jsonable

TIMEOUT_S = 600.0


def worker_check(family: str, name: str, *, seed: int, quick: bool, control: bool) -> Check:
    """A background Check that runs the default-suite `family` in a worker process."""
    def run():
        import torch
        cmd = [sys.executable, "-m", "trainprobes.audit.worker", "--families", family,
               "--seed", str(seed), "--threads", str(torch.get_num_threads())]
        proc = subprocess.run(cmd + (["--quick"] if quick else []), capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        try:
            doc = json.loads(proc.stdout)
            return [Result.from_dict(d) for d in doc["results"]]
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"the worker process for {family!r} exited {proc.returncode} "
                               f"without its Results ({e}); its stderr ends: "
                               f"{proc.stderr.strip()[-1500:]}") from None
    return Check(family, name, run, control=control, background=True)


def main(argv=None) -> int:
    from trainprobes.audit.run import run_suite
    from trainprobes.audit.suites import default_suite

    ap = argparse.ArgumentParser(prog="python -m trainprobes.audit.worker")
    ap.add_argument("--families", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
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
    sys.exit(main())
