"""The engine pair through compare: what each real combination shows (probes.drift.demo).
bf16 drift itself is checked in tests/test_lm.py; the full table is `trainprobes drift --demo`."""
import pytest

from probes.drift.demo import SCENARIOS, run_scenario
from reference.models.lm import TinyLM


@pytest.fixture(scope="module")
def model():
    return TinyLM(seed=0)


@pytest.mark.parametrize("name", [
    "fp32 infer / fp32 train",
    "T=0.7 processed logprobs / trainer at T=1 (temperature bug)",
    "top-p 0.9 processed logprobs / trainer full softmax",
])
def test_engine_pair_verdicts(model, name):
    sc = next(s for s in SCENARIOS if s.name == name)
    r = run_scenario(sc, n_prompts=24, max_new_tokens=24, model=model, seed=0)
    assert r.metrics["drift_verdict"] == sc.expect, r.message
    assert r.metrics["biased"] is (sc.expect == "biased")
    assert r.seed == 0 and r.evidence["scenario"]["name"] == name
    if name.startswith("fp32"):
        assert r.metrics["max_abs_log_ratio"] < 1e-4  # same math up to reduction order
