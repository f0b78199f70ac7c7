"""`trainprobes gemm`: the table, --json, exit codes."""
import json

import pytest
from trainprobes.cli import main


def test_table_and_exit_status(capsys):
    code = main(["gemm", "--k", "512", "--rows", "32", "--samples", "128", "--trials", "16",
                 "--presets", "h200-scaled-mm,fp32", "--mean", "1"])
    out = capsys.readouterr().out
    assert code == 1 and "h200-scaled-mm" in out and "biased" in out


def test_json_names_what_it_judged(capsys):
    code = main(["gemm", "--k", "256", "--rows", "16", "--samples", "64", "--trials", "8",
                 "--presets", "fp32", "--recipes", "mxfp8", "--json"])
    doc = json.loads(capsys.readouterr().out)
    results = doc["results"] if isinstance(doc, dict) else doc
    m = results[0]["metrics"]
    for key in ("preset", "recipe", "gemm", "k", "relative_bias", "ci_low", "ci_high",
                "max_relative_error", "sqnr_db", "biased", "stall_k"):
        assert key in m
    assert m["recipe"] == "mxfp8"
    assert code == (1 if m["biased"] else 2 if m["gemm_verdict"] == "inconclusive" else 0)
    # the recipe's quantisation noise leaves a CI wider than the default tolerance 1e-4:
    # cannot judge (2), never a pass; a stated tolerance the CI fits within is judged
    assert m["gemm_verdict"] == "inconclusive" and code == 2
    assert main(["gemm", "--k", "256", "--rows", "16", "--samples", "64", "--trials", "8",
                 "--presets", "fp32", "--recipes", "mxfp8", "--tolerance", "0.2"]) == 0
    assert "noise" in capsys.readouterr().out


def test_the_cli_names_are_the_registries():
    from trainprobes.commands.gemm import PRESET_NAMES, RECIPE_NAMES
    from trainprobes.reference.gemm import PRESETS
    from trainprobes.reference.recipes import RECIPES
    assert PRESET_NAMES == tuple(PRESETS) and RECIPE_NAMES == tuple(RECIPES)


def test_unknown_names_and_blocks_are_usage_errors(capsys):
    assert main(["gemm", "--presets", "h100", "--k", "64"]) == 2
    assert "h200-scaled-mm" in capsys.readouterr().err
    assert main(["gemm", "--recipes", "mxfp8", "--k", "40", "--rows", "8", "--samples", "16",
                 "--trials", "4"]) == 2
    assert "multiple of the block size 32" in capsys.readouterr().err


def test_too_few_outputs_for_the_trials_is_a_usage_error(capsys):
    assert main(["gemm", "--rows", "1", "--k", "64", "--samples", "32"]) == 2
    err = capsys.readouterr().err
    assert "M*N = 1 x 1 = 1" in err and "trials=32" in err and "all 0" not in err


def test_a_mean_that_saturates_e4m3_is_refused_not_exact(capsys):
    assert main(["gemm", "--mean", "1e6", "--k", "64", "--rows", "16", "--samples", "64",
                 "--trials", "8", "--presets", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "saturates 100.0%" in err and "--mean" in err
    # a mean well inside the range still runs
    assert main(["gemm", "--mean", "100", "--k", "64", "--rows", "16", "--samples", "64",
                 "--trials", "8", "--presets", "fp32"]) in (0, 1)


@pytest.mark.slow
def test_impact_table_and_exit_status(capsys):
    code = main(["gemm", "--impact", "--recipes", "fp8-rowwise,bf16", "--presets",
                 "h200-scaled-mm,fp32", "--k", "4096", "--steps", "6", "--loss-tol", "0.002"])
    out = capsys.readouterr().out
    assert code == 1 and "accumulator share" in out and "fp8-rowwise x h200-scaled-mm" in out
    assert "not run: bf16 x h200-scaled-mm" in out and "--what-if runs it" in out
    assert main(["gemm", "--impact", "--k", "512,1024"]) == 2
    assert "one --k" in capsys.readouterr().err


def test_a_significant_bias_within_tolerance_is_not_shown_as_noise():
    from trainprobes.commands.gemm import _shown
    assert _shown({"gemm_verdict": "noise", "ci_low": -9.9e-5, "ci_high": -9.6e-5}) == "bias<tol"
    assert _shown({"gemm_verdict": "noise", "ci_low": -1e-6, "ci_high": 2e-6}) == "noise"
    assert _shown({"gemm_verdict": "biased", "ci_low": -3e-2, "ci_high": -2e-2}) == "biased"


def test_target_refuses_what_it_would_silently_drop(capsys, tmp_path, monkeypatch):
    # --target judges one preset and one recipe: a second one named was dropped without a
    # word, as were the random operands' options; now each is a usage error naming it
    (tmp_path / "gemm_cli_target.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(16, 16)), torch.randn(32, 16)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["gemm", "--target", "gemm_cli_target:make", "--samples", "64", "--trials", "8"]
    for extra, named in ((["--presets", "h200-scaled-mm,fp32"], "--presets"),
                         (["--recipes", "bf16,mxfp8"], "--recipes"),
                         (["--k", "64"], "--k"), (["--mean", "1"], "--mean"),
                         (["--rows", "8"], "--rows"), (["--operands", "bf16"], "--operands")):
        assert main(base + extra) == 2, extra
        assert named in capsys.readouterr().err
    assert main(base + ["--presets", "fp32", "--tolerance", "1"]) == 0
    assert "fp32" not in capsys.readouterr().err


def test_a_preset_is_judged_only_on_what_it_was_measured_on(capsys, tmp_path, monkeypatch):
    # the fp8 tensor core's accumulator fed fp32 products (the old --target default: recipe
    # exact on the fp32 step's operands) judged a setup no hardware runs
    (tmp_path / "gemm_cli_fp32.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 16)), torch.randn(32, 64)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["gemm", "--target", "gemm_cli_fp32:make", "--samples", "64", "--trials", "8",
            "--presets", "h200-scaled-mm", "--tolerance", "1"]
    assert main(base + ["--recipes", "exact"]) == 2
    err = capsys.readouterr().err
    assert "operand a holds fp32" in err and "fp8-tensor" in err and "--what-if" in err
    assert main(base + ["--recipes", "exact", "--what-if"]) == 0
    assert "WHAT-IF" in capsys.readouterr().out
    assert main(base) == 0  # the default recipe: fp8-tensor, what an fp8 step multiplies
    out = capsys.readouterr().out
    assert "fp8-tensor" in out and "WHAT-IF" not in out
    # in the random table a cell no hardware runs is left out, and said
    code = main(["gemm", "--k", "64", "--rows", "16", "--samples", "64", "--trials", "8",
                 "--operands", "fp32", "--presets", "h200-scaled-mm,fp32", "--tolerance", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "not run: K=64 exact x h200-scaled-mm" in out


def test_a_target_in_the_current_directory_is_found_as_with_python_m(tmp_path, monkeypatch, capsys):
    # the console script has no '' on sys.path: a module beside the user was "cannot be
    # imported" for gemm (causality, transforms and drift localize searched the folder)
    import sys
    (tmp_path / "gemm_here_mod.py").write_text(
        "import torch\n"
        "def fn():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)), "
        "torch.randn(64, 32)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "gemm_here_mod", raising=False)
    code = main(["gemm", "--target", "gemm_here_mod:fn", "--samples", "64", "--trials", "8"])
    out = capsys.readouterr().out
    sys.modules.pop("gemm_here_mod", None)
    assert code in (0, 1) and "gemm_here_mod:fn:2.wgrad" in out, out
