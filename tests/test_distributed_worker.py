"""probes/distributed/worker.py: case validation and the torchrun entry point."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainprobes.distributed.worker import Case, _torchrun_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("case, world, backend, match", [
    (Case(collective="scan"), 2, "gloo", "collective='scan'"),
    (Case(op="prod"), 2, "gloo", "op='prod'"),
    (Case(data="cauchy"), 2, "gloo", "data='cauchy'"),
    (Case(numel=0), 2, "gloo", "numel=0"),
    (Case(seed=-1), 2, "gloo", "seed=-1"),
    (Case(root=2), 2, "gloo", "root=2"),
    (Case("reduce_scatter", numel=5), 2, "gloo", "divisible by world=2"),
    (Case(dtype="fp8_e4m3fn"), 2, "gloo", "gloo has no float8"),
    (Case(dtype="tf32"), 2, "nccl", "dtype='tf32'"),
    (Case(), 0, "gloo", "world=0"),
])
def test_bad_cases_are_named(case, world, backend, match):
    with pytest.raises(ValueError, match=match):
        case.check(world, backend)


def test_emulated_cases_accept_any_known_format():
    assert Case(dtype="tf32").check(8, "emulated").dtype == "tf32"


def test_torchrun_entry_without_environment_says_what_to_do(capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert _torchrun_main(["--backend", "gloo"]) == 2
    assert "run under torchrun" in capsys.readouterr().err


@pytest.mark.slow
def test_runs_under_torchrun():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "trainprobes.distributed.worker",
           "--backend", "gloo", "--dtype", "bf16", "--op", "avg", "--numel", "300", "--json"]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout[p.stdout.index("{"):])
    assert doc["metrics"]["bitwise_match_fraction"] == 1.0
    assert doc["metrics"]["world"] == 2 and doc["metrics"]["op"] == "avg"


@pytest.mark.parametrize("collective", ["reduce", "all_gather"])
def test_rank_outputs_reach_rank_0_as_raw_bytes(collective):
    # the torchrun entry's gather: bf16 bytes at their own offset, None off the reduce root
    from trainprobes.distributed.launcher import launch
    from trainprobes.distributed.selftest import gather_task
    from trainprobes.distributed.worker import cases_task
    case = Case(collective, "bf16", numel=6)
    direct = launch(cases_task, 2, timeout=120, args=([case], "gloo"))
    gathered = launch(gather_task, 2, timeout=120, args=(collective,))
    assert gathered[1] is None and len(gathered[0]) == 2
    for r in range(2):
        want = direct[r][0]
        assert (gathered[0][r] is None) == (want is None)
        if want is not None:
            assert gathered[0][r].dtype == want.dtype and torch.equal(gathered[0][r], want)
