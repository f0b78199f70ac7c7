"""The pytest plugin, driven by pytester: markers, options, report, baseline, xdist, JUnit."""
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

# pytester's in-process runs drop every module first imported during the run. numpy, torch
# and matplotlib cannot be imported twice in one process (an ImportError or a segfault
# later), so they are imported here, before any inner run; runs that need torch themselves
# go to a subprocess.
import matplotlib  # noqa: E402,F401
import numpy  # noqa: E402,F401
import pytest
import torch  # noqa: E402,F401
from trainprobes.result import Result, load_results, save_results

pytest_plugins = ["pytester"]

# A test module that records hand-made Results: the plugin's faces need no real probe.
RECORDING_TESTS = '''
import pytest
from trainprobes.result import Result

@pytest.mark.parametrize("i", range({n}))
@pytest.mark.causality
def test_router(trainprobes, i):
    trainprobes.record(Result("causality.check", f"router{{i}}", "{verdict}",
                              metrics={{"causal": {causal}, "n_leaks": {leaks}, "n_structural": {leaks},
                                       "n_unconfirmed": 0, "n_score_leaks": 0}},
                              codes={codes}, seed=i))
'''


def recording(n=2, causal=True):
    return RECORDING_TESTS.format(n=n, causal=causal, leaks=0 if causal else 3,
                                  verdict="pass" if causal else "fail",
                                  codes=[] if causal else ["TP-C1"])


