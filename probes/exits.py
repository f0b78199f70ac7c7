"""One exit-code contract for every face (the CLI, the torchrun entries, the audit worker):

    0  pass                       1  a finding (biased, leaky, not equivalent, ...)
    2  bad usage, or cannot judge 3  an internal error

A crash is never a finding. `guarded(prog, fn)` runs fn() and turns what it raises into the
code and one line on stderr, converted once, at the boundary (as torch.testing's ErrorMeta):
  1. trainprobes' own errors, and a probe's ValueError/TypeError about its arguments: 2, with
     the message (it names the value and says what works);
  2. the machine refused (a file that cannot be read or written, a full disk, a missing
     GPU driver): 2, naming the path or the device;
  3. anything else: 3, "internal error" with the exception's last line, the full traceback
     written to a log file whose path the line gives. Never a raw traceback on stdout.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

PASS, FINDING, USAGE, INTERNAL = 0, 1, 2, 3

# RuntimeErrors torch raises when a device that was asked for is not there: the request
# cannot run on this machine (2), it is not trainprobes breaking (3).
_NO_DEVICE = ("found no nvidia driver", "torch not compiled with cuda", "no cuda gpus are available",
              "cuda driver initialization failed", "invalid device ordinal",
              "distributed package doesn't have nccl", "nccl is not available")


def log_dir() -> str:
    """Where internal-error tracebacks go: $TMPDIR/trainprobes-logs (created on demand)."""
    return os.path.join(tempfile.gettempdir(), "trainprobes-logs")


def write_log(prog: str, exc: BaseException) -> str | None:
    """The traceback of `exc` in a new file; its path, or None when nothing can be written."""
    try:
        d = log_dir()
        os.makedirs(d, exist_ok=True)
        name = f"{prog.replace(' ', '-')}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
        path = os.path.join(d, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{' '.join(sys.argv)}\n\n")
            f.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return path
    except OSError:
        return None


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1]}" if text else type(exc).__name__


def classify(exc: BaseException) -> int:
    """The exit code an exception that reached the boundary maps to (module docstring)."""
    from trainprobes.errors import TrainprobesError
    if isinstance(exc, (TrainprobesError, ValueError, TypeError)):
        return USAGE
    if isinstance(exc, OSError):
        return USAGE
    if isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _NO_DEVICE):
        return USAGE
    return INTERNAL


def report(prog: str, exc: BaseException) -> int:
    """Say `exc` on stderr in one line (or its own message for a usage error); the code."""
    code = classify(exc)
    if code == USAGE:
        if isinstance(exc, OSError) and exc.filename is not None:
            msg = f"{exc.strerror or exc}: {exc.filename!r}"
        else:
            msg = str(exc) if str(exc) else type(exc).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return code
    path = write_log(prog, exc)
    where = f"; full traceback in {path}" if path else ""
    print(f"{prog}: internal error (exit 3, a bug in trainprobes or in the code it ran, not a "
          f"finding): {_last_line(exc)}{where}", file=sys.stderr)
    if path is None:  # nowhere to keep it: stderr, never stdout
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    return code


# after Ctrl-C, the cleanup (ranks killed and joined, files removed) gets this long before
# the process leaves anyway: the ranks watch this process and die with it
INTERRUPT_GRACE_S = 20.0


def _on_interrupt(signum, frame):
    """SIGINT: KeyboardInterrupt as usual, and a clock that ends the process with 130 if the
    cleanup it starts does not finish (a second Ctrl-C ends it at once)."""
    import signal
    import threading

    def leave():
        time.sleep(INTERRUPT_GRACE_S)
        print("interrupted (cleanup did not finish)", file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    threading.Thread(target=leave, name="trainprobes-interrupt", daemon=True).start()
    raise KeyboardInterrupt


def _arm_interrupt():
    """Install _on_interrupt where Python's own Ctrl-C handler is (the main thread); returns
    what to call to put the previous handler back (None: nothing installed)."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None
    signal.signal(signal.SIGINT, _on_interrupt)
    return lambda: signal.signal(signal.SIGINT, signal.default_int_handler)


def guarded(prog: str, fn) -> int:
    """fn() -> exit code, with every exception mapped by the contract (module docstring)."""
    disarm = _arm_interrupt()
    try:
        return _guarded(prog, fn)
    finally:
        if disarm is not None:
            disarm()


def _guarded(prog: str, fn) -> int:
    try:
        return int(fn() or 0)
    except SystemExit as e:  # argparse: usage error (2), --help or --version (0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else USAGE)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `trainprobes ... | head`: the reader left; no traceback, and no second error
        # when Python flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # noqa: BLE001 - the boundary: every error gets its code
        return report(prog, e)
