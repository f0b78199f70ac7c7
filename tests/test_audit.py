"""The audit: running suites, progress, history, reports on disk, config, the CLI."""
import io
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from trainprobes.audit import (
                               Check,
                               Progress,
                               exit_code,
                               point_latest,
                               read_history,
                               run_audit,
                               run_suite,
                               trend_plots,
)
from trainprobes.audit.config import ConfigError, apply_thresholds, find_config, suite_from_config
from trainprobes.audit.families import leak_map
from trainprobes.cli import main
from trainprobes.result import Result, load_results


def ok(target="t", **metrics):
    return Check("numerics", target, lambda: Result("numerics.fake", target, "pass",
                                                    metrics=metrics))


def boom():
    raise RuntimeError("router exploded")


# --- running -----------------------------------------------------------------------------

def test_a_raising_check_becomes_an_error_result_and_the_rest_run():
    results, timings = run_suite([Check("causality", "bad", boom), ok("after")])
    assert [r.verdict for r in results] == ["error", "pass"]
    assert results[0].codes == ["TP-E1"] and "router exploded" in results[0].message
    assert "RuntimeError" in results[0].evidence["traceback"]
    assert [t["name"] for t in timings] == ["bad", "after"]


def test_two_checks_with_one_target_keep_unique_keys_for_the_gate():
    # was: two entries with one name (or one import path in two modes) gave two Results
    # one probe::target key, and the gate compared only one of them
    results, _ = run_suite([ok("r"), ok("other"), ok("r"), ok("r")])
    assert [r.target for r in results] == ["r", "other", "r #2", "r #3"]
    assert len({r.key for r in results}) == 4


def test_a_check_returning_a_non_result_is_an_error():
    results, _ = run_suite([Check("drift", "odd", lambda: [42])])
    assert results[0].verdict == "error" and "returned int, expected Result" in results[0].message


def control(target, verdict, expected):
    return Check("causality", target, lambda: Result("causality.check", target, verdict,
                                                     expected=expected), control=True)


def test_a_control_without_its_known_verdict_is_an_error():
    # else it would show as a finding, red, in a report that should hold none
    results, _ = run_suite([Check("drift", "ctl", lambda: Result("drift.compare", "e", "fail"),
                                  control=True)])
    assert results[0].verdict == "error" and "without a known verdict" in results[0].message


def test_background_checks_run_beside_the_others_and_keep_suite_order():
    seen = threading.Event()

    def waits():  # finishes only if the foreground check runs meanwhile
        return Result("distributed.collective", "gloo", "pass" if seen.wait(10) else "fail")

    def sets():
        seen.set()
        return Result("numerics.fake", "cpu", "pass")
    results, timings = run_suite([Check("distributed", "gloo", waits, background=True),
                                  Check("numerics", "cpu", sets)])
    assert [(r.target, r.verdict) for r in results] == [("gloo", "pass"), ("cpu", "pass")]
    assert [t["name"] for t in timings] == ["gloo", "cpu"]


@pytest.mark.parametrize("verdicts,kw,code", [
    ([("pass", None), ("warn", None)], {}, 0),            # watch-outs do not fail
    ([("fail", "fail"), ("pass", "pass")], {}, 0),        # a known-leaky router that leaks
    ([("fail", None)], {}, 1),                            # a real finding, as pytest would
    ([("pass", "fail")], {}, 1),                          # a control missed: harness broken
    ([("fail", None)], {"report_only": True}, 0),
    ([("pass", "fail")], {"report_only": True}, 0),
    ([("error", None), ("fail", None)], {}, 2),           # could not run wins
    ([("error", None)], {"report_only": True}, 2),
    ([("pass", None)], {"strict": True, "skipped": {"gloo": "not installed"}}, 2),
    ([("pass", None)], {"skipped": {"gloo": "not installed"}}, 0),
])
def test_exit_codes(verdicts, kw, code):
    rs = [Result("p.q", f"t{i}", v, expected=e) for i, (v, e) in enumerate(verdicts)]
    assert exit_code(rs, **kw) == code


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_on_terminal_plain_lines_in_logs(tty):
    stream = io.StringIO()
    run_suite([ok("a"), ok("b")], progress=Progress(2, stream=stream, tty=tty))
    out = stream.getvalue()
    if tty:
        assert "\r[" in out and "1/2" in out and "\n" not in out
    else:
        assert "\r" not in out
        assert out.splitlines()[0].startswith("[1/2] numerics: a ... pass (")
        assert out.splitlines()[1].startswith("[2/2] numerics: b ... pass (")


