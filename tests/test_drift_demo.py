"""The engine pair through compare: what each real combination shows (trainprobes.drift.demo).
bf16 drift itself is checked in tests/test_lm.py; the full table is `trainprobes drift --demo`."""
import pytest
from trainprobes.drift.demo import SCENARIOS, run_scenario
from trainprobes.reference.models.lm import TinyLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return TinyLM(seed=0)


@pytest.mark.parametrize("name, size", [
    ("fp32 infer / fp32 train", 12),
    ("T=0.7 processed logprobs / trainer at T=1 (temperature bug)", 24),  # needs tokens for power
    ("top-p 0.9 processed logprobs / trainer full softmax", 12),
])
def test_engine_pair_verdicts(model, name, size):
    sc = next(s for s in SCENARIOS if s.name == name)
    r = run_scenario(sc, n_prompts=size, max_new_tokens=size, model=model, seed=0)
    assert r.metrics["drift_verdict"] == sc.expect, r.message
    assert r.metrics["biased"] is (sc.expect == "biased")
    assert r.seed == 0 and r.evidence["scenario"]["name"] == name
    if name.startswith("fp32"):
        assert r.metrics["max_abs_log_ratio"] < 1e-4  # same math up to reduction order
