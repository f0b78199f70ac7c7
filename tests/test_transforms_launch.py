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
    from trainprobes.distributed.launcher import free_port
    cmd = [sys.executable, "-m", "trainprobes.transforms.launch", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "--", "--target", M + "step", "--backend", "gloo",
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
