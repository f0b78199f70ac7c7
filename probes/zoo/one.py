"""A zoo worker: rows of the map measured in this process.

  python -m trainprobes.zoo.one MODEL_TYPE    one row, printed as one JSON line
  python -m trainprobes.zoo.one --serve       model types read from stdin, one a line; a JSON
                                              row written back for each, on the original
                                              stdout (whatever the libraries print goes to
                                              stderr)

A row is {"model_type", "cells", "seconds", "peak_rss_mb"}: peak_rss_mb is this row's own peak
resident set (the kernel's high-water mark, reset before each row). The sweep keeps a few
workers alive across rows (python, torch and transformers are imported once: about 9 s a
process here) and restarts one that hangs or dies, so a bad model costs its row only.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

__all__ = ["measure", "main"]


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_mb(reset_ok: bool) -> float:
    if reset_ok:
        try:
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
        except OSError:
            pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # the process's


def measure(model_type: str, seed: int = 0) -> dict:
    from trainprobes.zoo.cells import row
    ok = _reset_peak()
    t = time.perf_counter()
    cells = [c.to_dict() for c in row(model_type, seed=seed)]
    for c in cells:   # JSON holds no NaN: the number goes, the reason says what it was
        if isinstance(c["number"], float) and c["number"] != c["number"] or c["number"] in (
                float("inf"), float("-inf")):
            c["reason"] += f" (number {c['number']})"
            c["number"] = None
    return {"model_type": model_type, "cells": cells, "seconds": round(time.perf_counter() - t, 2),
            "peak_rss_mb": _peak_mb(ok), "peak_is_row": ok}


def _quiet() -> None:
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(1)  # the sweep runs one worker per core
    import transformers
    transformers.logging.set_verbosity_error()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = os.fdopen(os.dup(1), "w")   # rows only; the libraries' prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _quiet()
    if argv and argv[0] == "--serve":
        if "--parent" in argv:   # dies with the sweep, even when the sweep is SIGKILLed
            from trainprobes.lifetime import die_with
            die_with(int(argv[argv.index("--parent") + 1]), 24 * 3600.0, group=False)
        out.write(json.dumps({"ready": True}) + "\n")
        out.flush()
        for line in sys.stdin:
            mt = line.strip()
            if mt:
                out.write(json.dumps(measure(mt), allow_nan=False, default=str) + "\n")
                out.flush()
        return 0
    out.write(json.dumps(measure(argv[0]), allow_nan=False, default=str) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
