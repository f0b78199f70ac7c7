"""Real vLLM output, saved small by scripts/vllm_run.py, read back without vLLM.

The file holds a tiny random Llama (config and float32 weights), the prompts, and for each
sampling case (dtype x logprobs_mode x temperature) the sampled token ids with vLLM's
log-prob of each; plus greedy log-probs of 32 prompts computed alone and in one batch
(batch invariance). `judge` recomputes the log-probs with transformers, the trainer's view,
and hands both to trainprobes.drift.compare.
"""
from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from trainprobes.drift.io import Rollouts
from trainprobes.errors import DataFileError
from trainprobes.result import Result

__all__ = ["VllmSample", "SampleCase", "load_sample", "judge", "batch_invariance_figures"]


@dataclass
class SampleCase:
    name: str
    dtype: str            # vLLM's dtype: float32 or bfloat16
    logprobs_mode: str    # raw_logprobs (before temperature) or processed_logprobs (after)
    temperature: float
    rollouts: Rollouts


@dataclass
class VllmSample:
    config: dict
    weights: dict
    prompts: torch.Tensor
    cases: dict = field(default_factory=dict)       # name -> SampleCase
    batch: dict = field(default_factory=dict)       # label -> dict of [32, T] arrays
    versions: dict = field(default_factory=dict)
    path: str = ""

    def model(self, dtype: torch.dtype = torch.float32):
        """The sampled Llama, rebuilt with transformers from the saved config and weights."""
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**self.config))
        state = {k: torch.from_numpy(v) for k, v in self.weights.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if "rotary" not in k]:
            raise DataFileError(f"{self.path!r}: weights do not fit LlamaConfig (missing "
                                f"{missing[:3]}, unexpected {unexpected[:3]})")
        return model.to(dtype).eval()


def load_sample(path) -> VllmSample:
    """Read a file written by scripts/vllm_run.py (numpy .npz, never unpickled)."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise DataFileError(f"{str(path)!r} is not a readable vLLM sample (.npz): {e}") from None
    for key in ("config_json", "prompts", "cases"):
        if key not in arrays:
            raise DataFileError(f"{str(path)!r} has no {key!r}: not written by scripts/vllm_run.py")
    prompts = torch.from_numpy(arrays["prompts"].astype(np.int64))
    out = VllmSample(config=json.loads(str(arrays["config_json"])),
                     weights={k[3:]: v for k, v in arrays.items() if k.startswith("w__")},
                     prompts=prompts, versions=json.loads(str(arrays.get("versions_json", "{}"))),
                     path=str(path))
    for name in arrays["cases"].tolist():
        meta = json.loads(str(arrays[f"{name}__meta_json"]))
        ids = torch.from_numpy(arrays[f"{name}__token_ids"].astype(np.int64))
        ro = Rollouts(infer_logprobs=torch.from_numpy(arrays[f"{name}__logprobs"]),
                      mask=torch.from_numpy(arrays[f"{name}__mask"]), token_ids=ids,
                      prompt_ids=prompts.tolist(), source=f"{path}:{name}")
        out.cases[name] = SampleCase(name, meta["dtype"], meta["logprobs_mode"],
                                     float(meta["temperature"]), ro)
    for k, v in arrays.items():
        if k.startswith("bi_") and "__" in k[3:]:
            label, what = k[3:].split("__", 1)
            out.batch.setdefault(label, {})[what] = v
    return out


def judge(sample: VllmSample, case: str, *, temperature: float | None = None, model=None,
          **compare_options) -> Result:
    """vLLM's log-probs of case against transformers' recomputation of the same tokens.

    temperature: the trainer's (default 1.0 for raw_logprobs, which vLLM reports before
    temperature, and the sampling temperature for processed_logprobs, i.e. the distribution
    vLLM describes). A trainer that divides by the sampling temperature while vLLM reported
    raw log-probs is the mismatch of TRL#4159."""
    from trainprobes.drift import compare
    from trainprobes.drift.adapters import recompute_with_hf

    c = sample.cases[case]
    if temperature is None:
        temperature = c.temperature if c.logprobs_mode.startswith("processed") else 1.0
    train = recompute_with_hf(model if model is not None else sample.model(), c.rollouts,
                              temperature=temperature)
    r = compare(train, c.rollouts.infer_logprobs, mask=c.rollouts.mask,
                target=f"vllm[{case}] vs hf[fp32,T={temperature:g}]", **compare_options)
    r.evidence["case"] = {"name": case, "dtype": c.dtype, "logprobs_mode": c.logprobs_mode,
                          "sampling_temperature": c.temperature, "trainer_temperature": temperature,
                          "versions": sample.versions}
    return r


def batch_invariance_figures(sample: VllmSample, label: str) -> dict:
    """Greedy log-probs alone vs in one batch: prompts and tokens that differ bit for bit, the
    largest difference, and the first position where the greedy tokens themselves diverge."""
    b = sample.batch[label]
    a_lp, b_lp = b["alone_logprobs"].astype(np.float64), b["batch_logprobs"].astype(np.float64)
    same_ids = b["alone_ids"] == b["batch_ids"]
    # compare log-probs only up to the first diverging token of each prompt
    upto = np.cumprod(same_ids, axis=1).astype(bool)
    diff = np.where(upto, np.abs(a_lp - b_lp), 0.0)
    return {"prompts": int(a_lp.shape[0]), "tokens": int(a_lp.shape[1]),
            "prompts_bitwise_equal": int(((a_lp == b_lp) & same_ids).all(1).sum()),
            "tokens_differ": int((diff > 0).sum()), "tokens_compared": int(upto.sum()),
            "prompts_diverging_tokens": int((~same_ids).any(1).sum()),
            "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff[upto].mean())}