def test_run_audit_writes_timestamped_reports_without_overwriting(tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    a = run_audit([ok()], tmp_path, stamp="20260101T000000Z")
    b = run_audit([ok()], tmp_path, stamp="20260101T000000Z")
    assert a.out_dir.name == "20260101T000000Z" and b.out_dir.name == "20260101T000000Z-1"
    for o in (a, b):
        assert sorted(p.name for p in o.out_dir.iterdir()) == ["report.html", "report.json",
                                                               "summary.md"]
    results, meta = load_results(a.paths["json"])
    assert results[0].target == "t" and meta["timings"][0]["name"] == "t"


def test_run_audit_appends_to_step_summary(tmp_path, monkeypatch):
    summary = tmp_path / "gh.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    o = run_audit([ok()], tmp_path / "r")
    assert summary.read_text().strip() == o.paths["markdown"].read_text().strip()


def test_report_writing_shows_progress_and_counts_in_the_wall_time(tmp_path, monkeypatch):
    # was: "in 8.1 s" for a 16.4 s run, and ~6 s of silence while the report was written
    import trainprobes.report.html as html

    def slow_figure(spec):
        time.sleep(0.4)
        return "<figure></figure>"
    monkeypatch.setattr(html, "_figure", slow_figure)
    plot = {"kind": "line", "title": "t", "x": [1, 2], "series": {"a": [1, 2]}}
    check = Check("numerics", "w", lambda: Result("numerics.fake", "w", "warn",
                                                  evidence={"plots": [plot]}))
    stream = io.StringIO()
    o = run_audit([check], tmp_path, progress=Progress(1, stream=stream, tty=False),
                  step_summary=False)
    _, meta = load_results(o.paths["json"])
    assert meta["seconds"] >= meta["check_seconds"] + 0.39 and o.seconds   # both rounded to 0.01 s >= meta["seconds"]
    assert f"{meta['seconds']:.1f} s" in o.paths["markdown"].read_text()
    lines = stream.getvalue().splitlines()
    assert lines[1:4] == ["[report] drawing 1 plot for report.html", "[report] plot 1/1: t",
                          lines[3]] and lines[3].startswith("[report] wrote report.json (")


def test_reports_latest_names_the_newest_run(tmp_path):
    # was: no stable path; the example's reports/*/report.json glob broke on the second run
    a = run_audit([ok("first")], tmp_path, step_summary=False)
    b = run_audit([ok("second")], tmp_path, step_summary=False)
    assert (tmp_path / "LATEST").read_text().strip() == b.out_dir.name
    assert (tmp_path / "latest").is_symlink() and a.paths["latest"] == tmp_path / "latest"
    results, _ = load_results(tmp_path / "latest" / "report.json")
    assert results[0].target == "second"


def test_reports_latest_is_a_copy_where_symlinks_fail(tmp_path, monkeypatch):
    def no_symlinks(*a, **k):
        raise OSError("symbolic links are not allowed here")
    monkeypatch.setattr(os, "symlink", no_symlinks)
    run_audit([ok("first")], tmp_path, step_summary=False)
    b = run_audit([ok("second")], tmp_path, step_summary=False)
    latest = tmp_path / "latest"
    assert latest.is_dir() and not latest.is_symlink()
    assert load_results(latest / "report.json")[0][0].target == "second"
    assert (tmp_path / "LATEST").read_text().strip() == b.out_dir.name


def test_a_users_own_latest_folder_is_left_alone(tmp_path):
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "mine.txt").write_text("keep")
    o = run_audit([ok()], tmp_path, step_summary=False)
    assert (tmp_path / "latest" / "mine.txt").read_text() == "keep"
    assert point_latest(tmp_path, o.out_dir) == tmp_path / "LATEST"


def test_exit_code_2_when_a_probe_errored(tmp_path):
    assert run_audit([Check("x", "bad", boom)], tmp_path, step_summary=False).exit_code == 2
    assert run_audit([ok()], tmp_path, step_summary=False).exit_code == 0


@pytest.mark.slow
def test_history_appends_one_line_per_run_and_plots_trends(tmp_path):
    hist = tmp_path / "hist"
    for night, bias in enumerate([1e-4, 2e-4, 4e-4]):
        o = run_audit([ok("ar", bias=bias)], tmp_path / "r", history=hist, step_summary=False)
    runs = read_history(hist)
    assert [r["metrics"]["numerics.fake::ar::bias"] for r in runs] == [1e-4, 2e-4, 4e-4]
    assert runs[-1]["problems"] == {"failing_findings": 0, "missed_controls": 0, "errors": 0,
                                    "total": 0}
    plots = trend_plots(runs)
    assert [p["title"] for p in plots] == ["problems per run", "numerics.fake: bias across runs"]
    (panel,) = plots[1]["panels"]
    assert panel == {"ylabel": "relative error", "title": "bias",
                     "series": {"ar": [1e-4, 2e-4, 4e-4]}, "integer": False}
    assert plots[1]["x"] == [1, 2, 3] and len(plots[1]["xticklabels"]) == 3  # runs, not 0.0-1.0
    html = o.paths["html"].read_text()
    assert "id='trends'" in html and "id='all'" not in html  # one place per Result: no repeated table


