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


def BIAS(bias=1e-4, std=1e-3, trials=100, target="t", biased=None, min_effect=0.0, **edits):
    """A numerics.bias Result written by the probe (bias_probe, one stage) on trials whose
    signed errors have that mean and spread, so its CI, rms, p-values and per-trial errors agree
    (trainprobes.gate.rules). biased: what the caller expects the probe to find (checked). edits: metrics
    set afterwards, as a hand edit would."""
    import torch
    from trainprobes.numerics.bias import bias_probe
    z = torch.randn(trials, generator=torch.Generator().manual_seed(trials), dtype=torch.float64)
    errors = iter((bias + std * (z - z.mean()) / z.std()).tolist())
    r = bias_probe(lambda one: one + next(errors), lambda one: one,
                   lambda g: torch.ones(1, dtype=torch.float64), trials=trials, confirm=False,
                   min_effect=min_effect, target=target)
    assert biased is None or r.metrics["biased"] is biased, r.message
    r.metrics.update(edits)
    return r


def REVEAL(dtype="fp16", target="t"):
    """A numerics.reveal Result of the emulated ring all-reduce in dtype (fp16: 10 mantissa
    bits, fp32: 23), as the probe writes it."""
    from trainprobes.numerics.reveal import collective_reduction, reveal
    return reveal(collective_reduction(dtype), n=8, dtype=dtype, output_dtype=dtype, target=target)


def STALL(formats=("fp32",), n=100, target="t"):
    """A numerics.stall Result as the probe writes it (fp32 + 1 100 times: pass; fp16 3000
    times: stalls at 2048, warn TP-B2)."""
    from trainprobes.numerics.stall import stall
    r = stall(formats, n=n)
    r.target = target
    return r


def COLLECTIVE(mismatch=False, target="t"):
    """A distributed.collective Result of a 4-rank gloo bf16 all-reduce as the probe writes
    it, the real outputs stood in by the emulator's (mismatch: one element off, TP-B4)."""
    from trainprobes.distributed.case import Case
    from trainprobes.distributed.predict import emulate, result_from_outputs
    case = Case("all_reduce", "bf16", "sum", 64, "normal", 0, 0).check(4, "gloo")
    outs = emulate(case, 4, "gloo")
    if mismatch:
        outs = [o.clone() for o in outs]
        outs[1][3] += 1.0
    r = result_from_outputs(case, outs, backend="gloo", world=4)
    r.target = target
    return r


def CAUSAL(causal=True, target="t", verdict=None, codes=None, **kw):
    """A causality.check Result as the probe writes it: verdict, code and the leak counts
    agree with `causal` (trainprobes.gate.rules: COUNTS, SUMS)."""
    n = kw.pop("n_leaks", 0 if causal else 1)
    counts = {"n_leaks": n, "n_structural": n, "n_unconfirmed": 0, "n_score_leaks": 0}
    return R("causality.check", target, verdict or ("pass" if causal else "fail"),
             ([] if causal else ["TP-C1"]) if codes is None else codes, causal=causal,
             **counts, **kw)


def DRIFT(mean, se, biased=False, codes=(), verdict=None, units=50, **kw):
    """A drift.compare Result whose test figures are the probe's for that mean and standard
    error over `units` units (trainprobes.drift.stats._student: t_stat, p_mean, CI), and
    whose `biased` agrees with its test (trainprobes.gate.rules.TESTS). p_excess (the other half of the
    intersection-union test) is 1e-6 for a biased one, else 0.5."""
    import torch
    from trainprobes.drift.stats import _student
    f = lambda v: torch.tensor(float(v), dtype=torch.float64)  # noqa: E731
    n_tok = 1000.0
    ss = se * se * n_tok * n_tok * (units - 1) / units
    m, se_, t, p_mean, half, _ = (v.item() for v in _student(f(mean), f(ss), f(units), f(n_tok), 0.01))
    codes = list(codes) + (["TP-D1"] if biased else [])
    p_excess = 1e-6 if biased else 0.5
    test = {"p_value": max(p_mean, p_excess), "alpha": 0.01, "min_bias": 0.0}
    stats = {"t_stat": t, "p_mean": p_mean, "p_excess": p_excess, "ci_low": m - half,
             "ci_high": m + half, "n_units": units, "k2_kl": 0.0, "noise_kl_max": 1e-3}
    return R("drift.compare", "t", verdict or ("fail" if codes else "pass"), codes,
             mean_log_ratio=mean, se_mean=se_, biased=biased, **{**test, **stats, **kw})


