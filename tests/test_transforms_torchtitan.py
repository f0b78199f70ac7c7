"""torchtitan 0.3.0's own parallelize_llama judged by the probe (scripts/torchtitan_check.py,
steps in scripts/torchtitan_steps.py): the saved verdicts read back, and the check itself
run where torchtitan is importable (its own venv: scripts/torchtitan_check.sh)."""
import importlib.util
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "scripts")
with open(os.path.join(HERE, "data", "torchtitan_check.json"), encoding="utf-8") as f:
    SAVED = json.load(f)
CASES = SAVED["cases"]


@pytest.mark.parametrize("name", ["fsdp2 dp2", "tp2", "fsdp2 x tp 2x2"])
def test_torchtitans_fp32_parallelisms_are_equivalent_to_one_device(name):
    c = CASES[name]
    assert c["equivalent"] is True and c["transform_verdict"] == "noise", c["message"]
    assert c["dtype"] == "fp32" and c["max_added_error"] < 1e-6
    assert c["scale_ci_low"] <= 1.0 + 1e-6 and c["scale_ci_high"] >= 1.0 - 1e-6


def test_a_bf16_reduce_dtype_is_rounding_noise_when_declared_and_fails_closed_when_not():
    declared, bare = CASES["fsdp2 dp2 reduce bf16, declared"], CASES["fsdp2 dp2 reduce bf16, undeclared"]
    assert declared["transform_verdict"] == "noise" and declared["dtype"] == "bf16"
    assert abs(declared["scale"] - 1) < 1e-4 and declared["scale_ci_low"] < 1 < declared["scale_ci_high"]
    assert 1e-4 < declared["max_added_error"] < 0.05        # bf16-sized, far above fp32's
    assert bare["equivalent"] is False and 'precisions=("bf16",)' in bare["message"]
    assert CASES["fsdp2 x tp 2x2 reduce bf16, declared"]["transform_verdict"] == "noise"


def test_a_local_token_count_in_torchtitans_loss_is_biased_x_dp():
    c = CASES["fsdp2 dp2 local-token bug"]
    assert c["transform_verdict"] == "biased"
    assert c["scale_ci_low"] <= 2.0 <= c["scale_ci_high"] + 1e-6


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is not installed here (scripts/torchtitan_check.sh makes its venv)")
def test_torchtitans_fsdp2_run_here_is_equivalent():
    sys.path.insert(0, SCRIPTS)
    import torchtitan_steps as tt
    from trainprobes.transforms import Probe, run_probes
    from trainprobes.transforms.user import UserStep
    (r,) = run_probes([Probe(tt.single(), UserStep("torchtitan_steps:step", setup_fn="torchtitan_steps:fsdp"),
                             trials=4)], world=2)
    assert r.metrics["equivalent"] is True, r.message


@pytest.mark.parametrize("existing", [True, False])
def test_the_check_writes_to_the_current_folder_and_never_replaces_unasked(tmp_path, existing):
    # was: its default output was tests/data/torchtitan_check.json, a tracked file, so the
    # script as documented exited 2 ("exists: --force to replace it") on every checkout
    import subprocess
    mine = tmp_path / "torchtitan_check.json"
    if existing:
        mine.write_text("{}")
        args = []
    else:
        args = ["--out", str(tmp_path / "no_such_folder" / "x.json")]
    p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "torchtitan_check.py"), *args],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert ("torchtitan_check.json exists: --force" if existing else "its folder does not exist") in p.stderr
    assert mine.read_text() == "{}" if existing else not mine.exists()
