"""A zoo model called the ways a trainer packs documents, and its MoE routing decisions.

Packing conventions (`CONVENTIONS`; what a trainer hands the model for one packed row):
  position_ids           restarting position ids only, the model's default use_cache
  position_ids_no_cache  the same with use_cache=False (the training call)
  mask_4d                a block-diagonal causal mask [B, 1, L, L] (additive, with the model's
                         sliding window where every layer slides) and restarting position ids
  collator               the batch transformers' own DataCollatorWithFlattening returns for the
                         documents (input_ids, position_ids, and with return_flash_attn_kwargs
                         cu_seq_lens_q/k, max_length_q/k), passed as it is
"""
from __future__ import annotations

import copy
import inspect

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.isolation.hf import sliding_window
from trainprobes.zoo.fp64 import run_in_float64
from trainprobes.isolation.packing import Packing

__all__ = ["CONVENTIONS", "ZooPacked", "Routing", "fp64_copy"]

CONVENTIONS = ("position_ids", "position_ids_no_cache", "mask_4d", "collator")


def fp64_copy(model, cache: dict | None = None):
    """A float64 copy of model and the kernels swapped to get one: grouped expert matmuls
    (torch._grouped_mm refuses float64) run the eager loop over experts, and attention
    without a float64 CPU kernel (flex_attention) runs eager. With `cache` (a dict the caller
    owns, by id(model)) one copy serves every cell of a row: a row's cells only call it."""
    if cache is not None and id(model) in cache:
        return cache[id(model)]
    if cache is not None:
        cache[id(model)] = fp64_copy(model)
        return cache[id(model)]
    twin = copy.deepcopy(model).double()
    swapped = []
    cfg = twin.config
    for c in {id(c): c for c in (cfg, *(getattr(cfg, k) for k in vars(cfg)
                                        if hasattr(getattr(cfg, k), "to_dict")))}.values():
        impl = getattr(c, "_experts_implementation", None)
        if impl not in (None, "eager"):
            c._experts_implementation = "eager"
            swapped.append(f"experts: {impl} -> eager")
    if getattr(cfg, "_attn_implementation", None) == "flex_attention":
        twin.set_attn_implementation("eager")
        swapped.append("attention: flex_attention -> eager")
    # the modeling code's deliberate float32 upcasts (softmax, norms, rotary) stay float64
    return run_in_float64(twin), sorted(set(swapped))


