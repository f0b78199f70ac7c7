"""The zoo through the probe on 2 gloo ranks: every published bug gets its known verdict,
every fixed twin is exact or noise, scale factors contain the analytic values, and what
today's tolerance checks would have said."""
import pytest
from trainprobes.reference.bugs import ZOO
from trainprobes.transforms.judge import EQUIVALENT, LOSS
from trainprobes.transforms.zoo import analytic_checks, run_zoo

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def rows():
    return run_zoo(trials=8, seed=1)


def test_every_bug_gets_its_known_verdict_and_every_fixed_twin_is_equivalent(rows):
    assert [r.bug.name for r in rows] == [b.name for b in ZOO]
    for row in rows:
        assert row.buggy.metrics["transform_verdict"] == row.bug.expected, (row.bug.name, row.buggy.message)
        assert row.fixed.metrics["transform_verdict"] in EQUIVALENT, (row.bug.name, row.fixed.message)
        assert row.reproduced and row.buggy.reproduced and row.fixed.reproduced
        assert row.buggy.codes == (["TP-T2"] if row.bug.expected == "inconsistent" else ["TP-T1"])


def test_the_worst_parameter_is_where_the_bug_sits(rows):
    for row in rows:
        where = tuple(LOSS if w == "loss" else w for w in row.bug.where)
        assert row.buggy.metrics["worst_parameter"] in where, row.bug.name


def test_scale_factors_contain_the_analytic_values(rows):
    checks = [(row.bug.name, c) for row in rows for c in analytic_checks(row)]
    assert len(checks) >= 12
    for name, (what, value, est, lo, hi, within) in checks:
        assert within, f"{name} {what}: analytic {value}, measured {est} [{lo}, {hi}]"


def test_what_tolerance_checks_would_have_flagged(rows):
    """Against the single-device step in fp32: a 5% loss tolerance cannot see a bug that
    leaves the loss alone; rtol 1e-5 on gradients cannot see a loss-only bug; a bitwise loss
    comparison flags correct transforms too (reduction order)."""
    flagged = {k: {r.bug.name for r in rows if r.buggy.evidence["tolerances"][k]}
               for k in ("loss_rtol_5pct", "grad_rtol_1e-5", "loss_bitwise")}
    names = {b.name for b in ZOO}
    assert names - flagged["loss_rtol_5pct"] == {"sp_layernorm", "doubled_expert_grads", "pp_repeated_scaling",
                                                 "cp_loss_scaling", "cp_mtp_loss", "ep_expert_grad_scale",
                                                 "ep_lost_remote_grad"}
    assert names - flagged["grad_rtol_1e-5"] == {"cp_eval_loss"}
    assert flagged["loss_bitwise"] == names
    assert not any(r.fixed.evidence["tolerances"]["grad_rtol_1e-5"] for r in rows)
    assert sum(bool(r.fixed.evidence["tolerances"]["loss_bitwise"]) for r in rows) >= 7


def test_every_metric_is_documented_in_the_registry(rows):
    from trainprobes.result import PROBES, Result
    spec = PROBES["transforms.equivalence"]
    for row in rows:
        for r in (row.buggy, row.fixed):
            assert [k for k in r.metrics if not spec.documents(k)] == []
            for k, v in r.metrics.items():
                if spec.is_number(k):
                    assert isinstance(v, (int, float)) and not isinstance(v, bool), k
            assert r.flag() is r.passed and Result.from_json(r.to_json()) == r
