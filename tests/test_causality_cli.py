"""`trainprobes causality`: the reference table, a target by import path, JSON, and errors."""
import json

import pytest
from trainprobes.cli import main
from trainprobes.result import load_results


def run(capsys, *argv):
    code = main(["causality", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_reference_table_prints_every_known_verdict(capsys, tmp_path):
    report = tmp_path / "causality.json"
    code, out, _ = run(capsys, "--seq-len", "24", "--batch", "2", "--output", str(report))
    assert code == 0
    assert "22/22 verdicts as known from the mechanism" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("trainprobes.reference.")]
    assert len(rows) == 22 and all(row[-1] == "yes" for row in rows)
    by = {(row[0], row[1]): row for row in rows}
    assert by[("trainprobes.reference.routing:expert_choice", "perturb")][3] == "fail"
    assert by[("trainprobes.reference.routing:capacity_by_position", "perturb")][3] == "pass"
    assert by[("trainprobes.reference.routing:capacity_by_position", "truncate")][3] == "fail"
    results, meta = load_results(report)
    assert len(results) == 22 and meta["command"] == "causality"
    assert {r.probe for r in results} == {"causality.check"}
    # controls: each key once (the mode is part of the target), each with its known verdict
    assert len({r.key for r in results}) == 22 and all(r.reproduced for r in results)
    assert meta["controls"] == {"reproduced": 22, "of": 22}


def test_reference_table_json(capsys, monkeypatch):
    from trainprobes.causality import suite
    some = [c for c in suite.controls() if c.name.endswith(("topk_softmax", "expert_choice"))]
    monkeypatch.setattr(suite, "controls", lambda: some)
    code, out, _ = run(capsys, "--seq-len", "16", "--batch", "2", "--json")
    doc = json.loads(out)
    docs = doc["results"]
    assert code == 0 and doc["command"] == "causality"
    assert [d["target"] for d in docs] == [f"{some[0].name}[perturb]", f"{some[0].name}[truncate]",
                                           f"{some[1].name}[perturb]", f"{some[1].name}[truncate]"]
    assert [d["metrics"]["causal"] for d in docs] == [True, True, False, False]
    assert [d["expected"] for d in docs] == ["pass", "pass", "fail", "fail"]


def test_a_wrong_known_verdict_makes_the_table_fail(capsys, monkeypatch):
    from trainprobes.causality import suite
    wrong = suite.Control("trainprobes.reference.routing:expert_choice", suite.routing.expert_choice, True,
                          True, "router")
    monkeypatch.setattr(suite, "controls", lambda: [wrong])
    code, out, _ = run(capsys, "--seq-len", "16", "--batch", "2")
    assert code == 1 and "0/2 verdicts as known" in out and " NO" in out


def test_target_by_import_path_human_output(capsys):
    code, out, _ = run(capsys, "--target", "trainprobes.reference.models.moe:off_by_one_block", "--seq-len", "32",
                       "--vocab", "1000", "--decision", "hidden", "--show", "3")
    assert code == 1
    assert out.startswith("FAIL  causality.check trainprobes.reference.models.moe:off_by_one_block [TP-C1]")
    for field in ("causal             False", "n_leaks", "flip_rate", "mismatch_rate",
                  "first leaks", "leak distances     1:"):
        assert field in out
    leak_rows = [line.split() for line in out.splitlines()[-3:]]
    assert all(row[1] == row[2] and row[3] == "1" for row in leak_rows)  # position == cut


def test_target_json_truncate_float_inputs(capsys):
    code, out, _ = run(capsys, "--target", "trainprobes.reference.models.moe:causal_block", "--hidden", "64",
                       "--seq-len", "32", "--mode", "truncate", "--decision", "expert_ids",
                       "--scores", "router_probs", "--json")
    (doc,) = json.loads(out)["results"]
    assert code == 0 and doc["verdict"] == "pass"
    assert {"causal", "n_leaks", "flip_rate", "mismatch_rate"} <= set(doc["metrics"])
    assert doc["evidence"]["shape"] == [4, 32, 64]


def test_flat_target_and_explicit_cuts(capsys):
    code, out, _ = run(capsys, "--target", "tests.test_causality_cli:flat_expert_choice",
                       "--hidden", "8", "--flat", "--seq-len", "64", "--cuts", "10,40", "--json")
    (doc,) = json.loads(out)["results"]
    assert code == 1 and doc["evidence"]["cuts"] == [10, 40] and doc["evidence"]["layout"] == "flat"


def flat_expert_choice(x):
    from trainprobes.reference.routing import expert_choice
    return expert_choice(x[None])[0][0]


def changes_batch(x):
    return x[:1].argmax(-1)


@pytest.mark.parametrize("target, match", [
    ("no.such.module:fn", "module 'no.such.module' cannot be imported"),
    ("trainprobes.reference.routing:nothing", "has no attribute 'nothing'"),
    ("trainprobes.reference.routing:topk_softmax", "decision is a tuple, expected a Tensor"),
    ("tests.test_causality_cli:changes_batch", "the batch size changed from 4 to 1"),
])
def test_bad_targets_exit_2_with_a_message_naming_them(capsys, target, match):
    code, out, err = run(capsys, "--target", target, "--hidden", "8", "--seq-len", "16")
    assert code == 2 and out == ""
    assert err.startswith("trainprobes causality: error: ") and match in err and target in err


@pytest.mark.parametrize("argv, match", [
    (["--cuts", "a,b"], "cuts='a,b' must be 'all', a count, or positions"),
    (["--seq-len", "1"], "seq_len=1 must be an int >= 2"),
    (["--target", "trainprobes.reference.routing:topk_softmax", "--vocab", "1"],
     "vocab=1 must be an int >= 2"),
    (["--mode", "truncat"], "did you mean 'truncate'?"),
    (["--vocab", "10", "--hidden", "4"], "not allowed with argument"),
])
def test_bad_options_exit_2(capsys, argv, match):
    code, _, err = run(capsys, *argv)
    assert code == 2 and match in err


ROUTER = """
import torch
W = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))

def router(h):
    return (h @ W).argmax(-1)
"""


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A folder holding mymoe.py, as the current directory, not on sys.path (as for the
    `trainprobes` console script); sys.path and sys.modules restored after."""
    import sys
    (tmp_path / "mymoe.py").write_text(ROUTER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymoe", raising=False)
    yield tmp_path
    sys.modules.pop("mymoe", None)


def test_target_in_the_current_directory_is_found_as_with_python_m(here, capsys):
    # was: a module beside the user (not on sys.path for the console script) could not be
    # imported, and "mymoe.router" without a colon was refused
    for spec in ("mymoe:router", "mymoe.router"):
        code, out, err = run(capsys, "--target", spec, "--hidden", "16", "--seq-len", "16",
                             "--batch", "2")
        assert code == 0, err
        assert out.startswith(f"PASS  causality.check {spec}")


def test_a_float_router_without_hidden_is_told_to_pass_it(here, capsys):
    # was: a dtype error from inside the matmul
    code, out, err = run(capsys, "--target", "mymoe:router", "--seq-len", "16")
    assert code == 2 and out == ""
    assert "failed on token ids [4, 16] (int64, from --vocab 1000)" in err
    assert "pass --hidden D" in err


@pytest.mark.parametrize("spec, match", [
    ("mymoe:route", "'mymoe' has no attribute 'route'; did you mean 'router'?"),
    ("mymoe.py:router", "name the module, not the file: e.g. 'mymoe:function'"),
    ("nowhere_mod:fn", "install its package (pip install -e .), run from the folder that "
                       "holds it, or add that folder to PYTHONPATH"),
])
def test_unimportable_targets_say_the_fix(here, capsys, spec, match):
    code, _, err = run(capsys, "--target", spec, "--hidden", "16")
    assert code == 2 and match in err


def test_a_nondeterministic_target_cannot_be_judged_exit_2(capsys, tmp_path, monkeypatch):
    """Nondeterminism is not a causality verdict: causal=None beside fail is a cannot-judge (2),
    never a finding (1) nor a pass."""
    (tmp_path / "noisy_router.py").write_text(
        "import torch\n\ndef route(x):\n    return (x + 1e-2 * torch.randn(x.shape)).argmax(-1)\n")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "--target", "noisy_router:route", "--seq-len", "16", "--batch", "2",
                       "--hidden", "8", "--json")
    r = json.loads(out)["results"][0]
    assert r["metrics"]["causal"] is None and "TP-C2" in r["codes"]
    assert code == 2


def test_exit_for_a_finding_wins_over_an_unknown():
    from trainprobes.commands.options import exit_for
    from trainprobes.result import Result
    leak = Result(probe="causality.check", target="a", verdict="fail", codes=["TP-C1"],
                  metrics={"causal": False})
    unknown = Result(probe="causality.check", target="b", verdict="fail", codes=["TP-C2"],
                     metrics={"causal": None})
    fine = Result(probe="causality.check", target="c", verdict="pass", metrics={"causal": True})
    errored = Result(probe="numerics.bias", target="d", verdict="error", codes=["TP-E1"])
    assert exit_for([fine]) == 0
    assert exit_for([fine, unknown]) == 2 and exit_for([errored]) == 2
    assert exit_for([unknown, leak, errored]) == 1


ROUNDING_BY_LENGTH = '''
def rounded(x):
    # the value depends on the sequence length only through fp32 rounding: a prefix run
    # differs from the full one bit for bit, and not at all in fp64
    t = x.shape[1] * 3.3
    return (x * t) / t
'''


def test_truncate_mode_says_decisions_differ_within_noise_beside_its_mismatch_rate(tmp_path, monkeypatch,
                                                                                   capsys):
    # was: "no decisions that differ in the inference view" printed next to mismatch_rate 0.8
    (tmp_path / "rounding_by_length.py").write_text(ROUNDING_BY_LENGTH)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "rounding_by_length", raising=False)
    code, out, _ = run(capsys, "--target", "rounding_by_length:rounded", "--hidden", "8", "--mode",
                       "truncate", "--seq-len", "32", "--batch", "2", "--json")
    (r,) = json.loads(out)["results"]
    m = r["metrics"]
    assert code == 0 and m["causal"] is True and m["n_leaks"] == 0
    assert m["n_numerical"] > 0 and m["mismatch_rate"] > 0
    assert "no decisions that differ in the inference view" not in r["message"]
    assert (f"{m['n_flips']} of {m['n_compared']} compared" in r["message"]
            and f"mismatch_rate {m['mismatch_rate']:.4g}" in r["message"]
            and "beyond rounding noise" in r["message"])
