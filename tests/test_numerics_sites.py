import pytest
from trainprobes.numerics.sites import collective_site, grad_accumulation_site, weight_update_site


@pytest.mark.parametrize("dtype,verdict", [("bf16", "fail"), ("fp32", "pass")])
def test_collective_of_many_same_signed_gradients(dtype, verdict):
    r = collective_site(world=1024, numel=8, dtype=dtype, seed=1)
    assert r.verdict == verdict
    if dtype == "bf16":
        # bf16 stalls at 0.5 for increments 1e-3; the true sum is ~1.02: about half is lost
        assert 0.3 < r.metrics["lost_mass"] < 0.7 and r.codes == ["TP-B2"]
        assert r.metrics["stall_point"] == 0.5 and "too small" in r.message
    else:
        assert abs(r.metrics["relative_error"]) < 1e-6


@pytest.mark.parametrize("dtype,verdict", [("bf16", "fail"), ("fp32", "pass")])
def test_grad_accumulation_into_a_low_precision_grad(dtype, verdict):
    r = grad_accumulation_site(dtype=dtype, micro_batches=512, features=4, batch=8, seed=2)
    assert r.verdict == verdict
    if dtype == "bf16":
        assert r.metrics["relative_error"] < -0.03
    else:
        assert abs(r.metrics["relative_error"]) < 1e-5


def test_weight_updates_below_half_an_ulp_are_lost_as_predicted():
    r = weight_update_site(dtype="bf16", lr=1e-4, steps=5, numel=1024, seed=3)
    m = r.metrics
    assert r.verdict == "fail" and m["fraction_updates_lost"] > 0.9
    assert abs(m["fraction_updates_lost"] - m["fraction_predicted_lost"]) < 0.05
    assert m["lost_mass"] > 0.5
    big = weight_update_site(dtype="bf16", lr=0.1, steps=3, numel=1024, seed=3)
    assert big.metrics["fraction_updates_lost"] < 0.1
    f32 = weight_update_site(dtype="fp32", lr=1e-4, steps=3, numel=1024, seed=3)
    assert f32.verdict == "pass" and f32.metrics["fraction_updates_lost"] < 0.01  # only |grad| < ~1e-3


def test_weight_update_curve_and_seed_recorded():
    a = weight_update_site(dtype="bf16", lr=1e-3, steps=4, numel=256, seed=5)
    b = weight_update_site(dtype="bf16", lr=1e-3, steps=4, numel=256, seed=5)
    assert a.evidence["moved_ratio_curve"] == b.evidence["moved_ratio_curve"] and a.seed == 5
    assert len(a.evidence["moved_ratio_curve"]) == 4


@pytest.mark.parametrize("fn,kwargs,match", [
    (collective_site, {"world": 0}, "world=0"),
    (grad_accumulation_site, {"dtype": "tf32"}, "torch dtype"),
    (grad_accumulation_site, {"micro_batches": 0}, "micro_batches=0"),
    (weight_update_site, {"lr": -1.0}, "lr=-1.0"),
    (weight_update_site, {"steps": 0}, "steps=0"),
    (weight_update_site, {"dtype": "fp6_e2m3fn"}, "torch dtype")])
def test_bad_arguments(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(**kwargs)
