"""Finding: MiniMax-M3's sparse-attention layers join packed documents, whatever the mask.

Pinned: transformers==5.24.0, torch==2.13.0 (CPU). No downloads: a tiny random MiniMax-M3 text
model with one sparse layer ("minimax_m3_sparse"; the default config lists none, so the
released checkpoints' sparse layers are not in a default-config test), beside the same model
with a full-attention layer as the control.
Run:    python scripts/zoo_findings/minimax_m3_sparse_indexer_packing.py

A packed row of three documents (10, 12, 8 tokens), called as training calls it
(use_cache=False) with restarting position ids and, second, with a block-diagonal 4-D mask as
well: the other documents' logits move when one document changes, the earlier documents'
too (the future leaks), while the full-attention control is exactly isolated.

The mechanism (transformers/models/minimax_m3_vl/modeling_minimax_m3_vl.py):
  1. MiniMaxM3VLIndexer.forward marks a key as future by comparing key *slots* with query
     *position ids*: `token_future = k_positions > position_ids` (k_positions =
     arange(k_len), the slot), and anchors the always-kept local blocks at
     `q_block = position_ids // block_size`, a position id used as a slot. With restarting
     position ids a query of a later document keeps the blocks of the row's *first* slots
     (another document's) and calls its own document's keys future.
  2. MiniMaxM3VLIndexer.build_block_mask intersects that selection with the document mask
     (`keep = block_keep & padding_mask`): nothing is left for those queries, and the row
     becomes `min_dtype` everywhere (`masked_fill(~keep, min_dtype)`), which softmax turns into
     uniform attention over every token of the row: other documents and the future included.
  The script counts those queries (every query of documents 2 and 3 here).
What is a bug and what is the design: with position ids equal to the slots and the same 4-D
mask, no query is left without a key and earlier documents stay exactly still (the future does
not leak), while later documents still move (0.064 here): the indexer ranks the blocks of the
whole row before the document mask is applied, which is the sparse design (DeepSeek-V4's
compressor, called by design, pools across documents alike). The script prints that control
too; the bug is the empty rows that restarting position ids make, through which the future leaks.
Call: a bug. The model opts into packed rows: MiniMaxM3VLTextModel.forward hands position_ids
to create_causal_mask (masking_utils then builds the block-diagonal mask from them) and threads
them to every layer "so the sparse layers' lightning indexer can anchor block selection to each
query's content position" (its own comment), then compares those content positions with key
slots. With one document per row (position ids = slots) the selection is right, and the file's
TODO names only left padding as a limit. A fix reads key positions from the position ids too
(per-document blocks). Until then: pack MiniMax-M3 with one document per row.
"""
import sys

import torch
import transformers
from transformers import CONFIG_MAPPING, MiniMaxM3VLForCausalLM
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

PINNED = {"transformers": "5.24.0", "torch": "2.13.0"}
if not (transformers.__version__ == PINNED["transformers"] and torch.__version__.startswith(PINNED["torch"])):
    print(f"note: pinned {PINNED}, running transformers {transformers.__version__}, torch {torch.__version__}")
transformers.logging.set_verbosity_error()


def model(layer_kind: str, implementation: str):
    torch.manual_seed(0)
    cfg = CONFIG_MAPPING["minimax_m3_vl_text"](
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2,
        layer_types=["full_attention", layer_kind], mlp_layer_types=["dense", "dense"],
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return MiniMaxM3VLForCausalLM._from_config(cfg, attn_implementation=implementation).eval()


lengths = [10, 12, 8]
L = sum(lengths)
pos = torch.cat([torch.arange(n) for n in lengths])[None]
doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
allowed = (doc[:, None] == doc[None, :]) & (torch.arange(L)[:, None] >= torch.arange(L)[None, :])
mask4d = torch.zeros(1, 1, L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
x = torch.randint(0, 128, (1, L), generator=torch.Generator().manual_seed(0))
first, last = x.clone(), x.clone()
first[0, :lengths[0]] = (first[0, :lengths[0]] + 1) % 128        # the first document changed
last[0, -lengths[-1]:] = (last[0, -lengths[-1]:] + 1) % 128       # the last document changed

masks = []   # the additive masks the sparse layer builds
real = m3.MiniMaxM3VLIndexer.build_block_mask


def watched(self, *args, **kwargs):
    out = real(self, *args, **kwargs)
    masks.append(out)
    return out


m3.MiniMaxM3VLIndexer.build_block_mask = watched


def changes(net, position_ids=pos, **kw):
    """(later documents' largest change when the first changes, earlier documents' largest
    change when the last changes)"""
    with torch.no_grad():
        a = net(input_ids=x, position_ids=position_ids, use_cache=False, **kw).logits
        b = net(input_ids=first, position_ids=position_ids, use_cache=False, **kw).logits
        c = net(input_ids=last, position_ids=position_ids, use_cache=False, **kw).logits
    return (float((a[0, lengths[0]:] - b[0, lengths[0]:]).abs().max()),
            float((a[0, :-lengths[-1]] - c[0, :-lengths[-1]]).abs().max()))


ok = True
for impl in ("sdpa", "eager"):
    sparse, full = model("minimax_m3_sparse", impl), model("full_attention", impl)
    for name, kw in (("restarting position ids", {}), ("with a block-diagonal 4-D mask", {"attention_mask": mask4d})):
        masks.clear()
        (fwd, back), (cf, cb) = changes(sparse, **kw), changes(full, **kw)
        keep = masks[0][0] == 0                                # [heads, queries, keys]: allowed
        empty = (~keep).all(-1).any(0).nonzero().flatten().tolist()
        print(f"{impl:5s} {name:31s} sparse layer: later documents move {fwd:.3g} when the first changes, "
              f"earlier ones {back:.3g} when the last changes; queries left with no key: {len(empty)} "
              f"(positions {empty[0]}..{empty[-1]}) | full-attention control: {cf:.3g}, {cb:.3g}")
        ok &= fwd > 1e-3 and back > 1e-3 and len(empty) > 0 and cf == 0.0 and cb == 0.0
    # the by-design part, apart: with position ids equal to the slots and the 4-D mask no query is
    # left without a key and the future stays out (earlier documents 0), while later documents
    # still move, since the indexer ranks the whole row's blocks before the document mask (top-k
    # selection over the row: the sparse design, like DeepSeek-V4's compressor, which is by design)
    masks.clear()
    fwd, back = changes(sparse, torch.arange(L)[None], attention_mask=mask4d)
    empty = int((masks[0][0] != 0).all(-1).any(0).sum())
    print(f"{impl:5s} {'slot position ids, 4-D mask':31s} sparse layer: later documents move {fwd:.3g} (by design: "
          f"row-wide block selection), earlier ones {back:.3g}; queries left with no key: {empty}")
    ok &= back == 0.0 and empty == 0
sys.exit(0 if ok else 1)   # 0: the finding reproduces (and the control holds)
