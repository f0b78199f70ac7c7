"""Progress a log grep can trust: controls said as reproduced or MISSED, and a line at least
every 5 s on every long command, with an estimate of what is left, off when stderr is not a
terminal unless asked.

The clock is fake (trainprobes.progress.now): a slowed target advances it, and the heartbeat
thread must write within 5 s of it. No test waits on real time beyond the thread's poll."""
from __future__ import annotations

import argparse
import io
import sys
import threading
import time

import pytest
import trainprobes.progress as progress_mod
from trainprobes.audit import Check, Progress, run_suite
from trainprobes.audit.run import outcome_words
from trainprobes.cli import main
from trainprobes.commands.options import add_progress_options, progress_wanted
from trainprobes.result import Result


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Stderr(io.StringIO):
    """stderr as a command sees it; tells a waiting test when a line arrives."""

    def __init__(self, tty: bool = False):
        super().__init__()
        self.tty, self.changed = tty, threading.Condition()

    def isatty(self):
        return self.tty

    def write(self, s):
        with self.changed:
            n = super().write(s)
            self.changed.notify_all()
        return n

    def lines(self) -> list[str]:
        return [ln for ln in self.getvalue().replace("\r", "\n").splitlines() if ln.strip()]

    def wait_for(self, text: str, after: int = 0, timeout: float = 20.0) -> str:
        """The first line past the first `after` lines that holds text; fails after
        `timeout` real seconds (the thread polls every few ms: this never waits long)."""
        with self.changed:
            ok = self.changed.wait_for(lambda: any(text in ln for ln in self.lines()[after:]),
                                       timeout)
        assert ok, f"no line with {text!r} within {timeout} s: {self.lines()!r}"
        return next(ln for ln in self.lines()[after:] if text in ln)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress_mod, "now", c)
    monkeypatch.setattr(progress_mod, "POLL", 0.002)
    return c


@pytest.fixture
def stderr(monkeypatch):
    """A Stderr that becomes sys.stderr once the test body calls it (pytest's capture sets
    sys.stderr again between a fixture's set-up and the test's call)."""
    s = Stderr()

    def install() -> Stderr:
        monkeypatch.setattr(sys, "stderr", s)
        return s
    return install


class Slowed:
    """A target slowed on the fake clock. check_heartbeat, called while the work runs after
    the target has reported its progress, lets `advance` seconds pass and checks that the
    heartbeat says so, with a sane estimate; then that it stays silent for 4.9 s and speaks
    again past 5 s."""

    def __init__(self, clock: Clock, stderr: Stderr):
        self.clock, self.stderr, self.seen = clock, stderr, []

    def check_heartbeat(self, expect: str, advance: float = 10.0) -> None:
        n = len(self.stderr.lines())
        self.clock.advance(advance)
        self.seen.append(self.stderr.wait_for(expect, after=n))
        n = len(self.stderr.lines())
        self.clock.advance(4.9)
        time.sleep(0.05)                      # 25 polls: none may write before 5 s
        assert len(self.stderr.lines()) == n, self.stderr.lines()[n:]
        self.clock.advance(0.2)
        self.seen.append(self.stderr.wait_for(" in; ", after=n))


# --- the audit's checks ----------------------------------------------------------------------

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


def test_a_slow_audit_check_shows_progress_within_5_seconds_with_what_is_left(clock):
    stream = Stderr()
    prog = Progress(3, stream=stream, tty=False)
    assert prog.every == 5.0                                      # the default: 5 s
    beat = "numerics: deliberately slow still running"

    def slow():
        clock.advance(4.9)
        time.sleep(0.05)
        assert not any(beat in ln for ln in stream.lines())
        clock.advance(0.2)                                        # 5.1 s into the check
        stream.wait_for(beat)
        return Result("p.q", "slow", "pass")

    def fast():
        clock.advance(10)
        return Result("p.q", "fast", "pass")
    run_suite([Check("numerics", "fast", run=fast), Check("numerics", "deliberately slow", run=slow),
               Check("numerics", "fast", run=fast)], progress=prog)
    prog.close()
    # one check done, 15.1 s in, two left: about 30 s
    assert stream.wait_for(beat) == f"[2/3] {beat} (5 s); about 30 s left"


# --- every long command, slowed --------------------------------------------------------------

def _stub_counted(slowed: Slowed, total: int = 3, signature: str = "done,total,what"):
    """A probe that reports progress before each of `total` units; the first takes 10 s."""
    def run(*a, progress=None, **kw):
        for i in range(total):
            progress(*((i, total) if signature == "done,total" else (i, total, f"unit {i}")))
            if i == 1:   # one unit took 10 s; of 3, 2 are left: about 20 s
                slowed.check_heartbeat("1/3")
                assert "about 20 s left" in slowed.seen[0]
        return []
    return run


def _stub_phases(slowed: Slowed, result=None):
    """Work on other processes that says only what it does (launcher lines): no count, so
    the bound is the timeout (600 s for transforms, 120 s for collectives)."""
    def run(*a, progress=None, timeout, **kw):
        progress("started 2 gloo ranks")
        slowed.check_heartbeat(f"started 2 gloo ranks (10 s), 10 s in; at most "
                               f"{progress_mod.duration_text(timeout - 10)} left (its timeout)")
        return [] if result is None else result
    return run


