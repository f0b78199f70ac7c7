"""The exit-code contract on misuse that once slipped through it: a user's code that raises is
bad usage (2), an unreadable file is 2, reports that share nothing cannot be judged (2), a
target whose every decision is NaN is judged by nothing (2, never a pass), and config values
are type-checked naming the key."""
import json
import textwrap

import numpy as np
import pytest
import torch
from trainprobes.cli import main
from trainprobes.result import Result, save_results

USER = '''
import torch

def raising_factory():
    raise RuntimeError("the user's factory broke")

def nan_out(x):
    return torch.full(x.shape, float("nan"))

def nan_scores(x):
    return torch.full((*x.shape, 4), float("nan"))
'''


@pytest.fixture
def here(tmp_path, monkeypatch):
    (tmp_path / "usermod_misuse.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path


@pytest.mark.parametrize("command", ["gemm", "transforms"])
def test_a_factory_that_raises_is_bad_usage_naming_the_target(here, capsys, command):
    # was: exit 3 "internal error" (causality already said 2 for its own target raising)
    code = main([command, "--target", "usermod_misuse:raising_factory"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "internal error" not in err
    assert "usermod_misuse:raising_factory" in err and "RuntimeError: the user's factory broke" in err


def test_a_truncated_npz_is_bad_input_naming_the_file(tmp_path, capsys):
    # was: exit 3 (zipfile.BadZipFile escaped the reader)
    good = tmp_path / "good.npz"
    np.savez(good, logprobs=-np.abs(np.random.default_rng(0).normal(size=400)))
    data = good.read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(data[:len(data) // 2])
    code = main(["drift", "--train", str(cut), "--infer", str(good)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "internal error" not in err and "cut.npz" in err and "not a readable .npz" in err


def test_reports_with_nothing_in_common_cannot_be_judged(tmp_path, capsys):
    # was: "BLOCKED, 0 probe(s) compared, 1 regression" (TP-G1 for every baseline Result)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_results(a, [Result("custom.stall", "sequential_sum[nearest]", "warn", codes=["TP-B2"])])
    save_results(b, [Result("custom.collective", "all_reduce[fp32]", "pass")])
    code = main(["gate", "--baseline", str(a), "--candidate", str(b), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2 and doc["exit_code"] == 2
    assert "nothing to compare" in doc["cannot_judge"] and doc["regressions"] == []
    assert "custom.stall::sequential_sum[nearest]" in doc["cannot_judge"]


def test_a_new_failure_in_unrelated_reports_still_blocks(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_results(a, [Result("custom.probe", "x", "pass")])
    save_results(b, [Result("custom.probe", "y", "fail", codes=["TP-C1"])])
    assert main(["gate", "--baseline", str(a), "--candidate", str(b)]) == 1
    assert "TP-C1" in capsys.readouterr().out


def test_a_target_whose_every_decision_is_nan_cannot_be_judged(here, capsys):
    # was: exit 0 with a WARN, "no future-dependent decisions": nothing had been compared
    code = main(["causality", "--target", "usermod_misuse:nan_out", "--seq-len", "32", "--batch", "2"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "cannot judge: all 64 baseline decisions are NaN" in out


def test_all_nan_decisions_from_the_api_are_no_pass():
    from trainprobes.causality import check
    x = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    r = check(lambda t: torch.full((*t.shape, 4), float("nan")), x)
    assert r.verdict == "fail" and r.metrics["causal"] is None and not r.passed
    from trainprobes.commands.options import exit_for
    assert exit_for([r]) == 2


CONFIG = """
seed = {seed}
[[causality]]
target = "trainprobes.reference.routing:topk_softmax"
hidden = 8
decision = 0
"""


@pytest.mark.parametrize("seed,shown", [("0.5", "0.5"), ('"zero"', "'zero'"), ("true", "True"),
                                        ("-1", "-1")])
def test_a_mistyped_config_seed_is_refused_naming_the_key(here, capsys, seed, shown):
    # was: 0.5 accepted (the report said 0.5, the probes ran with 0); "zero" printed
    # Python's `invalid literal for int()`, naming neither the key nor what works
    cfg = here / "tp.toml"
    cfg.write_text(textwrap.dedent(CONFIG.format(seed=seed)))
    code = main(["audit", "--config", str(cfg), "--out", str(here / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"seed={shown}" in err and "must be an int" in err
    assert "invalid literal" not in err
    assert not (here / "out").exists() or not any((here / "out").iterdir())  # refused before any work


@pytest.mark.parametrize("key,value,want", [("defaults", '"yes"', "True or False"),
                                            ("out", "3", "str"), ("history", "[1]", "str"),
                                            ("families", "3", "str"),
                                            ("pythonpath", "[1]", "str")])
def test_mistyped_top_level_config_values_are_refused(here, capsys, key, value, want):
    cfg = here / "tp.toml"
    cfg.write_text(f"{key} = {value}\n" + textwrap.dedent(CONFIG.format(seed=0)).split("\n", 2)[2])
    code = main(["audit", "--config", str(cfg), "--out", str(here / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert key in err and want in err


def test_an_entry_seed_that_is_a_float_is_refused():
    from trainprobes.audit.config import suite_from_config
    from trainprobes.errors import ConfigError
    cfg = {"causality": [{"target": "trainprobes.reference.routing:topk_softmax", "hidden": 8,
                          "seed": 1.0}]}
    with pytest.raises(ConfigError, match=r"seed=1.0 must be an int"):
        suite_from_config(cfg)


def test_a_batch_target_whose_every_output_is_nan_cannot_be_judged():
    # was: pass, "every row gave the same bits": NaN beside NaN compares as the same
    from trainprobes.commands.options import exit_for
    from trainprobes.gate import check_judgeable
    from trainprobes.isolation import batch_invariance
    r = batch_invariance(lambda t: torch.full((t.shape[0], 3), float("nan")), torch.randn(6, 4),
                         sizes=(2, 4), trials=1)
    assert r.verdict == "fail" and r.metrics["batch_invariant"] is None and "cannot judge" in r.message
    assert exit_for([r]) == 2
    check_judgeable(r, "candidate")  # the gate reads it as unjudged, not as edited
    # one finite output is enough to compare on
    r = batch_invariance(lambda t: torch.cat([torch.full((t.shape[0], 2), float("nan")), t[:, :1]], 1),
                         torch.randn(6, 4), sizes=(2, 4), trials=1)
    assert r.verdict == "pass" and r.metrics["batch_invariant"] is True


@pytest.mark.parametrize("flag,spec,says", [
    ("--step", "trainprobes.transforms.demo:stepp", "step='trainprobes.transforms.demo:stepp': "
     "'trainprobes.transforms.demo' has no attribute 'stepp'; did you mean 'step'?"),
    ("--step", "no_such_module_misuse", "step='no_such_module_misuse': module"),
])
def test_a_misspelled_step_is_named_as_the_step_not_the_target(capsys, flag, spec, says):
    # was: "target='...'", while --target was spelled right
    code = main(["transforms", "--target", "trainprobes.transforms.demo:step", flag, spec])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "target=" not in err, err


def test_an_audit_finding_nothing_could_judge_exits_2_like_the_command():
    from trainprobes.audit import exit_code
    nan = Result("causality.check", "nan_router", "fail", codes=["TP-C1"],
                 metrics={"causal": None, "n_leaks": 0})
    leak = Result("causality.check", "router", "fail", codes=["TP-C1"], metrics={"causal": False})
    assert exit_code([nan]) == 2 and exit_code([leak]) == 1
    assert exit_code([nan, leak]) == 2  # as an errored check: could not run is said first
    assert exit_code([nan], report_only=True) == 2
    # a control is judged on reproducing its known verdict, never as cannot-judge
    ctl = Result("causality.check", "ctl", "fail", codes=["TP-C1"], metrics={"causal": None},
                 expected="fail")
    assert exit_code([ctl]) == 0
