"""Finding: models that build their mask without the position ids leak across packed documents
in the training call (use_cache=False) under eager and sdpa; where their attention layers
receive the position ids, flash attention isolates the same batch: a bug.

Pinned: transformers==5.24.0, torch==2.13.0 (CPU). No downloads: tiny random models.
Run:    python scripts/zoo_findings/packed_position_ids_dropped.py                # the bugs
        python scripts/zoo_findings/packed_position_ids_dropped.py --by-design    # the others
        python scripts/zoo_findings/packed_position_ids_dropped.py opt xglm       # chosen types

How transformers separates packed documents given restarting position ids (no 2-D mask, no
cache), one path per attention implementation:
  eager / sdpa / flex   the mask: masking_utils._preprocess_mask_arguments ->
                        find_packed_sequence_indices, only if the model's forward hands
                        create_causal_mask its position_ids
  flash attention       the kernel: modeling_flash_attention_utils._flash_attention_forward ->
                        _is_packed_sequence(position_ids) -> flash_varlen_fn, only if the
                        position ids reach the attention function (the layers' **kwargs)
The call, one rule for every model: where the position ids reach the attention layers and the
model supports flash attention (`_supports_flash_attn`), packing by position ids is a feature
of the model (flash attention keeps the documents apart; DataCollatorWithFlattening's docstring
even sets `position_ids_start` for the RoBERTa family), and a mask built without them makes
eager and sdpa compute another function on the same batch: a bug, one missing argument
(`position_ids=position_ids` in create_causal_mask's call), as in
  gpt_oss, afmoe                  Llama-template RoPE models (GptOssModel / AfmoeModel.forward:
                                  mask_kwargs without "position_ids")
  opt, biogpt                     learned absolute positions (OPTModel / BioGptModel.forward).
                                  BioGPT also fills attention_mask with ones when none is given,
                                  which skips packing detection even with the position ids
                                  (OPT's forward keeps it None on purpose: its own comment)
  bert, roberta, ... (12 types)   the BERT family run as decoders (BertModel.forward, ...):
                                  fixed upstream in transformers 5.25.0
                                  (BertModel._create_attention_masks and its copies pass the
                                  position ids to the mask): from 5.25.0 on this script expects
                                  them isolated, the mask having seen the position ids
Learned absolute positions are no reason: GPT-2, GPT-Neo and GPTBigCode use them too and hand
the position ids to create_causal_mask (their packed rows are isolated; controls below).
By design (--by-design): xglm, big_bird, megatron-bert, rembert support no flash attention and
their attention modules never receive the position ids: no attention path of these models reads
documents from position ids, so packing by position ids is not offered at all (transformers'
padding-free guide: inferring boundaries from position_ids relies on the attention path; a 4-D
block mask isolates them).
This script watches _preprocess_mask_arguments (did the mask see the position ids?) and the
attention modules' inputs (did the position ids reach them?), and measures the leak: the later
documents' logits move when the first document changes.
"""
import sys

import torch
import transformers
import transformers.masking_utils as mu
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

PINNED = {"transformers": "5.24.0", "torch": "2.13.0"}   # checked again on 5.25.0
if not (transformers.__version__ == PINNED["transformers"] and torch.__version__.startswith(PINNED["torch"])):
    print(f"note: pinned {PINNED}, running transformers {transformers.__version__}, torch {torch.__version__}")
transformers.logging.set_verbosity_error()

BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=128, max_position_embeddings=256)
DECODER = dict(BASE, is_decoder=True)    # the BERT family's causal-LM heads run as decoders
CONFIGS = {
    "llama": dict(BASE, num_key_value_heads=2, head_dim=16),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256),
    "gpt_neo": dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=128, max_position_embeddings=256,
                    attention_types=[[["global", "local"], 1]]),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256),
    "gpt_oss": dict(BASE, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "afmoe": dict(BASE, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, num_dense_layers=1),
    "opt": dict(hidden_size=64, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                max_position_embeddings=256, word_embed_proj_dim=64),
    "biogpt": dict(BASE),
    "xglm": dict(d_model=64, ffn_dim=64, num_layers=2, attention_heads=4, vocab_size=128, max_position_embeddings=256),
    "big_bird": dict(DECODER, attention_type="original_full"),
    "rembert": dict(DECODER, input_embedding_size=64, output_embedding_size=64),
}
CONTROLS = ["llama", "gpt2", "gpt_neo", "gpt_bigcode"]       # the mask sees the position ids: isolated
BUGS = ["gpt_oss", "afmoe", "opt", "biogpt", "bert", "bert-generation", "camembert", "data2vec-text", "electra",
        "ernie", "roberta", "roberta-prelayernorm", "roc_bert", "xlm-roberta", "xlm-roberta-xl", "xmod"]
