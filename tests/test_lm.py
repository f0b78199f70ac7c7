"""trainprobes.reference.models.lm: the two engines compute the same math; their settings change what is reported."""

import pytest
import torch
from trainprobes.reference.models.lm import LMConfig, TinyLM, generate, random_prompts, train_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return TinyLM(seed=0)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=1)


def test_kv_cache_decode_equals_full_forward_in_fp32(model, prompts):
    ro = generate(model, prompts, max_new_tokens=8, dtype=torch.float32, batch_size=3, seed=2)
    tl = train_logprobs(model, ro.prompts, ro.completions, ro.mask, dtype=torch.float32)
    diff = (ro.logprobs - tl)[ro.mask].abs()
    assert diff.max() < 1e-4  # reduction order only
    assert ro.mask.sum() > 10


@pytest.mark.parametrize("batch_size", [1, 5])
def test_batch_composition_and_left_padding_do_not_change_fp32_math(model, prompts, batch_size):
    ro = generate(model, prompts, max_new_tokens=4, dtype=torch.float32, batch_size=batch_size, seed=3)
    ref = generate(model, prompts, max_new_tokens=4, dtype=torch.float32, batch_size=1, seed=3)
    if batch_size == 1:
        assert torch.equal(ro.completions, ref.completions)
    tl = train_logprobs(model, ro.prompts, ro.completions, ro.mask)
    assert (ro.logprobs - tl)[ro.mask].abs().max() < 1e-4


def test_bf16_inference_drifts_more_than_fp32(model, prompts):
    ro = generate(model, prompts, max_new_tokens=8, dtype=torch.bfloat16, seed=4)
    tl = train_logprobs(model, ro.prompts, ro.completions, ro.mask, dtype=torch.float32)
    d = (ro.logprobs - tl)[ro.mask].abs()
    assert 1e-4 < d.max() < 0.5


def test_processed_logprobs_are_the_sampling_distribution(model, prompts):
    ro = generate(model, prompts, max_new_tokens=8, temperature=0.5, dtype=torch.float32,
                  logprobs="processed", seed=5)
    tl = train_logprobs(model, ro.prompts, ro.completions, ro.mask, temperature=0.5)
    assert (ro.logprobs - tl)[ro.mask].abs().max() < 1e-4
    raw = generate(model, prompts, max_new_tokens=8, temperature=0.5, dtype=torch.float32,
                   logprobs="raw", seed=5)
    assert torch.equal(raw.completions, ro.completions)  # same samples, different report
    tl1 = train_logprobs(model, raw.prompts, raw.completions, raw.mask)
    assert (raw.logprobs - tl1)[raw.mask].abs().max() < 1e-4


def test_top_p_processed_logprobs_renormalise_the_nucleus(model, prompts):
    ro = generate(model, prompts, max_new_tokens=8, top_p=0.8, dtype=torch.float32, logprobs="processed", seed=6)
    tl = train_logprobs(model, ro.prompts, ro.completions, ro.mask)
    x = (ro.logprobs - tl)[ro.mask]
    assert (x >= -1e-5).all() and x.mean() > 0.01  # log(1/kept mass) >= 0


def test_eos_ends_sequences_and_masks_the_rest():
    cfg = LMConfig(vocab_size=8, logit_scale=0.1)  # near-uniform: EOS (id 0) comes quickly
    m = TinyLM(cfg, seed=0)
    ro = generate(m, random_prompts(6, vocab_size=8, seed=0), batch_size=6, max_new_tokens=12, seed=1)
    ends = ro.completions == 0
    assert ends.any()
    first = torch.where(ends.any(1), ends.float().argmax(1), 12)
    pos = torch.arange(12)[None]
    assert torch.equal(ro.mask, pos <= first[:, None])


def test_same_seed_same_bits(model, prompts):
    a = generate(model, prompts, max_new_tokens=5, seed=9)
    b = generate(model, prompts, max_new_tokens=5, seed=9)
    assert torch.equal(a.completions, b.completions) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), "temperature=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(logprobs="logits"), "logprobs='logits'"),
    (dict(max_new_tokens=500), "max_new_tokens=500"),
    (dict(dtype=torch.int32), "dtype=torch.int32"),
    (dict(batch_size=0), "batch_size=0"),
])
def test_generate_bad_arguments(model, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, **kwargs)


def test_train_logprobs_bad_shapes(model, prompts):
    with pytest.raises(ValueError, match="one row per prompt"):
        train_logprobs(model, prompts, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids outside"):
        train_logprobs(model, [torch.tensor([1, 999])], torch.zeros(1, 3, dtype=torch.long))
