import json

import pytest
from trainprobes.result import Result, SchemaError, load_results, save_results


def _r(**kw):
    base = dict(probe="numerics.bias", target="t", verdict="fail", metrics={"bias": -1e-3, "x": float("nan")},
                evidence={"rows": [1, 2]}, seed=7, codes=["TP-B1"], message="m")
    base.update(kw)
    return Result(**base)


def test_roundtrip_json():
    r = _r()
    back = Result.from_json(r.to_json())
    assert back.to_dict() == r.to_dict()
    assert back.metrics["x"] == "nan" and back.seed == 7


def test_report_roundtrip_and_atomic(tmp_path):
    p = save_results(tmp_path / "r.json", [_r(), _r(target="u", verdict="pass", codes=[])], suite="s")
    results, meta = load_results(p)
    assert [r.target for r in results] == ["t", "u"] and meta["suite"] == "s"
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind


def test_truncated_and_newer_schema_refused(tmp_path):
    p = save_results(tmp_path / "r.json", [_r()])
    p.write_text(p.read_text()[:50])
    with pytest.raises(SchemaError, match="not valid JSON"):
        load_results(p)
    doc = {"schema_version": 99, "results": []}
    p.write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match="newer"):
        load_results(p)
    with pytest.raises(SchemaError, match="does not exist"):
        load_results(tmp_path / "missing.json")


def test_bad_verdict_and_code():
    with pytest.raises(ValueError, match="verdict"):
        _r(verdict="ok")
    with pytest.raises(ValueError, match="TP-X9"):
        _r(codes=["TP-X9"])


def test_written_report_has_ordinary_file_mode(tmp_path):
    import os
    umask = os.umask(0o022)
    try:
        p = save_results(tmp_path / "r.json", [_r()])
    finally:
        os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("field,value,match", [("metrics", [1], r"metrics=\[1\] must be a dict"),
                                               ("evidence", None, "evidence=None must be a dict"),
                                               ("target", None, "target=None must be a string"),
                                               ("probe", 3, "probe=3 must be a string"),
                                               ("codes", "TP-B1", r"codes='TP-B1' must be a list")])
def test_hand_edited_report_with_wrong_field_types_is_refused_at_load(tmp_path, field, value, match):
    # was: metrics=[1] crashed the gate with AttributeError (exit 1, read as "blocked"), and
    # target=None loaded and matched nothing
    with pytest.raises(ValueError, match=match):
        _r(**{field: value})
    path = tmp_path / "r.json"
    save_results(path, [_r()])
    doc = json.loads(path.read_text())
    doc["results"][0][field] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match=match):
        load_results(path)


def test_a_control_carries_its_expected_verdict_through_json():
    r = Result("causality.check", "trainprobes.reference.routing:expert_choice", "fail",
               expected="fail")
    back = Result.from_json(r.to_json())
    assert back.expected == "fail" and back.is_control and back.reproduced is True
    missed = Result("causality.check", "x", "pass", expected="fail")
    assert missed.reproduced is False
    finding = Result("causality.check", "x", "fail")
    assert not finding.is_control and finding.reproduced is None
    with pytest.raises(ValueError, match=r"expected='leaky' must be None \(a finding\) or one of"):
        Result("causality.check", "x", "fail", expected="leaky")
