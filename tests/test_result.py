import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trainprobes.errors import CannotJudge, InvalidArgument, InvalidType
from trainprobes.result import (
    FIELDS,
    PROBES,
    SCHEMA_VERSION,
    VERDICT_FLAGS,
    Result,
    SchemaError,
    dumps_report,
    from_jsonable,
    load_results,
    save_results,
    to_jsonable,
)


def _r(**kw):
    base = dict(probe="numerics.bias", target="t", verdict="fail",
                metrics={"bias": -1e-3, "x": float("nan"), "biased": True},
                evidence={"rows": [1, 2]}, seed=7, codes=["TP-B1"], message="m")
    base.update(kw)
    return Result(**base)


def _strict_loads(text):
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_roundtrip_is_exact_non_finite_floats_included():
    # was: a NaN metric came back as the string "nan" (the gate re-parsed it with _num)
    r = _r(metrics={"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "zero": -0.0,
                    "tiny": 5e-324, "one": 1, "one_f": 1.0, "flag": True, "none": None,
                    "text": "nan"},
           evidence={"errors": [0.5, math.nan, -math.inf], "nested": {"x": [(1, 2)]}})
    text = r.to_json()
    back = Result.from_json(text)
    assert back == r
    m = back.metrics
    assert math.isnan(m["nan"]) and m["inf"] == math.inf and m["-inf"] == -math.inf
    assert math.copysign(1.0, m["zero"]) == -1.0 and m["tiny"] == 5e-324
    assert type(m["one"]) is int and type(m["one_f"]) is float and m["flag"] is True
    assert m["none"] is None and m["text"] == "nan"  # a string stays a string
    assert math.isnan(back.evidence["errors"][1]) and back.evidence["nested"] == {"x": [[1, 2]]}
    _strict_loads(text)  # standard JSON: no NaN / Infinity tokens
    assert _strict_loads(text)["metrics"]["nan"] == {"$float": "nan"}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=10)


@given(metrics=st.dictionaries(st.text(max_size=6), json_values, max_size=5),
       evidence=st.dictionaries(st.text(max_size=6), json_values, max_size=3))
def test_roundtrip_property(metrics, evidence):
    r = Result("p", "t", "pass", metrics=metrics, evidence=evidence)
    text = r.to_json()
    _strict_loads(text)
    back = Result.from_json(text)
    assert back == r and back.to_json() == text


def test_equality_is_by_json():
    a = _r()
    assert a == _r(created=a.created) and a != _r(created=a.created, seed=8)
    a = _r(metrics={"x": 1}, created="c")
    assert a != _r(metrics={"x": 1.0}, created="c")  # an int is not a float, exactly
    assert a != _r(metrics={"x": True}, created="c")


def test_reserved_float_tag_is_refused_not_misread():
    with pytest.raises(InvalidArgument, match=r"\$float"):
        _r(evidence={"odd": {"$float": "user data"}}).to_json()
    assert to_jsonable({"$float": 1, "other": 2}) == {"$float": 1, "other": 2}
    assert from_jsonable({"$float": 1, "other": 2}) == {"$float": 1, "other": 2}
    with pytest.raises(SchemaError, match=r"\$float"):
        from_jsonable({"$float": "NaNish"})


def test_version_1_reports_are_read_with_their_meaning(tmp_path):
    # version 1 wrote non-finite floats as strings and numerics.bias's verdict as a string
    v1 = {"schema_version": 1, "results": [
        {"probe": "numerics.bias", "target": "t", "verdict": "pass", "metrics": {
            "bias": "nan", "std": "inf", "trials": 8, "verdict": "unbiased"},
         "evidence": {"errors": ["-inf", 1.0]}, "seed": 0, "codes": [], "message": "",
         "environment": {}, "created": "2026-01-01", "schema_version": 1}]}
    p = tmp_path / "v1.json"
    p.write_text(json.dumps(v1))
    (r,), _ = load_results(p)
    assert math.isnan(r.metrics["bias"]) and r.metrics["std"] == math.inf
    assert r.metrics["biased"] is False and "verdict" not in r.metrics
    assert r.evidence["errors"] == [-math.inf, 1.0] and r.schema_version == SCHEMA_VERSION


def test_report_roundtrip_and_atomic(tmp_path):
    p = save_results(tmp_path / "r.json", [_r(), _r(target="u", verdict="pass", codes=[],
                                                   metrics={"biased": False})], suite="s")
    results, meta = load_results(p)
    assert [r.target for r in results] == ["t", "u"] and meta["suite"] == "s"
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind
    doc = _strict_loads(p.read_text())
    assert list(doc) == ["schema_version", "suite", "results"]
    assert p.read_text() == dumps_report(results, suite="s") + "\n"


def test_report_document_keys_are_reserved():
    with pytest.raises(InvalidArgument, match="schema_version"):
        dumps_report([_r()], schema_version=1)


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
    p.write_text(_r().to_json())
    with pytest.raises(SchemaError, match="it is a single Result"):
        load_results(p)


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


# A value of the wrong kind for every field of a Result's JSON.
MISTYPED = {"probe": 3, "target": None, "verdict": "passed", "metrics": [1], "evidence": None,
            "seed": "0", "codes": "TP-B1", "message": 5, "environment": [], "created": 20260101,
            "schema_version": "2", "expected": "leaky"}


def test_every_field_has_a_mistyped_case():
    assert set(MISTYPED) == set(FIELDS)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("fault", ["deleted", "mistyped"])
