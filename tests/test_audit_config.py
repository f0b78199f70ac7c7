"""A user suite's configuration: errors before any work, thresholds against documented
metrics, keys that stay stable across the variants a gate compares."""
import numpy as np
import pytest
from trainprobes.audit import run_suite
from trainprobes.audit.config import ConfigError, apply_thresholds, suite_from_config
from trainprobes.gate import compare
from trainprobes.result import Result

# A target that cannot be imported: every error below must come before it would be.
NOWHERE = "no_such_module_anywhere:fn"


@pytest.mark.parametrize("section,entry,match", [
    # was: a FAIL tagged TP-C1 (a leak) after the whole probe had run
    ("causality", {"target": NOWHERE, "hidden": 8, "fail_above": {"flip_rat": 0}},
     r"fail_above.flip_rat is not a metric of causality.check; did you mean 'flip_rate'\?"
     r"; its numeric metrics: .*n_leaks"),
    ("bias", {"target": NOWHERE, "reference": NOWHERE, "inputs": NOWHERE,
              "fail_below": {"p_valeu": 0.5}}, r"did you mean 'p_value'"),
    ("drift", {"engine": NOWHERE, "fail_above": {"drift_verdict": 1}},
     "fail_above.drift_verdict is not a number"),
    ("drift", {"engine": NOWHERE, "fail_above": {"biased": 0}}, "is not a number"),
    ("collectives", {"fail_above": {"bitwise_match_fraction": 1}},
     "is not a metric of numerics.bias"),  # emulated: nothing real ran to match bits with
    ("causality", {"target": NOWHERE, "hidden": 8, "fail_above": {"n_leaks": "0"}},
     r"fail_above.n_leaks='0' must be int or float, not str"),
    ("causality", {"target": NOWHERE, "hidden": 8, "fail_above": {"n_leaks": True}},
     r"fail_above.n_leaks=True must be int or float, not bool"),
    ("causality", {"target": NOWHERE, "hidden": 8, "fail_above": {"n_leaks": float("nan")}},
     r"fail_above.n_leaks=nan must be a finite number"),
    ("causality", {"target": NOWHERE, "hidden": 8, "fail_above": 0.1}, "must be a table"),
    ("causality", {"target": NOWHERE, "hidden": 8, "name": 5}, "name=5 must be str"),
    ("causality", {"target": NOWHERE, "hidden": 8, "seed": "1"}, "seed='1' must be an int"),
    ("causality", {"target": NOWHERE, "hidden": 0}, r"hidden=0 must be an int >= 1"),
    ("causality", {"target": NOWHERE, "vocab": 1}, r"vocab=1 must be an int >= 2"),
    ("collectives", {"dtype": "bfloat17"}, r"dtype='bfloat17' is not a known number format; "
                                           r"did you mean 'bfloat16'\?"),
    ("collectives", {"world": 1}, r"world=1 must be an int >= 2"),
    ("collectives", {"world": [8, "16"]}, r"world='16' must be an int"),
    ("collectives", {"algorithm": "rign"}, r"did you mean 'ring'\?"),
    ("collectives", {"op": "mean"}, r"op='mean' must be one of"),
    # an explicitly requested backend runs as asked or is refused: never emulated instead
    ("collectives", {"backend": "gloo", "dtype": "fp8_e4m3fn"},
     r"backend 'gloo' cannot reduce it \(gloo has no float8\)"),
    ("drift", {"engine": NOWHERE, "intersect_masks": "yes"}, "intersect_masks='yes'"),
])
def test_configuration_errors_come_before_any_work(section, entry, match):
    with pytest.raises(ConfigError, match=match):
        suite_from_config({section: [entry]})


def test_nccl_without_cuda_is_refused(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="backend = 'nccl' needs CUDA GPUs"):
        suite_from_config({"collectives": [{"backend": "nccl"}]})


def test_every_spelling_of_a_dtype_is_one_format():
    for spelling in ("bf16", "bfloat16", "torch.bfloat16", "BF16"):
        (check,) = suite_from_config({"collectives": [{"dtype": spelling}]})[0]
        assert check.name == "all_reduce bf16 ring w=8"


