"""Start N local ranks on torch.distributed, collect what they return, leave nothing behind.

    launch(task, world, backend="gloo", timeout=120.0, args=()) -> [task's return, per rank]

`task(rank, world, *args)` must be a module-level function (spawned processes import it).
Each rank:
  1. starts in its own process group (os.setpgrp), so killing the group also kills anything
     the task started, with its stdout joined to stderr (the command's stdout may be a
     --json document; what a rank or a library prints is log);
  2. sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and joins the process
     group with the run's timeout (nccl: one GPU per rank, cuda:rank);
  3. runs the task and torch.save()s its return value to a private temp folder (tensors
     sent through a multiprocessing queue live in the sender's shared memory, which dies
     with it), then reports ("ok", rank) or ("error", rank, traceback) on a queue. A task
     returns plain data: tensors, numbers, strings, None, and lists/tuples/dicts of them;
     the launcher reads it back with torch.load(weights_only=True), which unpickles no
     objects (anything else is refused on the rank, naming the task).
The launcher waits until every rank reported or the deadline passed. A rank that raises,
dies without a word, or outlives the deadline stops the run: every rank's process group is
killed (SIGKILL), joined, and WorkerFailed / WorkerTimeout names the rank(s), with the
traceback. A free port is picked automatically, and picked again (up to `retries` times) if
the rendezvous finds it taken or fails before any task ran; an explicit port that is taken
is refused before any process starts.
"""
from __future__ import annotations

import errno
import os
import queue as queue_mod
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

from trainprobes.errors import InvalidArgument, InvalidType, TrainprobesError
from trainprobes.lifetime import die_with
from trainprobes.validation import check_choice, check_int, check_number

BACKENDS = ("gloo", "nccl")
_ADDR_IN_USE = ("address already in use", "eaddrinuse", "errno 98")


class LaunchError(TrainprobesError, RuntimeError):
    """A distributed run that did not complete; .pids: the rank processes (all stopped)."""

    pids: list = []


class WorkerFailed(LaunchError):
    """A rank raised (or died); .rank and .traceback say which and why."""

    port_taken = False  # some rank's error says the rendezvous port was in use
    rendezvous = False  # it failed while joining the process group, before the task ran

    def __init__(self, rank: int, tb: str, world: int):
        self.rank, self.traceback, self.world = rank, tb, world
        last = tb.strip().splitlines()[-1] if tb.strip() else "no traceback"
        super().__init__(f"rank {rank} of {world} failed: {last}\n--- rank {rank} traceback "
                         f"---\n{tb.rstrip()}\nall {world} ranks were stopped")


class WorkerTimeout(LaunchError):
    """Some ranks did not finish in time; .ranks lists them."""

    def __init__(self, ranks: list[int], timeout: float, world: int):
        self.ranks, self.timeout, self.world = ranks, timeout, world
        super().__init__(f"ranks {ranks} of {world} did not finish within timeout={timeout!r}s "
                         f"(a hang, or a run too large for the timeout: raise --timeout); all "
                         f"ranks were stopped")


class PortInUse(LaunchError):
    """The rendezvous port is taken."""


def torchrun_ranks(local_command: str) -> "tuple[int, int, int] | None":
    """(rank, world, local rank) from torchrun's environment; None, said on stderr with the
    command that launches local ranks instead, when a variable is missing."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        print(f"environment variables {missing} are not set: run under torchrun, or use "
              f"`{local_command}` to launch local ranks", file=sys.stderr)
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def free_port(addr: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to 0). Another process may take it before the
    rendezvous binds it: launch() retries with a new one when that happens."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def port_is_free(port: int, addr: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


class TooManyRanks(InvalidArgument):
    """More local ranks than this machine's cores or memory can hold."""


# A gloo rank forked from the torch-preloaded forkserver measured 36 MB PSS (160 MB RSS,
# most of it shared with the server) on torch 2.13 CPU; gloo's buffers and a task's tensors
# come on top, so plan on 100 MB.
RANK_BYTES = 100 * 2**20


