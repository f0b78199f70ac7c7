"""Fault injection for the launcher: whatever happens to the parent, no rank outlives it,
and more ranks than the machine holds are refused before any process starts."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from trainprobes.distributed.launcher import TooManyRanks, launch, local_rank_cap
from trainprobes.distributed.selftest import echo_task
from trainprobes.lifetime import is_alive as _alive


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _children() -> set:
    """Pids of this process's children (Linux); the empty set where /proc has no list."""
    try:
        return set(Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split())
    except OSError:
        return set()


def test_too_many_ranks_is_refused_before_any_process_starts():
    before = _children()
    t0 = time.perf_counter()
    with pytest.raises(TooManyRanks, match="torchrun"):
        launch(echo_task, 100_000)
    assert time.perf_counter() - t0 < 5
    assert _children() == before


def test_the_cap_takes_an_override_but_never_past_memory(monkeypatch):
    from trainprobes import budget
    cap, why = local_rank_cap()
    assert cap >= 8 and why
    assert local_rank_cap(3)[0] == 3
    monkeypatch.setattr(budget, "available_bytes", lambda: 500 * 2**20)
    cap, why = local_rank_cap(1000)
    assert cap == 4 and "memory" in why


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_the_parent_leaves_no_rank_nor_grandchild(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        from trainprobes.distributed.launcher import launch
        from trainprobes.distributed.selftest import hang_task
        if __name__ == "__main__":
            launch(hang_task, 3, timeout=300, args=({str(tmp_path)!r},))
    """))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("grandchild*"))) < 3:
            assert time.monotonic() < deadline and parent.poll() is None, "ranks never started"
            time.sleep(0.2)
        time.sleep(0.3)
        grandchildren = [int(p.read_text()) for p in tmp_path.glob("grandchild*")]
        ranks = [_ppid(g) for g in grandchildren]
        assert all(_alive(p) for p in ranks + grandchildren)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks + grandchildren) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [p for p in ranks + grandchildren if _alive(p)]
        assert survivors == []
    finally:
        for p in tmp_path.glob("grandchild*"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if parent.poll() is None:
            parent.kill()


def test_an_audit_worker_dies_with_its_audit_even_when_the_audit_is_killed(tmp_path):
    """The audit's worker process (trainprobes.audit.worker) watches the audit's pid: with
    its owner gone (here a stand-in parent, SIGKILLed) it exits within seconds, mid-family,
    rather than run its checks to the end for no one."""
    from trainprobes.audit import remote

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = subprocess.Popen([sys.executable, "-m", "trainprobes.audit.worker", "--families",
                               "collectives", "--parent", str(owner.pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)  # past its start-up, into the family
        assert worker.poll() is None, "the worker finished before the test could kill its owner"
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        worker.wait(timeout=10)
        assert worker.returncode == 137
    finally:
        for p in (owner, worker):
            if p.poll() is None:
                p.kill()
                p.wait()

    # and the audit passes its own pid: the command it runs, caught before it starts
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        raise subprocess.TimeoutExpired(cmd, 0)

    mp = pytest.MonkeyPatch()
    mp.setattr(remote.subprocess, "run", fake_run)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            remote.worker_check("collectives", "c", seed=0, quick=True, control=True).run()
    finally:
        mp.undo()
    cmd = seen["cmd"]
    assert cmd[cmd.index("--parent") + 1] == str(os.getpid())
