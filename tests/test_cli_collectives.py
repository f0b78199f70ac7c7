"""`trainprobes collectives`: the report for machines, readable text for people, clear errors,
and a backend that runs as asked or not at all."""
import json

import pytest
from trainprobes.cli import main
from trainprobes.result import load_results


def run(capsys, *argv):
    code = main(["collectives", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _result(out):
    doc = json.loads(out)
    assert doc["schema_version"] == 2 and doc["command"] == "collectives"
    (r,) = doc["results"]
    return doc, r


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", "torch.bfloat16"])
def test_gloo_runs_gloo_whatever_the_dtype_spelling(capsys, dtype):
    # was: --dtype bfloat16 (an alias) skipped gloo, emulated instead and exited 0
    code, out, _ = run(capsys, "--backend", "gloo", "--world", "2", "--dtype", dtype,
                       "--op", "sum", "--numel", "500", "--json")
    doc, r = _result(out)
    m = r["metrics"]
    assert code == 0 and r["probe"] == "distributed.collective"
    assert (m["backend"], m["world"], m["dtype"], m["op"], m["numel"]) == ("gloo", 2, "bf16", "sum", 500)
    assert m["bitwise_match_fraction"] == 1.0 and not r["evidence"].get("note")
    assert doc["options"]["dtype"] == "bf16"


def test_human_output_and_failing_emulator_exit_code(capsys):
    # NCCL's ring model is the wrong order for gloo at 4 ranks: TP-B4 and exit code 1.
    code, out, err = run(capsys, "--world", "4", "--dtype", "bf16", "--numel", "400",
                         "--algorithm", "ring", "--seed", "3", "--progress")
    assert code == 1
    assert "bitwise match" in out and "vs fp64 reference" in out
    assert "Mismatched elements:" in out and "FAIL  [TP-B4]" in out
    assert "started 4 gloo ranks" in err  # progress goes to stderr


@pytest.mark.parametrize("world", [4, 2048])
def test_emulated_needs_no_process_group(capsys, world, monkeypatch, tmp_path):
    import trainprobes.distributed.probe as P
    monkeypatch.setattr(P, "launch", lambda *a, **k: pytest.fail("a process was started"))
    code, out, _ = run(capsys, "--backend", "emulated", "--world", str(world), "--dtype", "bf16",
                       "--numel", "64", "--algorithm", "tree", "--json",
                       "--output", str(tmp_path / "r.json"))
    _, r = _result(out)
    assert code == 0 and "bitwise_match_fraction" not in r["metrics"]
    assert r["metrics"]["algorithm"] == "tree" and r["metrics"]["world"] == world
    # --json prints exactly the report --output writes: a gate baseline
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(out)
    assert load_results(tmp_path / "r.json")[0][0].probe == "distributed.collective"


def test_emulated_human_output_says_bitwise_does_not_apply(capsys):
    code, out, _ = run(capsys, "--backend", "emulated", "--world", "8", "--numel", "32")
    assert code == 0 and "not applicable" in out and "vs fp64 reference" in out


def test_reveal(capsys):
    code, out, _ = run(capsys, "--reveal", "--world", "3", "--numel", "50", "--json")
    _, r = _result(out)
    assert code == 0 and r["metrics"]["order_match_fraction"] == 1.0


@pytest.mark.parametrize("argv, match", [
    (("--world", "0"), "world=0 must be an int >= 2"),
    # was: one rank "passed" trivially (nothing to reduce, every bit matches)
    (("--world", "1"), "world=1 must be an int >= 2 (a collective of one rank moves nothing"),
    (("--collective", "reduce_scatter", "--world", "3", "--numel", "10"), "divisible by world=3"),
    (("--dtype", "fp7"), "dtype='fp7' is not a known number format"),
    (("--backend", "emulated", "--reveal"), "--reveal needs a real backend"),
    # was: --reveal quietly ran fp32 for any other dtype
    (("--reveal", "--dtype", "fp8_e5m2"), "--dtype='fp8_e5m2' cannot be used here: --reveal"),
    # was: gloo with an fp8 dtype emulated instead and exited 0
    (("--backend", "gloo", "--dtype", "fp8_e4m3fn"), "gloo has no float8 reduction"),
    (("--backend", "glo"), "did you mean 'gloo'?"),
    (("--port", "70000"), "port=70000 must be an int in [1, 65535]"),
    (("--timeout", "0"), "timeout=0.0 must be a finite number > 0"),
])
def test_bad_input_exits_2_with_a_reason_before_any_rank_starts(capsys, argv, match, monkeypatch):
    import trainprobes.distributed.probe as P
    if "reduce_scatter" not in argv:
        monkeypatch.setattr(P, "launch", lambda *a, **k: pytest.fail("a process was started"))
    code, out, err = run(capsys, *argv)
    assert code == 2 and match in err and out == ""


def test_nccl_without_gpus_exits_2_naming_why(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "--backend", "nccl")
    assert code == 2 and "backend 'nccl' needs CUDA" in err and out == ""


@pytest.mark.parametrize("algorithm", ["hierarchical", "order"])
def test_algorithms_that_need_options_the_cli_lacks_are_not_offered(capsys, algorithm):
    # was: accepted, then every rank ran and the emulator failed for want of ranks_per_node/order
    assert main(["collectives", "--backend", "emulated", "--algorithm", algorithm]) == 2
    assert f"algorithm={algorithm!r} must be one of" in capsys.readouterr().err