def local_rank_cap(max_local_ranks: int | None = None) -> tuple[int, str]:
    """(the most local ranks this machine runs, why): 4 per core, at least 8 (gloo ranks
    mostly wait on each other, so a few per core is fine; hundreds only thrash), and what
    80% of the available memory holds at RANK_BYTES each. max_local_ranks replaces the core
    cap, never the memory one."""
    from trainprobes.budget import SHARE, available_bytes, human
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    by_cores = max(8, 4 * cores) if max_local_ranks is None else max_local_ranks
    have = available_bytes()
    by_memory = max(1, int(SHARE * have // RANK_BYTES))
    if by_memory < by_cores:
        return by_memory, (f"{human(have)} available memory holds {by_memory} ranks at "
                           f"~{human(RANK_BYTES)} each")
    why = (f"{cores} core(s) x 4, at least 8" if max_local_ranks is None
           else f"max_local_ranks={max_local_ranks}")
    return by_cores, why


def _check_launch(world, backend, timeout, port, addr, max_local_ranks=None) -> None:
    check_int(world, "world", min=1, hint="the number of ranks")
    if max_local_ranks is not None:
        check_int(max_local_ranks, "max_local_ranks", min=1)
    cap, why = local_rank_cap(max_local_ranks)
    if world > cap:
        raise TooManyRanks(f"world={world!r} local ranks is more than this machine runs ({cap}: "
                           f"{why}); run more ranks across machines under torchrun (python -m "
                           f"trainprobes.distributed.worker), or use the emulated backend, "
                           f"which models thousands of ranks in one process")
    check_choice(backend, "backend", BACKENDS)
    check_number(timeout, "timeout", min=0, min_open=True, hint="seconds")
    if port is not None:
        check_int(port, "port", min=1, max=65535, hint="or None to pick a free one")
    if backend == "nccl":
        import torch
        if not torch.cuda.is_available():
            raise InvalidArgument("backend='nccl' needs CUDA, and torch.cuda.is_available() is "
                                  "False here; use backend='gloo' (CPU)")
        if torch.cuda.device_count() < world:
            raise InvalidArgument(f"world={world!r} with backend='nccl' needs one GPU per rank; "
                                  f"{torch.cuda.device_count()} visible")
    if port is not None and not port_is_free(port, addr):
        raise PortInUse(f"port={port!r} on {addr} is already in use; pass port=None to pick "
                        f"a free one")


def _rank_main(task, rank, world, backend, addr, port, timeout, args, outdir, q,
               launcher_pid=None):
    """Body of one spawned rank (module docstring, steps 1-3)."""
    try:
        os.setpgrp()
    except OSError:
        pass
    if launcher_pid is not None:
        die_with(launcher_pid, timeout + 30.0)  # its own group: itself and its children
    # stdout is the command's (a --json document): whatever a rank prints there, Python or C
    # (a library's logging, a print in the user's step), goes to stderr, the log
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        import torch
        import torch.distributed as dist
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR=addr, MASTER_PORT=str(port))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        status = "rendezvous"  # until the group is up: the task has not run, retrying is safe
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        status = "error"
        try:
            out = task(rank, world, *args)
            _check_plain(out, f"{getattr(task, '__name__', task)}() on rank {rank} returned")
            torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        finally:
            dist.destroy_process_group()
        q.put(("ok", rank, ""))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        q.put((locals().get("status", "rendezvous"), rank, traceback.format_exc()))


_PLAIN = (int, float, bool, str, bytes, type(None))


def _check_plain(value, where: str) -> None:
    """value must be data torch.load(weights_only=True) reads back without unpickling objects:
    tensors, numbers, strings, None, and lists/tuples/dicts (string or int keys) of them."""
    import torch
    if isinstance(value, (torch.Tensor,) + _PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where} [{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise InvalidType(f"{where} a dict key {k!r} of type {type(k).__name__}; "
                                  "a task returns plain data (keys: str or int)")
            _check_plain(v, f"{where} [{k!r}]")
        return
    raise InvalidType(f"{where} a {type(value).__name__}; a task returns plain data (tensors, "
                      "numbers, strings, None, and lists/tuples/dicts of them) so the launcher "
                      "reads it back without unpickling objects")


def _kill(procs) -> None:
    """SIGKILL every rank's process group, then join; nothing survives."""
    for p in procs:
        if p.pid is None:
            continue
        if p.is_alive():
            for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), p.kill):
                try:
                    kill()
                except (ProcessLookupError, PermissionError, OSError):
                    pass
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)


def _context():
    """forkserver with torch preloaded: the server imports torch once (seconds), and each
    rank is a fork of it (milliseconds), never a fork of the caller with its threads and
    CUDA state. spawn where there is no forkserver (macOS, Windows)."""
    import multiprocessing

    import torch.multiprocessing as mp
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "trainprobes.distributed.worker"])
    return ctx


def _first_cause(procs, q, done, rank, tb, world) -> "WorkerFailed":
    """The failure to report when `rank` raised: a rank that died silently (segfault,
    os._exit) makes its peers raise in the collective, and often their traceback arrives
    first; the dead rank is the cause, so name it, with the peer's error as context."""
    reported, tracebacks = {rank}, [tb or ""]
    by_rank = {rank: tb or ""}
    time.sleep(0.2)  # a rank that died first has exited by now; peers' reports are queued
    while True:
        try:
            _, r, other = q.get_nowait()
        except queue_mod.Empty:
            break
        reported.add(r)
        tracebacks.append(other or "")
        by_rank.setdefault(r, other or "")
    # a deliberate error (trainprobes.errors: a setup that raised on one rank) is the cause;
    # its peers' crashes in the collective it left are the consequence, whichever came first
    deliberate = [r for r, t in sorted(by_rank.items())
                  if t.strip() and t.strip().splitlines()[-1].startswith("trainprobes.errors.")]
    if deliberate and rank not in deliberate:
        rank, tb = deliberate[0], by_rank[deliberate[0]]
    failed = None
    for r, p in enumerate(procs):
        if r not in done and r not in reported and not p.is_alive() and p.exitcode not in (0, None):
            last = tb.strip().splitlines()[-1] if tb and tb.strip() else ""
            failed = WorkerFailed(r, f"rank {r} exited with code {p.exitcode} without reporting; "
                                     f"rank {rank} then failed: {last}", world)
            break
    failed = failed or WorkerFailed(rank, tb, world)
    # a taken rendezvous port shows in the rank that binds it, which may report second
    # (its peers then fail to connect: "Connection closed by peer")
    failed.port_taken = any(m in t.lower() for t in tracebacks for m in _ADDR_IN_USE)
    return failed


