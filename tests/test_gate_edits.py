"""The gate against hand edits: every probe has a consistency rule (trainprobes.gate.rules.RULES), and one
field of a real Result edited alone (x1000, set to 0.5, a boolean flipped) blocks (exit 1) or
cannot be judged (exit 2), in the baseline or the candidate; never passes. The edits no rule
can see are listed below with the reason, and the list is checked to be exact."""
import json
import math
from datetime import date

import pytest
from trainprobes.gate import check_judgeable, compare
from trainprobes.gate.rules import RULES
from trainprobes.result import PROBES, Result

TODAY = date(2026, 11, 29)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _transform(kind: str) -> Result:
    """A transforms.equivalence Result as equivalence.finish builds it from judge() on
    synthetic gradients (no ranks): rounding noise, or every gradient 1% too large."""
    import torch
    from trainprobes.transforms.judge import LOSS, Observed, judge
    from trainprobes.transforms.step import Truth
    g = torch.Generator().manual_seed(0)
    T = 16
    grads = {n: 1.0 + 0.3 * torch.randn(T, 24, generator=g, dtype=torch.float64)
             for n in ("0.weight", "0.bias")}
    loss = 2.0 + 0.1 * torch.randn(T, generator=g, dtype=torch.float64)
    f = (lambda x: x * (1 + 1e-7 * torch.randn(x.shape, generator=g, dtype=torch.float64))) \
        if kind == "noise" else (lambda x: x * 1.01)
    obs = Observed({n: {0: f(v)} for n, v in grads.items()},
                   {n: torch.float32 for n in grads} | {LOSS: torch.float32}, {0: f(loss)})
    j = judge(Truth(loss, grads), obs, alpha=0.01, min_effect=1e-6, noise_tol=1e-4,
              replica_tol=0.0, base=None)
    codes = {"biased": ["TP-T1"], "inconsistent": ["TP-T2"], "wrong": ["TP-T3"]}.get(j.kind, [])
    return Result("transforms.equivalence", "step[ddp,w=2]", "pass" if j.equivalent else "fail",
                  metrics={**j.metrics, "transform": "ddp", "world": 2, "dtype": "fp32",
                           "backend": "gloo"},
                  evidence=dict(j.evidence), seed=0, codes=codes, message=j.message)


def _localized() -> dict:
    """drift.localize Results on a plain-torch stack (no transformers): identical engines,
    noise (one block's MLP in fp64), a bf16 MLP, a stale tensor, a temperature applied twice."""
    import copy

    import torch
    from trainprobes.drift import faults
    from trainprobes.drift.decompose import localize
    from trainprobes.drift.engines import Engine, raw_logprobs
    from trainprobes.reference.models.stack import TinyStack
    a = TinyStack(seed=0)
    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(0))
    edits = {"exact engines": (lambda m: None, None),
             "noise engines": (lambda m: faults.in_dtype(m.blocks[1].mlp, torch.float64), None),
             "bf16 block": (lambda m: faults.in_dtype(m.blocks[1].mlp, torch.bfloat16), None),
             "stale tensor": (lambda m: faults.stale(m.blocks[2].mix.weight), None),
             "temperature twice": (lambda m: None, faults.temperature_logprobs(0.49)),
             # beyond noise through one sequence's ratio alone (max_ratio > margin^2): the others
             # at noise (fp64), the first in bf16
             "one sequence's fault": (lambda m: faults.in_dtype(m.blocks[1].mlp, torch.float64)
                                      .register_forward_hook(lambda mod, args, o: torch.cat(
                                          [o[:1].bfloat16().float(), o[1:]])), None)}
    out = {}
    for name, (edit, logprobs) in edits.items():
        b = copy.deepcopy(a)
        edit(b)
        trainer = Engine(a, faults.temperature_logprobs(0.7) if logprobs else raw_logprobs)
        out[name] = localize(trainer, Engine(b, logprobs or raw_logprobs), ids)
    return out


