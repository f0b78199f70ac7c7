"""Progress a log grep can trust: controls said as reproduced or MISSED, a line at least
every 5 s while a check runs long, off when stderr is not a terminal unless asked."""
from __future__ import annotations

import argparse
import io
import time

from trainprobes.audit import Check, Progress, run_suite
from trainprobes.audit.run import outcome_words
from trainprobes.commands.options import add_progress_options, progress_wanted
from trainprobes.result import Result


def test_a_control_that_did_what_it_should_is_reproduced_never_fail():
    leaky = Check("causality", "expert_choice", control=True,
                  run=lambda: Result("causality.check", "ec", "fail", expected="fail"))
    missed = Check("causality", "causal_block", control=True,
                   run=lambda: Result("causality.check", "cb", "fail", expected="pass"))
    mine = Check("causality", "my_router", run=lambda: Result("causality.check", "m", "fail"))
    stream = io.StringIO()
    run_suite([leaky, missed, mine], progress=Progress(3, stream=stream, tty=False))
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[1/3] causality: expert_choice ... reproduced (")
    assert lines[1].startswith("[2/3] causality: causal_block ... MISSED (expected pass, got fail)")
    assert lines[2].startswith("[3/3] causality: my_router ... fail (")  # a finding: its verdict
    assert "fail" not in lines[0]


def test_outcome_words_name_each_kind_once():
    rs = [Result("p.q", "a", "pass", expected="pass"), Result("p.q", "b", "fail", expected="fail"),
          Result("p.q", "c", "warn"), Result("p.q", "d", "error")]
    assert outcome_words(rs) == "reproduced, warn, error"
    assert outcome_words([]) == "no result"


def test_a_slow_check_shows_progress_within_5_seconds_with_what_is_left():
    def slow():
        time.sleep(2.6)
        return Result("p.q", "slow", "pass")
    stream = io.StringIO()
    prog = Progress(3, stream=stream, tty=False, heartbeat=1.0)  # 1 s here: the test stays short
    fast = Check("numerics", "fast", run=lambda: Result("p.q", "fast", "pass"))
    t0 = time.perf_counter()
    run_suite([fast, Check("numerics", "deliberately slow", run=slow), fast], progress=prog)
    prog.close()
    assert time.perf_counter() - t0 < 5
    beats = [ln for ln in stream.getvalue().splitlines() if "still running" in ln]
    assert beats and beats[0].startswith("[2/3] numerics: deliberately slow still running (")
    assert "s left" in beats[0]
    assert Progress(1, stream=io.StringIO(), tty=False).heartbeat == 5.0  # the default: 5 s


def test_progress_is_off_when_stderr_is_not_a_terminal_unless_asked():
    p = argparse.ArgumentParser()
    add_progress_options(p)

    class Tty(io.StringIO):
        def isatty(self):
            return True
    log = io.StringIO()
    assert progress_wanted(p.parse_args([]), log) is False
    assert progress_wanted(p.parse_args(["--progress"]), log) is True
    assert progress_wanted(p.parse_args([]), Tty()) is True
    assert progress_wanted(p.parse_args(["--no-progress"]), Tty()) is False