def test_trends_draw_the_series_that_changed_most_and_say_what_is_hidden():
    # was: the first 8 keys alphabetically, silently; the headline bf16 ring bias never showed
    runs = [{"created": f"2026-11-{d:02d}T07:30:00+00:00", "metrics": {
        **{f"numerics.bias::a{i:02d}::bias": 1e-3 for i in range(11)},
        "numerics.bias::z_bf16_ring::bias": -0.2 - 0.01 * d,
        "numerics.bias::a00::p_value": 0.5}} for d in (1, 2, 3)]
    (_, plot) = trend_plots(runs, max_series=4)
    shown = plot["panels"][0]["series"]
    assert "z_bf16_ring" in shown and len(shown) == 4
    assert plot["note"].startswith("4 of 12 targets drawn (the stack's own first, then those "
                                   "that changed most); 8 not drawn (all unchanged): ")
    hidden = [t for t in (f"a{i:02d}" for i in range(11)) if t not in shown]
    assert plot["note"].endswith(", ".join(hidden))  # every one not drawn is named
    assert plot["xticklabels"] == ["11-01 07:30", "11-02 07:30", "11-03 07:30"]
    assert [p["title"] for p in plot["panels"]] == ["bias"]  # p-values only jitter
    assert [p["ylabel"] for p in plot["panels"]] == ["relative error"]  # its unit


def test_trends_put_the_stacks_own_targets_before_the_controls():
    # was: most trends were the reference controls, the user's stack after or hidden
    runs = [{"created": f"2026-11-{d:02d}T07:30:00+00:00", "metrics": {
        **{f"numerics.bias::ctl{i}::bias": 0.1 * i * d for i in range(1, 6)},
        "numerics.bias::mine::bias": 1e-3,
        **{f"drift.compare::ctl_d{i}::mean_log_ratio": 0.01 * d for i in range(3)},
        "causality.check::my_router::flip_rate": 0.0},
        "controls": [f"numerics.bias::ctl{i}" for i in range(1, 6)]
        + [f"drift.compare::ctl_d{i}" for i in range(3)]} for d in (1, 2, 3)]
    plots = trend_plots(runs, max_series=3)
    fams = [p["title"].split(":")[0] for p in plots[1:]]
    assert fams.index("causality.check") < fams.index("drift.compare")  # own stack first
    bias = plots[1 + fams.index("numerics.bias")]
    shown = list(bias["panels"][0]["series"])
    assert shown[0] == "mine"  # unchanged, but the user's: drawn before controls that moved
    assert all(s.endswith("(control)") for s in shown[1:])
    not_drawn = [f"ctl{i}" for i in range(1, 6) if f"ctl{i} (control)" not in shown]
    assert bias["note"].endswith("3 not drawn (changed less): " + ", ".join(not_drawn))


def test_history_skips_a_torn_line(tmp_path):
    (tmp_path / "history.jsonl").write_text('{"metrics": {"a": 1}}\n{"metri')
    run_audit([ok()], tmp_path / "r", history=tmp_path, step_summary=False)
    assert len(read_history(tmp_path)) == 2


# --- thresholds, leak maps ---------------------------------------------------------------

@pytest.mark.parametrize("entry,verdict,broken", [
    ({"fail_above": {"k3_kl": 0.01}}, "fail", "k3_kl = 0.02 > 0.01 (fail_above)"),
    ({"fail_above": {"k3_kl": 0.05}}, "pass", None),
    ({"fail_below": {"match": 1.0}}, "fail", "match = 0.5 < 1 (fail_below)"),
    ({"fail_above": {"absent": 1.0}}, "error", None),  # cannot be checked: not a finding
])
def test_thresholds(entry, verdict, broken):
    r = apply_thresholds(Result("drift.compare", "e", "pass",
                                metrics={"k3_kl": 0.02, "match": 0.5}), entry, "drift")
    assert r.verdict == verdict
    if broken:
        assert r.codes == ["TP-D3"] and broken in r.message
        assert r.evidence["thresholds"]["broken"] == [broken]


def test_leak_map_counts_position_by_cut():
    spec = leak_map([{"position": 3, "cut": 1}, {"position": 3, "cut": 1}, (0, 2)], seq_len=4)
    assert spec["matrix"][3][1] == 2 and spec["matrix"][0][2] == 1
    assert sum(map(sum, spec["matrix"])) == 3
    binned = leak_map([(127, 0)], seq_len=128, bins=64)
    assert len(binned["matrix"]) == 64 and binned["matrix"][63][0] == 1