def _gemms() -> dict:
    """numerics.gemm Results: biased (truncating accumulator on positive operands, with its
    promotion search), noise (a 13-bit round-to-nearest accumulator on zero-mean operands) and exact (a wide accumulator)."""
    import torch
    from trainprobes.numerics.gemm import gemm_bias
    from trainprobes.reference.gemm import PRESETS
    nearest = PRESETS["h200-scaled-mm"].with_(rounding="nearest", alignment="sum")
    g = torch.Generator().manual_seed(0)
    pos = [(torch.rand(32, 512, generator=g) + 0.1).to(torch.float8_e4m3fn).double() for _ in "ab"]
    zm = [torch.randn(32, 512, generator=g).to(torch.float8_e4m3fn).double() for _ in "ab"]
    return {"biased gemm": gemm_bias(*pos, preset="h200-scaled-mm", samples=256, trials=16),
            "noise gemm": gemm_bias(*zm, preset=nearest, samples=256, trials=16),
            "exact gemm": gemm_bias(*zm, preset="b200-25bit", samples=256, trials=16)}


@pytest.fixture(scope="module")
def real():
    """Results as the probes write them, at small sizes (~5 s), covering every probe in
    PROBES and its verdict paths."""
    import torch
    from trainprobes.causality import check
    from trainprobes.distributed.case import Case
    from trainprobes.distributed.predict import emulate, result_from_outputs
    from trainprobes.distributed.probe import emulate_collective
    from trainprobes.drift import compare as drift_compare
    from trainprobes.isolation import batch_invariance, documents
    from trainprobes.isolation.controls import (
        VOCAB,
        bidirectional,
        block_diagonal,
        causal_over_row,
        exact_matmul,
        integer_rows,
        rounding_noise,
        split_by_batch,
    )
    from trainprobes.isolation.end_to_end import end_to_end
    from trainprobes.isolation.ops import _as_map_entry
    from trainprobes.numerics.bias import bias_probe, collective_bias, rounding_side_by_side
    from trainprobes.numerics.reveal import collective_reduction, reveal
    from trainprobes.numerics.stall import stall
    from trainprobes.reference import routing

    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    seqs = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    lp = -torch.rand(8, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    noise = 1e-3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3),
                               dtype=torch.float64)

    def lm(t):  # exact integer logits: batch-invariant
        return torch.log_softmax(integer_rows(0, VOCAB)[:, :VOCAB][t][:, :-1], -1).gather(
            2, t[:, 1:, None])[..., 0]

    case = Case("all_reduce", "bf16", "sum", 64, "normal", 0, 0).check(4, "gloo")
    outs = emulate(case, 4, "gloo")  # stand-ins for real gloo outputs: the emulator's own
    off = [o.clone() for o in outs]
    off[1][3] += 1.0
    out = {
        "causal router": check(routing.topk_softmax, x, decision=0),
        "leaky router": check(routing.expert_choice, x, decision=0),
        "isolated documents": documents(block_diagonal(), ids, [4, 6], vocab=VOCAB, causal=False),
        "leaking documents": documents(causal_over_row(), ids, [4, 6], vocab=VOCAB, causal=False),
        "unsettled documents": documents(rounding_noise(), ids, [4, 6], vocab=VOCAB, fp64=False,
                                         causal=False),
        "a document reading its future": documents(bidirectional(), ids, [10], vocab=VOCAB,
                                                   cuts=[4]),
        "invariant batch": batch_invariance(exact_matmul, integer_rows(), sizes=(2,)),
        "variant batch": batch_invariance(split_by_batch, integer_rows(), sizes=(2,)),
        "variant op": _as_map_entry(batch_invariance(split_by_batch, integer_rows(), sizes=(2,))),
        "invariant engine": end_to_end(lm, seqs, sizes=(2,)),
        "variant engine": end_to_end(lambda t: lm(t) + 1e-3 * t.shape[0], seqs, sizes=(2,)),
        "biased average": collective_bias(world=6, numel=64, trials=8, op="avg"),
        "fp32 sum": collective_bias(world=8, numel=64, trials=8, dtype="fp32"),
        "nothing measured": bias_probe(lambda t: t * math.inf, lambda t: t,
                                       lambda g: torch.randn(16, generator=g, dtype=torch.float64),
                                       trials=4),
        "biased drift": drift_compare(lp, lp - 0.05),
        "clean drift": drift_compare(lp, lp.clone()),
        "noisy drift": drift_compare(lp, lp + noise),
        "emulated collective": emulate_collective(world=4, dtype="bf16", numel=64),
        "gloo collective": result_from_outputs(case, outs, backend="gloo", world=4),
        "gloo collective mismatch": result_from_outputs(case, off, backend="gloo", world=4),
        "reveal": reveal(collective_reduction("fp16"), n=8, dtype="fp16", output_dtype="fp16"),
        "stall": stall(n=3000),
        "noise transform": _transform("noise"),
        "biased transform": _transform("biased"),
    }
    out.update(_gemms())
    holm = rounding_side_by_side(world=6, numel=32, trials=8, op="avg")
    out.update({f"holm {i}": r for i, r in enumerate(holm)})
    out.update(_localized())
    for name, r in out.items():
        r.target = name
    return out


