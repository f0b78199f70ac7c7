"""`trainprobes gemm`: the table, --json, exit codes."""
import json

import numpy as np
import pytest
import torch
from trainprobes.cli import main
from trainprobes.numerics.gemm import gemm_bias


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


# --- --load: the user's own operands -------------------------------------------------------

def _e4m3_operands():
    """Mostly positive e4m3 operands (post-activation inputs) that the truncating H200
    accumulator shrinks: biased at K = 512 (as the random table's mean-1 case)."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, 512, generator=g) + 1).to(torch.float8_e4m3fn) for rows in (32, 24)]


class Unpicklable:
    """An object torch.load(weights_only=True) refuses to rebuild."""


def _save(path, fmt, tensors: dict):
    if fmt == "pt":
        torch.save(tensors, path)
    elif fmt == "npz":
        np.savez(path, **{k: v.float().numpy() for k, v in tensors.items()})
    else:
        from safetensors.torch import save_file
        save_file(tensors, str(path))
    return str(path)


@pytest.mark.parametrize("fmt", ["pt", "npz", "safetensors"])
def test_load_judges_the_users_operands_as_the_api_does(fmt, tmp_path, capsys):
    a, b = _e4m3_operands()
    f = _save(tmp_path / f"ops.{fmt}", fmt, {"acts": a, "weights": b})
    base = ["gemm", "--load", f, "--a-key", "acts", "--b-key", "weights", "--presets", "h200-scaled-mm"]
    assert main(base) == 1  # e4m3 values: the default recipe is exact, the accumulator alone
    out = capsys.readouterr().out
    assert "fprop[exact,h200-scaled-mm,K=512]" in out and "biased" in out
    assert f"A {f}:acts (fp8_e4m3fn values, (32, 512))" in out
    assert main(base + ["--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    got = (doc["results"] if isinstance(doc, dict) else doc)[0]["metrics"]
    want = gemm_bias(a, b, preset="h200-scaled-mm", recipe="exact").metrics
    assert got["relative_bias"] == want["relative_bias"] and got["samples"] == want["samples"]


def test_load_a_file_per_operand_and_a_recipe(tmp_path, capsys):
    a, b = _e4m3_operands()
    fa = _save(tmp_path / "x.pt", "pt", {"x": a.float()})  # fp32 tensors holding e4m3 values
    fb = _save(tmp_path / "w.safetensors", "safetensors", {"w": b.to(torch.bfloat16)})
    assert main(["gemm", "--load", fa, "--load", fb, "--presets", "fp32", "--recipes",
                 "fp8-rowwise-pow2,bf16", "--tolerance", "1"]) == 0
    out = capsys.readouterr().out
    assert "fprop[fp8-rowwise-pow2,fp32,K=512]" in out and "fprop[bf16,fp32,K=512]" in out
    assert f"A {fa}:x" in out and f"B {fb}:w" in out


def test_load_bad_input_is_a_usage_error_naming_the_file(tmp_path, capsys):
    a, b = _e4m3_operands()
    good = {"A": a.float(), "B": b.float()}
    pt = _save(tmp_path / "ops.pt", "pt", good)
    npz = _save(tmp_path / "ops.npz", "npz", good)
    st = _save(tmp_path / "ops.safetensors", "safetensors", good)
    cut = {}
    for f in (pt, npz, st):
        data = open(f, "rb").read()
        cut[f] = str(tmp_path / ("cut" + f[f.rindex("."):]))
        open(cut[f], "wb").write(data[: len(data) // 2])
    nan = a.float()
    nan[3, 7] = float("nan")
    np.savez(tmp_path / "bf16.npz", A=np.zeros((4, 8), dtype=np.dtype("V2")), B=np.zeros((4, 8)))
    np.savez(tmp_path / "obj.npz", A=np.array([{"a": 1}], dtype=object), B=np.ones((2, 2)))
    torch.save({"A": a.float(), "B": b.float(), "extra": Unpicklable()}, tmp_path / "obj.pt")
    (tmp_path / "junk.pt").write_bytes(bytes(range(256)))
    cases = [
        (["--load", str(tmp_path / "missing.pt")], ["missing.pt", "does not exist"]),
        (["--load", cut[pt]], ["cut.pt", "not a readable .pt file", "torch.save"]),
        (["--load", cut[npz]], ["cut.npz", "not a readable .npz archive", "numpy.savez"]),
        (["--load", cut[st]], ["cut.safetensors", "not a readable .safetensors file"]),
        (["--load", str(tmp_path / "junk.pt")], ["junk.pt", "not a torch.save archive"]),
        (["--load", str(tmp_path / "obj.pt")], ["obj.pt", "Unpicklable object", "refused"]),
        (["--load", str(tmp_path / "obj.npz")], ["obj.npz", "allow_pickle=False"]),
        (["--load", st, "--a-key", "acts"], ["holds no tensor 'acts' (--a-key)", "'A', 'B'"]),
        (["--load", pt, "--load", st], ["holds 2 tensors ('A', 'B')", "--a-key"]),
        (["--load", _save(tmp_path / "nan.pt", "pt", {"A": nan, "B": b.float()})],
         ["nan.pt:A", "1 non-finite value(s)", "(3, 7)"]),
        (["--load", _save(tmp_path / "k.pt", "pt", {"A": a.float(), "B": torch.ones(4, 64)})],
         ["k.pt:B", "(4, 64)", "same K"]),
        (["--load", _save(tmp_path / "3d.pt", "pt", {"A": torch.ones(2, 3, 4), "B": b.float()})],
         ["3d.pt:A", "(2, 3, 4)", "2-D"]),
        (["--load", _save(tmp_path / "int.pt", "pt", {"A": torch.ones(4, 512, dtype=torch.int64),
                                                      "B": b.float()})], ["int.pt:A", "int64", "bfloat16"]),
        (["--load", _save(tmp_path / "zero.pt", "pt", {"A": torch.zeros(4, 512), "B": b.float()})],
         ["zero.pt:A", "all zeros"]),
        (["--load", str(tmp_path / "bf16.npz")], ["bf16.npz", "'A'", "numpy has no bf16"]),
        (["--load", str(tmp_path / "ops.txt")], ["ops.txt", ".pt, .npz, .safetensors"]),
        (["--load", pt, "--load", pt, "--load", pt], ["one file", "got 3"]),
        (["--load", pt, "--k", "64"], ["--k", "drop it"]),
        (["--load", pt, "--target", "m:f"], ["--target"]),
        (["--load", pt, "--impact"], ["--impact", "--load"]),
        (["--a-key", "A"], ["--load FILE"]),
    ]
    for args, said in cases:
        code = main(["gemm", *args, "--presets", "fp32", "--tolerance", "1"])
        err = capsys.readouterr().err
        assert code == 2, (args, code, err)
        assert "internal error" not in err
        for s in said:
            assert s in err, (args, s, err)


# --- one default for --samples, and honest N_C cells ------------------------------------

def test_one_samples_default_for_the_cli_the_api_and_the_docs():
    import inspect
    from pathlib import Path

    from trainprobes.cli import build_parser
    from trainprobes.numerics.gemm_defaults import DEFAULT_SAMPLES, DEFAULT_TRIALS
    from trainprobes.numerics.gemm_model import judge_model
    args = build_parser().parse_args(["gemm"])
    assert (args.samples, args.trials) == (DEFAULT_SAMPLES, DEFAULT_TRIALS)
    for fn in (gemm_bias, judge_model):
        p = inspect.signature(fn).parameters
        assert (p["samples"].default, p["trials"].default) == (DEFAULT_SAMPLES, DEFAULT_TRIALS), fn
    doc = (Path(__file__).parent.parent / "docs" / "gemm.md").read_text()
    assert f"`--samples` (default {DEFAULT_SAMPLES:,}" in doc


def test_a_biased_row_whose_search_did_not_run_says_so(capsys, tmp_path, monkeypatch):
    # --target judges without the promotion search: its biased rows printed N_C = K, which
    # the legend reads as "none needed"
    (tmp_path / "gemm_cli_nc.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(512, 32)), torch.randn(64, 512) + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["gemm", "--target", "gemm_cli_nc:make", "--recipes", "fp8-tensor-e4m3",
                 "--tolerance", "1e-4", "--samples", "256", "--trials", "16"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("gemm_cli_nc:make:")]
    biased = [line for line in rows if line.rstrip().endswith("biased")]
    assert code == 1 and biased, out
    assert all("not searched" in line for line in biased)
    assert all("not searched" not in line for line in rows if line not in biased)
    # the random table searches: its biased rows give an interval or nan, never "not searched"
    main(["gemm", "--k", "512", "--rows", "32", "--samples", "128", "--trials", "16",
          "--presets", "h200-scaled-mm", "--mean", "1"])
    out = capsys.readouterr().out
    assert "biased" in out and "not searched" not in out.split("\n\n")[0]