# --- the default suite's parts ------------------------------------------------------------

def test_stall_control_knows_its_verdict_from_the_stall_points():
    from trainprobes.audit.suites import stall_expected
    assert stall_expected(("fp16",), (1.0,), 4096, 0.01) == "warn"  # stalls at 2048
    assert stall_expected(("fp16",), (1.0,), 2048, 0.01) == "pass"  # 2048 ones reach 2048
    assert stall_expected(("fp32", "bf16"), (1.0,), 200, 0.01) == "pass"
    assert stall_expected(("fp8_e5m2",), (1e-9,), 10, 0.01) == "warn"  # rounds to 0


@pytest.mark.parametrize("bits,lower,verdict", [(10, False, "warn"), (23, False, "pass"),
                                                (7, True, "pass")])
def test_an_accumulator_narrower_than_fp32_is_a_watch_out(bits, lower, verdict):
    from trainprobes.audit.families import accumulator_finding
    r = accumulator_finding(Result("numerics.reveal", "torch.matmul[fp32,cuda]", "pass",
                                   metrics={"accumulator_mantissa_bits": bits,
                                            "accumulator_bits_lower_bound": lower}))
    assert r.verdict == verdict and ("TP-B3" in r.codes) == (verdict == "warn")
    assert r.message.startswith("watch out") == (verdict == "warn")


def test_gpu_families_are_not_on_this_machine_rather_than_skipped(monkeypatch):
    import trainprobes.audit.suites as suites
    monkeypatch.setattr(suites, "_cuda", lambda: "no CUDA device")
    checks, skipped = suites.default_suite(families=["reveal", "gpu_kernels", "nccl"])
    assert skipped == {} and {c.family for c in checks} == {"numerics"}
    assert suites.not_here(["reveal", "gpu_kernels", "nccl"]) == {
        "gpu_kernels": "no CUDA device", "nccl": "no CUDA device"}


def test_gpu_families_build_their_checks_where_cuda_is(monkeypatch):
    """Built, not run (no GPU here): the names say which settings they measure under."""
    import torch
    import torch.distributed as dist
    import trainprobes.audit.suites as suites
    monkeypatch.setattr(suites, "_cuda", lambda: None)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    checks, _ = suites.default_suite(families=["gpu_kernels", "nccl"])
    names = [c.name for c in checks]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    assert f"reveal torch.matmul[fp32,cuda,allow_tf32={tf32}]" in names
    assert "reveal torch._scaled_mm[fp8_e4m3fn,cuda,out=bf16]" in names
    assert names[-1] == "nccl all_reduce on 2 local ranks" and checks[-1].background
    assert not any(c.control for c in checks)  # the stack part: findings


@pytest.mark.slow
def test_a_worker_process_returns_the_same_results_as_running_here():
    from trainprobes.audit.remote import worker_check
    from trainprobes.audit.suites import default_suite
    here, _ = run_suite(default_suite(quick=True, families=["stall"], in_process=True)[0])
    there, _ = run_suite([worker_check("stall", "stall (worker)", seed=0, quick=True,
                                       control=True)])
    fields = ("probe", "target", "verdict", "expected", "metrics", "codes", "message")
    assert [[getattr(r, f) for f in fields] for r in there] == \
        [[getattr(r, f) for f in fields] for r in here]


def test_a_worker_that_fails_is_an_error_naming_its_family():
    from trainprobes.audit.remote import worker_check
    (r,) = run_suite([worker_check("nope", "nope (worker)", seed=0, quick=True,
                                   control=True)])[0]
    assert r.verdict == "error" and "worker process for 'nope' exited 2" in r.message  # an unknown family: bad usage
    assert "families='nope' must be one of" in r.message


def test_the_largest_calibration_family_runs_in_a_worker_process():
    from trainprobes.audit.suites import default_suite
    (check,) = default_suite(families=["collectives"])[0]
    assert check.background and check.control and check.name == "collectives (in a worker process)"


def test_the_op_map_is_a_default_watch_out_and_documents_runs_only_when_named():
    """This machine's per-op map runs by default as findings whose variant ops warn
    (isolation.op_map is advisory: CPU fp32 matmuls are variant on a healthy machine) and
    never fail; documents imports transformers (seconds of a 10-second audit): by name only."""
    from trainprobes.audit.suites import default_suite
    checks, _ = default_suite(quick=True)
    assert "batch invariance of torch.mm on cpu" in {c.name for c in checks}
    assert not any("packed documents" in c.name for c in checks)
    ops, skipped = default_suite(quick=True, families=["batch_invariance"])
    assert skipped == {} and {c.family for c in ops} == {"isolation"}
    assert not any(c.control for c in ops)  # findings about this machine
    (mm,) = [c for c in ops if c.name == "batch invariance of torch.mm on cpu"]
    results = run_suite([mm])[0]
    assert results and {r.probe for r in results} == {"isolation.op_map"}
    for r in results:
        assert r.verdict == ("pass" if r.metrics["batch_invariant"] else "warn"), r.summary_line()
        assert (r.codes == ["TP-I2"]) is (r.metrics["batch_invariant"] is False)
    docs, _ = default_suite(quick=True, families=["documents"])
    assert docs and all("packed documents" in c.name for c in docs)