def test_every_probe_has_a_consistency_rule():
    # a probe added to PROBES without a rule would be compared on figures nothing checks
    missing = sorted(set(PROBES) - set(RULES))
    assert not missing, f"probes without a rule in trainprobes.gate.rules.RULES: {missing}"


def test_the_real_results_cover_every_probe_and_are_judgeable(real):
    assert {r.probe for r in real.values()} == set(PROBES)
    for r in real.values():
        check_judgeable(r, "candidate")
        check_judgeable(Result.from_json(r.to_json()), "candidate")  # through its JSON too


def _edits(value):
    """The hand edits of one field: a boolean flipped; a number x1000 (0 becomes 1) and set
    to 0.5, where that changes it."""
    if isinstance(value, bool):
        return [("flipped", not value)]
    if not isinstance(value, (int, float)) or isinstance(value, float) and math.isnan(value):
        return []
    out = [("x1000", value * 1000) if value else ("0 -> 1", 1)]
    return [e for e in out + [("= 0.5", 0.5)] if e[1] != value]


# Fields an edit of which no rule can see, and why. Keyed by (probe, field) when true of the
# probe, by (case, field) when the field is checked in other cases. Four kinds:
SETTING = ("a setting the probe ran with, recorded for the reader: no figure in the Result is "
           "derived from it here, and no gate rule reads it")
FLOOR = ("the probe's floor for an effect that matters: the gate's growth test takes the lower "
         "of the two reports' floors, so raising it in either report cannot hide a growth, and "
         "the biased test reads it only past p < alpha (where an edit across |estimate| is seen)")
WORK = ("how much work the probe did (calls, cuts, trials run, tokens evaluated): no figure "
        "the gate reads depends on it")
SIZE = ("the size of what the verdict boolean already calls bad: the gate reads only whether it "
        "is 0, and the report keeps no record it could be recomputed from")
DESCRIPTIVE = ("a descriptive statistic of per-token or per-trial values the report does not "
               "keep (only sums the probe discarded could recompute it); no rule reads it")
