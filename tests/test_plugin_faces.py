"""The plugin without friction: an expected outcome for a case known to be bad, and report
keys that do not move with pytest's rootdir."""
import json

pytest_plugins = ["pytester"]

EXPECTING = """
import pytest
from trainprobes.result import Result


def test_known_leaky(trainprobes):
    trainprobes.assert_flag(Result("causality.check", "expert_choice", "fail",
                                   metrics={"causal": False}), expect="leaky")


def test_known_leaky_but_causal(trainprobes):
    trainprobes.assert_flag(Result("causality.check", "looks_leaky", "pass",
                                   metrics={"causal": True}), expect="leaky")


def test_check_expect_warn(trainprobes):
    trainprobes.check(Result("numerics.stall", "fp16", "warn"), expect="warn")


def test_bad_word(trainprobes):
    trainprobes.check(Result("numerics.stall", "fp16", "warn"), expect="leakyy")
"""


def test_expect_records_a_control_reproduced_or_missed(pytester):
    pytester.makepyfile(test_expect=EXPECTING)
    out = pytester.runpytest("-p", "no:cacheprovider", "--trainprobes-report", "r.json")
    out.assert_outcomes(passed=2, failed=2)
    out.stdout.fnmatch_lines(["MISSED: expected 'leaky': causality.check on 'looks_leaky' -> pass",
                              "*expected verdict fail, got pass"])
    out.stdout.fnmatch_lines(["*expect='leakyy'*"])
    doc = json.loads((pytester.path / "r.json").read_text())
    by = {r["target"].split(" @ ")[0]: r for r in doc["results"]}
    assert by["expert_choice"]["expected"] == "fail"  # a control that reproduced: not a FAIL
    assert by["looks_leaky"]["expected"] == "fail" and by["looks_leaky"]["verdict"] == "pass"
    assert by["fp16"]["expected"] == "warn"
    # the summary says what the audit says: a reproduced control is OK, a missed one MISSED,
    # never a finding's FAIL (was: "FAIL  causality.check expert_choice ...")
    text = out.stdout.str()
    summary = text[text.index("trainprobes ==="):]
    out.stdout.fnmatch_lines(["*1 control MISSED, 2 control ok*Result(s)*",
                              "  OK    causality.check expert_choice @ *: control, known verdict fail, got fail*",
                              "  MISSED causality.check looks_leaky @ *: control, known verdict fail, got pass*"])
    assert "FAIL  causality.check expert_choice" not in summary


RECORD = """
from trainprobes.result import Result


def test_one(trainprobes):
    trainprobes.record(Result("causality.check", "router", "pass", metrics={"causal": True}))
"""


def test_report_keys_do_not_move_with_rootdir(pytester):
    pytester.makeini("[pytest]\n")
    (pytester.path / "sub").mkdir()
    (pytester.path / "sub" / "test_keys.py").write_text(RECORD)
    pytester.runpytest("-p", "no:cacheprovider", "sub", "--trainprobes-report", "a.json") \
        .assert_outcomes(passed=1)
    pytester.runpytest("-p", "no:cacheprovider", "sub", f"--rootdir={pytester.path / 'sub'}",
                       "--trainprobes-report", str(pytester.path / "b.json")) \
        .assert_outcomes(passed=1)
    a = json.loads((pytester.path / "a.json").read_text())["results"][0]["target"]
    b = json.loads((pytester.path / "b.json").read_text())["results"][0]["target"]
    assert a == b == "router @ sub/test_keys.py::test_one"


UNJUDGED = """
from trainprobes.result import Result


def test_all_nan_decisions(trainprobes):
    # what causality.check writes when every decision is NaN: nothing was compared
    trainprobes.assert_flag(Result("causality.check", "nan_router", "fail", codes=["TP-C1"],
                                   metrics={"causal": None, "n_leaks": 0},
                                   message="cannot judge: all 64 baseline decisions are NaN"))


def test_errored(trainprobes):
    trainprobes.check(Result("numerics.stall", "fp16", "error", codes=["TP-E1"], message="boom"))
"""


def test_a_result_nothing_could_judge_fails_its_test_as_cannot_judge_exit_2(pytester):
    # was: pytest.fail, so the session exited 1 as if the probe had found something
    pytester.makepyfile(test_unjudged=UNJUDGED)
    out = pytester.runpytest("-p", "no:cacheprovider")
    out.assert_outcomes(failed=2)
    assert out.ret == 2
    out.stdout.fnmatch_lines(["*not a finding (exit 2)*test_all_nan_decisions*",
                              "*not a finding (exit 2)*test_errored*"], consecutive=False)
    out.stdout.fnmatch_lines(["*cannot judge: the probe could not decide*"])
