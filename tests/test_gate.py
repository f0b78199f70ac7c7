"""The gate: regressions by rule, the z-test, waivers, fail-closed loading, the CLI."""
import json
import math
from datetime import date

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trainprobes.cli import main
from trainprobes.gate import (
    CannotJudge,
    Waiver,
    compare,
    gate_files,
    larger_magnitude,
    load_waivers,
    parse_waivers,
    standard_error,
)
from trainprobes.result import Result, save_results

TODAY = date(2026, 11, 29)


def R(probe="custom.probe", target="t", verdict="pass", codes=(), **metrics):
    return Result(probe, target, verdict, metrics=metrics, codes=list(codes))


def BIAS(bias=1e-4, std=1e-4, trials=100, target="t", **kw):
    """A numerics.bias Result as the probe writes it: biased, verdict and code agree."""
    biased = kw.pop("biased", False)
    return R("numerics.bias", target, "fail" if biased else "pass", ["TP-B1"] if biased else [],
             bias=bias, std=std, trials=trials, biased=biased, **kw)


def CAUSAL(causal=True, target="t", **kw):
    return R("causality.check", target, "pass" if causal else "fail", [] if causal else ["TP-C1"],
             causal=causal, **kw)


def DRIFT(mean, se, biased=False, codes=(), verdict=None, **kw):
    codes = list(codes) + (["TP-D1"] if biased else [])
    return R("drift.compare", "t", verdict or ("fail" if codes else "pass"), codes,
             mean_log_ratio=mean, se_mean=se, biased=biased, **kw)


# (name, baseline, candidate, expected codes)
CASES = [
    ("causal now leaks", CAUSAL(), CAUSAL(False, n_leaks=4), ["TP-C1"]),
    ("bias significantly larger", BIAS(1e-4, 1e-4), BIAS(2e-3, 1e-3, biased=True), ["TP-G2"]),
    ("bias flips sign and grows", R(bias=1e-4, bias_se=1e-5), R(bias=-2e-3, bias_se=1e-4),
     ["TP-G2"]),
    ("bias from CI only", R(bias=0.0, ci_low=-1e-5, ci_high=1e-5, confidence=0.99),
     R(bias=1e-3, ci_low=9e-4, ci_high=1.1e-3, confidence=0.99), ["TP-G2"]),
    ("drift significantly worse", DRIFT(-1e-3, 1e-4), DRIFT(-5e-2, 1e-3), ["TP-G3"]),
    ("drift grows past its floor", DRIFT(5e-7, 1e-9, min_bias=1e-5),
     DRIFT(2e-5, 1e-8, min_bias=1e-5), ["TP-G3"]),
    ("drift over threshold", DRIFT(1e-5, 1e-5), DRIFT(1e-5, 1e-5, codes=["TP-D3"]), ["TP-G3"]),
    ("accumulator precision lower", R("numerics.reveal", accumulator_mantissa_bits=23),
     R("numerics.reveal", accumulator_mantissa_bits=10), ["TP-B3"]),
    ("probe errored", BIAS(), R("numerics.bias", verdict="error", codes=["TP-E1"]), ["TP-E1"]),
    # NaN is a measurement (an overflow): an estimate that cannot be shown not to have grown
    ("bias became NaN", BIAS(1e-4, 1e-4), BIAS(math.nan, 1e-4), ["TP-G2"]),
    ("bias SE became NaN", R(bias=1e-4, bias_se=1e-5), R(bias=1e-3, bias_se=math.nan), ["TP-G2"]),
    ("drift SE became NaN", DRIFT(-1e-3, 1e-4), DRIFT(-5e-2, math.nan), ["TP-G3"]),
    ("other verdict went to fail", R("numerics.stall"),
     R("numerics.stall", "t", "fail", ["TP-B2"]), ["TP-B2"]),
    ("baseline errored, candidate fails", R(verdict="error", codes=["TP-E1"]),
     R(verdict="fail", codes=["TP-B2"]), ["TP-B2"]),
]
CLEAN = [
    ("identical", BIAS(1e-3, 1e-3), BIAS(1e-3, 1e-3)),
    ("bias larger but not significant", R(bias=1e-3, bias_se=1e-3), R(bias=1.5e-3, bias_se=1e-3)),
    ("no standard error: not judged", R(bias=1e-3), R(bias=1e-1)),
    ("bias smaller", R(bias=1e-3, bias_se=1e-5), R(bias=1e-5, bias_se=1e-5)),
    ("significant but under rel_tol", R(bias=3.04e-8, bias_se=1e-12),
     R(bias=3.1e-8, bias_se=1e-12)),
    ("drift grows but stays under the probe's min_bias", DRIFT(5e-7, 1e-9, min_bias=1e-5),
     DRIFT(8e-7, 1e-9, min_bias=1e-5)),
    ("bias grows but stays under the probe's min_effect", R(bias=1e-6, bias_se=1e-9, min_effect=1e-4),
     R(bias=5e-6, bias_se=1e-9, min_effect=1e-4)),
    ("still causal", CAUSAL(), CAUSAL()),
    ("precision higher", R("numerics.reveal", accumulator_mantissa_bits=10),
     R("numerics.reveal", accumulator_mantissa_bits=23)),
    ("leaky in both (not a regression)", CAUSAL(False), CAUSAL(False)),
    ("nondeterministic in both", R("causality.check", "t", "fail", ["TP-C2"], causal=None),
     R("causality.check", "t", "fail", ["TP-C2"], causal=None)),
]


