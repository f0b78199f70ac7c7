"""The audit's gemm family: the presets' known verdicts reproduce, the CPU's fp8 GEMM is
revealed (and not modelled from a lower bound), and a revealed exact width is judged with."""
import pytest
import torch
from trainprobes.audit.suite_gemm import CONTROLS, _judge, gemm_checks, revealed_accumulator
from trainprobes.audit.suites import FAMILIES, default_suite
from trainprobes.numerics.reveal import reveal
from trainprobes.reference.gemm import dot


def test_registered_off_by_default():
    assert "gemm" in FAMILIES and not FAMILIES["gemm"].default
    checks, skipped = default_suite(families=["gemm"])
    assert not skipped and len(checks) == len(CONTROLS) + hasattr(torch, "_scaled_mm")


@pytest.mark.parametrize("i", range(len(CONTROLS)))
def test_each_control_reproduces_its_known_verdict(i):
    r = gemm_checks()[i].run()
    assert r.is_control and r.reproduced, r.message


def test_the_cpu_scaled_mm_is_revealed_not_modelled_from_a_bound():
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no torch._scaled_mm")
    check = gemm_checks()[-1]
    assert not check.control and "cpu" in check.name
    out = check.run()
    try:
        (r,) = out if isinstance(out, list) else [out]
    except ValueError:
        pytest.fail(f"a judgement from a lower bound: {out}")
    assert r.metrics["accumulator_bits_lower_bound"] and r.metrics["accumulator_mantissa_bits"] >= 17
    assert r.verdict == "pass" and "no accumulator model" in r.message


def test_an_exact_reveal_is_judged_with_what_it_found():
    # the GPU path, with the emulated Hopper accumulator standing in for the tensor cores:
    # e4m3's range shows its 13 bits exactly, so the family builds that model and judges
    def hopper(x):
        return dot(x.double().reshape(1, -1), torch.ones(1, x.numel(), dtype=torch.float64),
                   "h200-scaled-mm")
    # n = 32 as the audit reveals (and as the H200 record): a width of 32 or more reads 32
    r = reveal(hopper, n=32, dtype="fp8_e4m3fn", output_dtype="fp64", target="stand-in")
    acc = revealed_accumulator(r, "stand-in")
    assert acc is not None and (acc.mantissa_bits, acc.fused_terms, acc.rounding) == (13, 32, "toward_zero")
    assert _judge(acc, "stand-in").metrics["gemm_verdict"] == "biased"
