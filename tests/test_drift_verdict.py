"""trainprobes.drift.verdict: the option checks and the Result shared by compare and the monitor."""
import math

import pytest
from trainprobes.drift.verdict import check_options, judge
from trainprobes.errors import InvalidArgument, InvalidType

OPTIONS = dict(alpha=0.01, clip=2.0, clean_tol=1e-3, noise_kl_max=1e-3, tail_frac=0.01, tail_share_min=0.5,
               kl_warn=0.01)


@pytest.mark.parametrize("change, error, match", [
    (dict(alpha=1.0), InvalidArgument, r"alpha=1.0 must be a finite number in \(0, 1\)"),
    (dict(clip=float("nan")), InvalidArgument, "clip=nan"),
    (dict(tail_frac=0), InvalidArgument, r"tail_frac=0 must be a finite number in \(0, 1\]"),
    (dict(min_bias=True), InvalidArgument, "min_bias=True"),
    (dict(thresholds=[("k3_kl", 1)]), InvalidType, "thresholds=.* must be dict"),
    (dict(thresholds={"k3_kl": "tight"}), InvalidArgument, r"thresholds\['k3_kl'\]='tight' must be a number"),
    (dict(thresholds={"k3": 1}), InvalidArgument, "unknown metrics"),
])
def test_bad_options_name_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        check_options(**{**OPTIONS, **change})


def test_infinite_tolerances_are_allowed_and_thresholds_come_back_as_a_dict_of_floats():
    """A negative threshold is a number too: always exceeded, a way to force TP-D3."""
    assert check_options(**{**OPTIONS, "kl_warn": math.inf, "min_bias": math.inf}) is None
    assert check_options(**OPTIONS, thresholds={"k3_kl": math.inf, "k2_kl": -1}) == {"k3_kl": math.inf,
                                                                                     "k2_kl": -1.0}


def test_judge_keeps_the_metric_keys_the_gate_reads():
    metrics = {"p_value": 1e-9, "mean_log_ratio": 0.1, "ci_low": 0.09, "ci_high": 0.11, "k2_kl": 0.2,
               "frac_ratio_outside": 0.0, "tail_share": 0.0, "std_log_ratio": 0.5, "k3_kl": 0.2,
               "max_abs_log_ratio": 1.0, "min_bias": 1e-5}
    opts = {k: OPTIONS[k] for k in ("alpha", "clean_tol", "tail_frac", "tail_share_min", "kl_warn")}
    r = judge(metrics, {}, thresholds=None, probe="drift.compare", target="t", **opts)
    assert r.metrics["biased"] is True and r.metrics["heavy_tailed"] is False
    assert r.metrics["drift_verdict"] == "biased" and r.codes == ["TP-D1"] and r.verdict == "fail"
