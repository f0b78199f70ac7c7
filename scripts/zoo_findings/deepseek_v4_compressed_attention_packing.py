"""Finding: DeepSeek-V4's compressed attention joins packed documents, whatever the mask.

Pinned: transformers==5.24.0, torch==2.13.0 (CPU). No downloads: a tiny random DeepSeek-V4.
Run:    python scripts/zoo_findings/deepseek_v4_compressed_attention_packing.py

A packed row of three documents (10, 12, 8 tokens) with restarting position ids and, second,
with a block-diagonal 4-D mask as well (the two ways a trainer separates documents): the
later documents' logits move when the first document changes. The sliding-window branch
honours the mask; the compressed-sparse-attention branch does not see it:
DeepseekV4CSACompressor / DeepseekV4HCACompressor.forward (models/deepseek_v4/
modeling_deepseek_v4.py) pool every `compress_rate` consecutive tokens of the row into one
compressed KV entry (windows that straddle document boundaries) and mask those entries by
position alone (`causal_threshold = (position_ids + 1) // self.compress_rate`), so with
restarting position ids a token of document 2 attends to entries pooled from document 1.
Only the past leaks (no future token reaches an entry): the row stays causal, the documents
do not stay apart.
Call: by design. The compressor pools the sequence, as the paper's compressed attention does
(no per-document reset), and the entries' mask is a function of position, not of a document
mask: packing separate documents into one DeepSeek-V4 row is not supported, and nothing
refuses it. Pack with one document per row, or accept cross-document context.
"""
import sys

import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

PINNED = {"transformers": "5.24.0", "torch": "2.13.0"}
if not (transformers.__version__ == PINNED["transformers"] and torch.__version__.startswith(PINNED["torch"])):
    print(f"note: pinned {PINNED}, running transformers {transformers.__version__}, torch {torch.__version__}")

torch.manual_seed(0)
cfg = DeepseekV4Config(
    vocab_size=128, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_lora_rank=16, num_experts_per_tok=2,
    n_routed_experts=4, max_position_embeddings=256, sliding_window=8, index_head_dim=16,
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"])
model = DeepseekV4ForCausalLM(cfg).eval()

lengths = [10, 12, 8]
L = sum(lengths)
pos = torch.cat([torch.arange(n) for n in lengths])[None]
doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
allowed = (doc[:, None] == doc[None, :]) & (torch.arange(L)[:, None] >= torch.arange(L)[None, :])
mask4d = torch.zeros(1, 1, L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
x = torch.randint(0, 128, (1, L), generator=torch.Generator().manual_seed(0))
x2 = x.clone()
x2[0, :lengths[0]] = (x2[0, :lengths[0]] + 1) % 128      # change the first document only


def later_change(**kw) -> float:
    with torch.no_grad():
        a = model(input_ids=x, position_ids=pos, use_cache=False, **kw).logits
        b = model(input_ids=x2, position_ids=pos, use_cache=False, **kw).logits
    return float((a[0, lengths[0]:] - b[0, lengths[0]:]).abs().max())


by_ids, by_mask = later_change(), later_change(attention_mask=mask4d)
print(f"later documents' largest logit change when document 0 changes: restarting position ids "
      f"{by_ids:.3g}, with a block-diagonal 4-D mask too {by_mask:.3g}")
sys.exit(0 if by_ids > 1e-3 and by_mask > 1e-3 else 1)   # 0: the finding reproduces
