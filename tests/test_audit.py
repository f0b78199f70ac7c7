"""The audit: running suites, progress, history, reports on disk, config, the CLI."""
import io
import json
import sys
from pathlib import Path

import pytest
from trainprobes.audit import Check, Progress, read_history, run_audit, run_suite, trend_plots
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


def test_exit_code_2_when_a_probe_errored(tmp_path):
    assert run_audit([Check("x", "bad", boom)], tmp_path, step_summary=False).exit_code == 2
    assert run_audit([ok()], tmp_path, step_summary=False).exit_code == 0


def test_history_appends_one_line_per_run_and_plots_trends(tmp_path):
    hist = tmp_path / "hist"
    for night, bias in enumerate([1e-4, 2e-4, 4e-4]):
        o = run_audit([ok("ar", bias=bias)], tmp_path / "r", history=hist, step_summary=False)
    runs = read_history(hist)
    assert [r["metrics"]["numerics.fake::ar::bias"] for r in runs] == [1e-4, 2e-4, 4e-4]
    plots = trend_plots(runs)
    bias_plot = next(p for p in plots if p["title"] == "bias across runs")
    assert bias_plot["series"]["numerics.fake::ar"] == [1e-4, 2e-4, 4e-4]
    assert "trends across runs" in o.paths["html"].read_text()


def test_history_skips_a_torn_line(tmp_path):
    (tmp_path / "history.jsonl").write_text('{"metrics": {"a": 1}}\n{"metri')
    run_audit([ok()], tmp_path / "r", history=tmp_path, step_summary=False)
    assert len(read_history(tmp_path)) == 2


# --- thresholds, leak maps ---------------------------------------------------------------

@pytest.mark.parametrize("entry,verdict,broken", [
    ({"fail_above": {"k3_kl": 0.01}}, "fail", "k3_kl = 0.02 > 0.01 (fail_above)"),
    ({"fail_above": {"k3_kl": 0.05}}, "pass", None),
    ({"fail_below": {"match": 1.0}}, "fail", "match = 0.5 < 1 (fail_below)"),
    ({"fail_above": {"absent": 1.0}}, "fail", "absent missing from the Result (fail_above)"),
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

def test_cli_audit_stall_family_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    code = main(["audit", "--default", "--quick", "--families", "stall", "--out", "out",
                 "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["results"][0]["probe"] == "numerics.stall"
    results, _ = load_results(doc["report"])
    assert results[0].evidence["plots"][0]["kind"] == "line"
    assert 'src="data:image/png;base64,' in open(doc["html"]).read()


def test_cli_audit_unknown_family_exit_2(capsys):
    assert main(["audit", "--families", "stall,nope"]) == 2
    assert "families=['nope'] are not default-suite families" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out", "--history"])
def test_cli_audit_uncreatable_out_dir_exit_2_before_running(tmp_path, capsys, flag):
    # was: every check ran, then a FileNotFoundError traceback and exit 1
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    argv = ["audit", "--families", "stall", "--quick", "--no-progress", "--out", str(tmp_path / "o")]
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

def test_default_suite_end_to_end(tmp_path, monkeypatch):
    """The README's main command: every family present, controls right, report complete."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    import torch
    threads = torch.get_num_threads()
    assert main(["audit", "--no-progress", "--out", "out", "--history", "hist"]) == 0
    assert torch.get_num_threads() == threads  # --threads 1 is undone after the run
    (report,) = (tmp_path / "out").glob("*/report.json")
    results, meta = load_results(report)
    assert meta["suite"] == "default" and meta["skipped"] == {} and meta["torch_threads"] == 1
    families = {t["family"] for t in meta["timings"]}
    assert families == {"numerics", "collectives", "causality", "drift", "distributed"}
    assert not [r for r in results if r.verdict == "error"]
    by = {r.target: r for r in results}
    # causality controls: every reference router gets its known verdict
    from trainprobes.reference.routing import KNOWN_VERDICTS
    controls = [r for r in results if "known_causal" in r.metrics]
    assert len(controls) == 2 * len(KNOWN_VERDICTS) + 2  # both modes, plus the two MoE blocks
    assert all(r.metrics["matches_known_verdict"] for r in controls)
    # drift engine pair: every scenario gets its expected verdict
    drift = [r for r in results if r.probe == "drift.compare"]
    assert len(drift) == 7 and all(r.metrics["matches_expected"] for r in drift)
    # collectives: the 1024-rank bf16 ring stalls (biased low); stochastic rounding and fp32 do not
    assert by["all_reduce[bf16,ring,sum,nearest,w=1024,n=1024]"].metrics["bias"] < -0.1
    assert by["all_reduce[bf16,ring,sum,stochastic,w=128,n=1024]"].metrics["biased"] is False
    assert by["all_reduce[fp32,ring,sum,nearest,w=128,n=1024]"].metrics["biased"] is False
    # gloo: the emulator predicts every bit of the real runs
    gloo = [r for r in results if r.probe == "distributed.collective"]
    assert gloo and all(r.metrics["bitwise_match_fraction"] == 1.0 for r in gloo)
    assert by["all_reduce[bf16,ring]"].metrics["accumulator_mantissa_bits"] == 7
    html = report.with_name("report.html").read_text()
    assert html.count('src="data:image/png;base64,') >= 20
    assert len((tmp_path / "hist" / "history.jsonl").read_text().splitlines()) == 1


# --- config sections ---------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def docs_schema_example() -> dict:
    from trainprobes import _toml
    text = (REPO / "docs" / "audit.md").read_text()
    block = text.split("<!-- schema-example -->", 1)[1].split("```toml", 1)[1].split("```", 1)[0]
    return _toml.loads(block)["tool"]["trainprobes"]


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
    assert "dp_allreduce[bf16,ring,w=8]" in by
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
    ("causality", {"target": "x:y", "hidden": 8, "seq_len": 0}, r"seq_len=0 must be a positive"),
    ("bias", {"target": "x:y", "inputs": "x:z"}, r"missing 'reference'"),
    ("drift", {"train": "a.npz"}, "needs exactly one source"),
    ("drift", {"engine": "x:y", "rollouts": "r.jsonl"}, "needs exactly one source"),
    ("drift", {"engine": "x:y", "alhpa": 0.1}, r"unknown keys \['alhpa'\]"),
    ("collectives", {"backend": "mpi"}, r"backend='mpi' must be 'emulated', 'gloo' or 'nccl'"),
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
    assert [r.target for r in results] == ["grads[gloo,bf16,w=2]", "grads[gloo,fp16,w=2]"]
    for r in results:
        assert r.probe == "distributed.collective" and r.metrics["bitwise_match_fraction"] == 1.0
        assert r.verdict in ("pass", "warn")
