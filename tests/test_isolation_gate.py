"""The gate on isolation Results (result.PROBES documents their verdict booleans): an isolated
target that leaks, or a batch-invariant one that becomes variant, blocks."""
import pytest
from trainprobes.gate import compare
from trainprobes.result import Result


def needs(probe, value):
    """The metrics the gate reads beside the verdict boolean, agreeing with its value (trainprobes.gate.rules.COUNTS)."""
    bad = value is False
    return {"isolation.documents": {"n_leaks": int(bad), "max_leak": float(bad), "n_unverified": 0,
                                    "n_blind_tokens": 0},
            "isolation.end_to_end": {"max_abs_diff": float(bad), "frac_tokens_differ": bad / 4},
            }.get(probe, {"max_abs_diff": float(bad), "frac_rows_differ": bad / 4,
                          "breaking_sizes": [2] if bad else []})


def res(probe, metric, value, verdict="pass", codes=()):
    return Result(probe, "t", verdict, metrics={metric: value, **needs(probe, value)},
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


def test_each_isolation_probe_reports_only_documented_metrics_and_its_verdict_boolean():
    import torch
    from trainprobes.gate import check_judgeable
    from trainprobes.isolation import batch_invariance, documents
    from trainprobes.isolation.controls import (
        VOCAB,
        block_diagonal,
        causal_over_row,
        exact_matmul,
        integer_rows,
        split_by_batch,
    )
    from trainprobes.isolation.end_to_end import end_to_end
    from trainprobes.result import PROBES, VERDICT_FLAGS

    x = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    seqs = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))

    def lm(ids):  # exact integer logits: batch-invariant
        return torch.log_softmax(integer_rows(0, VOCAB)[:, :VOCAB][ids][:, :-1], -1).gather(
            2, ids[:, 1:, None])[..., 0]
    results = [documents(block_diagonal(), x, [4, 6], vocab=VOCAB, causal=False),
               documents(causal_over_row(), x, [4, 6], vocab=VOCAB, cuts=[4]),
               batch_invariance(exact_matmul, integer_rows(), sizes=(2,)),
               batch_invariance(split_by_batch, integer_rows(), sizes=(2,)),
               end_to_end(lm, seqs, sizes=(2,))]
    for r in results:
        spec = PROBES[r.probe]
        assert not [k for k in r.metrics if not spec.documents(k)], r.probe
        assert (r.flag() is VERDICT_FLAGS[spec.flag]) == r.passed, (r.probe, r.verdict)
        check_judgeable(r, "candidate")
        assert Result.from_json(r.to_json()) == r


def test_the_machine_op_map_is_advisory_a_variant_op_warns_and_never_passes():
    """isolation.op_map describes this torch build and device: batch_invariant False is a
    warn with TP-I2 (CPU fp32 GEMMs are variant on a healthy machine), never a pass, and the
    gate still blocks an op that was invariant and is variant now."""
    from trainprobes.isolation.ops import op_map
    op = "isolation.op_map"
    warned = res(op, "batch_invariant", False, "warn", ["TP-I2"])
    assert compare([warned], [warned]).exit_code == 0
    rep = compare([res(op, "batch_invariant", True)], [warned])
    assert rep.exit_code == 1 and [r.code for r in rep.blocking] == ["TP-I2"]
    for edited in (res(op, "batch_invariant", False, "pass"),        # a variant op passing
                   res(op, "batch_invariant", False, "warn")):       # a warn with no code
        rep = compare([res(op, "batch_invariant", True)], [edited])
        assert rep.exit_code == 2 and "batch_invariant" in rep.cannot_judge
    # the same rule for the user's own target stays a failure
    rep = compare([res("isolation.batch_invariance", "batch_invariant", True)],
                  [res("isolation.batch_invariance", "batch_invariant", False, "warn", ["TP-I2"])])
    assert rep.exit_code == 2
    # the real map: a split-K-like op warns, an invariant one passes
    for r in op_map(["mm", "softmax"], dtypes=("fp32",), sizes=(2, 4), trials=1, quick=True):
        assert r.probe == op
        assert r.verdict == ("pass" if r.metrics["batch_invariant"] else "warn")
