"""Finding: Doge's mixture-of-experts router reads the future at training time.

Pinned: transformers==5.24.0, torch==2.13.0 (CPU). No downloads: a tiny random Doge, MoE on.
Run:    python scripts/zoo_findings/doge_router_mixes_tokens.py

DogeCDMoE.forward (transformers/models/doge/modeling_doge.py) computes its product-key router
logits as
    router_logits = self.router_gate(hidden_states).view(2, bsz * seq_len, -1)
router_gate returns [bsz, seq_len, 2 * num_keys]; viewing that as [2, bsz * seq_len, ...]
splits the flattened token axis in two instead of the last axis, so the "x" keys of the first
half of the tokens and the "y" keys of every token come from other tokens' logits, later ones
included. The experts token t gets then depend on tokens after t: in training (a full
forward) the router sees the future, at generation (one token at a time) it does not.
Call: a bug that transformers keeps on purpose. The file's own comment: "this split mixes
router logits across tokens, so routing is not causal in a full forward pass (token-by-token
generation is unaffected). It is kept as-is so existing checkpoints give the same outputs."
The released Doge checkpoints were trained with this router, so the fix (the split over the
last axis, router_gate(hidden_states).view(bsz * seq_len, 2, -1)) would change their outputs;
the product-key token-choice top-k router it implements is causal by design. Whoever trains or
fine-tunes Doge with MoE on trains a router that reads the future (and other rows of the
batch), which generation never shows it.
"""
import sys

import torch
import transformers
from transformers import DogeConfig, DogeForCausalLM

PINNED = {"transformers": "5.24.0", "torch": "2.13.0"}
if not (transformers.__version__ == PINNED["transformers"] and torch.__version__.startswith(PINNED["torch"])):
    print(f"note: pinned {PINNED}, running transformers {transformers.__version__}, torch {torch.__version__}")

torch.manual_seed(0)
cfg = DogeConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, is_moe=True,
                 num_experts=4, num_experts_per_tok=2)
model = DogeForCausalLM(cfg).eval()
chosen = []     # the expert indices each MoE layer's expert table is looked up with: [B * T, k]
for layer in model.model.layers:
    layer.mlp.down_embed.register_forward_pre_hook(lambda m, args: chosen.append(args[0].clone()))


def experts_of(x):
    chosen.clear()
    with torch.no_grad():
        model(input_ids=x, use_cache=False)
    return [c.reshape(x.shape[0], x.shape[1], -1).sort(-1).values for c in chosen]


T, cut = 32, 15
x = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(0))
future = x.clone()
future[0, cut + 1:] = torch.randint(0, 128, (T - cut - 1,), generator=torch.Generator().manual_seed(1))
before, after = experts_of(x), experts_of(future)
# tokens 0..cut are identical in both inputs: a causal router gives them the same experts
moved = [int((a[0, :cut + 1] != b[0, :cut + 1]).any(-1).sum()) for a, b in zip(before, after)]
print(f"tokens 0..{cut} unchanged, tokens {cut + 1}..{T - 1} replaced; tokens among 0..{cut} whose "
      f"experts changed, per MoE layer: {moved}")

# the same mixing crosses packed documents, whatever the mask: three documents in one row, a
# block-diagonal 4-D mask, the first document changed, the later ones' logits watched
lengths = [10, 12, 8]
L = sum(lengths)
doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
allowed = (doc[:, None] == doc[None, :]) & (torch.arange(L)[:, None] >= torch.arange(L)[None, :])
mask4d = torch.zeros(1, 1, L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
pos = torch.cat([torch.arange(n) for n in lengths])[None]
y = torch.randint(0, 128, (1, L), generator=torch.Generator().manual_seed(2))
y2 = y.clone()
y2[0, :lengths[0]] = (y2[0, :lengths[0]] + 1) % 128
with torch.no_grad():
    a = model(input_ids=y, attention_mask=mask4d, position_ids=pos, use_cache=False).logits
    b = model(input_ids=y2, attention_mask=mask4d, position_ids=pos, use_cache=False).logits
cross = float((a[0, lengths[0]:] - b[0, lengths[0]:]).abs().max())
print(f"packed row, block-diagonal 4-D mask: later documents' largest logit change when document 0 "
      f"changes {cross:.3g}")
sys.exit(0 if moved[0] > 0 and cross > 1e-3 else 1)   # 0: the finding reproduces
