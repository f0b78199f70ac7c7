"""The `trainprobes` command line as a whole: --version, typos, options parsed by type=
callables, and one report shape for every command's --json that the gate reads."""
import argparse
import inspect
import json
import re

import numpy as np
import pytest
from trainprobes import __version__
from trainprobes.cli import COMMANDS, build_parser, main
from trainprobes.gate import gate_files
from trainprobes.result import SCHEMA_VERSION, load_results


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"trainprobes {__version__}"


@pytest.mark.parametrize("argv,match", [
    (["colectives"], "did you mean 'collectives'?"),
    ([], "the following arguments are required: COMMAND"),
    (["stall", "--formts", "fp16"], "unrecognized arguments: --formts"),
])
def test_usage_errors_exit_2(capsys, argv, match):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def _subparsers():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sub.choices


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "audit"])
def test_every_option_with_a_value_is_parsed_by_a_checking_type(command):
    # no hand-validation followed by `return 2`: numbers and choices are refused by argparse
    # before any work, with the validation module's message
    from trainprobes.commands import options
    parsers, actions = [_subparsers()[command]], []
    while parsers:  # a command's own subcommands (`isolation documents`) too
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
            else:
                actions.append(action)
    for action in actions:
        if action.nargs == 0 or action.dest == "help":
            continue
        if isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
            assert action.type not in (None, int, float), f"{command} {action.option_strings}"
        if action.choices is not None:
            pytest.fail(f"{command} {action.option_strings}: choices= has no typo hint; "
                        "use validation.parse_choice")
    mod = __import__(f"trainprobes.commands.{command}", fromlist=["run"])
    hand = re.search(r"file=sys\.stderr\)\s*\n\s*return 2", inspect.getsource(mod))
    assert hand is None, f"{command} prints an error by hand and returns 2"
    assert options.parse_dtype  # the shared option types live there


def _files(tmp_path):
    lp = -np.random.default_rng(0).random((16, 12)).astype(np.float32) * 3
    np.savez(tmp_path / "a.npz", logprobs=lp)
    np.savez(tmp_path / "b.npz", logprobs=lp)
    return tmp_path


REPORTS = {
    "stall": ["stall", "--formats", "bf16", "-n", "300"],
    "bias": ["bias", "--world", "8", "--numel", "8", "--trials", "3"],
    "collectives": ["collectives", "--backend", "emulated", "--world", "4", "--numel", "16"],
    "causality": ["causality", "--target", "trainprobes.reference.routing:topk_softmax",
                  "--hidden", "8", "--seq-len", "8", "--batch", "2", "--decision", "0"],
    "drift": ["drift", "--train", "{tmp}/a.npz", "--infer", "{tmp}/b.npz"],
}


@pytest.mark.parametrize("command", sorted(REPORTS))
def test_json_is_one_report_shape_the_gate_reads(capsys, tmp_path, command):
    # was: four different top-level shapes (a row list, an object, a list of Results, ...)
    argv = [a.format(tmp=_files(tmp_path)) for a in REPORTS[command]]
    saved = tmp_path / "saved.json"
    rc = main(argv + ["--json", "--output", str(saved)])
    assert rc in (0, 1)
    text = capsys.readouterr().out
    doc = json.loads(text)
    assert list(doc) == ["schema_version", "command", "options", "results"]
    assert doc["schema_version"] == SCHEMA_VERSION and doc["command"] == command
    assert json.loads(saved.read_text()) == doc  # exactly what --output writes
    printed = tmp_path / "printed.json"
    printed.write_text(text)  # `trainprobes X --json > r.json`
    results, meta = load_results(printed)
    assert results and meta["command"] == command
    assert gate_files(printed, saved).exit_code == 0  # a report the gate reads