@pytest.mark.parametrize("name,base,cand,codes", CASES, ids=[c[0] for c in CASES])
def test_regression_rules(name, base, cand, codes):
    rep = compare([base], [cand], today=TODAY)
    assert [r.code for r in rep.regressions] == codes
    assert rep.exit_code == 1
    assert all(r.target == "t" for r in rep.regressions)


@pytest.mark.parametrize("name,base,cand", CLEAN, ids=[c[0] for c in CLEAN])
def test_no_regression(name, base, cand):
    rep = compare([base], [cand], today=TODAY)
    assert rep.regressions == [] and rep.exit_code == 0 and rep.compared == 1


def test_missing_probe_is_tp_g1_and_new_failure_counts():
    rep = compare([R(target="a"), R(target="b")],
                  [R(target="a"), CAUSAL(False, target="new")], today=TODAY)
    assert sorted((r.code, r.target) for r in rep.regressions) == [("TP-C1", "new"), ("TP-G1", "b")]


finite = st.floats(-1.0, 1.0, allow_nan=False)
se = st.floats(0.0, 1.0, allow_nan=False)


@given(b=finite, sb=se, c=finite, sc=se)
def test_z_test_never_flags_a_smaller_magnitude(b, sb, c, sc):
    sig, z, p = larger_magnitude((b, sb), (c, sc), alpha=0.01)
    if abs(c) <= abs(b):
        assert not sig
    assert 0.0 <= p <= 1.0


@given(b=finite, sb=st.floats(1e-6, 1.0), c=finite, sc=st.floats(1e-6, 1.0))
def test_z_test_matches_formula(b, sb, c, sc):
    _, z, _ = larger_magnitude((b, sb), (c, sc), alpha=0.01)
    assert z == pytest.approx((abs(c) - abs(b)) / math.hypot(sb, sc))


@pytest.mark.parametrize("metrics,se", [
    ({"bias_se": 0.5, "se_mean": 9.0}, 0.5),
    ({"se_mean": 0.25}, 0.25),
    ({"bias_z": -0.2}, 0.5),
    ({"std": 2.0, "trials": 16}, 0.5),
    ({"ci_low": -1.959963984540054, "ci_high": 1.959963984540054, "confidence": 0.95}, 1.0),
    ({"ci_low": -1.0, "ci_high": 1.0}, 1.0 / 1.959963984540054),  # no confidence: 95%
    ({}, None),
])
def test_standard_error_sources(metrics, se):
    got = standard_error(R(bias=0.1, **metrics), "bias")
    assert got == (None if se is None else pytest.approx(se))


def test_rel_tol_is_validated_and_zero_restores_pure_significance():
    base, cand = R(bias=3.04e-8, bias_se=1e-12), R(bias=3.1e-8, bias_se=1e-12)
    assert compare([base], [cand], rel_tol=0.0, today=TODAY).exit_code == 1
    with pytest.raises(ValueError, match=r"rel_tol=-1 must be a finite number >= 0"):
        compare([], [], rel_tol=-1)


def test_z_test_deterministic_estimates():
    assert larger_magnitude((1.0, 0.0), (1.0 + 1e-12, 0.0), 0.01)[0]
    assert not larger_magnitude((1.0, 0.0), (1.0, 0.0), 0.01)[0]


@given(st.lists(st.tuples(st.sampled_from(["pass", "warn", "fail"]), finite, se,
                          st.booleans(), st.integers(0, 52)), max_size=6))
