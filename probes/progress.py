"""Progress on stderr while long work runs: one mechanism for every command and the audit.

    with Progress("isolation table", total=48, unit="cases") as p:
        for case in cases:
            p.doing(case.name)          # what runs now (shown with how long it has run)
            run(case)
            p.step()                    # one more unit done (or p.step(done, total))

A line at least every EVERY seconds while the work runs, saying what runs, how far it is
and about how long is left (the mean time of the units done so far times those left):
rewritten in place on a terminal, plain lines in a log (a carriage return in a CI log is
noise). The commands show it when stderr is a terminal or --progress asks, never with
--no-progress (trainprobes.commands.options.progress_for).

Time is read through `now` (monotonic seconds), so a test can drive a fake clock; the
thread looks at that clock every POLL real seconds and writes when EVERY seconds of it have
passed since the last line.

A floor module: it imports nothing from trainprobes.
"""
from __future__ import annotations

import sys
import threading
import time

__all__ = ["Progress", "EVERY", "duration_text"]

EVERY = 5.0   # seconds: the longest a running command stays silent
POLL = 0.2    # real seconds between the thread's looks at the clock
WIDTH = 110   # a terminal line, padded so a shorter text erases a longer one


def now() -> float:
    return time.monotonic()


def duration_text(seconds: float) -> str:
    """42 s, 3 min 05 s, 1 h 02 min: a duration as a person reads it."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """What a long piece of work has done, said on `stream` (stderr) at least every `every`
    seconds from a thread of its own while it runs.

    what: the work's name ("isolation table"); total: how many units (None: unknown, no
    estimate but the count done); unit: their name in the lines ("cases", "trials");
    quiet: say nothing (--no-progress, or stderr not a terminal), so the work reports the
    same way either way; limit: seconds after which the work is stopped (a timeout), the
    bound said where no count estimates what is left (work on other processes that report
    only when they finish)."""

    def __init__(self, what: str, total: int | None = None, *, unit: str = "",
                 stream=None, tty: bool | None = None, every: float | None = None,
                 quiet: bool = False, limit: float | None = None):
        self.what, self.total, self.unit, self.quiet = what, total, unit, quiet
        self.limit = limit
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.every = EVERY if every is None else every
        self.began = now()
        self.current: str | None = None
        self._since = self.began        # when `current` began
        self._last = self.began         # when the last line was written
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = False             # a bar is on the terminal's line
        self._opened = False            # start() said what starts: close() says it ended
        self._ended = "ended"

    # --- what the work reports --------------------------------------------------------------

    def start(self) -> "Progress":
        """Say what starts, and start the thread that keeps saying how it goes."""
        self._write_line(self.opening())
        self._opened = True
        self._launch()
        return self

    def _launch(self) -> None:
        if self.every and self._thread is None and not self.quiet:
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name="trainprobes-progress")
            self._thread.start()

    def doing(self, current: str | None) -> None:
        """`current` runs now (a case, a check, a phase)."""
        self.current, self._since = current, now()

    def say(self, phase: str) -> None:
        """A phase of work that reports no count (ranks started, a file written): shown now,
        and in the heartbeat's lines while it runs."""
        self.doing(phase)
        self._write_line(self.line())

    def step(self, done: int | None = None, total: int | None = None,
             current: str | None = None) -> None:
        """One more unit done (done=None), or `done` of `total` done; current: what runs next."""
        self.done = self.done + 1 if done is None else done
        if total is not None:
            self.total = total
        if current is not None and current != self.current:
            self.doing(current)
        if self.tty and now() - self._last >= min(self.every, 1.0):
            text = self.line()               # a terminal's bar moves with the work
            if text is not None:
                self._write_line(text)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.tty and self._shown:
            self._write("\r" + " " * WIDTH + "\r")
            self._shown = False
        elif not self.tty and self._opened:
            self._write_line(self.closing())   # a log says when the work ended

    def __enter__(self) -> "Progress":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None and self.total is not None:
            self.done = self.total   # the work said each unit as it began: now all are done
        self._ended = "ended" if exc_type is None else "stopped"
        self.close()

    # --- what the lines say -----------------------------------------------------------------

    def remaining(self) -> str:
        """'about 1 min 20 s left', from the mean time of the units done so far."""
        if self.total is None:
            if self.limit is not None:
                return f"at most {duration_text(self.limit - (now() - self.began))} left (its timeout)"
            return "total unknown"
        left = self.total - self.done
        if left <= 0:
            return "finishing"
        if not self.done:
            return f"time left unknown until the first of {self.total}{self._unit()} is done"
        per = (now() - self.began) / self.done
        return f"about {duration_text(per * left)} left"

    def _unit(self) -> str:
        return f" {self.unit}" if self.unit else ""

    def opening(self) -> str:
        count = "" if self.total is None else f" ({self.total}{self._unit()})"
        return f"{self.what}: started{count}; a line every {self.every:g} s"

    def closing(self) -> str:
        count = "" if self.total is None and not self.done else (
            f"{self.done}{self._unit()}, " if self.total is None else
            f"{self.done}/{self.total}{self._unit()}, ")
        return f"{self.what}: {self._ended}, {count}{duration_text(now() - self.began)}"

    def line(self) -> str | None:
        """The heartbeat's line (None: nothing to say now): 'isolation table: 12/48 cases
        done, llama sdpa mask_4d (3 s), 1 min 02 s in; about 3 min 06 s left'."""
        t = now()
        parts = []
        if self.total is not None or self.done:
            count = f"{self.done}" if self.total is None else f"{self.done}/{self.total}"
            parts.append(f"{count}{self._unit()} done")
        if self.current:
            parts.append(f"{self.current} ({duration_text(t - self._since)})")
        parts.append(f"{duration_text(t - self.began)} in")
        return f"{self.what}: {', '.join(parts)}; {self.remaining()}"

    # --- writing ----------------------------------------------------------------------------

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()

    def _write_line(self, text: str) -> None:
        self._last = now()
        if self.quiet:
            return
        if self.tty:
            self._shown = True
            self._write("\r" + text[:WIDTH].ljust(WIDTH))
        else:
            self._write(text + "\n")

    def _beat(self) -> None:
        while not self._stop.wait(POLL):
            if now() - self._last >= self.every:
                text = self.line()
                if text is not None:
                    self._write_line(text)
