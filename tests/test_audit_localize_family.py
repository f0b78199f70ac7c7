"""The audit family drift_localize (trainprobes.audit.localize_family): one control per demo
case, reproduced only at its stage, op and kind; not in the default audit."""
import pytest
from trainprobes.audit.suites import FAMILIES, default_suite

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_registered_by_name_only():
    from trainprobes.drift.localize_demo import CASES
    assert FAMILIES["drift_localize"].default is False
    checks, skipped = default_suite(families=["drift_localize"], in_process=True)
    assert not skipped and [c.name for c in checks] == [c.name for c in CASES]
    assert all(c.control and c.family == "drift_localize" for c in checks)
    assert "drift_localize" not in [c.family for c in default_suite(in_process=True)[0]]


def test_a_control_is_reproduced_only_where_injected():
    checks, _ = default_suite(families=["drift_localize"], in_process=True)
    r = next(c for c in checks if c.name == "block 2's MLP in bf16").run()
    assert r.reproduced and r.metrics["matches_known_verdict"] is True
    assert r.evidence["plots"][0]["kind"] == "stages"
    from trainprobes.drift.localize_demo import reproduced
    r.metrics["first_layer"] = "model.layers.1"  # found elsewhere: a fail, but not this control's
    assert r.verdict == r.expected == "fail" and not reproduced(r)