UNDETECTABLE = {
    ("numerics.bias", "min_effect"): FLOOR,
    ("holm 2", "p_value"): ("a Holm-adjusted p-value: it depends on the other Results of its "
                            "family, which share no key; alone it is bounded by [p, m p] of its "
                            "own unadjusted p, and an edit within that, not across alpha, is "
                            "unseen"),
    ("distributed.collective", "world"): SETTING + " (the ranks compared bound it from below)",
    ("drift.compare", "min_bias"): FLOOR,
    ("drift.compare", "clip"): SETTING,
    ("clean drift", "alpha"): "se_mean = 0: the CI has no width at any alpha, and p_mean = 1",
    ("clean drift", "noise_kl_max"): "p_mean = p_excess = 1: either test gives p_value = 1",
    ("noisy drift", "noise_kl_max"): "p_mean > p_excess: either test gives the same p_value",
    ("clean drift", "p_excess"): "p_mean = 1 >= p_excess: max(p_mean, p_excess) does not move",
    ("biased drift", "p_excess"): "k2_kl > noise_kl_max: the probe's p_value is p_mean alone",
    **{("drift.compare", f): DESCRIPTIVE for f in (
        "chi2_seq", "chi2_token", "ess_seq", "ess_token", "excess_kurtosis",
        "frac_seq_geo_ratio_outside", "frac_seq_ratio_outside", "k1_kl", "k2_kl", "k3_kl",
        "k3_kl_reverse", "max_abs_prob_diff", "mean_ratio", "prob_pearson",
        "seq_mean_log_ratio", "skewness", "std_log_ratio", "tail_share")},
    ("drift.compare", "n_tokens"): DESCRIPTIVE + " (n_units and n_sequences bound it from below)",
    **{("causality.check", f): WORK for f in ("n_cuts", "n_evaluations", "tokens_evaluated",
                                              "trials")},
    ("causal router", "n_compared"): WORK + " (it bounds n_flips, here 0, from above)",
    ("causal router", "n_confirmations"): WORK + " (at most n_evaluations)",
    ("causality.check", "n_score_numerical"): ("score changes below the fp64 check's threshold: "
                                               "counted, never a leak, and no other count holds them"),
    ("causality.check", "packed"): ("whether the copies were packed into one batch: a flip of "
                                    "it changes no count (packed=True beside batch_invariant=False "
                                    "is seen)"),
    **{("leaky router", f): SIZE for f in ("n_score_leaks", "n_unverified", "max_leak_distance",
                                           "first_leak_position")},
    **{("isolation.documents", f): WORK for f in ("causality_evaluations", "n_evaluations",
                                                  "n_fp64_evaluations", "n_documents")},
    ("isolation.documents", "batched"): SETTING,
    ("isolation.documents", "n_numerical"): ("changes below the fp64 check's threshold: counted, "
                                             "never a leak"),
    ("isolation.documents", "max_cross_change"): DESCRIPTIVE,
    **{("leaking documents", f): SIZE for f in ("max_leak", "n_leaks", "n_blind_tokens",
                                                "n_unverified")},
    **{("unsettled documents", f): SIZE for f in ("n_blind_tokens", "n_unverified")},
    ("unsettled documents", "deterministic"): ("isolated is None (unsettled, not measured): the "
                                               "probe writes deterministic beside a verdict only"),
    **{(p, f): SETTING for p in ("isolation.batch_invariance", "isolation.op_map")
       for f in ("atol", "n_rows")},
    **{(p, "n_evaluations"): WORK for p in ("isolation.batch_invariance", "isolation.op_map",
                                            "isolation.end_to_end")},
    **{(c, "companion_dependent"): SIZE for c in ("variant batch", "variant op")},
    ("isolation.end_to_end", "size"): SETTING,
    **{("isolation.end_to_end", f): DESCRIPTIVE + " (the engine pair's drift, reported beside "
       "the invariance verdict)" for f in ("k3_kl", "mean_log_ratio", "n_tokens", "p_value",
                                           "std_log_ratio")},
    **{("variant engine", f): SIZE for f in ("frac_tokens_differ", "max_abs_diff")},
    **{("drift.localize", f): SETTING for f in ("alpha", "margin", "nominal_roundoff")},
    ("drift.localize", "n_forwards"): WORK,
    **{("drift.localize", f): WORK + " (the tokens and sequences compared)" for f in (
        "n_tokens", "n_dropped_tokens")},
    **{("drift.localize", f): DESCRIPTIVE for f in ("max_abs_log_ratio", "offset",
                                                     "frac_positions_renormalised")},
    ("temperature twice", "mean_abs_log_ratio"): DESCRIPTIVE + " (0.5 still lies between "
                                                  "|mean_log_ratio| and max_abs_log_ratio)",
    ("transforms.equivalence", "min_effect"): FLOOR,
    ("numerics.gemm", "tolerance"): FLOOR,
    **{("transforms.equivalence", f): SETTING for f in ("noise_tol", "replica_tol", "power",
                                                        "world")},
    **{("transforms.equivalence", f): DESCRIPTIVE for f in (
        "max_added_error", "max_added_loss_error", "max_loss_relative_error",
        "max_relative_error", "mean_residual")},
}


