"""examples/compute_multiplier, the parallel half: audit each variant of the trainer's
parallel setup, gate it against the accepted one. Changing the accumulation normalisation
to a mean of micro-batch means, or FSDP2's gradient reduction to bf16 (over the team's noise
budget), is blocked; the accepted setup on other data passes."""
import json
from pathlib import Path

import pytest
from trainprobes.cli import main
from trainprobes.result import load_results

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "compute_multiplier"


def audit(tmp_path, variant: str, seed: int = 0) -> Path:
    out = tmp_path / variant / str(seed)
    code = main(["audit", "--config", str(EXAMPLE / f"{variant}.toml"), "--out", str(out),
                 "--seed", str(seed), "--no-progress", "--json"])
    assert code == 0, f"audit of {variant} exited {code}"
    (report,) = out.glob("*/report.json")
    return report


@pytest.fixture(scope="module")
def accumulation(tmp_path_factory):
    return audit(tmp_path_factory.mktemp("acc"), "accumulation")


def gate(baseline, candidate, capsys):
    capsys.readouterr()
    code = main(["gate", "--baseline", str(baseline), "--candidate", str(candidate), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_accepted_accumulation_is_equivalent_and_passes_on_other_data(accumulation, tmp_path, capsys):
    (r,) = load_results(accumulation)[0]
    assert r.target == "trainer.accumulation" and r.metrics["equivalent"] is True and r.verdict == "pass"
    code, doc = gate(accumulation, audit(tmp_path, "accumulation", seed=1), capsys)
    assert code == 0 and doc["regressions"] == [] and doc["compared"] == 1


def test_a_mean_of_micro_batch_means_is_blocked(accumulation, tmp_path, capsys):
    code, doc = gate(accumulation, audit(tmp_path, "accumulation_mean_of_means"), capsys)
    assert code == 1
    assert {(r["code"], r["target"]) for r in doc["regressions"]} >= {("TP-T1", "trainer.accumulation")}


def test_a_bf16_gradient_reduction_over_the_noise_budget_is_blocked(tmp_path, capsys):
    baseline = audit(tmp_path, "fsdp2")
    candidate = audit(tmp_path, "fsdp2_bf16_reduce")
    code, doc = gate(baseline, candidate, capsys)
    assert code == 1 and [(r["code"], r["target"]) for r in doc["regressions"]] == [("TP-T3", "trainer.fsdp2")]
    (fsdp,) = load_results(candidate)[0]
    # zero-mean noise (2 ranks: nothing biased to find), a thousand times fp32's, over the budget
    assert fsdp.metrics["transform_verdict"] == "noise" and fsdp.metrics["max_added_error"] > 1e-3
