"""The engine pair of trainprobes.reference.models.lm, run through `compare`: what each combination of
precision and sampling settings does to the train/inference log-prob mismatch."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from trainprobes.drift.compare import compare
from trainprobes.result import Result


@dataclass(frozen=True)
class Scenario:
    name: str
    infer_dtype: torch.dtype = torch.bfloat16
    train_dtype: torch.dtype = torch.float32
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: str = "raw"
    train_temperature: float = 1.0
    expect: str = ""


SCENARIOS = (
    Scenario("fp32 infer / fp32 train", torch.float32, torch.float32, expect="clean"),
    Scenario("bf16 infer / fp32 train", torch.bfloat16, torch.float32, expect="noisy"),
    Scenario("bf16 infer / bf16 train", torch.bfloat16, torch.bfloat16, expect="clean"),
    Scenario("T=0.7 processed logprobs / trainer at T=1 (temperature bug)", torch.float32,
             torch.float32, temperature=0.7, logprobs="processed", expect="biased"),
    Scenario("T=0.7 processed logprobs / trainer at T=0.7 (fixed)", torch.float32, torch.float32,
             temperature=0.7, logprobs="processed", train_temperature=0.7, expect="clean"),
    Scenario("top-p 0.9 processed logprobs / trainer full softmax", torch.float32, torch.float32,
             top_p=0.9, logprobs="processed", expect="biased"),
    Scenario("bf16, T=0.7 raw logprobs / trainer at T=1", torch.bfloat16, torch.float32,
             temperature=0.7, logprobs="raw", expect="noisy"),
)


def run_scenario(scenario: Scenario, *, n_prompts: int = 32, max_new_tokens: int = 32,
                 seed: int = 0, model=None, alpha: float = 0.01, infer_batch_size: int = 8,
                 **compare_options) -> Result:
    """Sample with the inference engine, rescore with the training engine, compare
    (compare_options: clip, noise_kl_max, min_bias, clean_tol, ... of trainprobes.drift.compare)."""
    from trainprobes.reference.models.lm import TinyLM, generate, random_prompts, train_logprobs

    model = TinyLM(seed=seed) if model is None else model
    prompts = random_prompts(n_prompts, seed=seed + 1)
    ro = generate(model, prompts, max_new_tokens=max_new_tokens, temperature=scenario.temperature,
                  top_p=scenario.top_p, dtype=scenario.infer_dtype, logprobs=scenario.logprobs,
                  batch_size=infer_batch_size, seed=seed + 2)
    tl = train_logprobs(model, ro.prompts, ro.completions, ro.mask, dtype=scenario.train_dtype,
                        temperature=scenario.train_temperature)
    r = compare(tl, ro.logprobs, mask=ro.mask, alpha=alpha, target=f"tinylm: {scenario.name}",
                **compare_options)
    r.seed = seed
    r.evidence["scenario"] = {"name": scenario.name, "infer_dtype": str(scenario.infer_dtype),
                              "train_dtype": str(scenario.train_dtype),
                              "temperature": scenario.temperature, "top_p": scenario.top_p,
                              "logprobs": scenario.logprobs,
                              "train_temperature": scenario.train_temperature,
                              "expect": scenario.expect, "n_prompts": n_prompts, "max_new_tokens": max_new_tokens}
    return r


def run_demo(*, n_prompts: int = 32, max_new_tokens: int = 32, seed: int = 0, progress=None,
             **compare_options) -> list:
    """Every scenario, one Result each; progress(i, n, name) is called before each.
    compare_options go to trainprobes.drift.compare (alpha, clip, min_bias, ...)."""
    from trainprobes.reference.models.lm import TinyLM

    model = TinyLM(seed=seed)
    out = []
    for i, sc in enumerate(SCENARIOS):  # loop over scenarios
        if progress is not None:
            progress(i, len(SCENARIOS), sc.name)
        out.append(run_scenario(sc, n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed,
                                model=model, **compare_options))
    return out
