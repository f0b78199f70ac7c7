"""keep_rng: every global generator the run draws from, as it was, after the sentinel's work.

A sentinel's check may call code that draws (a collator masking at random, dropout in a
forward it did not switch off, a library seeding itself). The run must not see it: python's
`random`, numpy's legacy global generator and torch's CPU and CUDA generators are saved
before and restored after, also when the block raises. torch.random.fork_rng covers torch's
alone.
"""
from __future__ import annotations

import contextlib
import random

import torch

__all__ = ["keep_rng"]


@contextlib.contextmanager
def keep_rng():
    """python's `random`, numpy's global generator (when numpy is installed), torch's CPU
    generator and every CUDA device's (when CUDA is available) restored on exit."""
    py = random.getstate()
    try:
        import numpy as np
    except ImportError:
        np = None
    npstate = np.random.get_state() if np is not None else None
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        if np is not None:
            np.random.set_state(npstate)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
