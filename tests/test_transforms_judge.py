"""trainprobes.transforms.judge on synthetic gradients: every verdict kind from its mechanism,
the paired design, the false-positive rate at the stated alpha, what a pass rules out."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from trainprobes.transforms.judge import LOSS, Observed, judge, lowest_precision, t_tests
from trainprobes.transforms.step import Truth

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = ("0.weight", "0.bias", "ln.weight")


def make(trials=16, seed=0, numel=24):
    """fp64 truth with a consistent gradient direction, and a single-device base 1e-7 off."""
    g = torch.Generator().manual_seed(seed)
    grads = {n: 1.0 + 0.3 * torch.randn(trials, numel, generator=g, dtype=torch.float64) for n in NAMES}
    loss = 2.0 + 0.1 * torch.randn(trials, generator=g, dtype=torch.float64)
    truth = Truth(loss, grads)
    base = Truth(loss * (1 + 1e-7 * torch.randn(trials, generator=g, dtype=torch.float64)),
                 {n: r * (1 + 1e-7 * torch.randn(r.shape, generator=g, dtype=torch.float64))
                  for n, r in grads.items()})
    return truth, base, g


def observed(grads: dict, loss, ranks=(0,)) -> Observed:
    return Observed({n: {r: v.reshape(v.shape[0], -1) for r in ranks} for n, v in grads.items()},
                    {n: torch.float32 for n in grads} | {LOSS: torch.float32},
                    {} if loss is None else {r: loss for r in ranks})


def noisy(x, g, rel=1e-7):
    return x * (1 + rel * torch.randn(x.shape, generator=g, dtype=torch.float64))


def run(truth, obs, base=None, **kw):
    opts = dict(alpha=0.01, min_effect=1e-6, noise_tol=1e-4) | kw
    return judge(truth, obs, base=base, **opts)


def test_rounding_noise_is_noise_and_says_what_it_rules_out():
    truth, base, g = make()
    j = run(truth, observed({n: noisy(r, g) for n, r in truth.grads.items()}, noisy(truth.loss, g)), base)
    assert j.kind == "noise" and j.equivalent and j.metrics["equivalent"] is True
    assert abs(j.metrics["scale"] - 1) < 1e-6
    assert j.metrics["min_detectable_scale_error"] < 1e-6
    assert "rules out a scale error of the whole gradient >" in j.message


def test_the_truth_rounded_to_fp32_is_exact():
    truth, base, _ = make()
    j = run(truth, observed({n: r.float().double() for n, r in truth.grads.items()},
                            truth.loss.float().double()), base)
    assert j.kind == "exact" and j.equivalent


def test_a_global_scale_is_biased_with_its_ci():
    truth, base, g = make()
    j = run(truth, observed({n: noisy(1.01 * r, g, 1e-3) for n, r in truth.grads.items()},
                            noisy(1.01 * truth.loss, g)), base)
    assert j.kind == "biased" and not j.equivalent
    assert j.metrics["scale_ci_low"] <= 1.01 <= j.metrics["scale_ci_high"]
    assert j.metrics["n_biased_parameters"] == 3


def test_a_bias_in_one_layernorm_shows_as_that_layernorm():
    truth, base, g = make()
    grads = {n: noisy(r, g) for n, r in truth.grads.items()}
    grads["ln.weight"] = 0.5 * truth.grads["ln.weight"]
    j = run(truth, observed(grads, noisy(truth.loss, g)), base)
    assert j.kind == "biased" and j.worst_parameter == "ln.weight"
    assert j.metrics["n_biased_parameters"] == 1 and "ln.weight x0.5" in j.message


def test_a_loss_only_bias_is_biased_at_the_loss():
    truth, base, g = make()
    j = run(truth, observed({n: noisy(r, g) for n, r in truth.grads.items()}, 2 * truth.loss), base)
    assert j.kind == "biased" and j.worst_parameter == LOSS
    assert abs(j.metrics["loss_scale"] - 2) < 1e-9 and abs(j.metrics["scale"] - 1) < 1e-6


def test_replicas_that_disagree_are_inconsistent_and_named():
    truth, base, g = make()
    obs = observed({n: noisy(r, g) for n, r in truth.grads.items()}, noisy(truth.loss, g), ranks=(0, 1))
    obs.grads["0.bias"][1] = obs.grads["0.bias"][1] * 0.5
    j = run(truth, obs, base)
    assert j.kind == "inconsistent" and j.worst_parameter == "0.bias" and "ranks [0, 1]" in j.message


def test_large_zero_mean_differences_are_wrong_and_nonfinite_values_too():
    truth, base, g = make()
    j = run(truth, observed({n: noisy(r, g, 0.2) for n, r in truth.grads.items()}, truth.loss), base)
    assert j.kind == "wrong" and "more than rounding explains" in j.message
    grads = {n: r.clone() for n, r in truth.grads.items()}
    grads["0.weight"][3, 0] = math.nan
    assert run(truth, observed(grads, truth.loss), base).kind == "wrong"


def test_a_significant_effect_below_min_effect_is_reported_not_failed():
    truth, base, g = make()
    obs = observed({n: noisy(r, g, 1e-9) * (1 + 5e-7) for n, r in truth.grads.items()}, truth.loss)
    assert run(truth, obs, base).kind == "noise"
    assert run(truth, obs, base, min_effect=0.0).kind == "biased"


def test_pairing_removes_the_models_own_rounding_bias():
    """The single device itself is 1e-5 off fp64 (its own dtype rounds systematically): a
    transform that adds only noise to it is noise, paired; against fp64 alone it would not be."""
    truth, _, g = make()
    base = Truth(truth.loss, {n: r * (1 + 1e-5) for n, r in truth.grads.items()})
    obs = observed({n: noisy(r * (1 + 1e-5), g) for n, r in truth.grads.items()}, truth.loss)
    assert run(truth, obs, base).kind == "noise"
    assert run(truth, obs, None).kind == "biased"


def test_false_positive_rate_under_the_null_is_at_most_alpha():
    """Transform and single device: independent noise of one size on the same truth. At
    alpha 0.05 and no floor, the verdict's false-positive rate stays within a binomial bound."""
    n, alpha, biased = 300, 0.05, 0
    for seed in range(n):
        truth, _, g = make(trials=8, seed=seed, numel=6)
        base = Truth(truth.loss, {k: noisy(r, g, 1e-4) for k, r in truth.grads.items()})
        obs = observed({k: noisy(r, g, 1e-4) for k, r in truth.grads.items()}, noisy(truth.loss, g, 1e-4))
        biased += run(truth, obs, base, alpha=alpha, min_effect=0.0, noise_tol=1.0).kind == "biased"
    assert biased <= stats.binom.ppf(0.999, n, alpha), biased


