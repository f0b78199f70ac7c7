"""Audit sections [[documents]] and [[batch_invariance]] (a user's target or model factory by
import path), and the default-suite family builders."""
import pytest
from trainprobes.audit import run_suite
from trainprobes.audit.config import ConfigError, suite_from_config
from trainprobes.audit.suites import isolation_documents_checks, isolation_ops_checks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

C = "trainprobes.isolation.controls"


def test_documents_section_with_a_factory_and_thresholds():
    cfg = {"documents": [{"name": "packed", "factory": f"{C}:causal_over_row", "lengths": [5, 6],
                          "vocab": 50, "causal": False},
                         {"name": "ok", "factory": f"{C}:block_diagonal", "lengths": [[5, 6], [4, 7]],
                          "vocab": 50, "fail_above": {"max_cross_change": 0.0}}]}
    checks, _ = suite_from_config(cfg, seed=2)
    bad, good = run_suite(checks)[0]
    assert bad.target == "packed" and bad.verdict == "fail" and "TP-I1" in bad.codes and bad.seed == 2
    assert good.verdict == "pass" and good.metrics["n_documents"] == 4


def test_batch_invariance_section_with_inputs():
    cfg = {"batch_invariance": [{"target": f"{C}:split_by_batch", "inputs": f"{C}:integer_rows",
                                 "sizes": [2, 3]},
                                {"target": f"{C}:exact_matmul", "inputs": f"{C}:integer_rows",
                                 "sizes": [2]}]}
    checks, _ = suite_from_config(cfg)
    variant, invariant = run_suite(checks)[0]
    assert variant.verdict == "fail" and variant.codes == ["TP-I2"]
    assert invariant.verdict == "pass" and invariant.metrics["batch_invariant"] is True


@pytest.mark.parametrize("section, entry, match", [
    ("documents", {"factory": "x:y", "lengths": [3], "vocab": 5, "hidden": 4}, "exactly one of vocab"),
    ("documents", {"lengths": [3], "vocab": 5}, "missing 'factory'"),
    ("documents", {"factory": "x:y", "lengths": [3], "vocab": 5, "batchd": True}, r"unknown keys \['batchd'\]"),
    ("batch_invariance", {"target": "x:y", "shape": [0]}, "positive integers"),
    ("batch_invariance", {"target": "x:y", "sizez": [2]}, r"unknown keys \['sizez'\]")])
def test_config_mistakes_name_the_key(section, entry, match):
    with pytest.raises(ConfigError, match=match):
        suite_from_config({section: [entry]})


def test_ops_family_one_check_per_op_and_results_per_shape_and_dtype(monkeypatch):
    checks = isolation_ops_checks(quick=True)
    assert {c.family for c in checks} == {"isolation"}
    emb = [c for c in checks if c.name.endswith("torch.embedding on cpu")]
    results = emb[0].run()
    assert [r.evidence["dtype"] for r in results] == ["fp32", "bf16"]
    assert all(r.metrics["batch_invariant"] is True for r in results)  # a gather: invariant


def test_documents_family_marks_the_verdicts_the_design_fixes_as_controls(monkeypatch):
    """One check per attention implementation present; rows whose verdict transformers'
    mechanism fixes are controls: the mask_4d rows expected to isolate, the cached call and
    packed position ids beside a mask of ones expected to leak (by design); a row the design
    does not fix stays a finding. The table itself runs in test_isolation_hf."""
    from trainprobes.isolation import hf
    from trainprobes.result import Result

    def fake_table(families, impls, seed=0):
        return [hf.TableRow(f, impls[0], conv, Result("isolation.documents", f"{f}[{conv}]", verdict,
                                                      metrics={"isolated": verdict == "pass"}), 0.0)
                for f in families for conv, verdict in (("flattening", "fail"), ("mask_4d", "pass"),
                                                        ("position_ids_ones_mask", "fail"))]
    monkeypatch.setattr(hf, "packed_table", fake_table)
    checks = isolation_documents_checks(quick=True)
    assert [c.name for c in checks] == [f"packed documents under {i} attention"
                                        for i in hf.available_implementations() if i != "flex_attention"]
    assert len(isolation_documents_checks()) == len(hf.available_implementations())
    cached, control, ones = checks[0].run()
    assert control.expected == "pass" and control.reproduced
    assert cached.expected == ones.expected == "fail" and cached.reproduced and ones.reproduced
    assert "leaky by transformers' design" in ones.message
    monkeypatch.setattr(hf, "design_verdict", lambda impl, conv, rows=1: None)   # a row the design leaves open
    assert checks[0].run()[0].expected is None
    assert control.metrics["by_hand_change"] == 0.0 and control.message.startswith("control")
