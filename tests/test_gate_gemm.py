"""The gate on numerics.gemm Results: a recipe change that adds bias blocks (TP-G2: the
relative bias significantly larger, which also covers the verdict turning biased, TP-B1),
an unjudgeable candidate blocks (TP-E1), and an edited verdict cannot be judged."""
import pytest
import torch
from trainprobes.gate import compare
from trainprobes.numerics.gemm import gemm_bias
from trainprobes.result import Result


@pytest.fixture(scope="module")
def operands():
    g = torch.Generator().manual_seed(5)
    # mostly positive bf16 inputs, as a bf16 training step hands its GEMMs after an activation
    return [(torch.randn(32, 1024, generator=g) + 1).to(torch.bfloat16).double() for _ in "ab"]


def judged(operands, recipe, preset, **kw):
    return gemm_bias(*operands, recipe=recipe, preset=preset, gemm="fprop", samples=256,
                     trials=16, target="mlp.up_proj.fprop", **kw)


def test_a_recipe_change_that_adds_bias_blocks(operands):
    base = judged(operands, "bf16", "fp32")                   # bf16 GEMM, fp32 accumulation
    cand = judged(operands, "fp8-tensor-e4m3", "h200-scaled-mm")  # fp8, Hopper's accumulator
    assert base.metrics["gemm_verdict"] in ("exact", "noise"), base.message
    assert cand.metrics["gemm_verdict"] == "biased", cand.message
    report = compare([base], [cand])
    assert report.exit_code == 1
    assert [r.code for r in report.blocking] == ["TP-G2"], report.to_markdown()
    assert compare([base], [base]).exit_code == 0


def test_an_unjudgeable_candidate_blocks_and_an_edited_one_cannot_be_judged(operands):
    base = judged(operands, "bf16", "fp32")
    # the truncating accumulator on zero-mean e4m3 data (a bias near -1.6e-4) with 64 samples:
    # a CI that holds 0 and reaches past the 1e-4 tolerance
    g = torch.Generator().manual_seed(12)
    a = torch.randn(64, 1024, generator=g).to(torch.float8_e4m3fn).double()
    g = torch.Generator().manual_seed(13)
    b = torch.randn(64, 1024, generator=g).to(torch.float8_e4m3fn).double()
    cand = gemm_bias(a, b, preset="h200-scaled-mm", samples=64, trials=8, target="mlp.up_proj.fprop")
    assert cand.metrics["gemm_verdict"] == "inconclusive" and cand.verdict == "error"
    report = compare([base], [cand])
    assert report.exit_code == 1 and [r.code for r in report.blocking] == ["TP-E1"]
    # the same Result edited to pass as noise: its CI reaches past the tolerance
    d = cand.to_dict()
    d["verdict"], d["codes"] = "pass", []
    d["metrics"].update(gemm_verdict="noise", biased=False)
    edited = Result.from_dict(d)
    report = compare([base], [edited])
    assert report.exit_code == 2 and "noise means the whole CI lies within" in report.cannot_judge


def test_a_promotion_fix_the_ci_does_not_show_cannot_be_judged(operands, monkeypatch):
    # the row-and-column-norm design on a GEMM small enough to be sized output by output
    monkeypatch.setattr("trainprobes.numerics.gemm.BY_OUTPUT", 0)
    # a biased candidate whose search found no candidate with its CI within the tolerance,
    # edited to claim the first candidate (its CI holds 0 and reaches past the tolerance:
    # no bias shown, but none ruled out) as the fix
    g = torch.Generator().manual_seed(4)
    a, b = ((torch.randn(64, 2048, generator=g)).to(torch.float8_e4m3fn).double() for _ in "ab")
    cand = gemm_bias(a, b, preset="h200-scaled-mm", samples=128, trials=16, seed=14,
                     target="mlp.up_proj.fprop")
    tol = cand.metrics["tolerance"]
    promo = cand.evidence["promotion"]
    k = next(i for i, c in enumerate(promo)
             if c["ci_low"] <= 0 <= c["ci_high"] and max(-c["ci_low"], c["ci_high"]) > tol)
    d = cand.to_dict()
    d["evidence"]["promotion"] = [dict(c, within=i == k) for i, c in enumerate(promo[:k + 1])]
    d["metrics"]["promote_every_needed"] = float(promo[k]["promote_every"])
    report = compare([judged(operands, "bf16", "fp32")], [Result.from_dict(d)])
    assert report.exit_code == 2 and "is not judged against tolerance" in report.cannot_judge


def test_a_biased_candidate_whose_point_estimate_is_under_the_tolerance_blocks():
    # the probe's fail-closed rule: deepseek-v3 on mostly positive data, 64 samples: a bias
    # of -9.6e-5 (under the 1e-4 tolerance) with a CI reaching -1.2e-4 is biased. The gate
    # must block it as the probe judged it, not call the genuine Result edited (exit 2)
    g = torch.Generator().manual_seed(1024)
    a, b = ((torch.randn(32, 1024, generator=g) + 1).to(torch.float8_e4m3fn).double() for _ in "ab")
    cand = gemm_bias(a, b, preset="deepseek-v3", samples=64, trials=8, seed=1,
                     target="mlp.up_proj.fprop")
    m = cand.metrics
    assert m["gemm_verdict"] == "biased" and abs(m["relative_bias"]) < m["tolerance"]
    base = gemm_bias(a, b, preset="fp32", samples=64, trials=8, target="mlp.up_proj.fprop")
    report = compare([base], [cand])
    assert report.cannot_judge is None, report.cannot_judge
    assert report.exit_code == 1 and "TP-B1" in [r.code for r in report.blocking]


def test_a_search_that_did_not_run_finds_nothing(operands):
    # a biased GEMM judged without the promotion search (judge_model, --target) says so:
    # promotion_searched False, N_C left at K; an edit claiming a fix it never searched for
    # cannot be judged
    cand = judged(operands, "fp8-tensor-e4m3", "h200-scaled-mm", promotion=False)
    assert cand.metrics["gemm_verdict"] == "biased" and cand.metrics["promotion_searched"] is False
    assert cand.metrics["promote_every_needed"] == cand.metrics["k"] and not cand.evidence["promotion"]
    assert "the promotion interval was not searched" in cand.message
    base = judged(operands, "bf16", "fp32")
    assert compare([base], [cand]).exit_code == 1
    d = cand.to_dict()
    d["metrics"]["promote_every_needed"] = 256.0
    report = compare([base], [Result.from_dict(d)])
    assert report.exit_code == 2 and "promotion_searched=False" in report.cannot_judge
    searched = judged(operands, "fp8-tensor-e4m3", "h200-scaled-mm")
    assert searched.metrics["promotion_searched"] is True and searched.evidence["promotion"]