def _masks(model, packing: Packing, dev):
    """The block-diagonal mask, or (layers of several kinds: full and sliding attention) one
    mask per layer type, as those models take attention_mask: a dict from layer type to its
    prepared mask (transformers 5: `if not isinstance(causal_mask_mapping := attention_mask,
    dict)`). Where every document fits the window one mask is exact for every layer."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    w = sliding_window(model)
    types = set(getattr(cfg, "layer_types", None) or [])
    dtype = model.dtype
    if w is None or packing.max_seqlen <= w or len(types) <= 1:
        return packing.block_mask(dtype, dev, window=None if w is None or packing.max_seqlen <= w else w)
    unknown = types - {"full_attention", "sliding_attention"}
    if unknown:
        raise InvalidArgument(f"{type(model).__name__} has layer types {sorted(types)}: a 4-D mask "
                              f"for {sorted(unknown)} is not defined here")
    return {"full_attention": packing.block_mask(dtype, dev),
            "sliding_attention": packing.block_mask(dtype, dev, window=w)}


class ZooPacked(torch.nn.Module):
    """forward(tokens, packing) -> logits [B, L, V] of `model` called by `convention`."""

    def __init__(self, model, convention: str, twins: dict | None = None):
        super().__init__()
        if convention not in CONVENTIONS:
            raise InvalidArgument(f"convention={convention!r}; expected one of {CONVENTIONS}")
        self.model, self.convention = model, convention
        self.twins = twins          # fp64 copies by id(model), shared by a row's cells
        self.substituted: list[str] = []
        self.__qualname__ = f"{type(model).__name__}[{model.config._attn_implementation},{convention}]"

    def forward(self, tokens, packing: Packing):
        dev = tokens.device
        if self.convention == "collator":
            return self.model(**_collated(tokens, packing)).logits
        kw = {"position_ids": packing.position_ids(dev)}
        if self.convention == "position_ids_no_cache":
            kw["use_cache"] = False
        elif self.convention == "mask_4d":
            kw["attention_mask"] = _masks(self.model, packing, dev)
        return self.model(input_ids=tokens, **kw).logits

    def fp64_twin(self) -> "ZooPacked":
        model, swapped = fp64_copy(self.model, self.twins)
        twin = ZooPacked(model, self.convention)
        twin.substituted = swapped
        return twin


def _collated(tokens, packing: Packing) -> dict:
    """DataCollatorWithFlattening's batch for the documents of each row, rows concatenated
    as the collator flattens its examples (one row of all documents, then reshaped)."""
    from transformers import DataCollatorWithFlattening
    coll = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
    feats = []
    for d in packing.documents:
        feats.append({"input_ids": tokens[d.row, d.start:d.start + d.length].tolist()})
    batch = coll(feats)
    B, L = tokens.shape
    out = {k: v for k, v in batch.items() if k != "labels"}
    out["input_ids"] = tokens  # the collator's ids are these, in this order; keep the dtype
    out["position_ids"] = batch["position_ids"].reshape(B, L)
    return out


class Routing:
    """The routing decisions of every MoE layer, captured where the experts receive them: a
    forward pre-hook on each module whose forward takes a routing index (INDEX_ARGS: top_k_index, router_indices, ...; the experts of the
    transformers 5 MoE blocks). `decisions(tokens)` -> [B, T, n_layers * E] float: the weight
    each layer gives each expert (0 where not chosen), so a changed choice and a changed
    weight both show, and a float change can be told rounding noise by an fp64 twin."""

    def __init__(self, model):
        self.model = model
        self.experts = [m for m in model.modules() if _routing_args(m) is not None]
        self._seen: list = []
        self._hooks = []

    @property
    def has_router(self) -> bool:
        return bool(self.experts)

    def _hook(self, module, args, kwargs):
        names = list(inspect.signature(type(module).forward).parameters)[1:]
        bound = dict(zip(names, args), **kwargs)
        idx_name, w_name = _routing_args(module)
        self._seen.append((module, bound[idx_name], bound.get(w_name) if w_name else None))

    def decisions(self, tokens):
        self._seen = []
        hooks = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self.experts]
        try:
            self.model(input_ids=tokens, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        B, T = tokens.shape
        out = []
        for module, idx, w in self._seen:
            E = _n_experts(module, idx)
            idx = idx.reshape(B * T, -1).long()
            w = torch.ones_like(idx, dtype=torch.float64) if w is None else w.reshape(B * T, -1)
            dense = torch.zeros(B * T, E, dtype=w.dtype).scatter(1, idx, w)
            out.append(dense.reshape(B, T, E))
        return torch.cat(out, -1)

    def kind(self, tokens) -> str:
        """The decision kind as the captured routing shows it: every token given the same
        number of experts (token choice top-k) or not (expert choice or capacity dropping),
        and an aux-loss-free bias where the router holds one."""
        if not self.experts:
            return "no router"
        counts = set()
        for module, idx, w in (self.decisions(tokens), self._seen)[1]:
            E = _n_experts(module, idx)
            real = (idx.reshape(-1, idx.shape[-1]) < getattr(module, "num_experts", E))
            if w is not None:
                real &= w.reshape(real.shape) != 0
            counts |= set(real.sum(-1).unique().tolist())
        routers = [m for m in self.model.modules() if "router" in type(m).__name__.lower()
                   or type(m).__name__.lower().endswith("gate")]
        bias = any(hasattr(m, "e_score_correction_bias") or hasattr(m, "expert_bias") for m in routers)
        cfg = self.model.config
        cap = any(getattr(c, "capacity_factor", None) for c in (cfg, getattr(cfg, "text_config", None)) if c)
        k = (f"token choice top-{counts.pop()}" if len(counts) == 1 else
             f"expert choice or capacity dropping ({min(counts)}-{max(counts)} experts per token)")
        if bias:
            k += ", aux-loss-free bias"
        if cap:
            k += ", capacity"
        return k


# the names transformers' expert modules give the routing decision they receive (the MoE
# blocks of transformers 5: top_k_index; GPT-OSS: router_indices; older and remote-code
# blocks: selected_experts, topk_idx / topk_ids), each with its weights' names
INDEX_ARGS = ("top_k_index", "router_indices", "selected_experts", "topk_idx", "topk_indices",
              "topk_ids", "expert_indices")
WEIGHT_ARGS = ("top_k_weights", "routing_weights", "topk_weight", "topk_weights",
               "router_weights", "expert_weights", "router_scores")
# config attributes that say a model has routed experts
MOE_CONFIG = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
              "n_experts", "expert_num")


def _routing_args(m) -> tuple[str, str | None] | None:
    """(index name, weight name or None) of the routing decision m's forward takes, or None."""
    try:
        params = inspect.signature(type(m).forward).parameters
    except (TypeError, ValueError):
        return None
    idx = next((n for n in INDEX_ARGS if n in params), None)
    if idx is None:
        return None
    return idx, next((n for n in WEIGHT_ARGS if n in params), None)


def moe_config(model) -> str | None:
    """'num_local_experts=4' where the config (or one of its sub-configs) says the model routes
    over more than one expert, else None."""
    from trainprobes.zoo.shrink import all_configs
    for c in all_configs(model.config):   # the config and every sub-config (dbrx's ffn_config)
        for name in MOE_CONFIG:
            v = getattr(c, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                return f"{name}={v}"
    return None


def _n_experts(module, idx) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(module, name, None)
        if isinstance(v, int):
            return max(v, int(idx.max()) + 1)
    for p in module.parameters(recurse=False):
        return max(p.shape[0], int(idx.max()) + 1)
    return int(idx.max()) + 1