@settings(max_examples=25, deadline=None)
@given(c=st.floats(0.2, 5.0))
def test_a_pure_scale_is_measured_exactly_and_judged_by_the_floor(c):
    truth, _, _ = make(trials=6)
    base = Truth(truth.loss, dict(truth.grads))
    j = run(truth, observed({n: c * r for n, r in truth.grads.items()}, truth.loss), base)
    assert math.isclose(j.metrics["scale"], c, rel_tol=1e-12)
    assert (j.kind == "biased") == (abs(c - 1) >= 1e-6)


def test_t_tests_leave_out_trials_where_a_statistic_does_not_exist():
    e = torch.tensor([[0.1, math.nan], [0.2, 1.0], [0.3, math.nan], [0.2, 2.0]], dtype=torch.float64)
    mean, se, p, n = t_tests(e)
    assert n.tolist() == [4, 2] and math.isnan(p[1]) and 0 < p[0] < 0.05
    assert math.isclose(mean[0], 0.2)


def test_lowest_precision():
    assert lowest_precision(("fp32", "bf16")) == "bf16"
    assert lowest_precision(("fp64", "fp32")) == "fp32"
    assert lowest_precision(("fp32", "fp8_e4m3fn")) == "fp8_e4m3fn"


def test_a_gradient_where_the_truth_has_none_is_never_rounding():
    truth, base, g = make()
    truth.grads["0.bias"][2] = 0.0
    base.grads["0.bias"][2] = 0.0
    grads = {n: noisy(r, g) for n, r in truth.grads.items()}
    for n in grads:  # this trial's whole fp64 gradient is zero; the transform's is not
        truth.grads[n][5] = 0.0
        base.grads[n][5] = 0.0
    grads["0.weight"][5] = 1e-3
    j = run(truth, observed(grads, truth.loss), base)
    assert j.kind == "wrong" and math.isinf(j.metrics["max_added_error"])


def small_parameter_case(seed, ln_scale=1.0, rel=2e-3, trials=16):
    """A 4000-element weight and an 8-element LayerNorm bias, bf16-sized noise on both."""
    g = torch.Generator().manual_seed(seed)
    grads = {n: torch.randn(trials, k, generator=g, dtype=torch.float64)
             for n, k in (("w", 4000), ("ln.bias", 8))}
    loss = 2.0 + 0.1 * torch.randn(trials, generator=g, dtype=torch.float64)
    truth = Truth(loss, grads)
    base = Truth(loss, {n: noisy(r, g, rel) for n, r in grads.items()})
    obs = {n: noisy(r, g, rel) for n, r in grads.items()}
    obs["ln.bias"] = noisy(ln_scale * grads["ln.bias"], g, rel)
    return run(truth, observed(obs, loss), base, noise_tol=5e-2)


def test_a_pass_states_what_it_rules_out_in_its_least_resolved_parameter():
    j = small_parameter_case(0)
    whole, one = j.metrics["min_detectable_scale_error"], j.metrics["min_detectable_parameter_scale_error"]
    assert j.kind == "noise" and one > 10 * whole
    assert f"in any one parameter > {one:.2g} (least resolved: ln.bias)" in j.message
    # honest: a scale error in that parameter at 1.5x the stated bound is caught most of the time
    caught = sum(small_parameter_case(s, 1 + 1.5 * one).kind == "biased" for s in range(1, 31))
    assert caught >= 24


