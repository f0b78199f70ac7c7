"""trainprobes.transforms.launch: torchrun keeping the exit-code contract (plain torchrun
exits 1 for any failing rank, so a bad usage read as a finding)."""
import json
import os
import subprocess
import sys

import pytest
from trainprobes.transforms.launch import RECORD_DIR, RECORDED, finish_rank, node_code

HERE = os.path.dirname(os.path.abspath(__file__))
M = "transforms_user_steps:"


@pytest.mark.parametrize("records, failures, code", [
    ([{"rank": 0, "code": 1}, {"rank": 1, "code": 0}], None, 1),     # rank 0's finding
    ([{"rank": 0, "code": 0}, {"rank": 1, "code": 0}], None, 0),
    ([{"rank": 3, "code": 0}, {"rank": 2, "code": 0}], None, 0),     # a node without rank 0
    ([{"rank": 0, "code": 0}], None, 3),                             # a rank left no record
    ([], [RECORDED + 2, -15], 2),                 # a refusal, its peer killed by torchrun
    ([], [-15, RECORDED + 3], 3),
    ([], [RECORDED + 3, RECORDED + 2], 2),        # the deliberate error before peers' crashes
    ([], [1, -15], 3),                            # exit 1 outside the contract is no finding
    ([{"rank": 1, "code": 2}], [RECORDED + 3], 2),  # the refusal recorded, its peer crashed first
])
def test_a_node_exits_with_the_contracts_code(records, failures, code):
    assert node_code(records, failures, 2)[0] == code


def test_a_rank_exits_by_the_contract_unless_the_launcher_records_it(tmp_path, monkeypatch):
    monkeypatch.delenv(RECORD_DIR, raising=False)
    assert [finish_rank(0, c) for c in (0, 1, 2, 3)] == [0, 1, 2, 3]
    monkeypatch.setenv(RECORD_DIR, str(tmp_path))
    assert [finish_rank(5, c) for c in (1, 2)] == [0, RECORDED + 2]
    assert json.loads((tmp_path / "rank5.json").read_text()) == {"rank": 5, "code": 2}