def _listed(case: str, r: Result, field: str) -> str | None:
    return UNDETECTABLE.get((case, field)) or UNDETECTABLE.get((r.probe, field))


def _sweep(real):
    """(case, field, edit, side, exit code) of every edit of every real Result."""
    for case, r in real.items():
        for field, value in r.metrics.items():
            for how, new in _edits(value):
                d = json.loads(r.to_json())
                d["metrics"][field] = new
                edited = Result.from_dict(d)
                for side, pair in (("candidate", ([r], [edited])), ("baseline", ([edited], [r]))):
                    yield case, field, how, side, compare(*pair, today=TODAY).exit_code


@pytest.mark.slow
def test_one_field_edited_alone_never_passes(real):
    # was: a collective's bias x1000 passed (its SE, bias / bias_z, grew with it), as did a
    # collective that says pass beside bitwise_match_fraction = 0.5
    passed, unseen = [], set()
    for case, field, how, side, code in _sweep(real):
        if code == 0:
            if _listed(case, real[case], field) is None:
                passed.append(f"{case}: {field} {how} in the {side}")
            else:
                unseen.update({(case, field), (real[case].probe, field)})
    assert not passed, "edits the gate passed:\n" + "\n".join(passed)
    # the list is exact: an entry the rules now see must go (so it never hides a new hole)
    stale = sorted(k for k in UNDETECTABLE if k not in unseen)
    assert not stale, f"listed as undetectable, but every edit is seen: {stale}"


@pytest.mark.parametrize("case,field,value,match", [
    ("gloo collective", "bitwise_match_fraction", 0.5,
     "bitwise_match_fraction=0.5 is not (compared - mismatched) / compared"),
    ("gloo collective", "bias", "x1000", "is not evidence['error'][k]"),
    # the metric and its copy in the evidence edited together: the statistics still disagree
    ("gloo collective", "bias", "x1000 with its evidence",
     "a mean error is at most the mean of its magnitudes"),
    ("gloo collective", "bias_z", "x1000 with its evidence", "bias / bias_z"),
    ("gloo collective", "bias_p", "x1000 with its evidence", "erfc(|bias_z| / sqrt 2)"),
    ("fp32 sum", "bias", "x1000", "is not bias - t(1 - alpha/2, trials - 1) std / sqrt(trials)"),
    ("fp32 sum", "std", "x1000", "ci_low"),
    ("fp32 sum", "p_value", 0.5, "is not the design's p-value from its stages"),
])
def test_the_issue_s_edits_are_named(real, case, field, value, match):
    r = real[case]
    d = json.loads(r.to_json())
    new = d["metrics"][field] * 1000 if str(value).startswith("x1000") else value
    d["metrics"][field] = new
    if str(value).endswith("with its evidence"):
        d["evidence"]["error"][field] = new
    rep = compare([r], [Result.from_dict(d)], today=TODAY)
    assert rep.exit_code == 2 and match in rep.cannot_judge, rep.cannot_judge


