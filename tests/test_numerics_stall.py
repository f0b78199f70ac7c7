import math

import pytest
import torch
from trainprobes.numerics.stall import explain, sequential_sums, stall, stall_table
from trainprobes.reference.formats import FORMATS


@pytest.mark.parametrize("name,expected", [("fp16", 2048.0), ("bf16", 256.0), ("fp8_e4m3fn", 16.0),
                                           ("fp8_e5m2", 8.0), ("tf32", 2048.0), ("fp4_e2m1fn", 4.0)])
def test_ten_thousand_ones_stall_at_the_exact_figure(name, expected):
    (row,) = stall_table([name], [1.0], 10_000)
    assert row["sequential_sum"] == expected
    assert row["stall_at"] == expected
    assert row["true_sum"] == 10_000
    assert row["adds_that_moved"] == int(expected) and row["stalled"]


def test_fp16_reason_names_the_tie_and_the_usual_guess():
    (row,) = stall_table(["fp16"], [1.0], 10_000)
    r = row["reason"]
    assert "not 1024, the usual guess" in r and "2049 is a tie" in r and "even 2048" in r and "spacing is 2" in r


def test_fp32_does_not_stall_within_n():
    (row,) = stall_table(["fp32"], [1.0], 3000)
    assert row["sequential_sum"] == 3000 and not row["stalled"]
    assert "still below the stall point 16777216" in row["reason"]


@pytest.mark.parametrize("name", ["fp6_e2m3fn", "fp4_e2m1fn"])
def test_saturating_formats_say_they_saturate(name):
    f = FORMATS[name]
    (row,) = stall_table([name], [f.max_finite / 2 + f.ulp(f.max_finite).item()], 100)
    assert row["sequential_sum"] == f.max_finite
    assert math.isinf(row["stall_at"])
    assert "saturates at" in row["reason"] and "past the largest finite" in row["reason"]


def test_fp6_e2m3_ones_saturate_before_the_stall_point():
    (row,) = stall_table(["fp6_e2m3fn"], [1.0], 100)
    assert row["sequential_sum"] == 7.5 and math.isinf(row["stall_at"])
    assert "16 lies past" in row["reason"]


@pytest.mark.parametrize("name,overflow", [("fp16", "inf"), ("fp8_e4m3fn", "NaN")])
def test_overflow_before_stall_is_reported(name, overflow):
    (row,) = stall_table([name], [64.0], 10_000)
    assert math.isinf(row["stall_at"])
    assert (math.isnan(row["sequential_sum"]) if overflow == "NaN" else math.isinf(row["sequential_sum"]))
    assert f"overflows to {overflow}" in row["reason"]
    (sat,) = stall_table([name], [64.0], 10_000, saturate=True)
    assert sat["sequential_sum"] == FORMATS[name].max_finite


def test_increment_that_rounds_to_zero():
    (row,) = stall_table(["fp4_e2m1fn"], [1e-3], 10)
    assert row["sequential_sum"] == 0 and row["stall_at"] == 0
    assert "rounds to 0" in row["reason"]


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e5m2"])
@pytest.mark.parametrize("d", [1.0, 0.75, 1e-3, 3.0, -1.0])
def test_sequential_sum_is_stuck_at_or_just_past_the_analytic_point(name, d):
    f = FORMATS[name]
    (row,) = stall_table([name], [d], 100_000)
    s = row["stall_at"]
    total = row["sequential_sum"]
    assert math.copysign(1, total) == math.copysign(1, d)
    # It never stops below the stall point and never moves past the binade that starts there.
    assert abs(s) <= abs(total) < 2 * abs(s)
    assert f.round(torch.tensor([total + row["increment_stored"]])).item() == total


def test_vectorised_sums_match_one_at_a_time():
    incs = [1.0, 0.3, 1e-3, -2.5]
    sums, _ = sequential_sums("bf16", incs, 3000)
    for i, d in enumerate(incs):
        one, _ = sequential_sums("bf16", [d], 3000)
        assert one.item() == sums[i].item()


def test_stochastic_rounding_walks_past_the_stall_and_is_seeded():
    a, _ = sequential_sums("bf16", [1.0], 2000, rounding="stochastic", seed=1)
    b, _ = sequential_sums("bf16", [1.0], 2000, rounding="stochastic", seed=1)
    assert a.item() == b.item()
    assert abs(a.item() - 2000) < 300  # unbiased: a random walk around the truth, not 256


def test_result_warns_with_code_and_records_rows():
    res = stall(["fp32", "fp16"], [1.0], 3000)
    assert res.verdict == "warn" and res.codes == ["TP-B2"]
    assert res.metrics["sequential_sum[fp16,1]"] == 2048
    assert res.metrics["rows_over_tolerance"] == 1
    ok = stall(["fp32"], [1.0], 3000)
    assert ok.verdict == "pass" and ok.codes == []


@pytest.mark.parametrize("kwargs,match", [({"formats": ["fp17"]}, "fp17"), ({"increments": [0.0]}, "increments"),
                                          ({"n": 0}, "n=0"), ({"rounding": "up"}, "rounding"),
                                          ({"formats": []}, "empty")])
def test_bad_input_names_the_argument(kwargs, match):
    args = {"formats": ["fp16"], "increments": [1.0], "n": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        stall_table(**args)


def test_explain_rejects_nothing_silently():
    assert "inexactly" in explain("fp32", 1e-3, 10_000, 10.000411033630371, stalled=False)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from trainprobes.strategies import format_values  # noqa: E402


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["bf16", "fp8_e4m3fn", "fp8_e5m2", "fp6_e3m2fn"]).flatmap(
    lambda name: st.tuples(st.just(name), format_values(name, allow_negative=True))))
def test_any_increment_ends_stuck_in_the_binade_of_its_stall_point(case):
    name, d = case
    f = FORMATS[name]
    if d == 0 or math.isinf(f.stall_point(d)):
        return
    (row,) = stall_table([name], [d], 4 * 2 ** (f.mantissa_bits + 2))
    s, total = row["stall_at"], row["sequential_sum"]
    assert row["stalled"]
    assert abs(s) <= abs(total) < 2 * abs(s) or s == 0
    assert f.round(torch.tensor([total + d])).item() == total


@pytest.mark.parametrize("name,n,text", [("fp16", 100, "would overflow to inf if it ran long enough"),
                                         ("fp16", 10_000, "it overflows to inf"),
                                         ("fp6_e2m3fn", 5, "would saturate at 7.5")])
def test_overflow_wording_depends_on_whether_the_sum_got_there(name, n, text):
    d = 64.0 if name == "fp16" else 1.0
    (row,) = stall_table([name], [d], n)
    assert text in row["reason"]