def test_on_a_gpu_machine_the_op_map_covers_the_gpu_too(monkeypatch):
    # an inference engine runs the GPU's kernels: mapping only the CPU there would say
    # nothing about them (what the first GPU run of the audit did)
    from trainprobes.audit import suites
    monkeypatch.setattr(suites, "_cuda", lambda: None)
    names = {c.name for c in suites.isolation_ops_checks(quick=True)}
    assert {"batch invariance of torch.mm on cpu", "batch invariance of torch.mm on cuda"} <= names
    monkeypatch.setattr(suites, "_cuda", lambda: "no CUDA device")
    assert not any(n.endswith("on cuda") for n in {c.name for c in suites.isolation_ops_checks()})


def test_controls_run_at_their_own_seed_whatever_seed_says():
    from trainprobes.audit.suites import CONTROL_SEED, default_suite
    checks, _ = default_suite(seed=7, quick=True, families=["causality"])
    assert all(c.control for c in checks)
    (r,) = run_suite(checks[:1])[0]
    assert r.seed == CONTROL_SEED and r.expected == "pass" and r.reproduced


# --- config ------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg,match", [
    ({"colectives": []}, r"unknown keys \['colectives'\]"),
    ({"causality": [{"seq_len": 8, "vocab": 10}]}, r"missing 'target'"),
    ({"causality": ["x"]}, r"must be a table"),
])
def test_config_errors_name_the_key(cfg, match):
    with pytest.raises(ConfigError, match=match):
        suite_from_config(cfg)


