"""Finding: models whose forward takes position ids but never hands them to the mask leak
across packed documents in the training call (use_cache=False), unlike Llama.

Pinned: transformers==5.24.0, torch==2.13.0 (CPU). No downloads: tiny random models.
Run:    python scripts/zoo_findings/packed_position_ids_dropped.py [MODEL_TYPE ...]

transformers' masking_utils reads restarting position ids as document boundaries when there is
no cache (masking_utils._preprocess_mask_arguments -> find_packed_sequence_indices), so a
packed row with restarting position ids and no cache is isolated for Llama. The models below
take position_ids, build their mask with masking_utils (create_causal_mask), but call it
without position_ids: _preprocess_mask_arguments sees position_ids=None, packing detection
never runs, and the mask stays causal over the whole row. This script watches that function
and measures the leak: the later documents' logits move when the first document changes.
  gpt_oss  GptOssModel.forward      (models/gpt_oss/modeling_gpt_oss.py): mask_kwargs without position_ids
  afmoe    AfmoeModel.forward       (see also afmoe_packed_position_ids.py)
  llama    the control: mask_kwargs holds position_ids, isolated
Call for these two: a bug (Llama-template RoPE models; one argument missing where their
siblings pass it, and the packing support for DataCollatorWithFlattening under sdpa/eager
relies on it).
  opt, xglm, biogpt, bert, roberta, ... (with `--by-design`): learned absolute position
  embeddings; BioGptModel.forward calls create_causal_mask(config, inputs_embeds,
  attention_mask, cache), OPT and the BERT family likewise. Call: by design. Their position ids
  only index the position table and their mask code predates packed-sequence detection:
  packing by restarting position ids is not a feature of these families (a 4-D block mask
  isolates them, as the zoo map's mask_4d cells show).
"""
import sys

import torch
import transformers
import transformers.masking_utils as mu
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

PINNED = {"transformers": "5.24.0", "torch": "2.13.0"}
if not (transformers.__version__ == PINNED["transformers"] and torch.__version__.startswith(PINNED["torch"])):
    print(f"note: pinned {PINNED}, running transformers {transformers.__version__}, torch {torch.__version__}")

BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=128, max_position_embeddings=256)
CONFIGS = {
    "llama": dict(BASE, num_key_value_heads=2, head_dim=16),
    "gpt_oss": dict(BASE, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "biogpt": dict(BASE),
    "afmoe": dict(BASE, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, num_dense_layers=1),
    "opt": dict(hidden_size=64, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                max_position_embeddings=256, word_embed_proj_dim=64),
    "xglm": dict(d_model=64, ffn_dim=64, num_layers=2, attention_heads=4, vocab_size=128, max_position_embeddings=256),
}
BY_DESIGN = ["opt", "xglm", "biogpt", "bert", "roberta"]   # the encoder families run as decoders
LENGTHS = [10, 12, 8]


def probe(model_type):
    torch.manual_seed(0)
    kw = CONFIGS.get(model_type, dict(BASE, is_decoder=True))   # the BERT family: a decoder
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**kw),
                                             attn_implementation="eager").eval()
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    x = torch.randint(0, 128, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    x2[0, :LENGTHS[0]] = (x2[0, :LENGTHS[0]] + 1) % 128       # change the first document only
    seen, real = [], mu._preprocess_mask_arguments

    def watch(config, inputs_embeds, attention_mask, cache, position_ids, *rest, **kw):
        seen.append(position_ids is not None)
        return real(config, inputs_embeds, attention_mask, cache, position_ids, *rest, **kw)
    mu._preprocess_mask_arguments = watch
    try:
        with torch.no_grad():
            a = model(input_ids=x, position_ids=pos, use_cache=False).logits
            b = model(input_ids=x2, position_ids=pos, use_cache=False).logits
    finally:
        mu._preprocess_mask_arguments = real
    change = float((a[0, LENGTHS[0]:] - b[0, LENGTHS[0]:]).abs().max())
    return change, bool(seen) and all(seen)


args = [a for a in sys.argv[1:] if a != "--by-design"]
types = args or (BY_DESIGN if "--by-design" in sys.argv else ["gpt_oss", "afmoe"])
ok = True
fl, saw = probe("llama")
print(f"{'llama':8s} later documents' largest change {fl:.3g}; the mask saw the position ids: {saw} (control)")
ok &= fl == 0.0 and saw
for mt in types:
    change, saw = probe(mt)
    print(f"{mt:8s} later documents' largest change {change:.3g}; the mask saw the position ids: {saw}")
    ok &= change > 1e-3 and not saw
sys.exit(0 if ok else 1)   # 0: every finding reproduces and the control holds
