"""Finding: AFMoE ignores packed position ids in the training call (use_cache=False).

Pinned: transformers==5.24.0, torch==2.13.0 (CPU). No downloads: a tiny random AFMoE.
Run:    python scripts/zoo_findings/afmoe_packed_position_ids.py

transformers' masking_utils reads restarting position ids as document boundaries when there
is no cache (masking_utils._preprocess_mask_arguments -> find_packed_sequence_indices), and
Llama-style models pass `position_ids` to create_causal_mask. AfmoeModel.forward
(transformers/models/afmoe/modeling_afmoe.py) builds mask_kwargs without "position_ids", so
the mask stays causal over the whole packed row: a document's logits change when an earlier
document's tokens change. Llama, the same call: unchanged. Call: a bug. AFMoE supports flash
attention and its attention layers receive the position ids, from which flash attention reads
the documents (modeling_flash_attention_utils._is_packed_sequence): the same batch is isolated
there and leaks under eager and sdpa, for want of one key in mask_kwargs. The rule and the
other models it covers: packed_position_ids_dropped.py.
"""
import sys

import torch
import transformers
from transformers import AfmoeConfig, AfmoeForCausalLM, LlamaConfig, LlamaForCausalLM

PINNED = {"transformers": "5.24.0", "torch": "2.13.0"}
if not (transformers.__version__ == PINNED["transformers"] and torch.__version__.startswith(PINNED["torch"])):
    print(f"note: pinned {PINNED}, running transformers {transformers.__version__}, torch {torch.__version__}")

SIZES = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256)


def cross_document_change(model) -> float:
    lengths = [10, 12, 8]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    x = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    x2[0, :10] = (x2[0, :10] + 1) % 128                  # change the first document only
    with torch.no_grad():
        a = model(input_ids=x, position_ids=pos, use_cache=False).logits
        b = model(input_ids=x2, position_ids=pos, use_cache=False).logits
    return float((a[0, 10:] - b[0, 10:]).abs().max())  # the later documents


torch.manual_seed(0)
afmoe = AfmoeForCausalLM(AfmoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32, num_dense_layers=1)).eval()
torch.manual_seed(0)
llama = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
fa, fl = cross_document_change(afmoe), cross_document_change(llama)
print("later documents' largest logit change when document 0 changes (use_cache=False):")
print(f"  afmoe {fa:.3g}   llama {fl:.3g}")
sys.exit(0 if fa > 1e-3 and fl == 0.0 else 1)  # 0: the finding reproduces
