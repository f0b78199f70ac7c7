import json

import pytest
from trainprobes.cli import main


def test_stall_json_rows(capsys):
    assert main(["stall", "--formats", "fp16,bf16,fp8_e4m3fn,fp8_e5m2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    got = {r["format"]: r["sequential_sum"] for r in rows}
    assert got == {"fp16": 2048, "bf16": 256, "fp8_e4m3fn": 16, "fp8_e5m2": 8}
    for r in rows:
        assert {"format", "increment", "n", "stall_at", "sequential_sum", "true_sum"} <= set(r)
        assert r["n"] == 10_000 and r["true_sum"] == 10_000


def test_stall_human_table_explains_2048(capsys):
    assert main(["stall", "--formats", "fp16,fp6_e2m3fn", "-n", "3000"]) == 0
    out = capsys.readouterr().out
    assert "2048" in out and "2049 is a tie" in out and "past max" in out and "saturates at 7.5" in out


@pytest.mark.parametrize("argv,match", [(["stall", "--formats", "fp17"], "fp17"),
                                        (["stall", "--increments", "one"], "--increments"),
                                        (["bias", "--algorithm", "rung", "--trials", "3"], "rung"),
                                        (["bias", "--trials", "2"], "trials=2")])
def test_bad_input_exits_2_with_a_clear_error(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_bias_json_has_the_promised_keys_and_exit_status(capsys):
    rc = main(["bias", "--dtype", "bf16", "--world", "1024", "--numel", "16", "--trials", "5", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert {"bias", "ci_low", "ci_high", "p_value", "verdict"} <= set(d)
    assert d["verdict"] == "biased" and d["bias"] < 0 and rc == 1
    assert d["world"] == 1024 and d["dtype"] == "bf16" and d["seed"] == 0


def test_bias_unbiased_case_exits_0_and_reads_well(capsys):
    rc = main(["bias", "--dtype", "bf16", "--world", "64", "--numel", "16", "--trials", "5",
               "--rounding", "stochastic"])
    out = capsys.readouterr().out
    assert rc == 0 and "unbiased" in out and "99% CI" in out and "PASS" in out


def test_bias_avg_premul_with_a_non_power_of_two_world_is_biased(capsys):
    # NCCL ncclAvg: every input times bf16(1/3) = 1/3 * (1 + 2^-9): +0.195% on every result
    rc = main(["bias", "--world", "3", "--numel", "64", "--op", "avg", "--avg", "premul",
               "--trials", "8", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 1 and d["verdict"] == "biased" and d["bias"] > 0


@pytest.mark.parametrize("argv,match", [(["bias", "--scale", "nan", "--trials", "3"], "scale=nan"),
                                        (["bias", "--scale", "0", "--trials", "3"], "scale=0.0"),
                                        (["bias", "--scale", "inf", "--trials", "3"], "scale=inf"),
                                        (["bias", "--noise", "-1", "--trials", "3"], "noise=-1.0")])
def test_bias_bad_scale_or_noise_is_a_usage_error_not_a_finding(argv, match, capsys):
    # was: --scale nan reported "FAIL TP-B1" (exit 1) and --scale 0 an error Result with exit 0
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_bias_errored_probe_exits_2_not_0(monkeypatch, capsys):
    import trainprobes.numerics.bias as bias
    from trainprobes.result import Result

    def errored(**kwargs):
        return Result(probe="numerics.bias", target="x", verdict="error", codes=["TP-E1"],
                      message="boom", metrics={"trials": 3}, seed=0,
                      evidence={"rounding": "nearest", "dtype": "bf16", "world": 2, "numel": 1,
                                "algorithm": "ring", "op": "sum"})
    monkeypatch.setattr(bias, "collective_bias", errored)
    assert main(["bias", "--trials", "3"]) == 2
    assert main(["bias", "--trials", "3", "--json"]) == 2
