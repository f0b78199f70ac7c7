"""An engine pair for the audit's [[drift]] section: engine = "engines:tinylm_bf16_pair".

fn(seed) -> (train_logprobs, infer_logprobs, mask): the tiny LM of trainprobes.reference.models.lm
samples with its KV-cache inference engine in bf16 and is rescored by its full-sequence
training engine in fp32, on the same tokens.
"""
from __future__ import annotations

import torch


def tinylm_bf16_pair(seed: int, n_prompts: int = 16, max_new_tokens: int = 16):
    from trainprobes.reference.models.lm import TinyLM, generate, random_prompts, train_logprobs

    model = TinyLM(seed=seed)
    prompts = random_prompts(n_prompts, seed=seed + 1)
    ro = generate(model, prompts, max_new_tokens=max_new_tokens, dtype=torch.bfloat16,
                  seed=seed + 2)
    train = train_logprobs(model, ro.prompts, ro.completions, ro.mask, dtype=torch.float32)
    return train, ro.logprobs, ro.mask
