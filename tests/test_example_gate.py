"""The compute-multiplier example end to end: audit each variant, gate it against the
fp32 token-choice baseline. The gate must block bf16 all-reduce and expert choice."""
import json
from pathlib import Path

import pytest
from trainprobes.cli import main
from trainprobes.result import load_results

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "compute_multiplier"


def audit(tmp_path, variant: str, seed: int = 0) -> Path:
    """The README's commands: the candidate audited with --report-only, read through latest."""
    out = tmp_path / variant / str(seed)
    code = main(["audit", "--config", str(EXAMPLE / f"{variant}.toml"), "--out", str(out),
                 "--seed", str(seed), "--no-progress", "--json", "--report-only"])
    assert code == 0, f"audit of {variant} exited {code}"
    return out / "latest" / "report.json"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return audit(tmp_path_factory.mktemp("cm"), "baseline")


def gate(baseline, candidate, capsys):
    capsys.readouterr()
    code = main(["gate", "--baseline", str(baseline), "--candidate", str(candidate), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_baseline_audit_is_clean(baseline):
    results, _ = load_results(baseline)
    by_target = {r.target: r for r in results}
    assert sorted(by_target) == ["trainer.grad_allreduce", "trainer.router"]
    assert by_target["trainer.router"].metrics["causal"] is True
    assert by_target["trainer.grad_allreduce"].metrics["biased"] is False
    assert all(r.verdict == "pass" for r in results)


def test_gate_passes_fp32_token_choice_on_fresh_data(baseline, tmp_path, capsys):
    code, doc = gate(baseline, audit(tmp_path, "baseline", seed=1), capsys)
    assert code == 0 and doc["regressions"] == [] and doc["compared"] == 2


def test_gate_blocks_bf16_allreduce(baseline, tmp_path, capsys):
    candidate = audit(tmp_path, "bf16_allreduce")
    code, doc = gate(baseline, candidate, capsys)
    assert code == 1
    assert [(r["code"], r["target"]) for r in doc["regressions"]] == \
        [("TP-G2", "trainer.grad_allreduce")]
    # bf16(1/6) = 0.16699: the ncclAvg pre-multiply makes the average +0.195% too large
    bias = {r.target: r for r in load_results(candidate)[0]}["trainer.grad_allreduce"]
    assert 1.5e-3 < bias.metrics["bias"] < 2.1e-3


def test_a_failing_candidate_audit_exits_1_without_report_only(tmp_path, capsys):
    code = main(["audit", "--config", str(EXAMPLE / "expert_choice.toml"), "--out",
                 str(tmp_path), "--no-progress"])
    assert code == 1 and "FAIL   causality.check trainer.router [TP-C1]" in capsys.readouterr().out


def test_latest_names_the_second_run_too(tmp_path, capsys):
    # was: the README's reports/*/report.json glob matched two files on the second run
    first, second = audit(tmp_path, "baseline"), audit(tmp_path, "baseline")
    assert first == second and len(list(first.parent.parent.glob("2*/report.json"))) == 2
    assert (first.parent.parent / "LATEST").read_text().strip() in str(first.resolve())


def test_gate_blocks_expert_choice(baseline, tmp_path, capsys):
    code, doc = gate(baseline, audit(tmp_path, "expert_choice"), capsys)
    assert code == 1
    assert [(r["code"], r["target"]) for r in doc["regressions"]] == [("TP-C1", "trainer.router")]


def test_trainer_runs_both_switches():
    import sys
    sys.path.insert(0, str(EXAMPLE))
    try:
        import trainer
    finally:
        sys.path.remove(str(EXAMPLE))
    for dtype in ("fp32", "bf16"):
        for router in ("token_choice", "expert_choice"):
            losses = trainer.train(trainer.TrainerConfig(allreduce_dtype=dtype, router=router,
                                                         steps=3, world=2))
            assert len(losses) == 3 and losses[-1] < losses[0]
    with pytest.raises(ValueError, match="router='switch'"):
        trainer.TrainerConfig(router="switch")
