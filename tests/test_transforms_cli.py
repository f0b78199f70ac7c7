"""`trainprobes transforms`: the zoo table, a user's target with transforms, --json in the
report document shape, and what a hurried newcomer types."""
import json

import pytest
from trainprobes.cli import main
from trainprobes.result import Result

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SUMMARY = ("transform", "world", "dtype", "equivalent", "verdict", "scale", "scale_ci_low",
           "scale_ci_high", "worst_parameter", "transform_verdict")


def test_list_shows_transforms_options_and_the_zoo(capsys):
    assert main(["transforms", "--list"]) == 0
    out = capsys.readouterr().out
    for word in ("ddp", "fsdp2", "micro_batches", "normalization", "mean_of_means", "Megatron-LM #6660"):
        assert word in out


@pytest.mark.parametrize("argv, message", [
    (["--target", "trainprobes.transforms.demo:step", "--transform", "fsdp3"], "did you mean 'fsdp2'"),
    (["--target", "trainprobes.transforms.demo:nope"], "has no attribute 'nope'"),
    (["--target", "trainprobes.transforms.demo:model"], "must be a trainprobes.transforms.TrainingStep"),
    (["--transform", "ddp"], "--transform needs --target"),
    (["--world", "100000"], "--world 100000 needs --target"),  # the zoo ran on 2 ranks, exit 0
    (["--target", "trainprobes.transforms.demo:step", "--transform", "accumulation:micro_batches=3"],
     "not divisible by world=2 x micro_batches=3"),
])
def test_mistakes_exit_2_naming_what_was_passed(capsys, argv, message):
    assert main(["transforms", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_numbers_are_refused_by_the_parser(capsys):
    assert main(["transforms", "--trials", "2"]) == 2
    assert "trials=2 must be an int >= 4" in capsys.readouterr().err


@pytest.mark.slow
def test_a_target_with_two_transforms_prints_one_object_each(capsys, tmp_path):
    code = main(["transforms", "--target", "trainprobes.transforms.demo:step", "--transform", "ddp",
                 "--transform", "accumulation:normalization=mean-of-means", "--trials", "16",
                 "--json", "--output", str(tmp_path / "r.json")])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1  # the mean of micro-batch means is a finding
    assert doc["command"] == "transforms" and isinstance(doc["schema_version"], int)
    first, second = doc["results"]
    for obj in (first, second):
        assert all(k in obj for k in SUMMARY)
        assert Result.from_dict(obj).probe == "transforms.equivalence"  # each is a Result too
    assert first["transform"] == "ddp" and first["equivalent"] is True and first["verdict"] == "pass"
    assert second["transform_verdict"] == "biased" and second["equivalent"] is False
    assert second["world"] == 2 and second["dtype"] == "fp32"
    assert (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_the_zoo_table_reports_caught_n_of_n(capsys):
    assert main(["transforms", "--trials", "8"]) == 0
    out = capsys.readouterr().out
    assert "caught 13 of 13 published bugs with their known verdict; fixed twins equivalent: 13 of 13" in out
    assert "a 5% loss tolerance flags 6 of 13" in out and "rtol 1e-5 on gradients flags 12 of 13" in out
    assert "analytic scale factors inside the measured CI: 36 of 36" in out


def test_torchrun_entry_without_environment_says_what_to_do(capsys, monkeypatch):
    from trainprobes.transforms.torchrun import main as torchrun_main
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert torchrun_main(["--target", "trainprobes.transforms.demo:step"]) == 2
    assert "run under torchrun" in capsys.readouterr().err


@pytest.mark.slow
def test_a_probe_runs_under_torchrun():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "trainprobes.transforms.torchrun",
           "--target", "trainprobes.transforms.demo:step", "--transform", "ddp", "--backend", "gloo",
           "--trials", "4", "--json"]
    p = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    doc = json.loads(p.stdout[p.stdout.index("{"):])
    assert doc["metrics"]["equivalent"] is True and doc["metrics"]["world"] == 2


R = "transforms_review_steps:"
U = "transforms_user_steps:"


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["--target", U + "step", "--step", U + "fsdp_step", "--setup", U + "raising_setup"],
     "setup transforms_user_steps:raising_setup raised on rank 1 of 2: RuntimeError: no such device mesh"),
    (["--target", U + "step", "--step", U + "forgetful_step", "--setup", U + "fsdp_setup"],
     "returned no gradient for 2 parameter(s) on any rank, e.g. ['4.weight', '4.bias']"),
    (["--target", R + "step", "--step", "transforms_user_bad_partition"],
     "partitions['0.weight'] does not tile the parameter: the pieces of ranks [0, 1] along dim 0 have sizes [8, 8]"),
    (["--target", R + "short_step", "--step", R + "dp_step", "--setup", R + "plain_ddp_setup"],
     "ran dry after 3 batch(es); 4 trials need 4"),
    (["--target", U + "step", "--step", U + "fsdp_step", "--setup", U + "renaming_setup"],
     "missing 8 parameter(s) of the single-device model: '0.weight' (closest found: ['net.0.weight'])"),
], ids=["setup raises", "gradients missing", "partition does not tile", "data runs dry", "names mismatch"])
def test_bad_input_to_a_users_step_exits_2_naming_it(capsys, monkeypatch, args, says):
    import os
    monkeypatch.chdir(os.path.dirname(os.path.abspath(__file__)))
    assert main(["transforms", *args, "--trials", "4", "--timeout", "120"]) == 2
    err = capsys.readouterr().err
    assert says in err, err[-2000:]
