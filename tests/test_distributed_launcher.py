"""probes/distributed/launcher.py: real local ranks; failures stop everything, nothing survives."""
import os
import socket

import pytest
import trainprobes.distributed.launcher as L
from trainprobes.distributed.selftest import (
    echo_task,
    exit_task,
    exit_then_peers_raise_task,
    hang_task,
    raise_task,
)


def alive(pid: int) -> bool:
    """True if pid is a live process (a zombie waiting to be reaped counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids, seconds=10.0) -> list:
    """pids still alive after waiting for the OS to reap them (not a speed assertion)."""
    import time
    end = time.monotonic() + seconds
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


@pytest.fixture
def reaper():
    """Collects pids a test started; kills any survivor even when the test fails."""
    pids = []
    yield pids
    for p in pids:
        if alive(p):
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("world", [1, 3])
def test_every_rank_runs_with_the_rendezvous_environment(world, reaper):
    out = L.launch(echo_task, world, timeout=120)
    reaper += [o["pid"] for o in out]
    assert [o["rank"] for o in out] == list(range(world))
    port = out[0]["env"]["MASTER_PORT"]
    for o in out:
        assert o["env"] == {"RANK": str(o["rank"]), "WORLD_SIZE": str(world),
                            "LOCAL_RANK": str(o["rank"]), "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": port}
    assert len({o["pid"] for o in out}) == world
    assert wait_dead(reaper) == []


def test_what_a_rank_prints_goes_to_stderr_never_to_the_commands_stdout():
    # was: a rank's print (torchtitan logs to stdout) landed inside `--json`'s document. A
    # process of its own: ranks come from a forkserver that keeps the descriptors it started with
    import subprocess
    import sys
    code = ("import json; import trainprobes.distributed.launcher as L; "
            "from trainprobes.distributed.selftest import print_task; "
            "print(json.dumps(L.launch(print_task, 2, timeout=120)))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    import json
    assert len(json.loads(p.stdout)) == 2  # stdout holds the document and nothing else
    for r in (0, 1):
        assert f"rank {r} says hello on stdout" in p.stderr and f"rank {r} writes to fd 1" in p.stderr


def test_a_rank_that_raises_stops_all_and_names_itself(reaper):
    with pytest.raises(L.WorkerFailed) as info:
        L.launch(raise_task, 3, timeout=120, args=(2,))
    e = info.value
    reaper += e.pids
    assert e.rank == 2
    assert "deliberate failure on rank 2" in e.traceback and "Traceback" in e.traceback
    assert "rank 2 of 3 failed" in str(e)
    assert len(e.pids) == 3 and wait_dead(e.pids) == []


def test_a_rank_that_dies_silently_is_reported(reaper):
    with pytest.raises(L.WorkerFailed, match="rank 1 exited with code 7") as info:
        L.launch(exit_task, 2, timeout=120, args=(1, 7))
    reaper += info.value.pids
    assert info.value.rank == 1 and wait_dead(info.value.pids) == []


def test_a_silent_death_is_named_as_the_cause_when_peers_raise_after_it(reaper):
    with pytest.raises(L.WorkerFailed, match="rank 1 exited with code 5") as info:
        L.launch(exit_then_peers_raise_task, 3, timeout=120, args=(1, 5))
    reaper += info.value.pids
    assert info.value.rank == 1 and wait_dead(info.value.pids) == []


@pytest.mark.slow
def test_hanging_ranks_time_out_and_their_children_die_too(tmp_path, reaper):
    reaper += [o["pid"] for o in L.launch(echo_task, 1)]  # warm start: ranks get going in time
    with pytest.raises(L.WorkerTimeout) as info:
        L.launch(hang_task, 2, timeout=10, args=(str(tmp_path),))
    e = info.value
    grandchildren = [int(p.read_text()) for p in tmp_path.glob("grandchild*")]
    reaper += e.pids + grandchildren
    assert len(grandchildren) == 2, "the ranks did not start their children before the timeout"
    assert e.ranks == [0, 1] and "timeout=10" in str(e)
    assert wait_dead(e.pids + grandchildren) == []


def test_an_explicit_port_that_is_taken_is_refused_before_starting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(L.PortInUse, match=f"port={port} on 127.0.0.1 is already in use"):
            L.launch(echo_task, 2, port=port)


def test_a_port_taken_at_rendezvous_is_retried(monkeypatch, reaper):
    lines = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        real = L.free_port
        calls = []

        def first_taken(addr="127.0.0.1"):
            calls.append(addr)
            return taken if len(calls) == 1 else real(addr)
        monkeypatch.setattr(L, "free_port", first_taken)
        out = L.launch(echo_task, 2, timeout=120, progress=lines.append)
    reaper += [o["pid"] for o in out]
    assert len(calls) == 2
    assert any(f"port {taken} was taken" in x for x in lines)
    assert out[0]["env"]["MASTER_PORT"] != str(taken)


@pytest.mark.parametrize("kw, match", [
    (dict(world=0), "world=0"),
    (dict(world=2, backend="mpi"), "backend='mpi'"),
    (dict(world=2, timeout=0), "timeout=0"),
    (dict(world=2, port=70000), "port=70000"),
])
def test_bad_arguments_fail_before_any_process_starts(kw, match, monkeypatch):
    monkeypatch.setattr(L, "_run_once", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(ValueError, match=match):
        L.launch(echo_task, **kw)


def test_a_lambda_task_is_refused():
    with pytest.raises(ValueError, match="module-level function"):
        L.launch(lambda r, w: r, 2)


def test_nccl_without_cuda_is_refused_clearly():
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
        L.launch(echo_task, 1, backend="nccl")


def test_free_port_is_bindable():
    p = L.free_port()
    assert 0 < p < 65536 and L.port_is_free(p)


def test_plain_data_comes_back_without_unpickling_objects(reaper):
    import torch
    from trainprobes.distributed.selftest import plain_task
    out = L.launch(plain_task, 2, timeout=120)
    assert [o["rank"] for o in out] == [0, 1] and out[1][7] == b"bytes"
    assert out[1]["nested"] == [None, 1.5, ("a", True)]
    assert torch.equal(out[1]["tensor"], torch.ones(3, dtype=torch.bfloat16))


def test_a_task_returning_objects_is_refused_naming_it(reaper):
    from trainprobes.distributed.selftest import object_task
    with pytest.raises(L.WorkerFailed, match=r"object_task\(\) on rank \d returned \['value'\] a "
                                             r"DeliberateFailure; a task returns plain data") as e:
        L.launch(object_task, 2, timeout=120)
    reaper += e.value.pids


def test_a_taken_port_is_seen_in_any_ranks_error_not_only_the_first():
    # under load the rank that fails to bind may report after a peer that failed to connect
    import queue
    from types import SimpleNamespace
    q = queue.Queue()
    q.put(("error", 0, "RuntimeError: The server socket has failed to listen on any local "
                       "network address. port: 29500, useIpv6: 0, code: -98, name: EADDRINUSE, "
                       "message: address already in use"))
    alive = [SimpleNamespace(is_alive=lambda: True, exitcode=None)] * 2
    e = L._first_cause(alive, q, set(), 1, "RuntimeError: Connection closed by peer", 2)
    assert e.rank == 1 and e.port_taken
    e = L._first_cause(alive, queue.Queue(), set(), 1, "RuntimeError: Connection closed by peer", 2)
    assert not e.port_taken


def test_a_rendezvous_that_fails_before_the_task_ran_is_retried_on_a_new_port(monkeypatch):
    # a loaded host can drop gloo's pair connections while the group forms; no task has
    # run, so a fresh port is safe. A failure inside the task is never retried.
    calls, lines = [], []

    def flaky(task, world, backend, timeout, args, addr, port, progress):
        calls.append(port)
        if len(calls) == 1:
            e = L.WorkerFailed(0, "RuntimeError: Gloo connectFullMesh failed ... Connection "
                                  "closed by peer", world)
            e.rendezvous = True
            raise e
        return ["ok"] * world
    monkeypatch.setattr(L, "_run_once", flaky)
    assert L.launch(echo_task, 2, progress=lines.append) == ["ok", "ok"]
    assert len(calls) == 2 and calls[0] != calls[1]
    assert any("rendezvous on port" in x and "Connection closed by peer" in x for x in lines)

    def task_fails(*a):
        calls.append(0)
        raise L.WorkerFailed(1, "RuntimeError: in the task", 2)
    calls.clear()
    monkeypatch.setattr(L, "_run_once", task_fails)
    with pytest.raises(L.WorkerFailed, match="in the task"):
        L.launch(echo_task, 2)
    assert len(calls) == 1