def test_find_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config() == (None, None)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert find_config() == (None, None)  # a pyproject without our table: default suite
    (tmp_path / "pyproject.toml").write_text('[tool.trainprobes]\nseed = 3\n')
    cfg, path = find_config()
    assert cfg == {"seed": 3} and path.name == "pyproject.toml"
    with pytest.raises(ConfigError, match="does not exist"):
        find_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[tool.trainprobes\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        find_config(tmp_path / "bad.toml")


# --- the CLI -----------------------------------------------------------------------------

def test_cli_audit_json_prints_the_report_document(tmp_path, capsys, monkeypatch):
    # was: {report, html, counts, skipped, results} of its own, unlike report.json
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    code = main(["audit", "--default", "--quick", "--families", "stall", "--out", "out",
                 "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["exit_code"] == 0
    saved = json.loads(Path(doc["paths"]["json"]).read_text())
    assert list(doc)[:2] == ["schema_version", "command"] and doc["command"] == "audit"
    assert doc["results"] == saved["results"]
    assert {k: v for k, v in doc.items() if k not in ("exit_code", "paths")} == saved
    (r,) = doc["results"]
    assert r["probe"] == "numerics.stall" and r["expected"] == "warn" and r["verdict"] == "warn"
    # was: a curve of the sums of ones only, tf32 hidden under fp16, while the warning was
    # about fp8_e5m2 + 0.001: now one bar per row of the table
    (stall_plot,) = r["evidence"]["plots"]
    assert stall_plot["kind"] == "bars"
    assert len(stall_plot["labels"]) == len(r["evidence"]["rows"]) == 12
    assert "fp8_e5m2 + 0.001: 0.007812 of 4.096" in stall_plot["labels"]
    assert 'src="data:image/png;base64,' in Path(doc["paths"]["html"]).read_text()
    assert Path(doc["paths"]["latest"]) == Path("out") / "latest"


USER_SUITE = """
[tool.trainprobes]
pythonpath = ["."]
[[tool.trainprobes.causality]]
name = "r"
target = "routers_mod:leaky"
hidden = 8
seq_len = 16
"""


def test_cli_user_suite_with_a_failing_finding_exits_1_unless_report_only(tmp_path, capsys,
                                                                          monkeypatch):
    # was: exit 0 on real failures unless --strict
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    write_module(tmp_path, "routers_mod", ROUTERS)
    (tmp_path / "suite.toml").write_text(USER_SUITE)
    argv = ["audit", "--config", str(tmp_path / "suite.toml"), "--out", str(tmp_path / "o"),
            "--no-progress"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "FAIL   causality.check r [TP-C1]" in out and "1 problem; findings: 1 fail" in out
    assert "exit 1 (problems): FAIL causality.check r" in err
    assert main(argv + ["--report-only"]) == 0
    assert main(argv + ["--report-only", "--strict"]) == 0  # nothing skipped
    assert len(list((tmp_path / "o").glob("2*/report.json"))) == 3


def test_cli_default_suite_families_exit_0_and_name_no_red_line(tmp_path, capsys, monkeypatch):
    """Controls with their known verdicts are reproduced, not failures: usable with --strict."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    assert main(["audit", "--families", "reveal,causality", "--quick", "--strict",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "OK     causality.check: 20 of 20 controls reproduced" in out
    assert not re.search(r"^\s+(FAIL|MISSED|ERROR)\s", out, re.M)
    assert "no problems; findings: 6 pass; calibration: 20 of 20 controls reproduced" in out


def test_cli_a_broken_control_exits_1_naming_it(tmp_path, capsys, monkeypatch):
    """If the known-leaky expert-choice router stopped leaking (here: replaced by a causal
    one), the harness is not doing its job on this machine: exit 1, naming the control."""
    from trainprobes.reference import routing
    monkeypatch.setattr(routing, "expert_choice", routing.topk_softmax)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    assert main(["audit", "--families", "causality", "--quick", "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert "MISSED causality.check: 18 of 20 controls reproduced; missed: " \
        "trainprobes.reference.routing:expert_choice[perturb], " \
        "trainprobes.reference.routing:expert_choice[truncate]" in out
    assert "expected fail, got pass" in out
    assert "exit 1 (problems): MISSED causality.check trainprobes.reference.routing:" \
        "expert_choice[perturb]" in err
    html = (tmp_path / "reports" / "latest" / "report.html").read_text()
    assert "expected fail, got pass</b>" in html


def test_cli_strict_exits_2_when_a_family_is_skipped(tmp_path, capsys, monkeypatch):
    import trainprobes.audit.suites as suites
    monkeypatch.setattr(suites, "_available", lambda m: m != "trainprobes.drift.demo")
    monkeypatch.chdir(tmp_path)
    argv = ["audit", "--families", "reveal,drift", "--no-progress"]
    assert main(argv) == 0
    assert main(argv + ["--strict"]) == 2
    assert "exit 2 (--strict): skipped drift" in capsys.readouterr().err


def test_cli_audit_unknown_family_exit_2(capsys):
    assert main(["audit", "--families", "stall,nope"]) == 2
    assert "families='nope' must be one of ('reveal', " in capsys.readouterr().err
    assert main(["audit", "--families", "stal"]) == 2
    assert "did you mean 'stall'?" in capsys.readouterr().err
    assert main(["audit", "--families", ","]) == 2
    assert "--families ',' names no family; e.g. --families reveal,causality" in \
        capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out", "--history"])
def test_cli_audit_uncreatable_out_dir_exit_2_before_running(tmp_path, capsys, flag):
    # was: every check ran, then a FileNotFoundError traceback and exit 1
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    argv = ["audit", "--families", "stall", "--quick", "--no-progress"]
    if flag != "--out":  # one --out: a second, different one is refused as a repeat
        argv += ["--out", str(tmp_path / "o")]
    assert main(argv + [flag, str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert "cannot be created" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_cli_audit_bad_config_exit_2(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[tool.trainprobes]\nbogus = 1\n")
    assert main(["audit", "--config", str(cfg)]) == 2
    assert "unknown keys ['bogus']" in capsys.readouterr().err


# --- the default suite, once, in full ----------------------------------------------------

@pytest.mark.slow
def test_default_suite_end_to_end(tmp_path, monkeypatch):
    """The README's main command on a healthy machine: your stack as findings, every control
    reproduced, no red line, exit 0, a report small enough to open and mail."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    import torch
    threads = torch.get_num_threads()
    assert main(["audit", "--no-progress", "--out", "out", "--history", "hist"]) == 0
    assert torch.get_num_threads() == threads  # --threads 1 is undone after the run
    report = tmp_path / "out" / "latest" / "report.json"
    results, meta = load_results(report)
    assert meta["suite"] == "default" and meta["skipped"] == {} and meta["torch_threads"] == 1
    assert meta["seconds"] >= meta["check_seconds"]
    families = {t["family"] for t in meta["timings"]}
    assert families == {"numerics", "collectives", "causality", "drift", "distributed", "isolation"}
    assert not [r for r in results if r.verdict == "error"]
    by = {r.target: r for r in results}
    # calibration: every control carries its known verdict and reproduces it
    controls = [r for r in results if r.is_control]
    assert all(r.reproduced for r in controls), [r.target for r in controls if not r.reproduced]
    from trainprobes.reference.routing import KNOWN_VERDICTS
    assert sum(r.probe == "causality.check" for r in controls) == 2 * len(KNOWN_VERDICTS) + 2
    assert {r.probe for r in controls} == {
        "numerics.stall", "numerics.sites.collective", "numerics.sites.grad_accumulation",
        "numerics.sites.weight_update", "numerics.bias", "numerics.reveal", "causality.check",
        "drift.compare"}
    drift = [r for r in controls if r.probe == "drift.compare"]
    assert len(drift) == 7
    assert all(r.metrics["drift_verdict"] == r.evidence["scenario"]["expect"] for r in drift)
    assert by["all_reduce[bf16,ring,sum,nearest,w=1024,n=256]"].metrics["bias"] < -0.1
    assert by["all_reduce[bf16,ring,sum,stochastic,w=128,n=1024]"].metrics["biased"] is False
    assert by["all_reduce[fp32,ring,sum,nearest,w=128,n=1024]"].metrics["biased"] is False
    assert by["emulated all_reduce[bf16,ring]"].metrics["accumulator_mantissa_bits"] == 7
    # your stack: findings about this machine, none failing
    found = [r for r in results if not r.is_control]
    assert {r.probe for r in found} == {"numerics.reveal", "distributed.collective",
                                        "isolation.op_map"}
    assert all(r.verdict in ("pass", "warn") for r in found)
    ops = [r for r in found if r.probe == "isolation.op_map"]
    assert {r.evidence["op"] for r in ops} >= {"mm", "softmax", "scaled_dot_product_attention"}
    gloo = [r for r in found if r.probe == "distributed.collective"]
    assert len(gloo) == 12 and all(r.metrics["bitwise_match_fraction"] == 1.0 for r in gloo)
    # the report: small, findings first, no red
    html = report.with_name("report.html").read_text()
    assert report.stat().st_size < 1_000_000 and len(html.encode()) < 500_000
    assert 'class="b b-fail"' not in html and 'class="b b-missed"' not in html
    assert "class='status good'>no problems" in html
    assert len((tmp_path / "hist" / "history.jsonl").read_text().splitlines()) == 1


# --- config sections ---------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def docs_schema_example() -> dict:
    from trainprobes import _toml
    text = (REPO / "docs" / "audit.md").read_text()
    block = text.split("<!-- schema-example -->", 1)[1].split("```toml", 1)[1].split("```", 1)[0]
    return _toml.loads(block)["tool"]["trainprobes"]


@pytest.mark.slow
def test_docs_schema_example(monkeypatch):
    """The documented schema builds, and each of its sections runs to a real Result."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = docs_schema_example()
    checks, skipped = suite_from_config(cfg, base_dir=REPO)
    assert skipped == {}
    names = [c.name for c in checks]
    assert names == ["moe.router", "moe.block", "grad_allreduce", "rl.engine_pair",
                     "all_reduce bf16 ring w=8", "all_reduce fp16 ring w=8",
                     "all_reduce bf16 ring w=64", "all_reduce fp16 ring w=64"]
    results, _ = run_suite([checks[i] for i in (0, 2, 3, 4)])
    by = {r.target: r for r in results}
    assert by["moe.router"].metrics["causal"] is True and by["moe.router"].verdict == "pass"
    assert by["grad_allreduce"].metrics["biased"] is True  # bf16(1/6): +0.195%
    assert "dp_allreduce[bf16,w=8]" in by  # only the axes the entry varies name a variant
    drift = by["rl.engine_pair"]
    assert drift.probe == "drift.compare" and drift.evidence["thresholds"]["k3_kl"] == 0.01
    assert any(p["kind"] == "hist" for p in drift.evidence["plots"])


def write_module(tmp_path, name, text):
    (tmp_path / f"{name}.py").write_text(text)
    return tmp_path


ROUTERS = '''
import torch
def causal(x):
    return x.argmax(-1, keepdim=True)
def leaky(x):
    return (x - x.mean(dim=1, keepdim=True)).argmax(-1, keepdim=True)
'''


@pytest.mark.parametrize("target,causal", [("routers_mod:causal", True),
                                           ("routers_mod:leaky", False)])
def test_config_causality_section(tmp_path, monkeypatch, target, causal):
    monkeypatch.setattr(sys, "path", list(sys.path))
    write_module(tmp_path, "routers_mod", ROUTERS)
    cfg = {"pythonpath": ["."], "causality": [{"name": "r", "target": target, "hidden": 8,
                                               "seq_len": 16, "cuts": "all",
                                               "fail_above": {"n_leaks": 0}}]}
    checks, _ = suite_from_config(cfg, base_dir=tmp_path, seed=3)
    (r,) = run_suite(checks)[0]
    assert r.target == "r" and r.seed == 3 and r.metrics["causal"] is causal
    assert r.verdict == ("pass" if causal else "fail")
    if not causal:
        assert "TP-C1" in r.codes and "n_leaks" in r.message
        assert any(p["kind"] == "heatmap" for p in r.evidence["plots"])


@pytest.mark.parametrize("section,entry,match", [
    ("causality", {"target": "x:y", "hidden": 8, "vocab": 10}, "exactly one of vocab"),
    ("causality", {"target": "x:y", "hidden": 8, "cutz": "all"},
     r"unknown keys \['cutz'\]; known for \[\[causality\]\]"),
    ("causality", {"target": "x:y", "hidden": 8, "seq_len": 0}, r"seq_len=0 must be an int >= 1"),
    ("bias", {"target": "x:y", "inputs": "x:z"}, r"missing 'reference'"),
    ("drift", {"train": "a.npz"}, "needs exactly one source"),
    ("drift", {"engine": "x:y", "rollouts": "r.jsonl"}, "needs exactly one source"),
    ("drift", {"engine": "x:y", "alhpa": 0.1}, r"unknown keys \['alhpa'\]"),
    ("collectives", {"backend": "mpi"}, r"backend='mpi' must be one of \('emulated', 'gloo', 'nccl'\)"),
    ("collectives", {"backend": "gloo", "trials": 4}, r"unknown keys \['trials'\]"),
])
def test_config_section_errors(section, entry, match):
    with pytest.raises(ConfigError, match=match):
        suite_from_config({section: [entry]})


def test_config_unimportable_target_is_an_error_result_naming_it(tmp_path):
    checks, _ = suite_from_config({"causality": [{"target": "no_such_mod:fn", "hidden": 4}]})
    (r,) = run_suite(checks)[0]
    assert r.verdict == "error" and "no_such_mod" in r.message and "target" in r.message


def test_config_drift_from_npz_files(tmp_path):
    import numpy as np
    g = np.random.default_rng(0)
    train = -g.uniform(0.1, 3.0, size=(32, 16))
    np.savez(tmp_path / "train.npz", logprobs=train)
    np.savez(tmp_path / "infer.npz", logprobs=train - 0.2)  # a constant offset: biased
    cfg = {"drift": [{"name": "files", "train": "train.npz", "infer": "infer.npz"}]}
    checks, _ = suite_from_config(cfg, base_dir=tmp_path)
    (r,) = run_suite(checks)[0]
    assert r.target == "files" and r.metrics["biased"] is True and "TP-D1" in r.codes


@pytest.mark.parametrize("with_train", [True, False])
def test_config_drift_from_rollouts(tmp_path, with_train):
    import numpy as np
    infer = -np.random.default_rng(1).uniform(0.1, 3.0, size=(16, 8))
    arrays = {"infer_logprobs": infer}
    if with_train:
        arrays["train_logprobs"] = infer  # identical sides: clean
    np.savez(tmp_path / "ro.npz", **arrays)
    checks, _ = suite_from_config({"drift": [{"rollouts": "ro.npz"}]}, base_dir=tmp_path)
    (r,) = run_suite(checks)[0]
    if with_train:
        assert r.target == "ro.npz" and r.metrics["drift_verdict"] == "clean"
    else:
        assert r.verdict == "error" and "hold no train_logprobs" in r.message


def test_config_real_gloo_collectives_run_and_are_predicted():
    checks, _ = suite_from_config({"collectives": [{
        "name": "grads", "backend": "gloo", "world": 2, "dtype": ["bf16", "fp16"], "op": "avg",
        "numel": 513, "fail_below": {"bitwise_match_fraction": 1.0}}]})
    assert [c.family for c in checks] == ["distributed", "distributed"]
    results, _ = run_suite(checks)
    assert [r.target for r in results] == ["grads[bf16]", "grads[fp16]"]
    for r in results:
        assert r.probe == "distributed.collective" and r.metrics["bitwise_match_fraction"] == 1.0
        assert r.verdict in ("pass", "warn")


def test_the_terminal_summary_is_plain_text_a_name_never_breaks_a_line():
    # a target holding a newline or a terminal escape shows them as \n, \x1b: it can never
    # fake a line ("no problems") or recolour the terminal; nothing is Markdown-escaped
    from types import SimpleNamespace

    from trainprobes.commands.audit import render
    rs = [Result("causality.check", "my*router_\nno problems", "fail", codes=["TP-C1"],
                 message="leaks \x1b[2J at *position* 3"),
          Result("causality.check", "ctl", "pass", expected="fail", message="missed")]
    out = render(SimpleNamespace(results=rs, skipped={}, seconds=1.0,
                                 paths={"html": Path("r/report.html")}))
    assert "  FAIL   causality.check my*router_\\nno problems [TP-C1]: leaks \\x1b[2J at *position* 3" in out
    assert "\\*" not in out and "None" not in out and "\x1b" not in out
    assert "\n         ctl: expected fail, got pass: missed" in out
