"""The sweep: every model type's row, measured by `workers` long-lived worker processes (torch
and transformers imported once per worker, not once per model: about 9 s of a row here), each
row bounded by a timeout (a hang kills its worker, which is replaced) and the worker's address
space (a runaway model dies alone); finished rows appended to a JSONL file and skipped when the
sweep runs again (resumable), except a row that timed out, which is measured once more (at the
end of the same run, or by the next run), a progress line per row, every worker's stderr in one
log beside the JSONL. `to_map` folds the rows into the map saved as JSON (versions, rows, time and peak
memory)."""
from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["sweep", "to_map", "versions", "load_rows", "estimate", "row_bytes", "timed_out", "TRIES"]


def versions() -> dict:
    import torch
    import transformers
    from trainprobes._version import __version__
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "trainprobes": __version__, "python": sys.version.split()[0]}


def _row_versions() -> dict:
    """The libraries a row's verdicts depend on (the map's versions less the harness's own)."""
    v = versions()
    return {"transformers": v["transformers"], "torch": v["torch"]}


def load_rows(jsonl: Path) -> dict:
    """The finished rows of jsonl by model type. Each row is one line ended by a newline
    when complete: an unterminated last line is a row cut short (the sweep killed while
    writing it) and is not a row; any other line that is not a row is a DataFileError."""
    from trainprobes.errors import DataFileError
    rows = {}
    if jsonl.exists():
        text = jsonl.read_text()
        lines = text.split("\n")[:-1]   # the part after the last newline is unfinished
        for i, line in enumerate(lines, 1):
            if line.strip():
                try:
                    r = json.loads(line)
                    rows[r["model_type"]] = r
                except (ValueError, KeyError, TypeError) as e:
                    raise DataFileError(f"{jsonl}:{i}: not a zoo row ({type(e).__name__}: {e}); "
                                        f"remove the line to measure that row again") from None
    return rows


def _drop_unfinished(jsonl: Path) -> str | None:
    """Cut an unterminated last line (a row the sweep was killed while writing) so the rows
    appended next start on a line of their own; returns what was cut, or None."""
    if not jsonl.exists():
        return None
    data = jsonl.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep == len(data):
        return None
    with jsonl.open("r+b") as f:
        f.truncate(keep)
    return data[keep:keep + 60].decode(errors="replace")


# What one row needs beyond the interpreter with torch (budget.BASE_BYTES): transformers
# imported, activations and temporaries of 30-token rows (ROW_FIXED), and PER_PARAM bytes per
# parameter of the shrunk model (at most MAX_PARAMS): an fp32 model per attention
# implementation (4 B each), their shared fp64 twins (8 B each), the drift cell's bf16 copy, a
# deep copy at a time. Checked against every row's measured peak RSS (a worker's high-water
# mark, its imports included) of the map in docs/: the largest, kimi_linear's 1175 MiB
# (transformers' torch fallback of the chunked delta rule), is estimated at 1272 MiB, bert's
# 722 MiB at 1251 MiB (reports/zoo-benchmark.md). A worker is planned at the largest row it may take
# and hard-limited by its address space (memory_mb).
ROW_FIXED = 850 << 20
PER_PARAM = 32


def row_bytes(model_type: str) -> int:
    """Bytes one row of model_type needs beyond budget.BASE_BYTES, from its parameter count on
    the meta device (a type that cannot be counted cannot be built: its row is a build failure,
    ROW_FIXED), at most MAX_PARAMS (a larger one is refused on the meta device, never allocated)."""
    from trainprobes.zoo.shrink import MAX_PARAMS, count_params
    return ROW_FIXED + PER_PARAM * min(count_params(model_type) or 0, MAX_PARAMS)


def _worker_bytes() -> int:
    from trainprobes.budget import BASE_BYTES
    from trainprobes.zoo.shrink import MAX_PARAMS
    return BASE_BYTES + ROW_FIXED + PER_PARAM * MAX_PARAMS
READY_S = 120.0       # importing torch + transformers in a new worker, on a loaded machine
WORKER = [sys.executable, "-m", "trainprobes.zoo.one", "--serve"]


class _Dead(Exception):
    """The worker exited or broke its protocol; the message says how."""


