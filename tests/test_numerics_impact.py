import pytest
from trainprobes.numerics.impact import impact

VARIANTS = (("fp64", {"dtype": "fp64"}), ("fp16", {"dtype": "fp16"}), ("bf16", {"dtype": "bf16"}))


def test_biased_bf16_reduction_falls_behind_and_the_gap_grows():
    r = impact(variants=VARIANTS, world=512, steps=10, seed=0, tol=0.02)
    m = r.metrics
    assert r.verdict == "fail" and r.codes == ["TP-B1"]
    assert m["loss_gap[bf16]"] > 0.02 and m["loss_gap[bf16]"] > 10 * abs(m["loss_gap[fp16]"])
    c = r.evidence["curves"]
    gap = [a / b - 1 for a, b in zip(c["bf16"], c["fp64"])]
    assert gap[-1] > gap[len(gap) // 4] > 0  # compounds: larger at the end than early on
    assert c["fp64"][-1] < c["fp64"][0]  # the reference trains
    assert len(c["fp64"]) == 11 and r.evidence["plots"][0]["series"] is c
    assert "bf16 +" in r.message and r.seed == 0


def test_stochastic_rounding_tracks_fp64():
    r = impact(variants=(("fp64", {"dtype": "fp64"}),
                         ("bf16 sr", {"dtype": "bf16", "rounding": "stochastic"})),
               world=256, steps=6, seed=1)
    assert r.verdict == "pass" and abs(r.metrics["loss_gap[bf16 sr]"]) < 0.01


def test_same_seed_same_curves():
    a = impact(variants=VARIANTS[:2], world=16, steps=3, seed=4)
    b = impact(variants=VARIANTS[:2], world=16, steps=3, seed=4)
    assert a.evidence["curves"] == b.evidence["curves"]


@pytest.mark.parametrize("kwargs,match", [({"variants": []}, "variants"), ({"steps": 0}, "steps=0"),
                                          ({"variants": [("x", {"dtype": "fp17"})]}, "fp17")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        impact(world=4, **kwargs)
