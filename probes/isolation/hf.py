"""Real transformers models as packed-document targets, built from tiny random configs (no
downloads), and the table of which attention implementation x packing convention leaks.

Conventions (what a trainer hands the model for one packed row; `PackedModel.CONVENTIONS`):
  flattening           DataCollatorWithFlattening's batch (input_ids, position_ids restarting
                       per document, cu_seq_lens_q/k and max_length_q/k), the model's default
                       use_cache. transformers builds a packed mask from the position ids only
                       when there is no cache (masking_utils._preprocess_mask_arguments), and
                       a causal LM makes a DynamicCache unless use_cache=False.
  flattening_no_cache  the same with use_cache=False (how training loops call the model).
  mask_4d              an explicit block-diagonal causal mask [B, 1, L, L], additive (0 /
                       finfo.min) in the model's dtype, with the restarting position ids; for
                       flex_attention a BlockMask of the same blocks (a tensor mask under CPU
                       flex_attention aborts the process in torch 2.13: double free).
  mask_4d_bool         the same mask as booleans (True = attend). eager attention adds the
                       mask to the scores, so True/False become +1/+0 and nothing is masked.
  position_ids_ones_mask  restarting position ids beside an all-ones attention_mask [B, L] (the
                       padding mask of a row without padding, which many trainers add to a
                       packed batch), use_cache=False. masking_utils looks for packed position
                       ids only "if the 2D attention mask is explicitly None"
                       (_preprocess_mask_arguments): the row is one sequence under eager, sdpa
                       and flex. flash attention drops an all-ones mask (flash_attention_mask)
                       and reads the documents from the position ids.
`design_verdict(implementation, convention)` is what the mechanism says each should give, and
CONVENTION_NOTES what a user should pass instead of a convention that leaks.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.isolation.fp64 import run_in_float64
from trainprobes.isolation.packing import Packing
from trainprobes.validation import check_choice

__all__ = ["FAMILIES", "IMPLEMENTATIONS", "CONVENTIONS", "CONVENTION_NOTES", "design_verdict", "tiny_model",
           "PackedModel", "sliding_window", "available_implementations", "packed_table", "TableRow"]

# family: (config class, model class, extra config): hidden 32, 2 layers, vocab 128 below
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # a window shorter than the documents, so the sliding-window mask is exercised
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    # grouped expert matmuls sized by tokens per expert: other documents move the arithmetic
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1}),
}
IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2")
CONVENTIONS = ("flattening", "flattening_no_cache", "mask_4d", "mask_4d_bool", "position_ids_ones_mask")
VOCAB = 128
# what to pass instead, for the conventions that leak by the library's design
CONVENTION_NOTES = {
    "flattening": "transformers reads packed position ids only without a cache "
                  "(masking_utils._preprocess_mask_arguments) and a causal LM makes a DynamicCache unless "
                  "use_cache=False: pass use_cache=False when training",
    "mask_4d_bool": "eager attention adds a 4-D mask to the scores, so True/False become +1/+0: pass the mask "
                    "additive (0 / finfo.min) in the model's dtype",
    "position_ids_ones_mask": "masking_utils._preprocess_mask_arguments looks for packed position ids only when "
                              "attention_mask is None: with packed position ids pass attention_mask=None (and "
                              "use_cache=False), or a 4-D block-diagonal mask; a 2-D mask cannot carry document "
                              "boundaries",
}


def design_verdict(implementation: str, convention: str, rows: int = 1) -> str | None:
    """'isolated' or 'leaky' as transformers' mechanism makes a tiny family of FAMILIES under
    this call on `rows` packed rows, or None where it is not known: a 4-D block mask and the
    training call (no cache) with restarting position ids isolate everywhere; flash_attention_2
    reads the documents from cu_seq_lens whatever the cache, and from the position ids where
    an all-ones mask is dropped, for one row only (_is_packed_sequence: batch_size == 1); the
    cached call and the all-ones mask leak on the mask path (eager, sdpa, flex); eager adds a
    boolean mask (leaks), sdpa applies it."""
    if convention in ("mask_4d", "flattening_no_cache"):
        return "isolated"
    if implementation == "flash_attention_2":
        if convention == "position_ids_ones_mask":
            return "isolated" if rows == 1 else "leaky"
        return "isolated" if convention == "flattening" else None
    if convention in ("flattening", "position_ids_ones_mask"):
        return "leaky"
    if convention == "mask_4d_bool":
        return {"eager": "leaky", "sdpa": "isolated"}.get(implementation)
    return None


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("the HF isolation targets need transformers: pip install "
                          "'trainprobes[hf]'") from None
    return transformers


def available_implementations() -> list[str]:
    """The attention implementations this machine can run: eager and sdpa always,
    flex_attention where torch has it, flash_attention_2 only with CUDA and flash_attn."""
    out = ["eager", "sdpa"]
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
        out.append("flex_attention")
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        out.append("flash_attention_2")
    return out


def tiny_model(family: str, attn_implementation: str = "sdpa", *, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str = "cpu", **overrides):
    """A random causal LM of `family` (hidden 32, 2 layers, 4 heads, 2 KV heads, vocab 128),
    in eval mode, built without any download (the weights drawn on the CPU from seed)."""
    check_choice(family, "family", FAMILIES)
    check_choice(attn_implementation, "attn_implementation", IMPLEMENTATIONS)
    tf = _transformers()
    cfg_name, model_name, extra = FAMILIES[family]
    cfg = getattr(tf, cfg_name)(**{
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 512, **extra, **overrides})
    cfg._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(tf, model_name)(cfg)
    return model.to(dtype=dtype, device=device).eval()


def sliding_window(model) -> int | None:
    """The model's sliding window (Mistral), which a correct 4-D mask keeps too; None where
    no layer slides (Qwen2 keeps sliding_window=0 beside use_sliding_window=False). Read from
    the text config of a composite model."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    w = getattr(cfg, "sliding_window", None)
    if not w or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(w)


