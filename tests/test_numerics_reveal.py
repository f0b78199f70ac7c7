import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.numerics.reveal import (
    collective_reduction,
    matmul_reduction,
    reveal,
    reveal_order,
    reveal_precision,
)
from trainprobes.reference.formats import get_format


def _ordered(order, fmt="fp16", acc="fp16", mode="nearest"):
    """Sums x in `order`, the accumulator rounded to `acc` with `mode` after every add."""
    f_acc, f_out = get_format(acc), get_format(fmt)

    def fn(x):
        x = x.double()
        total = x[order[0]]
        for k in order[1:]:
            total = f_acc.round(total + x[k], mode)
        return f_out.round(total).to(f_out.torch_dtype)
    return fn


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cpu_torch_sum_accumulates_in_fp32_and_says_so(dtype):
    r = reveal(torch.sum, n=16, dtype=dtype, target="torch.sum")
    m = r.metrics
    assert m["accumulator_mantissa_bits"] == 23 and not m["accumulator_bits_lower_bound"]
    assert m["rounds_per_add"] is False and m["rounding"] == "nearest"
    assert "23 mantissa bits (like fp32)" in r.message and "rounds once at the end" in r.message


@pytest.mark.parametrize("acc,bits", [("fp16", 10), ("bf16", 7), ("tf32", 10), ("fp32", 23),
                                      ("fp8_e4m3fn", 3)])
def test_accumulator_bits_of_emulated_sequential_sums(acc, bits):
    fmt = {"bf16": "bf16", "fp8_e4m3fn": "fp8_e4m3fn"}.get(acc, "fp16")
    r = reveal(_ordered(list(range(8)), fmt=fmt, acc=acc), n=8, dtype=fmt)
    assert r.metrics["accumulator_mantissa_bits"] == bits
    assert r.metrics["order_shape"] == "sequential"
    out_bits = get_format(fmt).mantissa_bits
    assert r.metrics["rounds_per_add"] == (bits <= out_bits)


def test_truncating_accumulator_is_named():
    r = reveal(_ordered(list(range(8)), fmt="bf16", acc="tf32", mode="toward_zero"), n=8, dtype="bf16")
    assert r.metrics["rounding"] == "toward_zero" and r.metrics["accumulator_mantissa_bits"] == 10


@settings(max_examples=10, deadline=None)
@given(st.permutations(list(range(7))))
def test_any_sequential_order_is_recovered(perm):
    order = reveal_order(_ordered(perm), 7, dtype="fp16")
    assert order["consistent"] and order["fan_in"] == 2
    leaves = []
    t = order["tree"]
    while isinstance(t, list):  # walk the chain from the top: the last leaf added first
        a, b = t
        leaves.append(a if isinstance(a, int) else b)
        t = b if isinstance(a, int) else a
    leaves.append(t)
    assert leaves[::-1][2:] == perm[2:] and set(leaves[::-1][:2]) == set(perm[:2])