def test_comparing_a_report_with_itself_finds_nothing(rows):
    results = [Result("p", f"t{i}", v, codes=["TP-B1"] if v == "fail" else [],
                      metrics={"bias": b, "bias_se": s, "causal": c, "accumulator_mantissa_bits": m})
               for i, (v, b, s, c, m) in enumerate(rows)]
    assert compare(results, results, today=TODAY).regressions == []


def test_alpha_is_validated():
    with pytest.raises(ValueError, match=r"alpha=1\.5 must be a finite number in \(0, 1\)"):
        compare([], [], alpha=1.5)


# --- waivers -----------------------------------------------------------------------------

LEAK = (CAUSAL(target="pkg.router:route"), CAUSAL(False, target="pkg.router:route"))


@pytest.mark.parametrize("target", ["pkg.router:route", "pkg.router:*",
                                    "causality.check::pkg.router:route"])
def test_live_waiver_applies(target):
    w = Waiver("TP-C1", target, "expert choice accepted for this ablation", date(2026, 12, 31))
    rep = compare([LEAK[0]], [LEAK[1]], waivers=[w], today=TODAY)
    assert rep.exit_code == 0 and rep.regressions[0].waived_by == w
    assert "Waived until 2026-12-31" in rep.to_markdown()


@pytest.mark.parametrize("w", [Waiver("TP-G2", "pkg.router:route", "other code", date(2027, 1, 1)),
                               Waiver("TP-C1", "pkg.other:*", "other target", date(2027, 1, 1))])
def test_waiver_must_match_code_and_target(w):
    rep = compare([LEAK[0]], [LEAK[1]], waivers=[w], today=TODAY)
    assert rep.exit_code == 1 and rep.unused_waivers == [w]


def test_waiver_matches_a_target_with_brackets_exactly():
    base = R(target="all_reduce[bf16,ring,w=1024]", bias=0.0, bias_se=1e-6)
    cand = R(target="all_reduce[bf16,ring,w=1024]", bias=-0.2, bias_se=1e-3)
    w = Waiver("TP-G2", "all_reduce[bf16,ring,w=1024]", "known stall", date(2027, 1, 1))
    assert compare([base], [cand], waivers=[w], today=TODAY).exit_code == 0


def test_expired_waiver_does_not_apply_and_is_reported():
    w = Waiver("TP-C1", "pkg.router:route", "was temporary", date(2026, 11, 28))
    rep = compare([LEAK[0]], [LEAK[1]], waivers=[w], today=TODAY)
    assert rep.exit_code == 1 and rep.expired_waivers == [w]
    md = rep.to_markdown()
    assert "Expired waivers" in md and "expired 2026-11-28" in md


def test_waiver_on_its_expiry_day_still_applies():
    w = Waiver("TP-C1", "pkg.router:route", "last day", TODAY)
    assert compare([LEAK[0]], [LEAK[1]], waivers=[w], today=TODAY).exit_code == 0


@pytest.mark.parametrize("suffix,text", [
    (".toml", '[[waiver]]\ncode = "TP-C1"\ntarget = "x"\nreason = "r"\nexpires = 2027-01-01\n'),
    (".toml", '[[waiver]]\ncode = "TP-C1"\ntarget = "x"\nreason = "r"\nexpires = "2027-01-01"\n'),
    (".json", '{"waivers": [{"code": "TP-C1", "target": "x", "reason": "r", '
              '"expires": "2027-01-01"}]}'),
])
def test_load_waivers(tmp_path, suffix, text):
    p = tmp_path / f"w{suffix}"
    p.write_text(text)
    assert load_waivers(p) == [Waiver("TP-C1", "x", "r", date(2027, 1, 1))]


@pytest.mark.parametrize("doc,match", [
    ({"waiver": [{"code": "TP-C1", "target": "x", "reason": "r"}]}, r"missing \['expires'\]"),
    ({"waiver": [{"code": "TP-Z9", "target": "x", "reason": "r", "expires": "2027-01-01"}]},
     r"code='TP-Z9' is not a known code"),
    ({"waiver": [{"code": "TP-C1", "target": "x", "reason": "r", "expires": "next week"}]},
     r"expires='next week' is not a date; write YYYY-MM-DD"),
    ({"other": []}, r"expected a \[\[waiver\]\]"),
])
def test_bad_waivers_are_named(doc, match):
    with pytest.raises(ValueError, match=match):
        parse_waivers(doc)