def launch(*probe_args):
    cmd = [sys.executable, "-m", "trainprobes.transforms.launch", "--nproc-per-node", "2",
           "--standalone", "--", "--target", M + "step", "--backend", "gloo",
           "--trials", "4", *probe_args]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=HERE, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_the_users_step_under_torchrun_passes_with_exit_0():
    p = launch("--step", "transforms_user_fsdp", "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    doc = json.loads(p.stdout[p.stdout.index("{"):])
    assert doc["metrics"]["transform_verdict"] == "noise" and doc["metrics"]["transform"] == "step"


@pytest.mark.slow
def test_a_setup_that_raises_under_torchrun_exits_2_naming_the_rank():
    p = launch("--step", M + "fsdp_step", "--setup", M + "raising_setup")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "setup transforms_user_steps:raising_setup raised on rank 1 of 2" in p.stderr


def test_two_torchrun_nodes_on_one_host_gave_the_local_ranks_verdict_bit_for_bit():
    """scripts/transforms_two_nodes.py's saved run (about a minute; not rerun here)."""
    with open(os.path.join(HERE, "data", "transforms_two_nodes.json"), encoding="utf-8") as f:
        doc = json.load(f)
    bug, ok = doc["cases"]["fsdp2 local tokens (bug)"], doc["cases"]["fsdp2 module (correct)"]
    for case in (bug, ok):
        assert case["same_verdict"] and case["metrics"] == case["local"]
        assert case["wall_s"] < 120  # both agents shut down at once (plain torchrun waited 300 s)
    assert bug["metrics"]["transform_verdict"] == "biased" and bug["exit_codes"] == [0, 1]
    assert ok["metrics"]["transform_verdict"] == "noise" and ok["exit_codes"] == [0, 0]


RV = "transforms_review_steps:"


@pytest.mark.slow
def test_a_setup_that_never_returns_under_torchrun_stops_at_the_timeout_with_exit_2():
    """The torchrun entry had no timeout: rank 1 asleep in its setup, rank 0 in the next
    collective, the launcher waited for gloo's 30 minutes (or forever)."""
    p = subprocess.run([sys.executable, "-m", "trainprobes.transforms.launch", "--nproc-per-node", "2",
                        "--standalone", "--", "--target", RV + "step", "--step",
                        RV + "dp_step", "--setup", RV + "hanging_setup", "--trials", "4", "--timeout", "5"],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=HERE, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "did not finish within timeout=5s" in p.stderr


@pytest.mark.slow
def test_the_ranks_die_with_a_killed_launcher(tmp_path):
    """SIGKILL of `python -m trainprobes.transforms.launch` left its ranks running, orphaned."""
    import signal
    import time

    from trainprobes.lifetime import is_alive
    p = subprocess.Popen([sys.executable, "-m", "trainprobes.transforms.launch", "--nproc-per-node", "2",
                          "--standalone", "--", "--target", RV + "step", "--step",
                          RV + "dp_step", "--setup", RV + "hanging_setup", "--trials", "4"],
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PIDS_DIR": str(tmp_path)}, cwd=HERE,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = []
    try:
        end = time.monotonic() + 90
        while len(pids) < 2 and time.monotonic() < end and p.poll() is None:
            time.sleep(0.2)
            pids = [int(f.read_text()) for f in tmp_path.iterdir() if f.read_text()]
        assert len(pids) == 2, "the ranks never reached their setup"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        end = time.monotonic() + 10
        while any(is_alive(q) for q in pids) and time.monotonic() < end:
            time.sleep(0.2)
        assert not [q for q in pids if is_alive(q)], "ranks outlived their launcher"
    finally:
        for q in pids:
            if is_alive(q):
                os.kill(q, signal.SIGKILL)
        if p.poll() is None:
            p.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited: its parent has not reaped it yet
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _sigint_default() -> None:
    """In the child: Ctrl-C as a terminal delivers it. A suite run in the background (`cmd &`
    in a script) ignores SIGINT, the child inherits that, and rightly stays running."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupted(cmd: list, tmp_path) -> tuple:
    """(exit code, stderr, the ranks' pids) of cmd (ranks running waiting_step) sent SIGINT
    once both ranks are inside a trial."""
    import signal
    import time
    mark = tmp_path / "running"
    p = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "TRAINPROBES_TEST_MARK": str(mark)},
                         cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_sigint_default)
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"running.{r}").exists() for r in (0, 1)):  # both ranks in a trial
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(0.3)  # the pid files are written whole
        pids = [int((tmp_path / f"running.{r}").read_text()) for r in (0, 1)]
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    time.sleep(1.0)
    return p.returncode, err, pids


@pytest.mark.slow
def test_ctrl_c_on_the_launcher_exits_130_in_one_line_and_leaves_no_rank(tmp_path):
    cmd = [sys.executable, "-m", "trainprobes.transforms.launch", "--nproc-per-node", "2",
           "--standalone", "--", "--target", M + "step", "--backend", "gloo",
           "--trials", "400", "--step", M + "waiting_step"]
    code, err, pids = _interrupted(cmd, tmp_path)
    assert code == 130, err[-3000:]
    assert "internal error" not in err and "Traceback" not in err, err[-3000:]
    # one line of ours (the ranks stopped by torchrun's agent say nothing); torchrun's own
    # agent logs its shutdown ("Received 2 death signal ...") on lines marked W....
    ours = [line for line in err.splitlines() if line.strip() and not line.startswith("W")]
    assert ours == ["interrupted"], err[-3000:]
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.slow
def test_ctrl_c_on_the_cli_exits_130_in_one_line_and_leaves_no_rank(tmp_path):
    cmd = [sys.executable, "-m", "trainprobes", "transforms", "--target", M + "step", "--world", "2",
           "--trials", "400", "--step", M + "waiting_step"]
    code, err, pids = _interrupted(cmd, tmp_path)
    assert (code, err.strip()) == (130, "interrupted"), err[-3000:]
    assert [pid for pid in pids if _alive(pid)] == []
