"""examples/compute_multiplier, the parallel half: audit each variant of the trainer's
parallel setup, gate it against the accepted one. Changing the accumulation normalisation
to a mean of micro-batch means, or FSDP2's gradient reduction to bf16 (over the team's noise
budget), is blocked; the accepted setup on other data passes."""
import pytest
from test_example_gate import audit, gate  # the same audit-then-gate steps as the other half
from trainprobes.result import load_results

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def accumulation(tmp_path_factory):
    return audit(tmp_path_factory.mktemp("acc"), "accumulation")


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
