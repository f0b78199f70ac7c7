"""Real vLLM (CPU build, saved by scripts/zoo_vllm.py) against transformers, per model type of
the zoo, judged here without vLLM installed: the same tiny random models rebuilt from their
configs and the weights' seed, the same prompts scored by teacher forcing, the drift verdict
of trainprobes.drift.compare per type; a weight changed on the transformers side must show."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from trainprobes.drift.compare import compare  # noqa: E402

DATA = Path(__file__).parent / "data" / "zoo_vllm_logprobs.npz"
SCRIPT = Path(__file__).parents[1] / "scripts" / "zoo_vllm.py"


def _script():
    spec = importlib.util.spec_from_file_location("zoo_vllm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)        # imports no vLLM: only main() does
    return mod


@pytest.fixture(scope="module")
def saved():
    d = np.load(DATA)
    return {k: d[k] for k in d.files}


def _hf_logprobs(model, ids) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(ids, dtype=torch.long), use_cache=False).logits.double()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, torch.as_tensor(ids[:, 1:], dtype=torch.long)[..., None])
    return lp[..., 0].numpy()


def test_the_file_is_small_real_vllm_output(saved):
    assert DATA.stat().st_size < 200_000
    versions = json.loads(str(saved["versions_json"]))
    assert versions["vllm"] and "cpu" in versions["torch"]
    types = json.loads(str(saved["types_json"]))
    assert "llama" in types and any(t in types for t in ("mixtral", "qwen3_moe"))   # a MoE served too
    failed = json.loads(str(saved["failed_json"]))
    assert all(isinstance(why, str) and why for why in failed.values())   # never dropped silently


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"])
def test_engine_vs_transformers_drift_per_model_type(saved, model_type):
    types = json.loads(str(saved["types_json"]))
    if model_type not in types:
        pytest.skip(f"vLLM did not serve {model_type}: {json.loads(str(saved['failed_json'])).get(model_type)}")
    mod = _script()
    model, _, names = mod.build(model_type)
    # the same parameters on both sides, or the comparison cannot judge
    assert names == json.loads(str(saved[f"{model_type}__param_names_json"]))
    ids = saved[f"{model_type}__prompts"]
    train = _hf_logprobs(model, ids)
    infer = saved[f"{model_type}__vllm_logprobs"]
    r = compare(torch.from_numpy(train), torch.from_numpy(infer), target=f"{model_type}: transformers vs vLLM")
    # the same fp32 model in two engines: rounding-level differences, no bias, no tail
    assert r.metrics["drift_verdict"] in ("clean", "noisy"), r.message
    assert float(np.abs(train - infer).max()) < 1e-3
    # power: one weight row changed on the transformers side is seen
    with torch.no_grad():
        model.get_output_embeddings().weight[int(ids[0, 1])] += 0.5
    moved = compare(torch.from_numpy(_hf_logprobs(model, ids)), torch.from_numpy(infer))
    assert moved.metrics["drift_verdict"] not in ("clean",), moved.message