def test_unparseable_waivers_file_cannot_judge(tmp_path):
    p = tmp_path / "w.toml"
    p.write_text("[[waiver]\n")
    with pytest.raises(CannotJudge, match="is not valid TOML"):
        load_waivers(p)


# --- files and the CLI -------------------------------------------------------------------

@pytest.fixture
def reports(tmp_path):
    base, cand = tmp_path / "a.json", tmp_path / "b.json"
    save_results(base, [LEAK[0], R(target="gone")])
    save_results(cand, [LEAK[1]])
    return base, cand


def test_cli_blocks_and_prints_markdown(reports, capsys, tmp_path, monkeypatch):
    summary = tmp_path / "step.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    md = tmp_path / "verdict.md"
    assert main(["gate", "--baseline", str(reports[0]), "--candidate", str(reports[1]),
                 "--markdown", str(md)]) == 1
    out = capsys.readouterr().out
    assert "BLOCKED (exit 1)" in out and "`TP-C1`" in out and "`TP-G1`" in out
    assert '[[waiver]]\ncode = "TP-C1"\ntarget = "pkg.router:route"' in out
    assert md.read_text() in summary.read_text()


def test_cli_waivers_pass_and_json(reports, capsys, tmp_path):
    w = tmp_path / "w.toml"
    w.write_text('[[waiver]]\ncode = "TP-C1"\ntarget = "pkg.router:route"\nreason = "ok"\n'
                 'expires = 2999-01-01\n[[waiver]]\ncode = "TP-G1"\ntarget = "gone"\n'
                 'reason = "removed on purpose"\nexpires = 2999-01-01\n')
    assert main(["gate", "--baseline", str(reports[0]), "--candidate", str(reports[1]),
                 "--waivers", str(w), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 0 and len(doc["regressions"]) == 2
    assert all(r["waived_by"] for r in doc["regressions"])


@pytest.mark.parametrize("fault,match", [
    ("truncated", "is not valid JSON"),
    ("newer schema", "written by a newer trainprobes"),
    ("older schema", "schema_version=0"),
    ("missing", "does not exist"),
    ("not a report", "has no 'results' list"),
    ("empty baseline", "holds no results"),
])
def test_unreadable_reports_exit_2(reports, tmp_path, capsys, fault, match):
    base, cand = reports
    bad = tmp_path / "bad.json"
    text = base.read_text()
    bad.write_text({"truncated": text[: len(text) // 2],
                    "newer schema": text.replace('"schema_version": 2', '"schema_version": 3', 1),
                    "older schema": text.replace('"schema_version": 2', '"schema_version": 0', 1),
                    "not a report": "[1, 2]",
                    "empty baseline": '{"schema_version": 1, "results": []}'}.get(fault, ""))
    if fault == "missing":
        bad.unlink()
    rep = gate_files(bad, cand)
    assert rep.exit_code == 2 and match in rep.cannot_judge
    assert main(["gate", "--baseline", str(bad), "--candidate", str(cand)]) == 2
    assert "CANNOT JUDGE" in capsys.readouterr().out


def test_unreadable_candidate_exit_2(reports, tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text('{"schema_version": 1, "results": [{"probe": "p"}]}')
    rep = gate_files(reports[0], bad)
    assert rep.exit_code == 2 and rep.cannot_judge.startswith("candidate:")


@pytest.mark.parametrize("side", ["baseline", "candidate"])
@pytest.mark.parametrize("first_fails", [False, True])
def test_duplicated_keys_in_a_report_cannot_judge(side, first_fails):
    # was: the last Result with a key won, so a failing duplicate before (or after) a
    # passing one went unseen and the gate passed
    good, bad = BIAS(), BIAS(0.5, 1e-3, biased=True)
    dup = [bad, good] if first_fails else [good, bad]
    base, cand = (dup, [good]) if side == "baseline" else ([good], dup)
    rep = compare(base, cand, today=TODAY)
    assert rep.exit_code == 2
    assert rep.cannot_judge.startswith(side) and "'numerics.bias::t'" in rep.cannot_judge
    assert "CANNOT JUDGE" in rep.to_markdown()


@pytest.mark.parametrize("rel_tol", ["nan", "-1"])
def test_cli_bad_rel_tol_exit_2_not_a_traceback(reports, capsys, rel_tol):
    # was: --rel-tol nan passed the CLI check and raised ValueError (a traceback, exit 1)
    assert main(["gate", "--baseline", str(reports[0]), "--candidate", str(reports[1]),
                 "--rel-tol", rel_tol]) == 2
    assert "--rel-tol" in capsys.readouterr().err