class PackedModel(torch.nn.Module):
    """A HF causal LM called on packed rows the way `convention` says: forward(tokens,
    packing) -> logits [B, L, V]. An nn.Module, so the isolation probe's fp64 twin is a
    float64 deep copy that keeps the convention."""

    CONVENTIONS = CONVENTIONS

    def __init__(self, model, convention: str):
        super().__init__()
        check_choice(convention, "convention", CONVENTIONS)
        self.model, self.convention = model, convention
        self.substituted: list[str] = []  # kernels swapped in an fp64 twin (fp64_twin)
        self.__qualname__ = f"{type(model).__name__}[{self.implementation},{convention}]"

    @property
    def window(self) -> int | None:
        return sliding_window(self.model)

    def _flex_window(self, packing: Packing) -> int | None:
        w = self.window
        if w is None or packing.max_seqlen <= w:
            return None
        types = set(getattr(self.model.config, "layer_types", None) or [])
        if len(types) > 1:
            raise InvalidArgument(f"{type(self.model).__name__} mixes layer types {sorted(types)}: one "
                                  f"BlockMask cannot give each its own window; use documents of at "
                                  f"most {w} tokens, or convention mask_4d (a mask per layer type)")
        return w

    def _mask(self, packing: Packing, dtype, dev):
        """The 4-D mask: where every document fits the sliding window the window cuts nothing
        and one block mask is exact for every layer; otherwise a model mixing full and
        sliding layers takes one mask per layer type (attention_mask as a dict, transformers
        5), and one with other layer kinds is refused."""
        w = self.window
        if w is not None and packing.max_seqlen <= w:
            return packing.block_mask(dtype, dev)
        types = set(getattr(self.model.config, "layer_types", None) or [])
        if w is None or len(types) <= 1:
            return packing.block_mask(dtype, dev, window=w)
        if types - {"full_attention", "sliding_attention"}:
            raise InvalidArgument(f"{type(self.model).__name__} has layer types {sorted(types)}: "
                                  f"one 4-D mask per kind is defined only for full and sliding "
                                  f"attention; documents of at most {w} tokens take one mask")
        return {"full_attention": packing.block_mask(dtype, dev),
                "sliding_attention": packing.block_mask(dtype, dev, window=w)}

    @property
    def implementation(self) -> str:
        return self.model.config._attn_implementation

    def forward(self, tokens: torch.Tensor, packing: Packing) -> torch.Tensor:
        dev = tokens.device
        kw = {"position_ids": packing.position_ids(dev)}
        if self.convention.startswith("flattening"):
            kw.update(_flash_kwargs(packing, dev))
            if self.convention == "flattening_no_cache":
                kw["use_cache"] = False
        elif self.convention == "position_ids_ones_mask":
            kw["attention_mask"] = torch.ones(tokens.shape, dtype=torch.long, device=dev)
            kw["use_cache"] = False
        elif self.implementation == "flex_attention":
            if self.convention == "mask_4d_bool":
                raise InvalidArgument("flex_attention takes a BlockMask, not a boolean tensor: "
                                      "use convention 'mask_4d'")
            kw["attention_mask"] = _flex_block_mask(packing, dev, self._flex_window(packing))
        else:
            dtype = torch.bool if self.convention == "mask_4d_bool" else self.model.dtype
            kw["attention_mask"] = self._mask(packing, dtype, dev)
        return self.model(input_ids=tokens, **kw).logits


    def fp64_twin(self) -> "PackedModel":
        """A float64 copy calling the model the same way. Kernels without float64 on this
        device are swapped for the eager path of the same function, and named in
        `substituted` (the isolation probe then lets the twin settle only changes within
        rounding noise): flex_attention on the CPU (fp32/fp16/bf16 only in torch 2.13), and
        grouped expert matmuls (torch._grouped_mm refuses float64). Float64 inside too:
        trainprobes.isolation.fp64.run_in_float64."""
        import copy

        model = copy.deepcopy(self.model).double()
        substituted = []
        convention = self.convention
        cfg = model.config
        if self.implementation == "flex_attention" and model.device.type == "cpu":
            model.set_attn_implementation("eager")
            substituted.append("attention: flex_attention -> eager")
        if self.implementation == "flash_attention_2":  # fp16/bf16 kernels only
            # varlen attention over cu_seq_lens is block-diagonal causal whether or not a
            # cache is made; sdpa under the flattening call with a cache is causal over the
            # row, another function (refused, so noise would stay unverified): the twin
            # takes the explicit mask of what flash_attention_2 computes
            model.set_attn_implementation("sdpa")
            convention = "mask_4d"
            substituted.append("attention: flash_attention_2 -> sdpa, block-diagonal mask")
        experts = getattr(cfg, "_experts_implementation", None)
        if experts not in (None, "eager"):
            cfg._experts_implementation = "eager"
            substituted.append(f"experts: {experts} -> eager")
        # the modeling code's deliberate float32 upcasts (softmax, norms, rotary) stay float64
        twin = PackedModel(run_in_float64(model), convention)
        twin.substituted = substituted
        return twin


