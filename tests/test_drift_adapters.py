"""trainprobes.drift.adapters: HF transformers recompute (tiny random GPT-2, nothing downloaded) and
vLLM outputs read from stand-in objects of vLLM's shape (vLLM itself is not installed here)."""
import sys
from types import SimpleNamespace as NS

import pytest
import torch
from trainprobes.drift import compare, hf_token_logprobs, recompute_with_hf, vllm_logprobs
from trainprobes.errors import TrainprobesError

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _reference(model, ids):
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.float(), -1)
    return lp[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)


def test_hf_logprobs_match_a_manual_forward(gpt2):
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    lp, mask = hf_token_logprobs(gpt2, ids, batch_size=2)
    assert lp.shape == (3, 11) and mask.all()
    assert torch.allclose(lp, _reference(gpt2, ids), atol=1e-6)


def test_hf_logprobs_mask_right_padding(gpt2):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[1, 5:] = 0
    lp, mask = hf_token_logprobs(gpt2, ids, am)
    assert mask[1].tolist() == [True] * 4 + [False] * 3
    assert (lp[~mask] == 0).all()
    assert torch.allclose(lp[1, :4], _reference(gpt2, ids[1:, :5])[0], atol=1e-5)


def test_hf_from_local_dir_and_absent_package(gpt2, tmp_path, monkeypatch):
    gpt2.save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    lp, _ = hf_token_logprobs(str(tmp_path / "m"), ids)
    assert torch.allclose(lp, _reference(gpt2, ids), atol=1e-5)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match="needs 'transformers'.*pip install") as info:
        hf_token_logprobs(str(tmp_path / "m"), ids)
    assert isinstance(info.value, TrainprobesError)


def _vllm_outputs(model, ids, prompt_len, shift=0.0):
    """RequestOutput/CompletionOutput/Logprob stand-ins with vLLM's attribute names."""
    ref = _reference(model, ids)
    outs = []
    for b in range(ids.shape[0]):
        comp = ids[b, prompt_len:].tolist()
        lps = [{tok: NS(logprob=float(ref[b, prompt_len - 1 + i]) - shift, rank=1, decoded_token="?"),
                (tok + 1) % 64: NS(logprob=-9.0, rank=2, decoded_token="?")}
               for i, tok in enumerate(comp)]
        outs.append(NS(prompt_token_ids=ids[b, :prompt_len].tolist(),
                       outputs=[NS(index=0, text="", token_ids=comp, logprobs=lps)]))
    return outs


def test_vllm_outputs_recomputed_with_hf_same_model_is_clean(gpt2):
    ids = torch.randint(1, 64, (6, 14), generator=torch.Generator().manual_seed(4))
    ro = vllm_logprobs(_vllm_outputs(gpt2, ids, prompt_len=4))
    assert ro.infer_logprobs.shape == (6, 10) and ro.mask.all()
    train = recompute_with_hf(gpt2, ro)
    r = compare(train, ro.infer_logprobs, mask=ro.mask)
    assert r.metrics["drift_verdict"] == "clean"


def test_vllm_outputs_with_offset_are_biased(gpt2):
    ids = torch.randint(1, 64, (16, 20), generator=torch.Generator().manual_seed(5))
    ro = vllm_logprobs(_vllm_outputs(gpt2, ids, prompt_len=4, shift=0.05))
    r = compare(recompute_with_hf(gpt2, ro), ro.infer_logprobs, mask=ro.mask)
    assert r.metrics["biased"] is True and r.metrics["mean_log_ratio"] == pytest.approx(-0.05, abs=1e-4)


def test_vllm_ragged_completions_are_masked():
    outs = [NS(prompt_token_ids=[1], outputs=[NS(token_ids=[3, 4, 5], logprobs=[{3: NS(logprob=-1.0)},
                                                                                 {4: NS(logprob=-2.0)},
                                                                                 {5: NS(logprob=-0.5)}])]),
            NS(prompt_token_ids=[2], outputs=[NS(token_ids=[6], logprobs=[{6: -0.25}])])]
    ro = vllm_logprobs(outs)
    assert ro.mask.tolist() == [[True, True, True], [True, False, False]]
    assert ro.infer_logprobs[1, 0].item() == -0.25


@pytest.mark.parametrize("outs, match", [
    ([NS(outputs=[NS(token_ids=[1], logprobs=None)])], r"\[0\].outputs\[0\].logprobs is None.*logprobs=0"),
    ([NS(outputs=[NS(token_ids=[1, 2], logprobs=[{1: NS(logprob=-1.0)}, {9: NS(logprob=-1.0)}])])],
     r"logprobs\[1\] has no entry for the sampled token 2"),
    ([NS(outputs=[])], r"has no outputs\[0\]"),
    ([], "empty"),
])
def test_vllm_errors_name_request_and_position(outs, match):
    with pytest.raises(ValueError, match=match):
        vllm_logprobs(outs)
