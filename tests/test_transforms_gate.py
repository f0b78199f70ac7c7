"""The gate on transforms Results: equivalent -> not equivalent blocks, coded by the
candidate's kind; a scale or loss error that grows is judged like bias; a candidate that
lost (or mistyped) its `equivalent` cannot be judged."""
import pytest
import torch
from trainprobes.gate import compare
from trainprobes.result import Result


def result(kind, scale_error=1e-9, se=1e-9, loss_error=1e-9, equivalent=None, **extra):
    eq = kind in ("exact", "noise") if equivalent is None else equivalent
    metrics = {"equivalent": eq, "transform_verdict": kind, "scale": 1 + scale_error, "trials": 16,
               "scale_error": scale_error,
               "scale_error_se": se, "loss_relative_error": loss_error, "loss_relative_error_se": se,
               "min_effect": 1e-6, "worst_parameter": "0.weight",
               "n_inconsistent": int(kind == "inconsistent"), **extra}
    if equivalent == "drop":
        del metrics["equivalent"]
    codes = {"biased": ["TP-T1"], "inconsistent": ["TP-T2"], "wrong": ["TP-T3"]}.get(kind, [])
    return Result(probe="transforms.equivalence", target="trainer.fsdp2", metrics=metrics,
                  verdict="fail" if eq is False else "pass", codes=codes)


def codes(base, cand):
    return sorted(r.code for r in compare([base], [cand]).blocking)


@pytest.mark.parametrize("kind, code", [("biased", "TP-T1"), ("inconsistent", "TP-T2"), ("wrong", "TP-T3")])
def test_a_transform_that_stops_being_equivalent_blocks(kind, code):
    assert code in codes(result("noise"), result(kind))
    assert code in codes(result("exact"), result(kind))


def test_equivalent_to_equivalent_passes_and_exact_to_noise_is_not_a_regression():
    assert codes(result("noise"), result("noise", scale_error=2e-9)) == []
    assert codes(result("exact", scale_error=0.0, se=0.0), result("noise", scale_error=3e-8, se=1e-8)) == []


def test_a_scale_that_grows_is_judged_like_bias():
    base = result("biased", scale_error=0.25, se=0.001)
    assert codes(base, result("biased", scale_error=0.25 + 1e-4, se=0.001)) == []
    assert "TP-T4" in codes(base, result("biased", scale_error=0.5, se=0.001))
    assert "TP-T4" in codes(result("biased", loss_error=0.1, se=1e-3), result("biased", loss_error=1.0, se=1e-3))


def test_a_candidate_without_the_verdict_boolean_cannot_be_judged():
    for broken in ("drop", "yes"):
        report = compare([result("noise")], [result("noise", equivalent=broken)])
        assert report.exit_code == 2 and "equivalent" in report.cannot_judge


def _judged(bug) -> Result:
    """A Result as the probe writes it, from judge() on synthetic gradients (no ranks):
    rounding noise everywhere, and `bug` applied to 0.bias."""
    import torch
    from trainprobes.transforms.judge import LOSS, Observed, judge
    from trainprobes.transforms.step import Truth
    g = torch.Generator().manual_seed(0)
    T = 16
    grads = {"0.weight": 1.0 + 0.3 * torch.randn(T, 64, generator=g, dtype=torch.float64),
             "0.bias": 1.0 + 0.3 * torch.randn(T, 4, generator=g, dtype=torch.float64)}
    loss = 2.0 + 0.1 * torch.randn(T, generator=g, dtype=torch.float64)

    def noise(x):
        return x * (1 + 1e-7 * torch.randn(x.shape, generator=g, dtype=torch.float64))
    seen = {n: noise(bug(v) if n == "0.bias" else v) for n, v in grads.items()}
    obs = Observed({n: {0: v} for n, v in seen.items()},
                   {n: torch.float32 for n in grads} | {LOSS: torch.float32}, {0: noise(loss)})
    j = judge(Truth(loss, grads), obs, alpha=0.01, min_effect=1e-6, noise_tol=1e-4, base=None)
    return Result(probe="transforms.equivalence", target="trainer.fsdp2",
                  metrics={**j.metrics, "transform": "ddp", "world": 2, "dtype": "fp32"},
                  evidence=dict(j.evidence), verdict="pass" if j.equivalent else "fail",
                  codes={"biased": ["TP-T1"], "wrong": ["TP-T3"]}.get(j.kind, []), message=j.message)


@pytest.mark.parametrize("bug, kind, named", [
    (lambda x: x * (1 + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1),
                                          dtype=torch.float64)), "wrong", "max_added_error"),
    (lambda x: x * 1.01, "biased", "significant tests"),
])
def test_a_finding_edited_to_noise_cannot_be_judged(bug, kind, named):
    """A wrong (0.bias 30% off at random) or biased (0.bias x1.01) Result with its verdict
    edited to noise, equivalent, pass and no codes: the gate passed the wrong one (no scale
    grew); its added error, or its significant tests, contradict 'noise'."""
    found, clean = _judged(bug), _judged(lambda x: x)
    assert (found.metrics["transform_verdict"], clean.metrics["transform_verdict"]) == (kind, "noise")
    assert compare([clean], [found]).exit_code == 1
    found.metrics.update(transform_verdict="noise", equivalent=True)
    found.verdict, found.codes = "pass", []
    report = compare([clean], [found])
    assert report.exit_code == 2 and "transform_verdict='noise' beside" in report.cannot_judge
    assert named in report.cannot_judge