BY_DESIGN = ["xglm", "big_bird", "megatron-bert", "rembert"]
FIXED_IN = {mt: "5.25.0" for mt in BUGS[4:]}   # the BERT family


def fixed(model_type) -> bool:
    from packaging.version import Version
    return model_type in FIXED_IN and Version(transformers.__version__) >= Version(FIXED_IN[model_type])
LENGTHS = [10, 12, 8]


def probe(model_type):
    """(largest change of the later documents, the mask saw the position ids, the attention
    modules received them, the model supports flash attention)"""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**CONFIGS.get(model_type, DECODER)),
                                             attn_implementation="eager").eval()
    if hasattr(model, "set_default_language"):      # X-MOD: one adapter per language
        model.set_default_language(next(iter(model.config.languages)))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    x = torch.randint(0, 128, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    x2[0, :LENGTHS[0]] = (x2[0, :LENGTHS[0]] + 1) % 128       # change the first document only
    saw, reached, real = [], [], mu._preprocess_mask_arguments

    def watch(config, inputs_embeds, attention_mask, cache, position_ids, *rest, **kw):
        saw.append(position_ids is not None)
        return real(config, inputs_embeds, attention_mask, cache, position_ids, *rest, **kw)

    def attention_inputs(module, args, kwargs):
        reached.append(kwargs.get("position_ids") is not None)
    hooks = [m.register_forward_pre_hook(attention_inputs, with_kwargs=True) for m in model.modules()
             if type(m).__name__.endswith("Attention")]
    mu._preprocess_mask_arguments = watch
    try:
        with torch.no_grad():
            a = model(input_ids=x, position_ids=pos, use_cache=False).logits
            b = model(input_ids=x2, position_ids=pos, use_cache=False).logits
    finally:
        mu._preprocess_mask_arguments = real
        for h in hooks:
            h.remove()
    change = float((a[0, LENGTHS[0]:] - b[0, LENGTHS[0]:]).abs().max())
    return change, bool(saw) and all(saw), any(reached), bool(getattr(type(model), "_supports_flash_attn", False))


# a leak moves a later document's logits by 1e-3 to 1e-0 here; a mask that isolates leaves them
# bit-identical (the same arithmetic on the same tokens): any change above float32 rounding is one
LEAK = 1e-5


def call(change, saw, reached, flash) -> str:
    if saw and change == 0.0:
        return "isolated: the mask saw the position ids"
    if change > LEAK and not saw and reached and flash:
        return "bug: eager/sdpa mask without them, flash attention reads them"
    if change > LEAK and not saw and not reached and not flash:
        return "by design: no attention path reads them"
    return "UNEXPECTED"


args = [a for a in sys.argv[1:] if a != "--by-design"]
types = args or (BY_DESIGN if "--by-design" in sys.argv else BUGS)
ok = True
print(f"{'model type':22s} {'later docs move':>15s}  mask saw / attention got the position ids, flash attention: call")
for mt in CONTROLS + types:
    change, saw, reached, flash = probe(mt)
    verdict = call(change, saw, reached, flash)
    want = ("isolated" if mt in CONTROLS or fixed(mt) else "bug" if mt in BUGS else "by design" if mt in BY_DESIGN
            else verdict)
    ok &= verdict.startswith(want) and verdict != "UNEXPECTED"
    print(f"{mt:22s} {change:15.3g}  {saw!s:5} / {reached!s:5}, {flash!s:5}: {verdict}"
          + ("" if verdict.startswith(want) else f"   <- expected {want}")
          + (f"   (fixed upstream in {FIXED_IN[mt]})" if fixed(mt) else ""))
sys.exit(0 if ok else 1)   # 0: every call reproduces (or is fixed where recorded) and the controls hold
