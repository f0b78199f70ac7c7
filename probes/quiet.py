"""Third-party import noise kept off the terminal, and kept in a log file.

A CPU build of torch with torchao installed prints, whenever transformers imports torchao,
torchao's "Failed to load .../_C_mxfp8...so" (its CUDA kernels, absent on a CPU build) and
torch's `_pytree` "register_constant() on Enum subclasses is deprecated" warnings: lines about
the libraries' own packaging, not about the user's run, that read like a broken install. Each
is matched by logger and message; anything else those loggers say, and every warning from the
user's own code, still reaches the terminal. The matched records go to
$TMPDIR/trainprobes-logs/third-party-<date>.log (trainprobes.exits.log_dir).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time

__all__ = ["NOISE", "third_party_noise_to_log"]

# (logger name, the start of the message): the records that are import noise
NOISE = (
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported"),
)


class _ToLog(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.path: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        try:
            from trainprobes.exits import log_dir
            os.makedirs(log_dir(), exist_ok=True)
            self.path = os.path.join(log_dir(), f"third-party-{time.strftime('%Y%m%d')}.log")
            with open(self.path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()} {record.name} "
                        f"{record.levelname}: {record.getMessage()}\n")
        except OSError:
            pass   # no log file: the line is dropped all the same, it is not about the run
        return False


@contextlib.contextmanager
def third_party_noise_to_log():
    """While active, NOISE records go to the log file instead of the terminal."""
    filters = [(logging.getLogger(name), _ToLog(prefix)) for name, prefix in NOISE]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