def test_a_small_significant_scale_is_written_so_it_does_not_read_as_one():
    truth, base, g = make()
    j = run(truth, observed({n: noisy(r * (1 + 2e-5), g, 1e-7) for n, r in truth.grads.items()},
                            noisy(truth.loss, g)), base)
    assert j.kind == "biased"
    assert "gradients scaled by 1+2e-05" in j.message and "x1+2e-05" in j.message
    assert " x1 " not in j.message and "[1, 1]" not in j.message


def two_replicas(edit):
    truth, base, g = make()
    grads = {n: noisy(r, g).float().double() for n, r in truth.grads.items()}
    obs = observed(grads, noisy(truth.loss, g), ranks=(0, 1))
    x = obs.grads["0.bias"][1].clone()
    x[3, 5] = edit(x[3, 5])
    obs.grads["0.bias"][1] = x
    return run(truth, obs, base)


def test_a_nan_on_one_replica_is_wrong_not_a_disagreement():
    j = two_replicas(lambda v: math.nan)
    assert j.kind == "wrong" and j.worst_parameter == "0.bias" and "nan" not in j.message.replace("NaN", "")


def test_replicas_one_rounding_apart_are_named_as_rounding_not_a_missing_reduction():
    j = two_replicas(lambda v: torch.nextafter(v.float(), torch.tensor(10.0)).double())
    assert j.kind == "inconsistent" and "rounding-sized" in j.message and "0.0%" not in j.message
    far = two_replicas(lambda v: v + 1.0)
    assert far.kind == "inconsistent" and "a reduction missing" in far.message


def test_ranks_reporting_different_losses_are_told_about_the_loss_not_a_gradient_reduction():
    """Each rank returning its own piece's loss: the advice named sequence-parallel LayerNorm
    weights and dropout seeds, about gradients every rank held alike."""
    truth, base, g = make()
    obs = observed({n: noisy(r, g) for n, r in truth.grads.items()}, noisy(truth.loss, g), ranks=(0, 1))
    obs.losses[1] = obs.losses[1] * 0.6
    j = run(truth, obs, base)
    assert j.kind == "inconsistent" and j.worst_parameter == LOSS
    assert "report different losses" in j.message and "LayerNorm" not in j.message


@pytest.mark.parametrize("bad_trials, factor", [([3], 2.0), ([3, 5, 9], 0.0)])
def test_a_small_parameter_wrong_on_a_few_trials_is_wrong_not_noise(bad_trials, factor):
    """An 8-element bias doubled (or dropped) on 1 to 3 of 16 trials beside 100k weights, with
    bf16-sized rounding everywhere: the whole gradient's error (1%) is inside bf16's noise_tol,
    the bias's median is rounding, and its t-test has no power: it was called noise. Against
    the bias's typical gradient (its RMS over trials) those trials are off by ~100%."""
    g = torch.Generator().manual_seed(0)
    T = 16
    grads = {"w": 0.1 + 0.3 * torch.randn(T, 100_000, generator=g, dtype=torch.float64),
             "b": 0.1 + 0.3 * torch.randn(T, 8, generator=g, dtype=torch.float64)}
    loss = 2.0 + 0.1 * torch.randn(T, generator=g, dtype=torch.float64)
    base = Truth(noisy(loss, g, 3e-3), {n: noisy(v, g, 3e-3) for n, v in grads.items()})
    seen = {n: noisy(v, g, 3e-3) for n, v in grads.items()}
    for t in bad_trials:
        seen["b"][t] *= factor
    j = run(Truth(loss, grads), observed(seen, noisy(loss, g, 3e-3)), base, noise_tol=5e-2)
    assert j.kind == "wrong" and j.worst_parameter == "b", j.message
    clean = run(Truth(loss, grads), observed({n: noisy(v, g, 3e-3) for n, v in grads.items()},
                                             noisy(loss, g, 3e-3)), base, noise_tol=5e-2)
    assert clean.kind == "noise", clean.message


def test_a_trial_whose_gradient_nearly_cancels_is_not_wrong():
    """Rounding of a size set by the summands on a trial whose fp64 gradient is 1e-3 of its
    usual size: per-trial relative error ~1 there, rounding against the typical gradient."""
    truth, base, g = make()
    truth.grads["0.bias"][4] *= 1e-3
    base = Truth(base.loss, {n: r + 1e-7 * torch.randn(r.shape, generator=g, dtype=torch.float64)
                             for n, r in truth.grads.items()})
    obs = observed({n: r + 1e-7 * torch.randn(r.shape, generator=g, dtype=torch.float64)
                    for n, r in truth.grads.items()}, noisy(truth.loss, g))
    j = run(truth, obs, base)
    row = next(x for x in j.evidence["parameters"] if x["parameter"] == "0.bias")
    assert row["max_added_error"] > 1e-4 > row["peak_added_error"]
    assert j.kind == "noise", j.message
