"""`trainprobes collectives`: JSON for machines, readable text for people, clear errors."""
import json

import pytest
from trainprobes.cli import main

KEYS = ("backend", "world", "dtype", "op", "numel", "bitwise_match_fraction", "max_ulp_error",
        "bias")


def run(capsys, *argv):
    code = main(["collectives", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_gloo_json_has_the_promised_fields(capsys):
    code, out, _ = run(capsys, "--backend", "gloo", "--world", "2", "--dtype", "bf16",
                       "--op", "sum", "--numel", "500", "--json")
    doc = json.loads(out)
    assert code == 0 and all(k in doc for k in KEYS)
    assert (doc["backend"], doc["world"], doc["dtype"], doc["op"], doc["numel"]) == \
        ("gloo", 2, "bf16", "sum", 500)
    assert doc["bitwise_match_fraction"] == 1.0 and doc["result"]["probe"] == "distributed.collective"


def test_human_output_and_failing_emulator_exit_code(capsys):
    # NCCL's ring model is the wrong order for gloo at 4 ranks: TP-B4 and exit code 1.
    code, out, err = run(capsys, "--world", "4", "--dtype", "bf16", "--numel", "400",
                         "--algorithm", "ring", "--seed", "3")
    assert code == 1
    assert "bitwise match" in out and "vs fp64 reference" in out
    assert "Mismatched elements:" in out and "FAIL  [TP-B4]" in out
    assert "started 4 gloo ranks" in err  # progress goes to stderr


@pytest.mark.parametrize("world", [4, 2048])
def test_emulated_needs_no_process_group(capsys, world, monkeypatch):
    import trainprobes.distributed.probe as P
    monkeypatch.setattr(P, "launch", lambda *a, **k: pytest.fail("a process was started"))
    code, out, _ = run(capsys, "--backend", "emulated", "--world", str(world), "--dtype", "bf16",
                       "--numel", "64", "--algorithm", "tree", "--json")
    doc = json.loads(out)
    assert code == 0 and all(k in doc for k in KEYS)
    assert doc["bitwise_match_fraction"] is None and "not applicable" in doc["bitwise_match"]
    assert doc["algorithm"] == "tree" and doc["world"] == world


def test_emulated_human_output_says_bitwise_does_not_apply(capsys):
    code, out, _ = run(capsys, "--backend", "emulated", "--world", "8", "--numel", "32")
    assert code == 0 and "not applicable" in out and "vs fp64 reference" in out


def test_reveal(capsys):
    code, out, _ = run(capsys, "--reveal", "--world", "3", "--numel", "50", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["order_match_fraction"] == 1.0


@pytest.mark.parametrize("argv, match", [
    (("--world", "0"), "world=0"),
    (("--collective", "reduce_scatter", "--world", "3", "--numel", "10"), "divisible by world=3"),
    (("--dtype", "fp7"), "fp7"),
    (("--backend", "emulated", "--reveal"), "--reveal needs a real backend"),
])
def test_bad_input_exits_2_with_a_reason(capsys, argv, match):
    code, out, err = run(capsys, *argv)
    assert code == 2 and match in err and out == ""


@pytest.mark.parametrize("algorithm", ["hierarchical", "order"])
def test_algorithms_that_need_options_the_cli_lacks_are_not_offered(capsys, algorithm):
    # was: accepted, then every rank ran and the emulator failed for want of ranks_per_node/order
    with pytest.raises(SystemExit) as e:
        main(["collectives", "--backend", "emulated", "--algorithm", algorithm])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