def _run_once(task, world, backend, timeout, args, addr, port, progress):
    import torch
    ctx = _context()
    q = ctx.Queue()
    outdir = tempfile.mkdtemp(prefix="trainprobes-dist-")
    procs = []
    deadline = time.monotonic() + timeout  # start-up counts: a machine too busy to start
    try:                                    # the ranks in time is a timeout too
        for r in range(world):
            if time.monotonic() > deadline:
                raise WorkerTimeout(list(range(r, world)), timeout, world)
            p = ctx.Process(target=_rank_main, name=f"trainprobes-rank{r}",
                            args=(task, r, world, backend, addr, port, timeout, args, outdir, q,
                                  os.getpid()))
            p.start()
            procs.append(p)
        if progress:
            progress(f"started {world} {backend} ranks on {addr}:{port} (timeout {timeout}s)")
        done: set[int] = set()
        while len(done) < world:
            try:
                status, rank, tb = q.get(timeout=0.1)
            except queue_mod.Empty:
                for r, p in enumerate(procs):  # died without reporting (segfault, os._exit)
                    if r not in done and not p.is_alive():
                        try:  # its report may still be in the pipe
                            status, rank, tb = q.get(timeout=0.5)
                            break
                        except queue_mod.Empty:
                            raise WorkerFailed(r, f"rank {r} exited with code {p.exitcode} "
                                                  f"without reporting", world) from None
                else:
                    if time.monotonic() > deadline:
                        raise WorkerTimeout(sorted(set(range(world)) - done), timeout, world)
                    continue
            if status != "ok":
                failed = _first_cause(procs, q, done, rank, tb, world)
                failed.rendezvous = status == "rendezvous" and failed.rank == rank
                raise failed
            done.add(rank)
            if progress:
                progress(f"rank {rank} done ({len(done)}/{world})")
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=True)
                for r in range(world)]
    except LaunchError as e:
        e.pids = [p.pid for p in procs]  # so a caller (a test) can check none survived
        raise
    finally:
        _kill(procs)
        q.close()
        q.join_thread()
        shutil.rmtree(outdir, ignore_errors=True)


def launch(task, world: int, *, backend: str = "gloo", timeout: float = 120.0, args=(),
           port: int | None = None, addr: str = "127.0.0.1", retries: int = 3,
           progress=None, max_local_ranks: int | None = None) -> list:
    """Run task(rank, world, *args) on `world` local ranks; return the per-rank results.

    Raises WorkerFailed (a rank raised or died; also a task that returned more than plain
    data), WorkerTimeout (deadline passed), PortInUse (an explicit port is taken) or
    InvalidArgument (bad arguments, checked before any process starts), TooManyRanks (more
    ranks than local_rank_cap(max_local_ranks) allows). progress: optional callable(str) for
    human progress lines. Every rank dies with this process, even when it is SIGKILLed.
    """
    _check_launch(world, backend, timeout, port, addr, max_local_ranks)
    check_int(retries, "retries", min=1)
    if not callable(task) or getattr(task, "__name__", "<lambda>") == "<lambda>":
        raise InvalidArgument(f"task={task!r} must be a module-level function (spawned ranks "
                              f"import it by name)")
    for attempt in range(retries):
        chosen = port if port is not None else free_port(addr)
        try:
            return _run_once(task, world, backend, timeout, args, addr, chosen, progress)
        except WorkerFailed as e:
            # a port taken, or a rendezvous that failed before any task ran (a loaded host
            # drops gloo's pair connections: "Connection closed by peer"): a fresh port
            taken = e.port_taken or any(m in e.traceback.lower() for m in _ADDR_IN_USE)
            if taken and (port is not None or attempt == retries - 1):
                raise PortInUse(f"port {chosen} on {addr} was taken when the ranks tried to "
                                f"bind it ({retries if port is None else 1} attempt(s)); pass "
                                f"port=None or another free port") from e
            if not (taken or e.rendezvous) or port is not None or attempt == retries - 1:
                raise
            if progress:
                last = e.traceback.strip().splitlines()[-1] if e.traceback.strip() else ""
                progress(f"port {chosen} was taken; retrying with another" if taken else
                         f"rendezvous on port {chosen} failed ({last}); retrying with another")
    raise AssertionError("unreachable")
