"""The gate's isolation rules: an isolated target that leaks, or a batch-invariant one that
becomes variant, blocks; the same metric from another probe does not."""
import pytest
from trainprobes.gate import compare
from trainprobes.result import Result


def res(probe, metric, value, verdict="pass", codes=()):
    return Result(probe, "t", verdict, metrics={metric: value}, codes=list(codes))


@pytest.mark.parametrize("probe, metric, code", [
    ("isolation.documents", "isolated", "TP-I1"),
    ("isolation.batch_invariance", "batch_invariant", "TP-I2"),
    ("isolation.end_to_end", "batch_invariant", "TP-I2")])
def test_true_to_false_blocks_with_the_isolation_code(probe, metric, code):
    # a warn verdict (batch variance is not a failure by itself) must still block here
    rep = compare([res(probe, metric, True)], [res(probe, metric, False, "warn", [code])])
    assert rep.exit_code == 1 and [r.code for r in rep.blocking] == [code]
    assert compare([res(probe, metric, True)], [res(probe, metric, True)]).exit_code == 0
    assert compare([res(probe, metric, False, "warn")],
                   [res(probe, metric, False, "warn")]).exit_code == 0


def test_isolation_unknown_in_the_candidate_is_not_a_pass_by_default():
    # isolated None (unverified noise) is a warn, not the leak code; the verdict rule decides
    rep = compare([res("isolation.documents", "isolated", True)],
                  [res("isolation.documents", "isolated", None, "warn", [])])
    assert rep.exit_code == 0
    rep = compare([res("isolation.documents", "isolated", True)],
                  [res("isolation.documents", "isolated", None, "fail", ["TP-C2"])])
    assert rep.exit_code == 1 and rep.blocking[0].code == "TP-C2"


def test_causality_batch_invariant_metric_is_not_an_isolation_rule():
    rep = compare([res("causality.check", "batch_invariant", True)],
                  [res("causality.check", "batch_invariant", False)])
    assert rep.exit_code == 0