def test_hand_edited_field_is_refused_at_load_naming_it(tmp_path, field, fault):
    # was: a deleted metrics object loaded as {} and the gate passed it; seed "0",
    # message 5, environment [] loaded as they were
    path = tmp_path / "r.json"
    save_results(path, [_r()])
    doc = json.loads(path.read_text())
    if fault == "deleted":
        del doc["results"][0][field]
    else:
        doc["results"][0][field] = MISTYPED[field]
    path.write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match=rf"results\[0\].*{field}"):
        load_results(path)


@pytest.mark.parametrize("field,value,match", [("metrics", [1], r"metrics=\[1\] must be dict"),
                                               ("evidence", None, "evidence=None must be dict"),
                                               ("target", None, "target=None must be str"),
                                               ("probe", 3, "probe=3 must be str"),
                                               ("seed", 1.5, "seed=1.5 must be an int"),
                                               ("codes", "TP-B1", r"codes='TP-B1' must be a list")])
def test_wrong_field_types_are_refused_in_memory(field, value, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _r(**{field: value})


def test_numpy_and_torch_integer_seeds_are_ints():
    import numpy as np
    import torch
    assert _r(seed=np.int64(3)).seed == 3 and type(_r(seed=torch.tensor(4)).seed) is int


def test_a_control_carries_its_expected_verdict_through_json():
    r = Result("causality.check", "trainprobes.reference.routing:expert_choice", "fail",
               expected="fail")
    back = Result.from_json(r.to_json())
    assert back.expected == "fail" and back.is_control and back.reproduced is True
    missed = Result("causality.check", "x", "pass", expected="fail")
    assert missed.reproduced is False
    finding = Result("causality.check", "x", "fail")
    assert not finding.is_control and finding.reproduced is None
    with pytest.raises(ValueError, match=r"expected='leaky' must be one of"):
        Result("causality.check", "x", "fail", expected="leaky")


# --- reading metrics through the model ----------------------------------------------------

def test_number_reads_numbers_and_names_a_mistyped_one():
    r = _r(metrics={"bias": math.nan, "n": 3, "s": "nan", "b": True})
    assert math.isnan(r.number("bias")) and r.number("n") == 3.0 and r.number("absent") is None
    for name in ("s", "b"):
        with pytest.raises(InvalidType, match=rf"'numerics.bias::t': metric {name}=.* expected a number"):
            r.number(name)


@pytest.mark.parametrize("metrics,verdict,match", [
    ({}, "pass", "'biased' .* is missing"),
    ({"biased": "false"}, "pass", "mistyped: a str, expected true or false"),
    ({"biased": 0}, "pass", "mistyped: a int"),
    ({"biased": None}, "pass", "nothing measured"),
])
def test_flag_fails_closed(metrics, verdict, match):
    with pytest.raises(CannotJudge, match=match):
        _r(metrics=metrics, verdict=verdict, codes=[]).flag()


def test_flag_reads_the_probe_s_documented_boolean():
    assert _r(metrics={"biased": True}).flag() is True
    assert _r(metrics={"biased": None}, verdict="fail").flag() is None  # nonfinite trials
    assert Result("causality.check", "t", "pass", metrics={"causal": True}).flag() is True
    with pytest.raises(CannotJudge, match="documents no verdict boolean"):
        Result("numerics.stall", "t", "pass").flag()


def test_registry_is_consistent():
    for probe, spec in PROBES.items():
        assert spec.flag is None or spec.flag in VERDICT_FLAGS, probe
        assert spec.flag is None or spec.documents(spec.flag), probe
        assert all(spec.documents(n) for n in spec.needs), probe
    stall = PROBES["numerics.stall"]
    assert stall.documents("sequential_sum[fp16,1]") and not stall.documents("sequential_sum")


def _real_results():
    """One cheap Result of each documented probe, as the probe writes it."""
    import torch
    from trainprobes.causality import check
    from trainprobes.distributed.probe import emulate_collective
    from trainprobes.drift import compare
    from trainprobes.numerics import reveal as rv
    from trainprobes.numerics.bias import collective_bias
    from trainprobes.numerics.stall import stall
    from trainprobes.reference import routing

    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(8, 32, generator=g, dtype=torch.float64) * 3
    x = torch.randn(2, 16, 8, generator=g)
    return [collective_bias(world=8, numel=64, trials=8),
            collective_bias(world=8, numel=64, trials=8, dtype="bf16", op="avg"),
            compare(lp, lp + 1e-3 * torch.randn(8, 32, generator=g, dtype=torch.float64)),
            compare(lp.reshape(-1), lp.reshape(-1) - 0.05),
            check(routing.expert_choice, x, decision=0, mode="truncate"),
            check(routing.topk_softmax, x, decision=0),
            emulate_collective(world=4, dtype="bf16"),
            stall(increments=(1.0, 1e-3)),
            rv.reveal(lambda t: t.sum(), dtype="fp16", target="sum")]


def test_each_probe_reports_only_documented_metrics_and_its_verdict_boolean():
    # the registry is the one place thresholds and the gate read metric names from: a
    # probe that adds a metric must document it there
    for r in _real_results():
        spec = PROBES[r.probe]
        undocumented = [k for k in r.metrics if not spec.documents(k)]
        assert not undocumented, f"{r.probe} reports undocumented metrics {undocumented}"
        for k, v in r.metrics.items():  # what thresholds may compare are numbers
            if spec.is_number(k):
                assert v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)), k
            else:
                assert not isinstance(v, float), f"{r.probe}: {k}={v!r} is a number"
        if spec.flag is not None:
            assert isinstance(r.flag(), bool) and (r.flag() is VERDICT_FLAGS[spec.flag]) == r.passed
        assert Result.from_json(r.to_json()) == r