def test_import_does_not_import_torch():
    code = ("import sys, trainprobes.pytest_plugin; "
            "assert 'torch' not in sys.modules, 'plugin imported torch'; "
            "assert not any(m.startswith(('trainprobes.causality', 'trainprobes.numerics', "
            "'trainprobes.drift')) for m in sys.modules), 'plugin imported a probe'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_session_without_probes_does_not_import_torch(pytester):
    pytester.makepyfile("""
        import sys
        def test_light():
            assert "torch" not in sys.modules
    """)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_markers_registered_under_strict_markers(pytester):
    pytester.makepyfile("""
        import pytest
        @pytest.mark.numerics
        @pytest.mark.causality
        @pytest.mark.drift
        @pytest.mark.distributed
        def test_marked():
            pass
    """)
    pytester.runpytest("--strict-markers").assert_outcomes(passed=1)


@pytest.mark.slow
def test_gpu_marker_skips_with_reason_without_cuda(pytester):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the gpu marker runs the test here")
    pytester.makepyfile("""
        import pytest
        @pytest.mark.gpu
        def test_needs_gpu():
            raise AssertionError("must not run without CUDA")
    """)
    # torch-importing runs go to a subprocess: pytester's in-process runs drop the modules
    # they imported afterwards, and torch's C extensions do not survive a re-import.
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs CUDA*torch.cuda.is_available() is False*"])


@pytest.mark.parametrize("via_ini", [False, True])
def test_report_written_with_every_result(pytester, via_ini, monkeypatch):
    test_file = pytester.makepyfile(recording(n=3))
    out = pytester.path / "tp.json"
    if via_ini:  # a relative ini path is taken relative to the ini file, not the cwd
        ini = pytester.makeini("[pytest]\ntrainprobes_report = tp.json\n")
        (pytester.path / "sub").mkdir()
        monkeypatch.chdir(pytester.path / "sub")
        result = pytester.runpytest("-c", str(ini), str(test_file))
        assert not (pytester.path / "sub" / "tp.json").exists()
    else:
        result = pytester.runpytest(f"--trainprobes-report={out}")
    result.assert_outcomes(passed=3)
    results, meta = load_results(out)
    assert sorted(r.target.split(" @ ")[0] for r in results) == ["router0", "router1", "router2"]
    assert all("test_router" in r.target for r in results)  # the test id keeps keys unique
    assert meta["source"] == "pytest"
    result.stdout.fnmatch_lines(["*trainprobes*", "*3 pass Result(s)*"])


def test_junit_xml_carries_results(pytester):
    pytester.makepyfile(recording(n=1))
    xml = pytester.path / "junit.xml"
    pytester.runpytest(f"--junitxml={xml}").assert_outcomes(passed=1)
    props = ET.parse(xml).getroot().findall(".//property")
    found = [p for p in props if p.get("name") == "trainprobes:causality.check"]
    assert len(found) == 1
    value = json.loads(found[0].get("value"))
    assert value["verdict"] == "pass" and value["metrics"]["causal"] is True


def _baseline(path, n=2):
    save_results(path, [Result("causality.check", f"router{i} @ test_mod.py::test_router[{i}]",
                               "pass", metrics={"causal": True, "n_leaks": 0, "n_structural": 0,
                                                "n_unconfirmed": 0, "n_score_leaks": 0})
                        for i in range(n)])


def test_baseline_regression_fails_the_session(pytester):
    pytester.makepyfile(test_mod=recording(n=2, causal=False))
    base = pytester.path / "base.json"
    _baseline(base)
    result = pytester.runpytest(f"--trainprobes-baseline={base}")
    result.assert_outcomes(passed=2)  # the tests pass; the comparison fails the session
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*BLOCKED*", "*TP-C1*router0*"])
    assert "| `TP-C1` |" not in result.stdout.str()  # the terminal gets plain text


def test_baseline_without_regression_passes(pytester):
    pytester.makepyfile(test_mod=recording(n=2, causal=True))
    base = pytester.path / "base.json"
    _baseline(base)
    result = pytester.runpytest(f"--trainprobes-baseline={base}")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*PASSED (exit 0)*"])


def test_missing_probe_against_baseline_is_a_regression(pytester):
    pytester.makepyfile(test_mod=recording(n=1, causal=True))
    base = pytester.path / "base.json"
    _baseline(base, n=2)  # router1 is in the baseline, and no test produces it now
    result = pytester.runpytest(f"--trainprobes-baseline={base}")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*TP-G1*router1*"])


@pytest.mark.parametrize("content", ['{"schema_version": 1, "results": [', "not json at all",
                                     '{"schema_version": 99, "results": []}', None])
def test_unreadable_baseline_fails_closed(pytester, content):
    # exit 2, as the summary says: cannot judge is not a finding (was: pytest exited 1)
    pytester.makepyfile(test_mod=recording(n=1))
    base = pytester.path / "base.json"
    if content is not None:  # None: the baseline file does not exist
        base.write_text(content)
    result = pytester.runpytest(f"--trainprobes-baseline={base}")
    assert result.ret == 2
    result.stdout.fnmatch_lines(["*CANNOT JUDGE (exit 2)*"])


def test_check_fails_with_a_clear_message(pytester):
    pytester.makepyfile("""
        from trainprobes.result import Result
        def test_biased(trainprobes):
            trainprobes.check(Result("numerics.bias", "all_reduce[bf16]", "fail",
                                     metrics={"bias": -0.003}, codes=["TP-B1"], seed=7,
                                     message="sum is 0.3% too small"), "biased")
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*biased: numerics.bias on 'all_reduce[[]bf16[]]' -> fail*",
                                 "*sum is 0.3% too small*", "*TP-B1 biased reduction*",
                                 "*bias = -0.003*", "*seed = 7*"])


def test_record_rejects_non_results(pytester):
    pytester.makepyfile("""
        import pytest
        def test_bad(trainprobes):
            with pytest.raises(TypeError, match="needs a trainprobes.result.Result"):
                trainprobes.record({"verdict": "pass"})
    """)
    pytester.runpytest().assert_outcomes(passed=1)


@pytest.mark.slow
def test_xdist_workers_results_reach_the_controller(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(test_mod=recording(n=6, causal=False))
    out = pytester.path / "tp.json"
    base = pytester.path / "base.json"
    _baseline(base, n=6)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist", f"--trainprobes-report={out}",
                                           f"--trainprobes-baseline={base}")
    result.assert_outcomes(passed=6)
    results, _ = load_results(out)
    assert sorted(r.target.split(" @ ")[0] for r in results) == [f"router{i}" for i in range(6)]
    assert result.ret == 1  # regressions found from the workers' Results, on the controller
    result.stdout.fnmatch_lines(["*BLOCKED*"])


# --- the helpers, on the real probes -----------------------------------------------------

REAL_PROBES = '''
import pytest, torch
from trainprobes.reference.routing import expert_choice, topk_softmax
from trainprobes.reference.collectives import all_reduce

x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))

@pytest.mark.causality
def test_causal_router(trainprobes):
    r = trainprobes.assert_causal(topk_softmax, x, decision=0, cuts="all")
    assert r.metrics["causal"] is True

@pytest.mark.causality
def test_leaky_router(trainprobes):
    trainprobes.assert_causal(expert_choice, x, decision=0, cuts="all")

def batch_normalised_router(h):
    # causal along the sequence, but each decision depends on the other sequences
    return (h - h.mean(dim=0, keepdim=True)).argmax(-1)

@pytest.mark.causality
def test_batch_leaky_router(trainprobes):
    trainprobes.assert_causal(batch_normalised_router, x)

def grads(g):
    return list(torch.randn(6, 512, generator=g, dtype=torch.float64) * 1e-3 + 1e-3)

def fp64(xs):
    return all_reduce(xs, op="avg", dtype="fp64")[0]

def fp32(xs):
    return all_reduce(xs, op="avg", dtype="fp32")[0]

def bf16(xs):
    return all_reduce(xs, op="avg", dtype="bf16")[0]

@pytest.mark.numerics
def test_fp32_avg_unbiased(trainprobes):
    trainprobes.assert_unbiased(fp32, fp64, grads, trials=16, min_effect=1e-6)

@pytest.mark.numerics
def test_bf16_avg_biased(trainprobes):
    trainprobes.assert_unbiased(bf16, fp64, grads, trials=16, min_effect=1e-6)

@pytest.mark.numerics
def test_fp32_no_stall(trainprobes):
    trainprobes.assert_no_stall("fp32", 1.0, 4096)

@pytest.mark.numerics
def test_fp16_stalls(trainprobes):
    trainprobes.assert_no_stall("fp16", 1.0, 4096)

lp = -torch.rand(32, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3

@pytest.mark.drift
def test_same_logprobs_within(trainprobes):
    trainprobes.assert_within(lp, lp.clone())

@pytest.mark.drift
def test_offset_logprobs_not_within(trainprobes):
    trainprobes.assert_within(lp, lp - 0.05)
'''


@pytest.mark.slow
def test_helpers_on_real_probes(pytester):
    pytester.makepyfile(test_real=REAL_PROBES)
    out = pytester.path / "tp.json"
    result = pytester.runpytest_subprocess("--strict-markers", "-v", f"--trainprobes-report={out}")
    result.assert_outcomes(passed=4, failed=5)
    result.stdout.fnmatch_lines([
        "*::test_causal_router PASSED*", "*::test_leaky_router FAILED*",
        "*::test_batch_leaky_router FAILED*",
        "*::test_fp32_avg_unbiased PASSED*", "*::test_bf16_avg_biased FAILED*",
        "*::test_fp32_no_stall PASSED*", "*::test_fp16_stalls FAILED*",
        "*::test_same_logprobs_within PASSED*", "*::test_offset_logprobs_not_within FAILED*"])
    result.stdout.fnmatch_lines([
        "*not causal: causality.check on 'expert_choice' -> fail*", "*TP-C1 causality leak*",
        "*biased: numerics.bias on 'bf16' -> fail*", "*TP-B1 biased reduction*",
        "*stalled: numerics.stall*", "*TP-B2 accumulation stall*",
        "*train/inference drift: drift.compare*", "*TP-D1*"], consecutive=False)
    results, _ = load_results(out)
    assert len(results) == 9  # every helper recorded its Result, passing or not
    assert {r.probe for r in results} == {"causality.check", "numerics.bias", "numerics.stall",
                                          "drift.compare"}


def test_two_results_on_one_target_in_one_test_keep_unique_keys(pytester):
    # was: both were stored as "sequential_sum @ <node>", and the gate compared only one
    pytester.makepyfile("""
        from trainprobes.result import Result

        def test_two(trainprobes):
            trainprobes.record(Result("numerics.stall", "sequential_sum", "pass", seed=0))
            trainprobes.record(Result("numerics.stall", "sequential_sum", "fail", codes=["TP-B2"]))
            trainprobes.record(Result("numerics.stall", "other", "pass"))
    """)
    out = pytester.path / "tp.json"
    pytester.runpytest(f"--trainprobes-report={out}").assert_outcomes(passed=1)
    results, _ = load_results(out)
    assert [r.target for r in results] == ["sequential_sum @ test_two_results_on_one_target_in_one_test_keep_unique_keys.py::test_two",
                                           "sequential_sum @ test_two_results_on_one_target_in_one_test_keep_unique_keys.py::test_two #2",
                                           "other @ test_two_results_on_one_target_in_one_test_keep_unique_keys.py::test_two"]
    assert len({r.key for r in results}) == 3


def test_assert_flag_fails_closed_without_the_verdict_boolean(pytester):
    # was: assert_unbiased read metrics.get("verdict") == "biased", so a Result without it
    # passed; each helper now requires the probe's verdict boolean with its good value
    pytester.makepyfile("""
        from trainprobes.result import Result

        def bias(**metrics):
            return Result("numerics.bias", "t", "pass", metrics=metrics)

        def test_missing(trainprobes):
            trainprobes.assert_flag(bias(bias=0.0))

        def test_mistyped(trainprobes):
            trainprobes.assert_flag(bias(biased="false"))

        def test_bad_value_beside_a_pass(trainprobes):
            trainprobes.assert_flag(bias(biased=True))

        def test_no_flag_documented(trainprobes):
            trainprobes.assert_flag(Result("numerics.stall", "t", "pass"))

        def test_good(trainprobes):
            trainprobes.assert_flag(bias(biased=False))
    """)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=1, failed=4)
    result.stdout.fnmatch_lines([
        "*cannot judge: 'numerics.bias::t': metric 'biased' (the verdict boolean) is missing*",
        "*cannot judge: 'numerics.bias::t': metric biased='false' is mistyped*",
        "*biased = True (passes with biased = False)*",
        "*cannot judge: 'numerics.stall::t': probe 'numerics.stall' documents no verdict*"],
        consecutive=False)


CRASHING_TESTS = '''
import torch
import trainprobes.causality.summary as summary
from trainprobes.reference.routing import expert_choice

X = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))

def test_finding(trainprobes):
    trainprobes.assert_causal(expert_choice, X, decision=0)

def test_usage(trainprobes):
    trainprobes.assert_no_stall("fp17", 1.0, 10)

def test_internal(trainprobes, monkeypatch):
    monkeypatch.setattr(summary, "Kind", None)  # a bug: an AttributeError inside the summary
    trainprobes.assert_causal(lambda x: x.argmax(-1), X)

def test_users_own_error(trainprobes):
    raise KeyError("the test's own bug, not trainprobes'")
'''


@pytest.mark.slow
@pytest.mark.parametrize("tests, code", [("finding or users_own_error", 1), ("finding or usage", 2),
                                         ("finding or usage or internal", 3)])
def test_a_crash_of_trainprobes_is_never_a_finding(pytester, tests, code):
    """Exit 1 means a finding; trainprobes raising inside a helper exits 2 (could not judge)
    or 3 (an internal error, traceback in the log folder), as every other face does."""
    pytester.makepyfile(test_crash=CRASHING_TESTS)
    result = pytester.runpytest_subprocess("-k", tests, "-p", "no:cacheprovider")
    assert result.ret == code, result.stdout.str()[-3000:]
    out = result.stdout.str()
    assert ("not a finding (exit 3)" in out and "traceback in" in out) == (code == 3)
    assert ("not a finding (exit 2)" in out) == (code >= 2)
    crashes = [ln for ln in out.splitlines() if ln.startswith("not a finding")]
    assert not any("test_users_own_error" in ln for ln in crashes)  # the test's own bug is its own