# (name, baseline, candidate, expected codes)
CASES = [
    ("causal now leaks", CAUSAL(), CAUSAL(False, n_leaks=4), ["TP-C1"]),
    ("bias significantly larger", BIAS(1e-4, 1e-3), BIAS(2e-3, 1e-3, biased=True), ["TP-G2"]),
    ("bias flips sign and grows", R(bias=1e-4, bias_se=1e-5), R(bias=-2e-3, bias_se=1e-4),
     ["TP-G2"]),
    ("bias from CI only", R(bias=0.0, ci_low=-1e-5, ci_high=1e-5, confidence=0.99),
     R(bias=1e-3, ci_low=9e-4, ci_high=1.1e-3, confidence=0.99), ["TP-G2"]),
    ("drift significantly worse", DRIFT(-1e-3, 1e-4), DRIFT(-5e-2, 1e-3), ["TP-G3"]),
    ("drift grows past its floor", DRIFT(5e-7, 1e-9, min_bias=1e-5),
     DRIFT(2e-5, 1e-8, min_bias=1e-5), ["TP-G3"]),
    ("drift over threshold", DRIFT(1e-5, 1e-5), DRIFT(1e-5, 1e-5, codes=["TP-D3"]), ["TP-G3"]),
    ("accumulator precision lower", REVEAL("fp32"), REVEAL("fp16"), ["TP-B3"]),
    ("probe errored", BIAS(), R("numerics.bias", verdict="error", codes=["TP-E1"]), ["TP-E1"]),
    # NaN is a measurement (an overflow): an estimate that cannot be shown not to have grown
    # (on a probe that may write one: numerics.bias never does, test_a_nan_bias_...)
    ("bias became NaN", R(bias=1e-4, bias_se=1e-5), R(bias=math.nan, bias_se=1e-5), ["TP-G2"]),
    ("bias SE became NaN", R(bias=1e-4, bias_se=1e-5), R(bias=1e-3, bias_se=math.nan), ["TP-G2"]),
    ("drift SE became NaN", DRIFT(-1e-3, 1e-4), DRIFT(-5e-2, math.nan), ["TP-G3"]),
    ("other verdict went to fail", R(), R(verdict="fail", codes=["TP-B2"]), ["TP-B2"]),
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
    ("precision higher", REVEAL("fp16"), REVEAL("fp32")),
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


def test_cli_blocks_prints_plain_text_and_writes_markdown(reports, capsys, tmp_path, monkeypatch):
    summary = tmp_path / "step.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    md = tmp_path / "verdict.md"
    assert main(["gate", "--baseline", str(reports[0]), "--candidate", str(reports[1]),
                 "--markdown", str(md)]) == 1
    out = capsys.readouterr().out
    # the terminal: plain text, no table, no code spans, no escapes
    assert out.startswith("trainprobes gate: BLOCKED (exit 1)\n")
    assert "\n  TP-C1  causality.check  pkg.router:route\n" in out and "  TP-G1  " in out
    assert not any(m in out for m in ("`", "|", "\\", "##", "None"))
    assert '[[waiver]]\ncode = "TP-C1"\ntarget = "pkg.router:route"' in out
    # the PR comment and the job summary: Markdown
    assert "| `TP-C1` |" in md.read_text() and md.read_text() in summary.read_text()


def test_cli_waivers_pass_and_json(reports, capsys, tmp_path):
    w = tmp_path / "w.toml"
    w.write_text('[[waiver]]\ncode = "TP-C1"\ntarget = "pkg.router:route"\nreason = "ok"\n'
                 'expires = 2999-01-01\n[[waiver]]\ncode = "TP-G1"\ntarget = "gone"\n'
                 'reason = "removed on purpose"\nexpires = 2999-01-01\n')
    assert main(["gate", "--baseline", str(reports[0]), "--candidate", str(reports[1]),
                 "--waivers", str(w), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 0 and len(doc["regressions"]) == 2 and doc["command"] == "gate"
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
    assert f"argument --rel-tol: rel_tol={float(rel_tol)!r} must be a finite number >= 0" \
        in capsys.readouterr().err


# --- fail closed: every field, every metric a rule reads, every unexplained verdict ---------

from trainprobes.result import FIELDS  # noqa: E402

MISTYPED_FIELD = {"probe": 3, "target": None, "verdict": "passed", "metrics": [1],
                  "evidence": None, "seed": "0", "codes": "TP-B1", "message": 5,
                  "environment": [], "created": 20260101, "schema_version": "2",
                  "expected": "leaky"}


def _edited(tmp_path, side, edit, results=None):
    """Baseline and candidate reports of the same Results, one side edited by edit(doc)."""
    results = results or [BIAS(target="grad_allreduce"), CAUSAL(target="router")]
    paths = {}
    for name in ("baseline", "candidate"):
        p = tmp_path / f"{name}.json"
        save_results(p, results)
        if name == side:
            doc = json.loads(p.read_text())
            edit(doc["results"][0])
            p.write_text(json.dumps(doc))
        paths[name] = p
    return gate_files(paths["baseline"], paths["candidate"])


@pytest.mark.parametrize("side", ["baseline", "candidate"])
@pytest.mark.parametrize("fault", ["deleted", "mistyped"])
@pytest.mark.parametrize("field", FIELDS)
def test_every_result_field_deleted_or_mistyped_cannot_judge(tmp_path, side, fault, field):
    def edit(r):
        if fault == "deleted":
            del r[field]
        else:
            r[field] = MISTYPED_FIELD[field]
    rep = _edited(tmp_path, side, edit)
    assert rep.exit_code == 2, rep.to_markdown()
    assert rep.cannot_judge.startswith(f"{side}:") and "results[0]" in rep.cannot_judge
    assert field in rep.cannot_judge


# (probe, a Result as the probe writes it, the metrics the gate's rules read from it)
GATED = [
    ("numerics.bias", BIAS(target="x"), ["biased", "bias", "std", "trials"]),
    ("drift.compare", DRIFT(1e-5, 1e-6), ["biased", "mean_log_ratio", "se_mean"]),
    ("causality.check", CAUSAL(target="x"),
     ["causal", "n_leaks", "n_score_leaks", "n_structural", "n_unconfirmed"]),
    ("numerics.reveal", REVEAL(), ["accumulator_mantissa_bits"]),
    ("distributed.collective", COLLECTIVE(), ["bias", "bias_z"]),
]


@pytest.mark.parametrize("side", ["baseline", "candidate"])
@pytest.mark.parametrize("fault", ["deleted", "mistyped", "all metrics deleted"])
@pytest.mark.parametrize("probe,result,metric",
                         [(p, r, m) for p, r, ms in GATED for m in ms],
                         ids=[f"{p}.{m}" for p, _, ms in GATED for m in ms])
def test_a_metric_a_rule_needs_deleted_or_mistyped_cannot_judge(tmp_path, side, fault, probe,
                                                                 result, metric):
    # was: a candidate whose metrics object was emptied PASSED ("0 regressions"), and a
    # bias edited to a string was "NaN or missing"
    def edit(r):
        if fault == "deleted":
            del r["metrics"][metric]
        elif fault == "mistyped":
            r["metrics"][metric] = "0.5" if not isinstance(r["metrics"][metric], bool) else "false"
        else:
            r["metrics"] = {}
    rep = _edited(tmp_path, side, edit, [result])
    assert rep.exit_code == 2, rep.to_markdown()
    assert rep.cannot_judge.startswith(f"{side} '{result.key}'")
    if fault != "all metrics deleted":
        assert metric in rep.cannot_judge
    if fault == "mistyped":
        assert "mistyped" in rep.cannot_judge or "expected a number" in rep.cannot_judge
        assert "NaN or missing" not in rep.cannot_judge


def test_bias_edited_to_a_string_is_mistyped_not_nan(tmp_path):
    rep = _edited(tmp_path, "candidate", lambda r: r["metrics"].update(bias="0.002"))
    assert rep.exit_code == 2
    assert "metric bias='0.002' is a str, expected a number" in rep.cannot_judge


@pytest.mark.parametrize("side", ["baseline", "candidate"])
def test_verdict_edited_to_fail_is_unexplained_not_a_probe_error(side):
    # was: TP-E1 "probe error" for a verdict edited from pass to fail
    edited = STALL()
    edited.verdict = "fail"
    base, cand = (edited, STALL()) if side == "baseline" else (STALL(), edited)
    rep = compare([base], [cand], today=TODAY)
    assert rep.exit_code == 2 and "TP-E1" not in rep.to_markdown()
    assert rep.cannot_judge.startswith(f"{side} 'numerics.stall::t': verdict 'fail' carries no code")


@pytest.mark.parametrize("result,match", [
    (R("causality.check", verdict="pass", causal=False), "verdict 'pass' contradicts metric causal=False"),
    (R("causality.check", verdict="fail", codes=["TP-C1"], causal=True),
     "verdict 'fail' but metric causal=True, and no other code"),
    (R("numerics.bias", verdict="warn", biased=True, bias=1.0, std=1.0, trials=8),
     "verdict 'warn' contradicts metric biased=True"),
    (R("numerics.bias", verdict="fail", codes=["TP-B1"], biased=False, bias=1.0, std=1.0, trials=8),
     "verdict 'fail' but metric biased=False"),
    (R("numerics.bias", verdict="pass", biased=None, trials=8), "nothing measured"),
])
def test_a_verdict_that_its_boolean_does_not_explain_cannot_judge(result, match):
    rep = compare([result], [result], today=TODAY)
    assert rep.exit_code == 2 and match in rep.cannot_judge
    # both sides are named, not only the first problem found
    assert "2 Result(s) cannot be judged" in rep.cannot_judge
    assert f"baseline {result.key!r}" in rep.cannot_judge
    assert f"candidate {result.key!r}" in rep.cannot_judge


def test_a_verdict_change_with_its_code_is_reported_as_that():
    rep = compare([R()], [R(verdict="fail", codes=["TP-B2"])], today=TODAY)
    (reg,) = rep.regressions
    assert reg.code == "TP-B2" and reg.what == "verdict went from pass to fail (accumulation stall)"


def test_fails_explained_by_another_code_or_a_threshold_are_judged():
    batch_leak = CAUSAL(True, verdict="fail", codes=["TP-C3"])
    over = BIAS()
    over.verdict, over.codes = "fail", ["TP-B1"]
    over.evidence["thresholds"] = {"fail_above": {"p_value": 0.5}, "broken": ["p_value ..."]}
    drift_over = DRIFT(1e-5, 1e-6, codes=["TP-D3"])
    for r in (batch_leak, over, drift_over):
        assert compare([r], [r], today=TODAY).exit_code == 0


def test_the_issue_repro_two_results_emptied_no_longer_pass(tmp_path):
    results = [BIAS(target="a"), CAUSAL(target="b"), STALL(target="c")]

    def empty(doc):
        doc["metrics"] = {}
    base, cand = tmp_path / "a.json", tmp_path / "b.json"
    save_results(base, results)
    save_results(cand, results)
    doc = json.loads(cand.read_text())
    for r in doc["results"][:2]:
        empty(r)
    cand.write_text(json.dumps(doc))
    rep = gate_files(base, cand)
    assert rep.exit_code == 2
    assert "candidate 'numerics.bias::a'" in rep.cannot_judge
    assert "candidate 'causality.check::b'" in rep.cannot_judge


# --- controls --------------------------------------------------------------------------

def control(verdict, expected="fail", target="expert_choice"):
    causal = verdict == "pass"
    r = CAUSAL(causal, target=target)
    r.expected = expected
    return r


@pytest.mark.parametrize("base,cand,codes", [
    (control("fail"), control("fail"), []),            # reproduced in both: a pass of the harness
    (control("fail"), control("pass"), ["TP-G4"]),     # the harness broke on this machine
    (control("pass"), control("pass"), []),            # broken in both: the baseline's state
    (control("pass"), control("fail"), []),            # repaired
    (None, control("fail"), []),                       # a new control that reproduces
    (None, control("pass"), ["TP-G4"]),                # a new control that does not
])
def test_controls_are_judged_on_reproducing_their_known_verdict(base, cand, codes):
    rep = compare([base] if base else [], [cand], today=TODAY)
    assert [r.code for r in rep.regressions] == codes
    if codes:
        assert "the harness itself is broken on this machine" in rep.regressions[0].what
        assert "TP-G4" in rep.to_markdown()


@pytest.mark.parametrize("expected", [None, "pass"])
def test_a_control_s_known_verdict_cannot_change_between_reports(expected):
    cand = control("pass")
    cand.expected = expected
    rep = compare([control("fail")], [cand], today=TODAY)
    assert rep.exit_code == 2 and "known verdict differs between the reports" in rep.cannot_judge


def test_real_probe_results_are_judgeable_every_verdict_path():
    # the fail-closed checks must never refuse what the probes really write: pass, fail by
    # the boolean, fail by another code, nothing measured (None), thresholds
    import torch
    from trainprobes.audit.config import apply_thresholds
    from trainprobes.causality import check
    from trainprobes.drift import compare as drift_compare
    from trainprobes.numerics.bias import bias_probe, collective_bias
    from trainprobes.reference import routing
    from trainprobes.result import PROBES

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 8, generator=g)
    lp = -torch.rand(8, 24, generator=g, dtype=torch.float64) * 3

    def batch_leak(h):
        return (h - h.mean(dim=0, keepdim=True)).argmax(-1)

    def noisy(h):
        return torch.randint(0, 4, h.shape[:2])

    def make(gen):
        return torch.randn(16, generator=gen, dtype=torch.float64)

    results = [
        check(routing.topk_softmax, x, decision=0),                       # pass
        check(routing.expert_choice, x, decision=0),                      # fail: causal False
        check(batch_leak, x),                                             # fail: TP-C3, causal True
        check(noisy, x),                                                  # fail: TP-C2, causal None
        collective_bias(world=6, numel=64, trials=8, op="avg"),           # fail: biased (bf16 1/6)
        collective_bias(world=8, numel=64, trials=8, dtype="fp32"),
        bias_probe(lambda t: t * math.inf, lambda t: t, make, trials=4),  # fail: biased None
        drift_compare(lp, lp - 0.05),                                     # fail: biased
        drift_compare(lp, lp.clone(), thresholds={"k3_kl": -1.0}),        # fail: TP-D3 only
        apply_thresholds(collective_bias(world=8, numel=64, trials=8, dtype="fp32"),
                         {"fail_above": {"p_value": -1.0}}, "bias"),      # fail: threshold
    ]
    for i, r in enumerate(results):
        r.target = f"case{i}"
    verdicts = [(r.verdict, r.metrics.get(PROBES[r.probe].flag)) for r in results]
    assert ("fail", None) in verdicts and ("fail", True) in verdicts and ("fail", False) in verdicts
    rep = compare(results, results, today=TODAY)
    assert rep.exit_code == 0 and rep.cannot_judge is None and rep.compared == len(results)


@pytest.mark.parametrize("side", ["baseline", "candidate"])
def test_any_documented_number_mistyped_cannot_judge(tmp_path, side):
    # a metric no rule reads is still part of the Result the gate vouches for
    stall = STALL(("fp16",), n=3000)
    rep = _edited(tmp_path, side, lambda r: r["metrics"].update({"sequential_sum[fp16,1]": "2048"}),
                  [stall])
    assert rep.exit_code == 2
    assert "metric sequential_sum[fp16,1]='2048' is a str, expected a number" in rep.cannot_judge


# --- review-gate: what still passed when it should not -----------------------------------

INF_SE = [
    # (a probe without a rule: numerics.bias never writes an infinite std beside a finite CI)
    ("bias std became inf", R(bias=1e-4, std=1e-4, trials=100), R(bias=0.5, std=math.inf, trials=100),
     ["TP-G2"]),
    ("bias and std became inf", R(bias=1e-4, std=1e-4, trials=100),
     R(bias=math.inf, std=math.inf, trials=100), ["TP-G2"]),
    ("bias CI became infinite", R(bias=0.0, ci_low=-1e-5, ci_high=1e-5),
     R(bias=1e-3, ci_low=-math.inf, ci_high=math.inf), ["TP-G2"]),
    ("drift se_mean became inf", DRIFT(-1e-3, 1e-4), DRIFT(-5e-2, math.inf), ["TP-G3"]),
    ("transform scale_error_se became inf", R(scale_error=1e-8, scale_error_se=1e-8),
     R(scale_error=0.5, scale_error_se=math.inf), ["TP-T4"]),
]


@pytest.mark.parametrize("name,base,cand,codes", INF_SE, ids=[c[0] for c in INF_SE])
def test_an_infinite_standard_error_is_untestable_like_nan(name, base, cand, codes):
    # an infinite SE made z = 0 (or inf/inf = NaN, p = 1): any growth passed unseen
    rep = compare([base], [cand], today=TODAY)
    assert [r.code for r in rep.regressions] == codes and rep.exit_code == 1
    assert "cannot be tested" in rep.regressions[0].what


def test_a_candidate_cannot_raise_its_own_floor_past_a_regression():
    # the candidate's config raised min_effect 1e-6 -> 1.0: its probe calls 1e-3 unbiased, but
    # against the accepted floor (the baseline's) the growth is a regression
    base = R(bias=1e-6, bias_se=1e-9, min_effect=1e-6)
    for cand, code in ((R(bias=1e-3, bias_se=1e-9, min_effect=1.0), "TP-G2"),
                       (DRIFT(2e-2, 1e-8, min_bias=1.0), "TP-G3")):
        b = DRIFT(1e-6, 1e-9, min_bias=1e-5) if code == "TP-G3" else base
        rep = compare([b], [cand], today=TODAY)
        assert [r.code for r in rep.regressions] == [code] and rep.exit_code == 1


@pytest.mark.parametrize("side", ["baseline", "candidate"])
@pytest.mark.parametrize("floor", [math.nan, math.inf])
def test_a_non_finite_floor_cannot_judge(side, floor):
    # abs(bias) >= NaN (or inf) is False: the growth test was skipped and the gate passed
    base = R(bias=1e-6, bias_se=1e-9, min_effect=floor if side == "baseline" else 1e-6)
    cand = R(bias=1e-3, bias_se=1e-9, min_effect=floor if side == "candidate" else 1e-6)
    rep = compare([base], [cand], today=TODAY)
    assert rep.exit_code == 2 and f"{side} 'custom.probe::t'" in rep.cannot_judge
    assert "min_effect" in rep.cannot_judge and "floor" in rep.cannot_judge


def _transform(kind, equivalent, verdict="pass", codes=()):
    return R("transforms.equivalence", "t", verdict, codes, equivalent=equivalent,
             transform_verdict=kind, scale=1.0, scale_error=0.0, scale_error_se=1e-8, trials=16,
             n_inconsistent=int(kind == "inconsistent"))


CONTRADICTIONS = [
    # the label the probe derives its boolean from says the opposite of the boolean
    ("transform biased but equivalent", _transform("biased", True), "transform_verdict"),
    ("transform wrong but equivalent", _transform("wrong", True), "transform_verdict"),
    ("transform noise but not equivalent", _transform("noise", False, "fail", ["TP-T1"]),
     "transform_verdict"),
    ("transform of an unknown kind", _transform("fine", True), "transform_verdict"),
    ("drift labelled biased but not biased", DRIFT(1e-5, 1e-5, drift_verdict="biased"),
     "drift_verdict"),
    # a boolean beside the verdict one whose bad value carries its own code
    ("drift heavy-tailed but passes", DRIFT(1e-5, 1e-5, heavy_tailed=True), "heavy_tailed"),
    ("router leaks across the batch but passes", CAUSAL(batch_isolated=False), "batch_isolated"),
]


@pytest.mark.parametrize("side", ["baseline", "candidate"])
@pytest.mark.parametrize("name,edited,metric", CONTRADICTIONS, ids=[c[0] for c in CONTRADICTIONS])
def test_a_label_that_contradicts_the_verdict_cannot_judge(side, name, edited, metric):
    # a transform edited to "biased" (or a drift to heavy-tailed) beside a pass was exit 0
    ok = {"transforms.equivalence": _transform("noise", True), "drift.compare": DRIFT(1e-5, 1e-5),
          "causality.check": CAUSAL()}[edited.probe]
    base, cand = (edited, ok) if side == "baseline" else (ok, edited)
    rep = compare([base], [cand], today=TODAY)
    assert rep.exit_code == 2 and side in rep.cannot_judge and metric in rep.cannot_judge


def test_labels_that_agree_are_judged():
    rows = [_transform("exact", True), _transform("biased", False, "fail", ["TP-T1"]),
            DRIFT(1e-5, 1e-5, drift_verdict="heavy-tailed", heavy_tailed=True, codes=["TP-D2"],
                  verdict="warn"),
            DRIFT(1e-2, 1e-5, biased=True, drift_verdict="biased", heavy_tailed=False),
            CAUSAL(True, verdict="fail", codes=["TP-C3"], batch_isolated=False)]
    for r in rows:
        assert compare([r], [r], today=TODAY).exit_code == 0, r


def test_a_waiver_for_one_code_does_not_hide_another_new_one():
    # the TP-C1 waiver (leaks accepted) also hid the router's new batch-isolation leak (TP-C3)
    cand = CAUSAL(False, codes=["TP-C1", "TP-C3"], batch_isolated=False)
    waiver = Waiver("TP-C1", "t", "accepted for the ablation", date(2027, 1, 1))
    rep = compare([CAUSAL(batch_isolated=True)], [cand], waivers=[waiver], today=TODAY)
    assert [(r.code, r.waived_by is not None) for r in rep.regressions] == [
        ("TP-C1", True), ("TP-C3", False)]
    assert rep.exit_code == 1


def test_a_result_that_already_failed_still_blocks_a_new_code():
    # a router whose known leak (TP-C1) fails in the baseline hid its new batch-isolation
    # leak (TP-C3): only a verdict going from pass/warn to fail was read for codes
    base = CAUSAL(False, n_leaks=4, batch_isolated=True)
    cand = CAUSAL(False, n_leaks=4, codes=["TP-C1", "TP-C3"], batch_isolated=False)
    rep = compare([base], [cand], today=TODAY)
    assert [r.code for r in rep.blocking] == ["TP-C3"] and "new code" in rep.blocking[0].what
    assert compare([base], [base], today=TODAY).exit_code == 0  # the same codes: no news


# --- nothing compared, nothing excused wholesale -----------------------------------------

@pytest.mark.parametrize("target", ["*", "**", "?*", " * ",
    # no name in them: each matched every probe::target key (or every collective)
    "*:*", "*::*", "*.*", "[a-z]*", "*[*", "*]", "*,*", "*=*", "[!_]*"])
def test_a_waiver_that_matches_every_target_is_refused(target):
    doc = {"waiver": [{"code": "TP-G1", "target": target, "reason": "r", "expires": "2027-01-01"}]}
    with pytest.raises(ValueError, match="matches every target"):
        parse_waivers(doc)


def test_reports_with_no_result_in_common_cannot_pass():
    # an empty candidate with every TP-G1 waived by name, or an empty baseline: nothing
    # was compared, so the gate cannot say the change is safe
    base = [CAUSAL(True, target="a"), CAUSAL(True, target="b")]
    waivers = parse_waivers({"waiver": [{"code": "TP-G1", "target": t, "reason": "r",
                                         "expires": "2027-01-01"} for t in ("a", "b")]})
    rep = compare(base, [], waivers=waivers, today=TODAY)
    assert rep.exit_code == 2 and "nothing to compare" in rep.cannot_judge
    rep = compare([], [CAUSAL(True, target="c")], today=TODAY)  # an empty baseline
    assert rep.exit_code == 2 and "nothing to compare" in rep.cannot_judge
    # a new failure still blocks (exit 1) rather than being hidden behind "cannot judge"
    assert compare([], [CAUSAL(False, target="c")], today=TODAY).exit_code == 1


def test_a_key_written_twice_in_one_object_cannot_judge(tmp_path):
    # json keeps the last value silently: an edit that appends "causal": true after the real
    # "causal": false would otherwise pass unseen
    base, cand = tmp_path / "a.json", tmp_path / "b.json"
    save_results(base, [CAUSAL(True, target="x")])
    save_results(cand, [CAUSAL(True, target="x")])
    text = cand.read_text().replace('"causal": true', '"causal": false, "causal": true', 1)
    assert text != cand.read_text()
    cand.write_text(text)
    rep = gate_files(base, cand)
    assert rep.exit_code == 2 and "appear twice" in rep.cannot_judge


@pytest.mark.parametrize("edit", [
    {"scale": 1.2},                                          # the shown scale alone
    {"scale_error": 0.2},                                    # the estimate alone
    {"scale": 1.2, "scale_error": 0.2},                      # both, outside the CI
])
def test_a_transform_scale_edited_apart_from_its_estimate_cannot_judge(edit):
    def tr(**m):
        metrics = {"equivalent": True, "transform_verdict": "noise", "scale": 1.0, "scale_error": 0.0,
                   "scale_ci_low": 0.999, "scale_ci_high": 1.001, "scale_error_se": 1e-4, "trials": 16,
                   "n_inconsistent": 0, **m}
        return R("transforms.equivalence", "t", "pass", [], **metrics)
    assert compare([tr()], [tr()], today=TODAY).exit_code == 0
    rep = compare([tr()], [tr(**edit)], today=TODAY)
    assert rep.exit_code == 2 and ("is not 1 + scale_error" in rep.cannot_judge
                                   or "outside its CI" in rep.cannot_judge)


# --- the verdict boolean against the counts or test it is derived from (COUNTS, SUMS, TESTS)

@pytest.fixture(scope="module")
def written():
    """Results as the probes write them, on tiny reference targets (~0.1 s in all)."""
    import torch
    from trainprobes.causality import check
    from trainprobes.drift import compare as drift_compare
    from trainprobes.isolation import batch_invariance, documents
    from trainprobes.isolation.controls import (
        VOCAB,
        bidirectional,
        block_diagonal,
        causal_over_row,
        exact_matmul,
        integer_rows,
        rounding_noise,
        split_by_batch,
    )
    from trainprobes.isolation.end_to_end import end_to_end
    from trainprobes.isolation.ops import _as_map_entry
    from trainprobes.numerics.bias import collective_bias
    from trainprobes.reference import routing

    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    seqs = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    lp = -torch.rand(8, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3

    def lm(t):  # exact integer logits: batch-invariant
        return torch.log_softmax(integer_rows(0, VOCAB)[:, :VOCAB][t][:, :-1], -1).gather(
            2, t[:, 1:, None])[..., 0]

    def batch_sized_lm(t):  # reads the batch size: variant
        return lm(t) + 1e-3 * t.shape[0]
    return {
        "causal router": check(routing.topk_softmax, x, decision=0),
        "leaky router": check(routing.expert_choice, x, decision=0),
        "isolated documents": documents(block_diagonal(), ids, [4, 6], vocab=VOCAB, causal=False),
        "leaking documents": documents(causal_over_row(), ids, [4, 6], vocab=VOCAB, causal=False),
        "unsettled documents": documents(rounding_noise(), ids, [4, 6], vocab=VOCAB, fp64=False,
                                         causal=False),
        "a document reading its future": documents(bidirectional(), ids, [10], vocab=VOCAB, cuts=[4]),
        "invariant batch": batch_invariance(exact_matmul, integer_rows(), sizes=(2,)),
        "variant batch": batch_invariance(split_by_batch, integer_rows(), sizes=(2,)),
        "variant op": _as_map_entry(batch_invariance(split_by_batch, integer_rows(), sizes=(2,))),
        "invariant engine": end_to_end(lm, seqs, sizes=(2,)),
        "variant engine": end_to_end(batch_sized_lm, seqs, sizes=(2,)),
        "biased average": collective_bias(world=6, numel=64, trials=8, op="avg"),  # bf16(1/6)
        "fp32 sum": collective_bias(world=8, numel=64, trials=8, dtype="fp32"),
        "biased drift": drift_compare(lp, lp - 0.05),
    }


def _edit(r: Result, **changes) -> Result:
    """r through its JSON, as a hand edit would change it: verdict and codes, else metrics."""
    d = json.loads(r.to_json())
    for k, v in changes.items():
        (d if k in ("verdict", "codes") else d["metrics"])[k] = v
    return Result.from_dict(d)


PASSING = {"verdict": "pass", "codes": []}
# (real Result, edit, the gate table holding the rule, what the gate says)
COUNT_EDITS = [
    ("leaky router", {"causal": True, **PASSING}, "COUNTS", "causal=True contradicts n_leaks=34"),
    ("leaky router", {"causal": True, "n_leaks": 0, **PASSING}, "SUMS",
     "n_leaks=0 is not the sum of n_structural + n_unconfirmed (34 + 0)"),
    ("causal router", {"causal": False, "verdict": "fail", "codes": ["TP-C1"]}, "COUNTS",
     "causal=False but n_leaks=0, n_score_leaks=0"),
    ("leaking documents", {"isolated": True, **PASSING}, "COUNTS", "isolated=True contradicts n_leaks=1"),
    ("unsettled documents", {"isolated": True, **PASSING}, "COUNTS",
     "isolated=True contradicts n_unverified=2"),
    ("isolated documents", {"isolated": False, "verdict": "fail", "codes": ["TP-I1"]}, "COUNTS",
     "isolated=False but n_leaks=0"),
    ("a document reading its future", PASSING, "SIDE_FLAGS", "causal=False goes with code TP-C1"),
    ("variant batch", {"batch_invariant": True, **PASSING}, "COUNTS",
     "batch_invariant=True contradicts frac_rows_differ=1.0, breaking_sizes=[2, 6]"),
    ("variant op", {"batch_invariant": True, **PASSING}, "COUNTS", "frac_rows_differ=1.0"),
    ("invariant batch", {"batch_invariant": False, "verdict": "fail", "codes": ["TP-I2"]}, "COUNTS",
     "batch_invariant=False but frac_rows_differ=0.0, breaking_sizes=[]"),
    ("variant engine", {"batch_invariant": True, **PASSING}, "COUNTS",
     "batch_invariant=True contradicts frac_tokens_differ=1.0"),
    ("biased average", {"biased": False, **PASSING}, "TESTS",
     "biased=False contradicts its test: p_value=1.218e-05 < alpha=0.01 and |bias|=0.001959 "
     ">= min_effect=0.0002441, so the probe writes biased=True"),
    ("fp32 sum", {"biased": True, "verdict": "fail", "codes": ["TP-B1"]}, "TESTS",
     "p_value=0.5315 is not below alpha=0.01"),
    ("biased drift", {"biased": False, "drift_verdict": "noisy", **PASSING}, "TESTS",
     "|mean_log_ratio|=0.05 >= min_bias=1e-05, so the probe writes biased=True"),
]


def _without(monkeypatch, table: str, probe: str) -> None:
    """Switch the gate's rule for probe off (to show the edit passed without it), and the
    probe's consistency rule (trainprobes.gate.rules.RULES), which catches some of these edits too."""
    import trainprobes.gate.judgeable as gate
    import trainprobes.gate.rules as gate_rules
    rules = getattr(gate, table)
    monkeypatch.setattr(gate, table, {k: v for k, v in rules.items() if k != probe}
                        if isinstance(rules, dict) else tuple(x for x in rules if x[0] != probe))
    monkeypatch.setattr(gate_rules, "RULES", {k: v for k, v in gate_rules.RULES.items() if k != probe})


@pytest.mark.parametrize("which,edit,table,match", COUNT_EDITS,
                         ids=[f"{c[0]}: {', '.join(c[1])}" for c in COUNT_EDITS])
def test_a_verdict_boolean_its_counts_contradict_cannot_judge(written, monkeypatch, which, edit,
                                                             table, match):
    # was: a report edited to `causal: true` beside 34 leaks (or `false` beside none), or to
    # `biased: false` beside p = 1e-6, passed
    real = written[which]
    assert compare([real], [real], today=TODAY).exit_code == 0  # as the probe wrote it: judged
    edited = _edit(real, **edit)
    for side, pair in (("candidate", ([real], [edited])), ("baseline", ([edited], [real]))):
        rep = compare(*pair, today=TODAY)
        assert rep.exit_code == 2 and rep.cannot_judge.startswith(f"{side} {real.key!r}")
        assert match in rep.cannot_judge, rep.cannot_judge
    _without(monkeypatch, table, real.probe)
    assert compare([edited], [edited], today=TODAY).exit_code == 0  # the rule is what stops it


@pytest.mark.parametrize("which,count", [("causal router", "n_score_leaks"),
                                         ("isolated documents", "n_blind_tokens"),
                                         ("invariant batch", "breaking_sizes"),
                                         ("invariant engine", "frac_tokens_differ"),
                                         ("biased average", "p_value"),
                                         ("biased drift", "min_bias")])
@pytest.mark.parametrize("fault", ["deleted", "mistyped"])
def test_a_count_the_verdict_boolean_rests_on_deleted_or_mistyped_cannot_judge(written, which,
                                                                             count, fault):
    d = json.loads(written[which].to_json())
    if fault == "deleted":
        del d["metrics"][count]
    else:
        d["metrics"][count] = "0"
    rep = compare([written[which]], [Result.from_dict(d)], today=TODAY)
    assert rep.exit_code == 2 and count in rep.cannot_judge
    assert ("missing" in rep.cannot_judge if fault == "deleted" else
            "mistyped" in rep.cannot_judge or "expected a number" in rep.cannot_judge)


@pytest.mark.slow
def test_a_transform_whose_replicas_disagree_cannot_be_edited_equivalent(monkeypatch):
    # ~5 s: two gloo ranks run the zoo's sequence-parallel LayerNorm bug (replicas drift apart)
    from trainprobes.reference.bugs import bug
    from trainprobes.transforms import Custom, Probe, run_probes
    from trainprobes.transforms.zoo import step_of

    b = bug("sp_layernorm")
    (real,) = run_probes([Probe(step_of(b), Custom(b.buggy, title=b.name), 4, 0)], world=2)
    n = real.metrics["n_inconsistent"]
    assert real.codes == ["TP-T2"] and n > 0
    edited = _edit(real, equivalent=True, transform_verdict="noise", **PASSING)
    rep = compare([real], [edited], today=TODAY)
    assert rep.exit_code == 2 and f"equivalent=True contradicts n_inconsistent={n}" in rep.cannot_judge
    _without(monkeypatch, "COUNTS", real.probe)
    assert compare([edited], [edited], today=TODAY).exit_code == 0


# --- names that hold markup in the Markdown verdict ---------------------------------------

NASTY = "</td><script>alert(1)</script> | col | `tick` \"q\"\n# heading [x](javascript:1) <!--"


def _markdown_tables_and_markup(md: str):
    """Through a CommonMark + GFM-table parser: each table row's cell texts (code spans
    included), the kinds of every inline token (links, raw HTML, code spans, ...), the code
    spans and all the text."""
    from markdown_it import MarkdownIt
    rows, kinds, cell, codes, text = [], set(), None, [], ""
    for tok in MarkdownIt("commonmark").enable("table").parse(md):
        if tok.type == "tr_open":
            rows.append([])
        elif tok.type in ("td_open", "th_open"):
            cell = ""
        elif tok.type in ("td_close", "th_close"):
            rows[-1].append(cell)
            cell = None
        elif tok.type == "inline":
            kinds |= {c.type for c in tok.children}
            codes += [c.content for c in tok.children if c.type == "code_inline"]
            text += "".join(c.content for c in tok.children) + "\n"
            if cell is not None:
                cell += "".join(c.content for c in tok.children if c.type in ("text", "code_inline"))
    return rows, kinds, codes, text


def test_markdown_verdict_shows_names_with_markup_as_written(tmp_path, capsys, monkeypatch):
    # was: a target holding `|`, a backtick or a newline broke the table and the waiver
    # snippet, and its HTML reached the job summary raw
    base, cand, waivers = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "w.toml"
    save_results(base, [CAUSAL(True, target=NASTY), CAUSAL(True, target="x" + NASTY)])
    save_results(cand, [CAUSAL(False, target=NASTY), CAUSAL(False, target="x" + NASTY)])
    waivers.write_text('[[waiver]]\ncode = "TP-C1"\ntarget = "old </td>| `"\n'
                       'reason = "</li><script>1</script> | [x](y)"\nexpires = 2000-01-01\n')
    summary = tmp_path / "step.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    args = ["gate", "--baseline", str(base), "--candidate", str(cand), "--waivers", str(waivers)]
    assert main(args) == 1
    md = summary.read_text()
    out = capsys.readouterr().out
    # the terminal shows each name as written, on its own line (a newline shown as \n),
    # and the Markdown holds the same regressions
    assert f"  TP-C1  causality.check  {NASTY}".replace("\n", "\\n") in out
    assert out.count("\n  TP-C1  causality.check  ") == 2 and md.count("| `TP-C1` |") == 2
    assert "\n  TP-C1  old </td>| ` expired 2000-01-01: </li><script>1</script> | [x](y)\n" in out
    rows, kinds, codes, text = _markdown_tables_and_markup(md)
    assert kinds <= {"text", "code_inline", "strong_open", "strong_close", "softbreak"}, kinds
    assert len(rows) == 3 and {len(r) for r in rows} == {7}  # the table kept its shape
    shown = NASTY.replace("\n", " ")
    assert [r[2] for r in rows[1:]] == [shown, "x" + shown]
    assert "old </td>| `" in codes and " expired 2000-01-01: </li><script>1</script> | [x](y)" in text
    # the waiver snippet it prints is valid TOML that names the target exactly: pasted into
    # the waivers file, it waives that regression
    snippet = md.split("```toml\n", 1)[1].split("```", 1)[0]
    waivers.write_text(snippet.replace("<why this regression is accepted>", "accepted"))
    rep = gate_files(base, cand, waivers)
    assert [(r.target, r.waived_by is not None) for r in rep.regressions] == [
        (NASTY, True), ("x" + NASTY, False)]


# --- counts, tests and standard errors a report cannot bend ------------------------------

@pytest.mark.parametrize("edit,match", [
    # causal=true beside a count of NaN: NaN > 0 is False, so the contradiction went unseen
    ({"n_score_leaks": math.nan}, "n_score_leaks=nan"),
    # n_leaks = n_structural + n_unconfirmed holds, and no count is above 0
    ({"n_leaks": -1, "n_structural": 0, "n_unconfirmed": -1}, "n_leaks=-1"),
    ({"n_score_leaks": -math.inf}, "n_score_leaks=-inf"),
])
def test_a_count_that_is_not_a_count_cannot_judge(edit, match):
    cand = CAUSAL(True)
    cand.metrics.update(edit)
    rep = compare([CAUSAL(True)], [cand], today=TODAY)
    assert rep.exit_code == 2, rep.regressions
    assert match in rep.cannot_judge and "not a count" in rep.cannot_judge


@pytest.mark.parametrize("name", ["n_leaks", "bias"])
def test_a_number_too_large_for_a_float_cannot_judge_not_a_traceback(tmp_path, capsys, name):
    # JSON integers are unbounded; float(10**400) raised OverflowError out of the gate (exit 1)
    base, cand = tmp_path / "a.json", tmp_path / "b.json"
    save_results(base, [CAUSAL(True), BIAS()])
    doc = json.loads(base.read_text())
    doc["results"][0 if name == "n_leaks" else 1]["metrics"][name] = 10 ** 400
    if name == "n_leaks":
        doc["results"][0]["metrics"]["n_structural"] = 10 ** 400
    cand.write_text(json.dumps(doc))
    assert main(["gate", "--baseline", str(base), "--candidate", str(cand)]) == 2
    out = capsys.readouterr().out
    assert f"metric {name}=100000000000000000...000" in out and "(401 characters)" in out


@pytest.mark.parametrize("alpha", [math.nan, 0.0, -1.0, 1.0, 2.0])
def test_a_biased_test_at_an_alpha_no_probe_writes_cannot_judge(alpha):
    # p_value = 1e-9 and a bias past the floor: biased. alpha edited to NaN (or 0, or
    # below) made `p < alpha` False, so biased=false and a pass agreed with the "test"
    rep = compare([BIAS()], [BIAS(p_value=1e-9, alpha=alpha)], today=TODAY)
    assert rep.exit_code == 2 and "alpha" in rep.cannot_judge


@pytest.mark.parametrize("extra", [{"bias_se": 1e3}, {"se_mean": 1e3}, {"bias_z": 1e-9}])
def test_a_standard_error_its_probe_does_not_write_is_not_read(extra):
    # numerics.bias's SE is std / sqrt(trials); an undocumented bias_se (read first) hid a
    # 20x larger bias behind a huge standard error (both biased: only TP-G2 can block)
    base, cand = BIAS(1e-4, 1e-5, biased=True), BIAS(2e-3, 1e-3, biased=True)
    assert [r.code for r in compare([base], [cand], today=TODAY).blocking] == ["TP-G2"]
    cand.metrics.update(extra)
    assert [r.code for r in compare([base], [cand], today=TODAY).blocking] == ["TP-G2"]
    assert standard_error(cand, "bias") == pytest.approx(1e-4)
