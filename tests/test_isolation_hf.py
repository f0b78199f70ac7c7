"""Real transformers models from tiny random configs: the documents probe's verdict against
perturbation by hand, for each packing convention transformers offers (no downloads)."""
import pytest
import torch

pytest.importorskip("transformers")
from trainprobes.isolation import Packing, documents  # noqa: E402
from trainprobes.isolation.hf import VOCAB, PackedModel, by_hand, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
P = Packing.of([10, 12, 8])
X = torch.randint(0, VOCAB, (1, P.length), generator=torch.Generator().manual_seed(0))


def probe(family, impl, convention, **kw):
    model = PackedModel(tiny_model(family, impl), convention)
    r = documents(model, X, P, vocab=VOCAB, causal=False, target=f"{family}[{impl},{convention}]", **kw)
    return r, by_hand(model, X, P)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sdpa"])
def test_llama_packed_by_position_ids_leaks_while_a_cache_is_made(impl):
    """DataCollatorWithFlattening's batch under the model's default use_cache: transformers
    looks for packed position ids only when there is no cache, so the causal mask spans the
    whole row and earlier documents leak into later ones (as the issue measured: ~0.1)."""
    r, hand = probe("llama", impl, "flattening")
    assert hand > 0.01
    assert r.metrics["isolated"] is False and "TP-I1" in r.codes
    assert {lk["direction"] for lk in r.evidence["leaks"] if lk["kind"] == "structural"} == {"forward"}
    assert r.metrics["max_leak"] >= hand  # the probe's matrix covers the hand check's pair
    # d + 2, and the 2 perturbations that leaked (documents 0 and 1) once more: reproduced
    assert r.metrics["n_evaluations"] == len(P.documents) + 2 + 2


@pytest.mark.parametrize("family, impl, convention", [
    ("llama", "sdpa", "flattening_no_cache"), ("llama", "eager", "mask_4d"), ("qwen2", "sdpa", "mask_4d"),
    ("qwen2", "sdpa", "mask_4d_bool"), ("mistral", "sdpa", "mask_4d")])
def test_conventions_that_isolate_are_called_isolated(family, impl, convention):
    r, hand = probe(family, impl, convention)
    assert hand == 0.0
    assert r.verdict == "pass" and r.metrics["isolated"] is True, r.message


def test_a_boolean_mask_under_eager_attention_is_added_not_applied():
    """eager attention adds the 4-D mask to the scores: True/False become +1/+0."""
    r, hand = probe("qwen2", "eager", "mask_4d_bool")
    assert hand > 0.01 and r.metrics["isolated"] is False
    assert {lk["direction"] for lk in r.evidence["leaks"] if lk["kind"] == "structural"} == {"forward", "backward"}


@pytest.mark.slow
def test_moe_kernel_noise_is_not_a_leak_and_a_missing_mask_is():
    """Qwen2-MoE's grouped expert matmuls are sized by tokens per expert, so another
    document's tokens move a document's logits by an ulp or so: the fp64 twin (eager experts)
    excuses that, and still finds the real leak of the cached position-ids path."""
    r, hand = probe("qwen2_moe", "sdpa", "mask_4d")
    assert r.metrics["isolated"] is True and r.verdict == "pass", r.message
    if r.metrics["max_cross_change"] > 0:  # the noise did appear: it was judged, not ignored
        assert r.metrics["n_numerical"] > 0 and "experts: grouped_mm -> eager" in r.metrics["fp64"]
    r, hand = probe("qwen2_moe", "sdpa", "flattening")
    assert hand > 0.01 and r.metrics["isolated"] is False


@pytest.mark.slow
def test_within_document_causality_runs_through_the_causality_probe():
    model = PackedModel(tiny_model("mistral", "sdpa"), "mask_4d")
    r = documents(model, X, P, vocab=VOCAB, target="mistral", cuts=[4, 11, 20, 27])
    assert r.metrics["causal"] is True and r.metrics["causality_evaluations"] > 0
    assert r.evidence["causality"]["verdict"] == "pass"


def test_a_flash_attention_twin_computes_the_varlen_function():
    """flash_attention_2 reads DataCollatorWithFlattening's cu_seq_lens: isolated, cache or
    not. Its fp64 twin swaps in sdpa, which under the same call with the default cache is
    causal over the whole row: a twin that leaks where the target does not is refused as
    another function, so every noise-sized change (grouped expert GEMMs on the GPU) stayed
    unverified and an isolating model failed. The twin takes the block-diagonal mask that
    varlen attention computes. (Only the twin is built here: no flash_attn on the CPU.)"""
    model = tiny_model("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"  # as a GPU run would have it
    for convention in ("flattening", "flattening_no_cache", "mask_4d"):
        twin = PackedModel(model, convention).fp64_twin()
        assert twin.implementation == "sdpa" and twin.convention == "mask_4d"
        assert any("flash_attention_2 -> sdpa" in s for s in twin.substituted)
        assert by_hand(twin, X, P) == 0.0


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_packed_position_ids_with_a_mask_of_ones_leak_by_design(impl):
    """Restarting position ids beside an all-ones 2-D attention_mask (what many trainers pass
    for a packed row), no cache: masking_utils looks for packed position ids only when
    attention_mask is None, so the row is attended as one sequence. The design's verdict says
    so, and names what to pass instead."""
    from trainprobes.isolation.hf import CONVENTION_NOTES, design_verdict
    r, hand = probe("llama", impl, "position_ids_ones_mask")
    assert hand > 0.01 and r.metrics["isolated"] is False, r.message
    assert {lk["direction"] for lk in r.evidence["leaks"] if lk["kind"] == "structural"} == {"forward"}
    assert design_verdict(impl, "position_ids_ones_mask") == "leaky"
    assert design_verdict("flash_attention_2", "position_ids_ones_mask") == "isolated"
    assert "attention_mask=None" in CONVENTION_NOTES["position_ids_ones_mask"]
    # the same row without the mask of ones: isolated (the note's advice holds)
    r, hand = probe("llama", impl, "flattening_no_cache")
    assert hand == 0.0 and r.metrics["isolated"] is True and design_verdict(impl, "flattening_no_cache") == "isolated"