def test_a_collective_mismatch_that_says_pass_cannot_be_judged(real):
    r = Result.from_json(real["gloo collective mismatch"].to_json())
    r.target = real["gloo collective"].target
    d = json.loads(r.to_json())
    d["verdict"], d["codes"] = "pass", []
    rep = compare([real["gloo collective"]], [Result.from_dict(d)], today=TODAY)
    assert rep.exit_code == 2 and "codes [] lack TP-B4" in rep.cannot_judge
    # as the probe wrote it: the emulator missed a bit, a regression of the pass before it
    rep = compare([real["gloo collective"]], [r], today=TODAY)
    assert rep.exit_code == 1 and [x.code for x in rep.blocking] == ["TP-B4"]


def test_a_nan_bias_on_numerics_bias_cannot_be_judged(real):
    # the probe averages finite trials only: a NaN bias beside a finite CI was written by hand
    r = real["fp32 sum"]
    d = json.loads(r.to_json())
    d["metrics"]["bias"] = {"$float": "nan"}
    rep = compare([r], [Result.from_dict(d)], today=TODAY)
    assert rep.exit_code == 2 and "bias" in rep.cannot_judge


@pytest.mark.parametrize("key", ["stages", "design", "errors"])
def test_a_bias_without_the_evidence_its_figures_come_from_cannot_be_judged(real, key):
    r = real["fp32 sum"]
    d = json.loads(r.to_json())
    del d["evidence"][key]
    rep = compare([r], [Result.from_dict(d)], today=TODAY)
    assert rep.exit_code == 2 and f"evidence[{key!r}] missing" in rep.cannot_judge


def test_a_report_cut_to_32_errors_is_still_judged(real):
    # an audit's report.json keeps the first 32 items of each list (report.evidence)
    from trainprobes.numerics.bias import collective_bias
    from trainprobes.report.evidence import summarise
    r = collective_bias(world=8, numel=16, trials=40, dtype="fp32")
    r.evidence = summarise(r.evidence)
    assert r.evidence["truncated"]["errors"] == 40
    assert compare([r], [r], today=TODAY).exit_code == 0


@pytest.mark.parametrize("case,section,limit", [
    ("noise transform", "transforms", "max_relative_error"),
    ("gloo collective", "collectives", "max_ulp_error"),
    ("fp32 sum", "bias", "std"),
    ("causal router", "causality", "n_compared"),
    ("invariant batch", "batch_invariance", "n_rows"),
])
def test_a_broken_threshold_s_code_is_explained(real, case, section, limit):
    # a configured fail_above adds its family's code (audit.thresholds: TP-T3 beside a
    # transform the probe calls noise): the rules must not read it as a contradiction
    from trainprobes.audit.config import apply_thresholds
    r = apply_thresholds(Result.from_json(real[case].to_json()), {"fail_above": {limit: -1.0}},
                         section)
    assert r.verdict == "fail" and r.evidence["thresholds"]["broken"]
    assert compare([r], [r], today=TODAY).exit_code == 0


@pytest.mark.parametrize("edit, match", [
    ("max_ratio", "is beyond noise, but its ratio"),         # the one sequence's ratio hidden
    ("n_trainer_rounded_tensors", "n_trainer_rounded_tensors=1 is not"),
])
def test_a_localisation_edited_where_its_verdict_comes_from_cannot_be_judged(real, edit, match):
    r = real["one sequence's fault"]
    row = next(s for s in r.evidence["stages"] if s["verdict"] == "beyond")
    assert row["ratio"] < r.metrics["margin"] < row["max_ratio"] ** 0.5  # beyond by one sequence alone
    d = json.loads(r.to_json())
    if edit == "max_ratio":
        next(s for s in d["evidence"]["stages"] if s["name"] == row["name"])["max_ratio"] = row["ratio"]
    else:
        d["metrics"][edit] = 1
    rep = compare([r], [Result.from_dict(d)], today=TODAY)
    assert rep.exit_code == 2 and match in rep.cannot_judge, rep.cannot_judge