def test_gate_json_is_a_verdict_not_a_report(capsys, tmp_path):
    main(REPORTS["stall"] + ["--output", str(tmp_path / "r.json")])
    capsys.readouterr()
    assert main(["gate", "--baseline", str(tmp_path / "r.json"), "--candidate",
                 str(tmp_path / "r.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "gate" and doc["schema_version"] == SCHEMA_VERSION
    assert "results" not in doc and doc["exit_code"] == 0


def test_hand_written_dtype_spellings_resolve_to_one_format():
    from trainprobes.commands.options import check_dtype
    spellings = {"fp16": ["fp16", "float16", "half", "torch.float16", "FP16", " fp16 "],
                 "bf16": ["bf16", "bfloat16", "torch.bfloat16", "ml_dtypes.bfloat16"],
                 "fp32": ["fp32", "float32", "float", "torch.float32", "np.float32"],
                 "fp8_e4m3fn": ["fp8_e4m3fn", "float8_e4m3fn", "torch.float8_e4m3fn", "e4m3"],
                 "fp8_e5m2": ["fp8_e5m2", "float8_e5m2", "torch.float8_e5m2", "e5m2"],
                 "fp6_e2m3fn": ["fp6_e2m3fn", "float6_e2m3fn"],
                 "fp4_e2m1fn": ["fp4_e2m1fn", "float4_e2m1fn"]}
    for name, forms in spellings.items():
        assert {check_dtype(f) for f in forms} == {name}, forms
    # ml_dtypes' float8_e4m3 (IEEE-like, with infinities) is another format: not e4m3fn
    with pytest.raises(ValueError, match="float8_e4m3"):
        check_dtype("float8_e4m3")


@pytest.mark.parametrize("typed, suggested", [
    ("fp8", "'fp8_e4m3fn' or 'fp8_e5m2' or 'fp8_e4m3fnuz' or 'fp8_e5m2fnuz'"),
    ("FP6", "'fp6_e2m3fn' or 'fp6_e3m2fn'"), ("bfloat17", "'bfloat16'")])
def test_a_format_family_without_its_variant_suggests_its_members(typed, suggested):
    # 'fp8' is nearest to 'fp4' by spelling: a hurried user means an fp8 format
    from trainprobes.commands.options import check_dtype
    with pytest.raises(ValueError, match=f"did you mean {suggested}\\?"):
        check_dtype(typed)


def test_help_imports_no_torch_and_still_lists_every_choice():
    # was ~1.1 s: building the parser imported torch for stall's, bias's and collectives'
    # choices, so `trainprobes --help` and `trainprobes gate --help` paid for it too
    import subprocess
    import sys
    code = ("import contextlib, io, sys\n"
            "from trainprobes.cli import COMMANDS, main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    codes = [main([*c, '--help']) for c in [[]] + [[c] for c in COMMANDS]]\n"
            "print(codes, sorted(m for m in ('torch', 'numpy', 'scipy') if m in sys.modules))\n"
            "print(out.getvalue())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "COLUMNS": "200"})
    first, text = done.stdout.split("\n", 1)
    assert first == f"{[0] * (len(COMMANDS) + 1)} []", done.stderr  # exit 0, nothing heavy
    for listed in ("nearest, stochastic or toward_zero", "(default: fp32,tf32,fp16,bf16,fp8_e4m3fn",
                   "ring, tree, halving_doubling, hierarchical, sequential, gloo (default: ring)",
                   "gradient: heavy-tailed, gradient-like"):
        assert listed in text


def test_help_choice_tables_equal_the_ones_the_probes_use():
    import importlib

    from trainprobes.commands import choices
    for here, module, there in choices.SOURCES:
        assert getattr(choices, here) == getattr(importlib.import_module(module), there), (here, module)


@pytest.mark.parametrize("argv, said", [
    (["stall", "--formts", "fp8"], "--formts: did you mean --formats?"),
    (["stall", "--dtype", "fp8"], "trainprobes stall takes --force, --formats"),
    (["isolation", "table", "--famly", "llama"], "did you mean --family?"),
])
def test_an_option_the_command_does_not_take_names_the_ones_it_does(capsys, argv, said):
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_a_shell_pattern_that_matched_two_reports_is_named(capsys, tmp_path):
    # was: --baseline reports/acc/*/report.json also matched latest/: 'unrecognized arguments'
    for d in ("20261201T000000Z", "latest"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "report.json").write_text("{}")
    reports = sorted(str(p) for p in tmp_path.glob("*/report.json"))
    assert main(["gate", "--baseline", *reports, "--candidate", reports[0]]) == 2
    assert "did a shell pattern (*) match several files?" in capsys.readouterr().err


PLAIN = [["stall", "-n", "300"],
         ["bias", "--world", "4", "--numel", "8", "--trials", "3", "--no-confirm", "--compare"],
         ["causality", "--target", "plainmod:route", "--hidden", "4", "--seq-len", "8"],
         ["collectives", "--backend", "emulated", "--world", "4", "--numel", "64"],
         ["gemm", "--k", "16", "--rows", "8", "--samples", "16", "--trials", "4",
          "--presets", "fp32"],
         ["drift", "--train", "TRAIN", "--infer", "INFER"],
         ["isolation", "documents", "--target", "plainmod:doc", "--lengths", "4,4", "--no-causal"]]


@pytest.mark.parametrize("argv", PLAIN, ids=lambda a: " ".join(a[:2]))
def test_what_a_terminal_shows_is_plain_text(argv, capsys, tmp_path, monkeypatch):
    """No Markdown escape (\\*, \\_, \\|), no code span, no 'None' a reader would have to
    decode, in what each command prints on a terminal, on stdout and stderr alike."""
    import numpy as np
    (tmp_path / "plainmod.py").write_text(
        "def route(x):\n    return x.sum(-1) > 0\n"
        "def doc(tokens, packing):\n    return tokens.float().unsqueeze(-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    g = np.random.default_rng(0)
    lp = np.log(g.uniform(0.05, 1.0, 512))
    np.savez(tmp_path / "t.npz", logprobs=lp)
    np.savez(tmp_path / "i.npz", logprobs=lp + 1e-3 * g.standard_normal(512))
    argv = [{"TRAIN": str(tmp_path / "t.npz"), "INFER": str(tmp_path / "i.npz")}.get(a, a)
            for a in argv]
    assert main(argv) in (0, 1)
    cap = capsys.readouterr()
    for text in (cap.out, cap.err):
        assert not re.search(r"\\[*_|`$\[\]]|\bNone\b|`", text), text


def test_a_list_option_takes_a_repeated_item_once():
    # `--presets fp32,fp32` judged the same preset twice (two rows, twice the time)
    from trainprobes.commands.options import parse_list
    from trainprobes.validation import parse_choice
    parse = parse_list(parse_choice("presets", ["fp32", "h200-scaled-mm"]), "--presets")
    assert parse("fp32, h200-scaled-mm,fp32") == ["fp32", "h200-scaled-mm"]