def _bias_result():
    return Result("numerics.bias", "x", "pass", metrics={"bias": 0.0, "biased": False})


COMMANDS = {
    # family: (argv, module, attribute, stub maker)
    "isolation table": (["isolation", "table", "--family", "llama"], "trainprobes.isolation.hf",
                        "packed_table", _stub_counted),
    "isolation ops": (["isolation", "ops"], "trainprobes.isolation.ops", "op_map", _stub_counted),
    "drift --demo": (["drift", "--demo", "--json"], "trainprobes.drift.demo", "run_demo",
                     lambda s: _stub_counted(s, signature="i,n,name")),
    "drift localize --demo": (["drift", "localize", "--demo", "--json"],
                              "trainprobes.drift.localize_demo", "run_demo",
                              lambda s: _stub_counted(s, signature="i,n,name")),
    "transforms": (["transforms", "--json"], "trainprobes.transforms.zoo", "run_zoo", _stub_phases),
    "collectives gloo": (["collectives", "--backend", "gloo", "--world", "2", "--json"],
                         "trainprobes.distributed", "run_collective",
                         lambda s: _stub_phases(s, Result("distributed.collective", "x", "pass"))),
}


@pytest.mark.parametrize("family", list(COMMANDS))
def test_a_long_command_says_how_it_goes_every_5_seconds(family, clock, stderr, monkeypatch):
    stderr = stderr()
    argv, module, attr, make = COMMANDS[family]
    slowed = Slowed(clock, stderr)
    monkeypatch.setattr(__import__(module, fromlist=[attr]), attr, make(slowed))
    assert main(argv + ["--progress"]) in (0, 1), stderr.lines()
    assert len(slowed.seen) == 2, stderr.lines()
    assert stderr.lines()[0].startswith(stderr.lines()[0].split(":")[0] + ": started")


def test_bias_compare_counts_the_trials_of_every_row(clock, stderr, monkeypatch):
    stderr = stderr()
    import trainprobes.numerics.bias as bias
    slowed = Slowed(clock, stderr)

    def rows(*, progress, trials, **kw):
        out = []
        for label in ("round to nearest", "stochastic rounding", "fp32 accumulation"):
            for t in range(trials):
                progress(label, t + 1, trials)
            if label == "round to nearest":
                # 5 of 15 trials in 10 s: 10 left, about 20 s
                slowed.check_heartbeat("5/15 trials done, round to nearest")
                assert "about 20 s left" in slowed.seen[0]
            out.append(_bias_result())
        return out
    monkeypatch.setattr(bias, "rounding_side_by_side", rows)
    assert 0 == main(["bias", "--compare", "--trials", "5", "--json", "--progress"])
    assert "stochastic rounding" not in slowed.seen[0]


def test_gemm_says_which_gemm_runs_and_what_is_left(clock, stderr, monkeypatch):
    stderr = stderr()
    import trainprobes.numerics.gemm as gemm
    slowed = Slowed(clock, stderr)
    calls = []

    def one(*a, preset, **kw):
        calls.append(preset)
        if len(calls) == 2:        # one GEMM of 4 took 10 s
            slowed.check_heartbeat("1/4 GEMMs done, K=8 exact h200-scaled-mm-signfill")
            assert "about 30 s left" in slowed.seen[0]
        return Result("numerics.gemm", "g", "pass", metrics={"biased": False})
    monkeypatch.setattr(gemm, "gemm_bias", one)
    assert 0 == main(["gemm", "--k", "8", "--rows", "4", "--json", "--progress"])
    assert len(calls) == 4


