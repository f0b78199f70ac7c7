"""Processes that die with the one that started them, even when it is SIGKILLed.

PR_SET_PDEATHSIG (Linux) signals a child when its parent thread exits, but a rank's parent is
multiprocessing's forkserver, not the launcher, and the signal is Linux-only: so a watchdog
thread also polls the owner's pid, and kills at a deadline too.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

__all__ = ["die_with", "is_alive"]


def is_alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie waiting for its reaper is dead (a SIGKILLed owner whose
    parent has not reaped it yet must still count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc (macOS): kill(pid, 0) is all there is
        return True


def die_with(owner_pid: int, deadline_s: float, *, group: bool = True) -> None:
    """When `owner_pid` is gone, or after `deadline_s`, kill this process: its whole process
    group with group=True (itself and whatever it started; call os.setpgrp() first), else
    itself alone (its own children watch it in turn)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    end = time.monotonic() + deadline_s

    def watch():
        while is_alive(owner_pid) and time.monotonic() < end:
            time.sleep(0.25)
        try:
            if group:
                os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(137)

    threading.Thread(target=watch, name="trainprobes-watchdog", daemon=True).start()