def test_a_limit_the_result_does_not_report_is_an_error_not_a_finding():
    # mismatch_rate exists only in mode="truncate": was a FAIL tagged TP-C1 (a leak)
    r = Result("causality.check", "r", "pass", metrics={"causal": True, "n_leaks": 0})
    r = apply_thresholds(r, {"fail_above": {"mismatch_rate": 0.0}}, "causality")
    assert r.verdict == "error" and r.codes == ["TP-E1"]
    assert "cannot check the configured limits: mismatch_rate (fail_above)" in r.message
    assert r.evidence["thresholds"]["unchecked"] == ["mismatch_rate (fail_above) is not in this Result"]


def test_a_nan_metric_crosses_every_limit():
    r = Result("numerics.bias", "b", "pass", metrics={"biased": False, "bias": float("nan")})
    r = apply_thresholds(r, {"fail_below": {"bias": -1.0}}, "bias")
    assert r.verdict == "fail" and "bias = nan < -1 (fail_below)" in r.message


def test_a_broken_limit_is_what_the_message_says_first():
    # was: an FSDP2 bf16 FAIL whose message began "noise: zero-mean differences", the
    # probe's own reading, with the limit that failed it appended at the end
    r = Result("transforms.equivalence", "trainer.fsdp2", "pass", codes=[],
               metrics={"equivalent": True, "max_added_error": 3e-3},
               message="noise: zero-mean differences (max relative error 0.004 against fp64)")
    r = apply_thresholds(r, {"fail_above": {"max_added_error": 1e-4}}, "transforms")
    assert r.verdict == "fail" and r.codes == ["TP-T3"]
    assert r.message.startswith("over the configured threshold: max_added_error = 0.003 > 0.0001 "
                                "(fail_above); the probe's own reading: noise: ")


def _collectives(dtype, **extra):
    entry = {"name": "grad_allreduce", "world": 16, "dtype": dtype, "numel": 256,
             "trials": 8, "op": "sum", **extra}
    checks, _ = suite_from_config({"collectives": [entry]})
    return run_suite(checks)[0]


def test_changing_dtype_keeps_the_key_so_the_gate_compares_the_change():
    # was: the dtype was part of the key, so the gate said TP-G1 "missing" instead of
    # judging the very change (fp32 -> bf16 gradient all-reduce) it exists to judge
    (base,), (cand,) = _collectives("fp32"), _collectives("bf16")
    assert base.key == cand.key == "numerics.bias::grad_allreduce"
    assert base.evidence["dtype"] == "fp32" and cand.evidence["dtype"] == "bf16"
    assert cand.evidence["variant"].startswith("all_reduce[bf16,ring,sum")
    rep = compare([base], [cand])
    assert [r.code for r in rep.regressions] == ["TP-G2"] and rep.compared == 1


def test_an_entry_that_lists_several_values_names_them_apart():
    checks, _ = suite_from_config({"collectives": [
        {"world": [8, 16], "dtype": ["bf16", "torch.float16"], "algorithm": "tree"}]})
    results, _ = run_suite(checks[:1])
    assert results[0].target == "all_reduce[bf16,w=8]"
    keys = [c.name for c in checks]
    assert keys == ["all_reduce bf16 tree w=8", "all_reduce fp16 tree w=8",
                    "all_reduce bf16 tree w=16", "all_reduce fp16 tree w=16"]


def _npz(path, mask_cols):
    lp = -np.random.default_rng(0).uniform(0.1, 3.0, size=(16, 8))
    mask = np.ones(lp.shape, bool)
    mask[:, mask_cols:] = False
    np.savez(path, logprobs=lp, mask=mask)


@pytest.mark.parametrize("intersect", [False, True])
def test_drift_files_whose_masks_differ_are_not_silently_intersected(tmp_path, intersect):
    # was: the infer file's mask was ignored when the train file had one
    _npz(tmp_path / "train.npz", 8)
    _npz(tmp_path / "infer.npz", 6)
    entry = {"name": "files", "train": "train.npz", "infer": "infer.npz"}
    if intersect:
        entry["intersect_masks"] = True
    checks, _ = suite_from_config({"drift": [entry]}, base_dir=tmp_path)
    (r,) = run_suite(checks)[0]
    if intersect:
        assert r.metrics["n_tokens"] == 96 and "masks differed at 32 positions" in r.message
    else:
        assert r.verdict == "error" and "differ at 32 of 128 positions" in r.message


def test_every_documented_number_is_accepted_as_a_limit():
    from trainprobes.result import PROBES
    for metric in PROBES["causality.check"].numbers:
        suite_from_config({"causality": [{"target": NOWHERE, "hidden": 4,
                                          "fail_above": {metric: 1}}]})