class _Worker:
    """A long-lived `python -m trainprobes.zoo.one --serve` process: one row per request."""

    def __init__(self, memory_mb: int, log: Path, command: list | None = None):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.log = log
        self.rows = 0
        with open(log, "a") as err:
            self.p = subprocess.Popen(
                (command or WORKER) + ["--parent", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                preexec_fn=_limit(memory_mb) if memory_mb else None)
        self._read(READY_S)

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            raise _Dead(f"worker exited {self.p.returncode}: {self._tail()}")
        return json.loads(line)

    def _tail(self) -> str:
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        return (lines[-1] if lines else "nothing logged")[:200]

    def ask(self, model_type: str, timeout: float) -> dict:
        try:
            self.p.stdin.write(model_type + "\n")
            self.p.stdin.flush()
        except OSError as e:
            raise _Dead(f"worker gone ({type(e).__name__}): {self._tail()}") from None
        r = self._read(timeout)
        self.rows += 1
        return r

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def _limit(memory_mb: int):
    def apply():  # bounded memory: the worker's address space, so a runaway model dies alone
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    return apply


TIMEOUT = "timeout: "   # the reason of a row whose worker was killed for taking too long
TRIES = 2              # a row that times out is measured once more (a loaded machine), then kept


def _failed(mt, reason, t) -> dict:
    return {"model_type": mt, "seconds": round(time.perf_counter() - t, 2), "peak_rss_mb": None,
            "cells": [{"model_type": mt, "probe": "build", "variant": "", "verdict": "error",
                       "number": None, "what": "", "reason": reason, "expected": None,
                       "finding": False, "seconds": 0.0}]}


def timed_out(row: dict) -> bool:
    """Whether a stored row is a timeout (its worker killed), not a measurement."""
    cells = row.get("cells") or []
    return len(cells) == 1 and cells[0]["verdict"] == "error" and cells[0]["reason"].startswith(TIMEOUT)


def _slot(todo: queue.Queue, emit, *, timeout: float, memory_mb: int, recycle: int, log: Path,
          command: list | None, tries: dict) -> None:
    """One worker's share: rows until the queue is empty; a worker that hangs (timeout) or dies
    costs the row it held, and a new one takes the next; every `recycle` rows it is replaced so
    what a model leaves behind (caches, fragmentation) cannot grow without bound. A row that
    timed out goes back to the end of the queue until it has had TRIES tries (tries: model
    type -> tries so far, shared by the slots)."""
    w = None
    try:
        while True:
            try:
                mt = todo.get_nowait()
            except queue.Empty:
                return
            t = time.perf_counter()
            tries[mt] = tries.get(mt, 0) + 1
            again = False
            try:
                if w is None or w.rows >= recycle:
                    if w is not None:
                        w.close()
                    w = None
                    w = _Worker(memory_mb, log, command)
                r = w.ask(mt, timeout)
            except TimeoutError:
                again = tries[mt] < TRIES
                r = _failed(mt, f"{TIMEOUT}no row after {timeout:g} s (the worker was killed; try "
                                f"{tries[mt]} of {TRIES})", t)
                w.close() if w is not None else None
                w = None
            except _Dead as e:
                r = _failed(mt, str(e), t)
                w = None
            r["tries"] = tries[mt]
            emit(r, again)   # stored even when tried again: a sweep killed meanwhile keeps it
            if again:
                todo.put(mt)
    finally:
        if w is not None:
            w.close()


def estimate(workers: int, memory_mb: int) -> int:
    """Bytes the sweep plans to hold: each worker at the largest row it may take, never more
    than its hard limit."""
    per = min(_worker_bytes(), memory_mb << 20) if memory_mb else _worker_bytes()
    return workers * per


def sweep(model_types, jsonl: Path, *, workers: int = 2, timeout: float = 300.0,
          memory_mb: int = 4096, recycle: int = 40, progress=print, command: list | None = None) -> dict:
    """Rows of model_types not yet in jsonl, appended to it as they finish, by `workers`
    long-lived worker processes; returns every row in jsonl (old and new) by model type.
    Refuses (TooLarge, exit 2) a worker count whose planned memory the machine lacks.
    command: the worker's argv (default WORKER; a test gives a stub speaking the protocol:
    a {"ready": true} line, then one JSON row per model type read from stdin)."""
    from trainprobes.budget import check_fits
    from trainprobes.errors import InvalidArgument
    from trainprobes.validation import check_int, check_number
    check_int(workers, "workers", min=1, max=16)
    # settings under which no row can be measured are refused before anything starts (a
    # negative timeout raised in every worker thread and left an empty map, exit 0)
    check_number(timeout, "timeout", min=0.0, min_open=True, hint="seconds per model type, e.g. 300")
    check_int(recycle, "recycle", min=1, hint="rows a worker measures before it is replaced, e.g. 40")
    check_int(memory_mb, "memory_mb", min=0, hint="MiB of address space per worker (0: no limit), e.g. 4096")
    if memory_mb and memory_mb << 20 < _worker_bytes():
        raise InvalidArgument(f"memory_mb={memory_mb} MiB is below the {_worker_bytes() >> 20} MiB a worker is "
                              f"planned at (the interpreter with torch and the largest row): its workers would "
                              f"die on the rows; pass --memory-mb {_worker_bytes() >> 20} or more (0: no limit)")
    check_fits(estimate(workers, memory_mb), f"a zoo sweep on {workers} worker processes",
               fix="fewer --workers")
    jsonl = Path(jsonl)
    cut = _drop_unfinished(jsonl)
    if cut is not None and progress:
        progress(f"zoo: dropped an unfinished last row of {jsonl} ({cut!r}...): it is measured again")
    done = load_rows(jsonl)
    # a row measured under other libraries (a resume across an upgrade) is not this map's row:
    # measured again here, so every row of one map holds the versions the map names
    here = _row_versions()
    stale = [m for m, r in done.items() if r.get("versions") != here]
    for m in stale:
        del done[m]
    if stale and progress:
        progress(f"zoo: {len(stale)} rows of {jsonl} were measured under other versions than "
                 f"{here} (or name none): measured again")
    wanted = list(dict.fromkeys(model_types))
    # a row stored as a timeout is measured once more, until it has had TRIES tries
    retry = [m for m in wanted if m in done and timed_out(done[m]) and done[m].get("tries", 1) < TRIES]
    tries = {m: done[m].get("tries", 1) for m in retry}
    todo = [m for m in wanted if m not in done] + retry
    if progress:
        progress(f"zoo: {len(done)} rows already in {jsonl}, {len(todo)} to run on {workers} processes "
                 f"(worker log {jsonl.with_suffix('.log')})"
                 + (f"; {len(retry)} of them timed out before and are measured once more: {', '.join(retry)}"
                    if retry else ""))
    start, n, total = time.perf_counter(), 0, len(todo)
    lock = threading.Lock()
    q: queue.Queue = queue.Queue()
    for m in todo:
        q.put(m)
    with jsonl.open("a") as out:
        def emit(r, again: bool):
            nonlocal n, total
            with lock:
                r["versions"] = here
                out.write(json.dumps(r, allow_nan=False) + "\n")
                out.flush()
                done[r["model_type"]] = r
                n += 1
                total += again
                if progress:
                    el = time.perf_counter() - start
                    findings = sum(c["finding"] for c in r["cells"])
                    what = (f"timed out after {r['seconds']:.1f} s, measured once more at the end" if again
                            else f"{len(r['cells'])} cells, {findings} findings, {r['seconds']:.1f} s")
                    progress(f"[{n}/{total}] {r['model_type']}: {what}; elapsed {el:.0f} s, "
                             f"about {el / n * (total - n):.0f} s left")
        threads = [threading.Thread(target=_slot, args=(q, emit), daemon=True,
                                    kwargs=dict(timeout=timeout, memory_mb=memory_mb, recycle=recycle,
                                                log=jsonl.with_suffix(".log"), command=command, tries=tries))
                   for _ in range(min(workers, max(len(todo), 1)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return done


def to_map(rows: dict, *, wall_seconds: float | None = None) -> dict:
    peak = [r["peak_rss_mb"] for r in rows.values() if r.get("peak_rss_mb")]
    return {"schema": 1, "versions": versions(), "n_model_types": len(rows),
            "wall_seconds": wall_seconds, "sum_row_seconds": round(sum(r["seconds"] for r in rows.values()), 1),
            "peak_rss_mb": max(peak) if peak else None,
            "row_versions": {m: rows[m].get("versions") for m in sorted(rows)},
            "rows": {m: rows[m]["cells"] for m in sorted(rows)}}
