"""The parent side of trainprobes.audit.worker: a background Check that runs a default-suite
family in a second Python process (`python -m trainprobes.audit.worker`), so an audit uses a
second core. A worker that dies or prints something else is an error Result (TP-E1) naming
the family, never a silent gap in the report.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from trainprobes.audit.run import Check
from trainprobes.result import Result

TIMEOUT_S = 600.0


def worker_check(family: str, name: str, *, seed: int, quick: bool, control: bool) -> Check:
    """A background Check that runs the default-suite `family` in a worker process."""
    def run():
        import torch
        cmd = [sys.executable, "-m", "trainprobes.audit.worker", "--families", family,
               "--seed", str(seed), "--threads", str(torch.get_num_threads()),
               "--parent", str(os.getpid()), "--deadline", str(TIMEOUT_S + 30)]
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