def test_fused_multi_term_add_shows_as_fan_in():
    # A tensor-core style fused add of 4 terms (Fasi et al. 2021): align every term to the
    # largest exponent, truncate to 24 bits there, add exactly, round once; then chain groups.
    f32 = get_format("fp32")

    def fused(g):
        q = torch.ldexp(torch.ones(()), torch.frexp(g.abs().max())[1] - 1 - 23).double()
        return (torch.trunc(g / q) * q).sum() if g.abs().max() > 0 else g.sum()

    def fn(x):
        g = x.double().reshape(2, 4)
        return f32.round(f32.round(fused(g[0])) + f32.round(fused(g[1]))).half()

    order = reveal_order(fn, 8, dtype="fp16")
    assert order["fan_in"] == 4 and order["tree"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert order["shape"] == "fused(4-term adds)"


@pytest.mark.parametrize("algorithm,shape", [("ring", "sequential from 1"), ("sequential", "sequential"),
                                             ("halving_doubling", "pairwise")])
def test_collective_order_and_wire_precision(algorithm, shape):
    r = reveal(collective_reduction("bf16", algorithm=algorithm), n=8, dtype="bf16", output_dtype="bf16")
    assert r.metrics["order_shape"] == shape
    assert r.metrics["accumulator_mantissa_bits"] == 7 and r.metrics["rounds_per_add"]


def test_bf16_matmul_on_cpu():
    r = reveal(matmul_reduction(), n=16, dtype="bf16")
    assert r.metrics["accumulator_mantissa_bits"] >= 23  # CPU matmul keeps fp32 partial sums


def test_too_wide_accumulator_gives_a_lower_bound_and_unobservable_order():
    r = reveal(lambda x: x.double().sum(), n=8, dtype="fp16")
    assert r.metrics["accumulator_bits_lower_bound"] and r.metrics["order_shape"] == "unobservable"
    assert r.metrics["accumulator_mantissa_bits"] == 15 + 24  # fp16's whole range, 2^-24 .. 2^15
    assert "at least 39 mantissa bits" in r.message


def test_accumulator_narrower_in_range_than_the_input():
    # bf16 inputs into an fp16 accumulator: 2^-133 underflows and 2^127 overflows there; the
    # crafted values are moved into the range the accumulator keeps.
    fn = _ordered(list(range(8)), fmt="bf16", acc="fp16")
    for kw in ({}, {"max_exponent": 14}):
        r = reveal(fn, n=8, dtype="bf16", **kw)
        assert r.metrics["accumulator_mantissa_bits"] == 10 and r.metrics["order_shape"] == "sequential"
    with pytest.raises(ValueError, match="max_exponent=-200"):
        reveal(fn, n=8, dtype="bf16", max_exponent=-200)


def test_an_order_that_changes_between_calls_is_not_passed_off_as_a_tree():
    g = torch.Generator().manual_seed(0)

    def shuffled(x):  # a different sequential order on every call
        return _ordered(torch.randperm(x.numel(), generator=g).tolist())(x)

    order = reveal_order(shuffled, 8, dtype="fp16")
    assert not order["consistent"] and order["shape"] == "inconsistent"


def test_expected_bits_gate_fails_with_code():
    r = reveal(_ordered(list(range(8))), n=8, dtype="fp16", expected_mantissa_bits=23)
    assert r.verdict == "fail" and r.codes == ["TP-B3"] and "expected at least 23" in r.message


def test_precision_positions_matter_only_through_the_order():
    fn = _ordered([3, 2, 1, 0, 4, 5, 6, 7], fmt="bf16", acc="bf16")
    assert reveal_precision(fn, 8, dtype="bf16", positions=(3, 2, 7))["mantissa_bits"] == 7


@pytest.mark.parametrize("n,match", [(2, "n=2"), (10_000, "too large")])
def test_bad_n(n, match):
    with pytest.raises(ValueError, match=match):
        reveal_order(torch.sum, n, dtype="fp16")


def test_unsupported_dtype_is_a_clear_error():
    def fn(x):
        raise NotImplementedError(f'"sum_cpu" not implemented for {x.dtype}')  # as torch says

    with pytest.raises(ValueError, match="cannot reduce a fp8_e4m3fn tensor of 4 elements on device='cpu'"):
        reveal(fn, n=4, dtype="fp8_e4m3fn")


def test_empty_output_is_a_clear_error():
    with pytest.raises(ValueError, match="empty"):
        reveal(lambda x: x[:0], n=4, dtype="fp16")


def test_fp8_scaled_mm_adapter_runs_where_torch_has_it():
    from trainprobes.numerics.reveal import scaled_mm_reduction

    fn = scaled_mm_reduction()
    try:
        fn(torch.zeros(16, dtype=torch.float8_e4m3fn))
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm unavailable here: {e}")
    r = reveal(fn, n=16, dtype="fp8_e4m3fn")
    # fp8 inputs span 2^-9 .. 2^8: 17 bits is all a sum of fp8 values can show; a wider
    # accumulator is a lower bound, a narrower one (e.g. ~14 bits on Hopper) an exact figure
    assert r.metrics["output_format"] == "bf16"
    assert r.metrics["accumulator_mantissa_bits"] <= 17
    with pytest.raises(ValueError, match="multiple of 16"):
        fn(torch.zeros(8, dtype=torch.float8_e4m3fn))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_argument_runs_on_gpu():
    r = reveal(torch.sum, n=16, dtype="fp16", device="cuda")
    assert r.metrics["accumulator_mantissa_bits"] >= 10 and r.evidence["device"] == "cuda"