def test_causality_on_a_big_target_counts_its_cuts(clock, stderr, monkeypatch, tmp_path):
    stderr = stderr()
    import trainprobes.causality as causality
    (tmp_path / "slowrouter.py").write_text("def route(x):\n    return x.sum(-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    slowed = Slowed(clock, stderr)
    run = _stub_counted(slowed, signature="done,total")
    monkeypatch.setattr(causality, "check",
                        lambda *a, **kw: run(**kw) or Result("causality.check", "t", "pass"))
    assert 0 == main(["causality", "--target", "slowrouter:route", "--hidden", "4", "--seq-len", "8",
          "--json", "--progress"])
    assert "1/3 cuts x trials done" in slowed.seen[0]


def test_zoo_row_counts_its_cells(clock, stderr, monkeypatch):
    stderr = stderr()
    pytest.importorskip("transformers")
    import trainprobes.zoo.cells as cells
    slowed = Slowed(clock, stderr)

    def row(model, *, progress, **kw):
        progress("llama isolation eager,position_ids")
        progress("llama isolation eager,mask_4d")
        slowed.check_heartbeat("1/2 cells done, llama isolation eager,mask_4d")
        return [cells.Cell(model, "batch", "", "invariant", 0.0, "", "same bits")]   # a judged row
    monkeypatch.setattr(cells, "row", row)
    assert 0 == main(["zoo", "--model", "llama", "--probes", "router,batch", "--json", "--progress"])
    assert "about 10 s left" in slowed.seen[0]


# --- when it shows -----------------------------------------------------------------------------

def test_progress_is_off_when_stderr_is_not_a_terminal_unless_asked():
    p = argparse.ArgumentParser()
    add_progress_options(p)
    log = io.StringIO()
    assert progress_wanted(p.parse_args([]), log) is False
    assert progress_wanted(p.parse_args(["--progress"]), log) is True
    assert progress_wanted(p.parse_args([]), Stderr(tty=True)) is True
    assert progress_wanted(p.parse_args(["--no-progress"]), Stderr(tty=True)) is False


@pytest.mark.parametrize("flags, tty, shown", [([], False, False), (["--progress"], False, True),
                                                ([], True, True), (["--no-progress"], True, False)])
def test_a_command_obeys_the_flags_and_the_terminal(flags, tty, shown, clock, monkeypatch):
    import trainprobes.isolation.ops as ops
    err = Stderr(tty=tty)
    monkeypatch.setattr(sys, "stderr", err)

    def op_map(*a, progress, **kw):
        progress(0, 2, "op a")
        progress(1, 2, "op b")
        clock.advance(6)
        if shown:
            err.wait_for("about 6 s left")
        else:
            time.sleep(0.05)
        return []
    monkeypatch.setattr(ops, "op_map", op_map)
    assert main(["isolation", "ops", "--json"] + flags) == 0
    assert bool(err.getvalue()) is shown
    if tty and shown:   # a bar on one line, cleared before the results are printed
        assert "\n" not in err.getvalue() and err.getvalue().endswith("\r")


def test_durations_read_as_a_person_reads_them():
    d = progress_mod.duration_text
    assert (d(4.4), d(59.6), d(65), d(3725)) == ("4 s", "1 min 00 s", "1 min 05 s", "1 h 02 min")


def test_no_count_and_no_limit_says_so(clock):
    p = progress_mod.Progress("work", stream=io.StringIO())
    assert p.remaining() == "total unknown"
    p = progress_mod.Progress("work", 4, unit="cases", stream=io.StringIO())
    assert p.remaining() == "time left unknown until the first of 4 cases is done"


def test_isolation_documents_counts_the_target_calls(clock, stderr, monkeypatch, tmp_path):
    stderr = stderr()
    slowed = Slowed(clock, stderr)
    (tmp_path / "slowdocs.py").write_text(
        "calls = []\nHOOK = None\n"
        "def fn(tokens, packing):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n        HOOK()\n"
        "    return tokens.float().unsqueeze(-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import slowdocs
    # the second of d + 2 = 5 calls runs: one done in 10 s, 4 left: about 40 s
    monkeypatch.setattr(slowdocs, "HOOK", lambda: slowed.check_heartbeat("1/5 calls done"))
    assert main(["isolation", "documents", "--target", "slowdocs:fn", "--lengths", "10,12,8",
                 "--no-causal", "--no-fp64", "--json", "--progress"]) == 0
    assert "about 40 s left" in slowed.seen[0]


def test_isolation_batch_counts_its_calls(clock, stderr, monkeypatch, tmp_path):
    stderr = stderr()
    slowed = Slowed(clock, stderr)
    (tmp_path / "slowbatch.py").write_text(
        "calls = []\nHOOK = None\n"
        "def fn(rows):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n        HOOK()\n"
        "    return rows * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import slowbatch
    # 4 rows alone + 1 again + 2 sizes x 1 trial + the pool of 4 = 8 calls; 1 done in 10 s
    monkeypatch.setattr(slowbatch, "HOOK", lambda: slowed.check_heartbeat("1/8 calls done"))
    assert main(["isolation", "batch", "--target", "slowbatch:fn", "--shape", "4,8",
                 "--sizes", "2,3", "--trials", "1", "--json", "--progress"]) == 0
    assert "about 1 min 10 s left" in slowed.seen[0]


def test_drift_localize_on_a_users_pair_counts_its_forwards(clock, stderr, monkeypatch):
    pytest.importorskip("transformers")
    stderr = stderr()
    slowed = Slowed(clock, stderr)
    import trainprobes.drift.localize as localize
    real, calls = localize.record, []

    def record(*a, **kw):   # the engine's forward (the second) runs with one of ~10 done in 10 s
        calls.append(1)
        if len(calls) == 2:
            slowed.check_heartbeat("1/10 forwards")
        return real(*a, **kw)
    monkeypatch.setattr(localize, "record", record)
    demo = "trainprobes.drift.localize_demo"
    assert main(["drift", "localize", "--target", f"{demo}:example_trainer", "--engine",
                 f"{demo}:example_engine_sdpa", "--json", "--sequences", "4", "--length", "8",
                 "--progress"]) in (0, 1)
    assert "engine" in slowed.seen[0] and "about 1 min 30 s left" in slowed.seen[0], slowed.seen
