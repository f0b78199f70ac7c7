"""The gate on isolation Results (result.PROBES documents their verdict booleans): an isolated
target that leaks, or a batch-invariant one that becomes variant, blocks."""
import pytest
from trainprobes.gate import compare
from trainprobes.result import Result

NEEDS = {"isolation.documents": {"n_leaks": 0, "max_leak": 0.0},
         "isolation.batch_invariance": {"max_abs_diff": 0.0},
         "isolation.end_to_end": {"max_abs_diff": 0.0}}


def res(probe, metric, value, verdict="pass", codes=()):
    return Result(probe, "t", verdict, metrics={metric: value, **NEEDS.get(probe, {})},
                  codes=list(codes))


@pytest.mark.parametrize("probe, metric, code", [
    ("isolation.documents", "isolated", "TP-I1"),
    ("isolation.batch_invariance", "batch_invariant", "TP-I2"),
    ("isolation.end_to_end", "batch_invariant", "TP-I2")])
def test_true_to_false_blocks_with_the_isolation_code(probe, metric, code):
    rep = compare([res(probe, metric, True)], [res(probe, metric, False, "fail", [code])])
    assert rep.exit_code == 1 and [r.code for r in rep.blocking] == [code]
    assert compare([res(probe, metric, True)], [res(probe, metric, True)]).exit_code == 0
    # variant in both (a machine's fp32 GEMM): no change, nothing to block
    assert compare([res(probe, metric, False, "fail", [code])],
                   [res(probe, metric, False, "fail", [code])]).exit_code == 0


def test_isolation_unknown_never_passes():
    rep = compare([res("isolation.documents", "isolated", True)],
                  [res("isolation.documents", "isolated", None, "warn")])
    assert rep.exit_code == 2 and "isolated" in rep.cannot_judge  # a pass-like unknown: fail closed
    rep = compare([res("isolation.documents", "isolated", True)],
                  [res("isolation.documents", "isolated", None, "fail", ["TP-C2"])])
    assert rep.exit_code == 1 and rep.blocking[0].code == "TP-C2"
