"""trainprobes.power: the smallest effect a t-test detects with 80% power, shared by the bias
probe, the drift verdict and the transforms probe."""
import math

import numpy as np
import pytest
import torch
from scipy import stats
from trainprobes.errors import InvalidArgument
from trainprobes.power import min_detectable_effect


def test_large_samples_approach_the_normal_formula():
    z = stats.norm.ppf(0.995) + stats.norm.ppf(0.8)
    assert math.isclose(min_detectable_effect(1.0, 10**6, 0.01), z, rel_tol=1e-4)


def test_fewer_trials_or_a_stricter_level_need_a_larger_effect():
    m = [min_detectable_effect(1.0, df, 0.01) for df in (3, 7, 15, 63)]
    assert m == sorted(m, reverse=True)
    assert min_detectable_effect(1.0, 15, 0.001) > min_detectable_effect(1.0, 15, 0.01)
    assert min_detectable_effect(2.0, 15, 0.01) == pytest.approx(2 * min_detectable_effect(1.0, 15, 0.01))


def test_the_t_test_detects_that_effect_80_percent_of_the_time():
    n, alpha, sims = 12, 0.05, 4000
    delta = min_detectable_effect(1.0 / math.sqrt(n), n - 1, alpha)
    x = np.random.default_rng(0).normal(delta, 1.0, size=(sims, n))
    power = (stats.ttest_1samp(x, 0.0, axis=1).pvalue < alpha).mean()
    assert abs(power - 0.8) < 0.03, power


def test_degenerate_inputs():
    assert min_detectable_effect(0.0, 5, 0.01) == 0.0
    assert math.isnan(min_detectable_effect(math.nan, 5, 0.01))
    assert math.isnan(min_detectable_effect(1.0, 0, 0.01))
    with pytest.raises(InvalidArgument, match="alpha=1.5"):
        min_detectable_effect(1.0, 5, 1.5)
    with pytest.raises(InvalidArgument, match="se=-1"):
        min_detectable_effect(-1.0, 5, 0.01)


def test_the_bias_probe_and_the_drift_verdict_report_it():
    from trainprobes.drift import compare
    from trainprobes.numerics.bias import bias_probe
    r = bias_probe(lambda x: x.float(), lambda x: x, lambda g: torch.randn(64, generator=g, dtype=torch.float64),
                   trials=16)
    se = r.metrics["std"] / 4
    assert r.metrics["min_detectable_bias"] == pytest.approx(min_detectable_effect(se, 15, 0.01))
    assert "rules out |bias| >" in r.message
    g = torch.Generator().manual_seed(0)
    train = -3 - torch.rand(32, 16, generator=g)
    d = compare(train, train + 0.01 * torch.randn(32, 16, generator=g))
    assert d.metrics["min_detectable_bias"] == pytest.approx(
        min_detectable_effect(d.metrics["se_mean"], d.metrics["n_units"] - 1, 0.01))