def _flash_kwargs(packing: Packing, device) -> dict:
    """What DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds to the batch."""
    cu = packing.cu_seqlens(device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": packing.max_seqlen,
            "max_length_k": packing.max_seqlen}


def _flex_block_mask(packing: Packing, device, window: int | None):
    from torch.nn.attention.flex_attention import create_block_mask

    ids = packing.doc_ids(device)
    w = packing.length if window is None else window

    def same_document_causal(b, h, q, kv):
        return (ids[b, q] == ids[b, kv]) & (kv <= q) & (q - kv < w)

    L = packing.length
    return create_block_mask(same_document_causal, packing.batch, None, L, L, device=str(device))


@dataclass(frozen=True)
class TableRow:
    family: str
    implementation: str
    convention: str
    result: object          # trainprobes.result.Result of the documents probe
    by_hand: float          # largest change of later documents when the first one changes


def by_hand(model: PackedModel, tokens: torch.Tensor, packing: Packing, seed: int = 0) -> float:
    """The check a user would write: change every token of the first document, take the
    largest change of every later document's logits (no classification)."""
    g = torch.Generator().manual_seed(seed + 1)
    first = packing.lengths[0][0]
    x2 = tokens.clone()
    shift = torch.randint(1, VOCAB, x2[:, :first].shape, generator=g).to(x2.device)
    x2[:, :first] = (x2[:, :first] + shift) % VOCAB
    with torch.no_grad():
        a, b = model(tokens, packing), model(x2, packing)
    return float((a[:, first:] - b[:, first:]).abs().max())


def packed_table(families=tuple(FAMILIES), implementations=None, conventions=CONVENTIONS, *,
                 lengths=(10, 12, 8), seed: int = 0, causal: bool = False, device: str = "cpu",
                 progress=None) -> list[TableRow]:
    """The documents probe on every family x implementation x convention available here,
    beside the by-hand check, in fp32 (bf16 for flash_attention_2, which has no fp32
    kernel). Combinations that cannot run (a boolean mask for flex_attention) are left out.
    progress(done, total, case) is called before each case."""
    from trainprobes.isolation.documents import documents

    impls = available_implementations() if implementations is None else list(implementations)
    packing = Packing.of(list(lengths))
    tokens = torch.randint(0, VOCAB, (1, packing.length),
                           generator=torch.Generator().manual_seed(seed)).to(device)
    total = sum(not (impl == "flex_attention" and conv == "mask_4d_bool")
                for impl in impls for conv in conventions) * len(families)
    rows = []
    for family in families:
        for impl in impls:
            dtype = torch.bfloat16 if impl == "flash_attention_2" else torch.float32
            base = tiny_model(family, impl, seed=seed, dtype=dtype, device=device)
            for conv in conventions:
                if impl == "flex_attention" and conv == "mask_4d_bool":
                    continue
                if progress is not None:
                    progress(len(rows), total, f"{family} {impl} {conv}")
                model = PackedModel(base, conv)
                name = f"{family}[{impl},{conv}]"
                res = documents(model, tokens, packing, seed=seed, vocab=VOCAB, causal=causal,
                                output=None, target=name)
                rows.append(TableRow(family, impl, conv, res, by_hand(model, tokens, packing, seed)))
    return rows
