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

__all__ = ["die_with"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
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
        while _alive(owner_pid) and time.monotonic() < end:
            time.sleep(0.25)
        try:
            if group:
                os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(137)

    threading.Thread(target=watch, name="trainprobes-watchdog", daemon=True).start()
