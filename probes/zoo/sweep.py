"""The sweep: every model type's row, one process per model (a timeout ends a hang, a
crash costs one row), `workers` at once, finished rows appended to a JSONL file and skipped
when the sweep runs again (resumable), a progress line per row. `to_map` folds the rows into
the map saved as JSON (versions, rows, time and peak memory)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

__all__ = ["sweep", "to_map", "versions", "load_rows"]


def versions() -> dict:
    import torch
    import transformers
    from trainprobes._version import __version__
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "trainprobes": __version__, "python": sys.version.split()[0]}


def load_rows(jsonl: Path) -> dict:
    rows = {}
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows[r["model_type"]] = r
    return rows


def _run_one(mt: str, timeout: float, memory_mb: int) -> dict:
    t = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        p = subprocess.run([sys.executable, "-m", "trainprobes.zoo.one", mt], capture_output=True,
                           text=True, timeout=timeout, env=env,
                           preexec_fn=_limit(memory_mb) if memory_mb else None)
    except subprocess.TimeoutExpired:  # run() kills the child on timeout
        return _failed(mt, f"timeout: no row after {timeout:g} s (the process was killed)", t)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        last = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:200]
        return _failed(mt, f"process exited {p.returncode}: {last}", t)
    return json.loads(lines[-1])


def _limit(memory_mb: int):
    def apply():  # bounded memory: the child's address space, so a runaway model dies alone
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    return apply


def _failed(mt, reason, t) -> dict:
    return {"model_type": mt, "seconds": round(time.perf_counter() - t, 2), "peak_rss_mb": None,
            "cells": [{"model_type": mt, "probe": "build", "variant": "", "verdict": "error",
                       "number": None, "what": "", "reason": reason, "expected": None,
                       "finding": False, "seconds": 0.0}]}


def sweep(model_types, jsonl: Path, *, workers: int = 2, timeout: float = 300.0,
          memory_mb: int = 6144, progress=print) -> dict:
    """Rows of model_types not yet in jsonl, appended to it as they finish; returns every
    row in jsonl (old and new) by model type."""
    jsonl = Path(jsonl)
    done = load_rows(jsonl)
    todo = [m for m in model_types if m not in done]
    if progress:
        progress(f"zoo: {len(done)} rows already in {jsonl}, {len(todo)} to run on {workers} processes")
    start, n = time.perf_counter(), 0
    with ThreadPoolExecutor(workers) as pool, jsonl.open("a") as out:
        futures = [pool.submit(_run_one, m, timeout, memory_mb) for m in todo]
        for f in as_completed(futures):  # as each finishes: a slow row holds up no line
            r = f.result()
            out.write(json.dumps(r, allow_nan=False) + "\n")
            out.flush()
            done[r["model_type"]] = r
            n += 1
            if progress:
                el = time.perf_counter() - start
                findings = sum(c["finding"] for c in r["cells"])
                progress(f"[{n}/{len(todo)}] {r['model_type']}: {len(r['cells'])} cells, "
                         f"{findings} findings, {r['seconds']:.1f} s; elapsed {el:.0f} s, "
                         f"about {el / n * (len(todo) - n):.0f} s left")
    return done


def to_map(rows: dict, *, wall_seconds: float | None = None) -> dict:
    peak = [r["peak_rss_mb"] for r in rows.values() if r.get("peak_rss_mb")]
    return {"schema": 1, "versions": versions(), "n_model_types": len(rows),
            "wall_seconds": wall_seconds, "sum_row_seconds": round(sum(r["seconds"] for r in rows.values()), 1),
            "peak_rss_mb": max(peak) if peak else None,
            "rows": {m: rows[m]["cells"] for m in sorted(rows)}}
