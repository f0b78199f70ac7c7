"""A zoo model called the ways a trainer packs documents, and its MoE routing decisions.

Packing conventions (`CONVENTIONS`; what a trainer hands the model for one packed row):
  position_ids           restarting position ids only, the model's default use_cache
  position_ids_no_cache  the same with use_cache=False (the training call)
  mask_4d                a block-diagonal causal mask [B, 1, L, L] (additive, with the model's
                         sliding window where every layer slides) and restarting position ids
  collator               the batch transformers' own DataCollatorWithFlattening returns for the
                         documents (input_ids, position_ids, and with return_flash_attn_kwargs
                         cu_seq_lens_q/k, max_length_q/k), passed as it is
  position_ids_ones_mask restarting position ids beside an all-ones attention_mask [B, L] (the
                         padding mask of an unpadded row, which many trainers add to a packed
                         batch), use_cache=False; masking_utils looks for packed position ids
                         only when attention_mask is None (isolation.hf.CONVENTION_NOTES)
"""
from __future__ import annotations

import copy
import inspect

import torch
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.isolation.fp64 import run_in_float64
from trainprobes.isolation.hf import sliding_window
from trainprobes.isolation.packing import Packing

__all__ = ["CONVENTIONS", "ZooPacked", "Routing", "fp64_copy"]

CONVENTIONS = ("position_ids", "position_ids_no_cache", "mask_4d", "collator", "position_ids_ones_mask")


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
    from trainprobes.zoo.shrink import all_configs
    for c in all_configs(cfg):
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
        elif self.convention == "position_ids_ones_mask":
            kw["attention_mask"] = torch.ones(tokens.shape, dtype=torch.long, device=dev)
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
    """The routing decisions of every MoE layer, captured where the model hands them on, by
    the first of these taps the model has:
      1. experts   a forward pre-hook on each module whose forward takes a routing index
                   (INDEX_ARGS: top_k_index, router_indices, ...; the experts of the
                   transformers 5 MoE blocks), with its weights (WEIGHT_ARGS);
      2. router    a forward hook on each router module (class name with Router / Gating /
                   ending in Gate) whose output holds its decisions in a known layout: a
                   dense [N, E] score with zeros where not chosen (Llama 4), or JetMoE's
                   expert-sorted (slot, token, gate, expert sizes, logits);
      3. tables    a forward pre-hook on the expert tables a MoE block indexes by routing
                   (nn.Embedding inside a *MoE module: Doge's product-key experts).
    `decisions(tokens)` -> [B, T, sum of E] float: the weight each layer gives each expert (0
    where not chosen; 1 where a tap sees the choice only), so a changed choice and a changed
    weight both show, and a float change can be told rounding noise by an fp64 twin. A
    router output in no known layout raises TargetError: never read as "no decision"."""

    def __init__(self, model):
        self.model = model
        self.experts = [m for m in model.modules() if _routing_args(m) is not None]
        self.tap = "experts"
        if not self.experts:
            self.experts, self.tap = _router_modules(model), "router"
        if not self.experts:
            self.experts, self.tap = _expert_tables(model), "tables"
        if not self.experts:
            self.tap = "none"
        # fail closed: a router module for which no tapped module receives decisions would go
        # unmeasured, and a pass over the others would say nothing of it
        routers = _router_modules(model) if self.tap == "experts" else []
        self.untapped = (f"{len(routers)} router modules but {len(self.experts)} modules receiving "
                         f"their decisions" if len(routers) > len(self.experts) else None)
        self._seen: list = []   # (module, dense [N, E], slots per token [N]) per tapped call

    @property
    def has_router(self) -> bool:
        return bool(self.experts)

    def _pre(self, module, args, kwargs):
        if self.tap == "tables":
            idx = args[0] if args else kwargs["input"]
            self._seen.append((module, _dense(idx, None, module.num_embeddings), _slots(idx, None, None)))
            return
        names = list(inspect.signature(type(module).forward).parameters)[1:]
        bound = dict(zip(names, args), **kwargs)
        idx_name, w_name = _routing_args(module)
        idx, w = bound[idx_name], bound.get(w_name) if w_name else None
        E = _n_experts(module, idx)
        self._seen.append((module, _dense(idx, w, E), _slots(idx, w, _expert_count(module))))

    def _post(self, module, args, output):
        dense = _router_output(module, output)
        self._seen.append((module, dense, (dense != 0).sum(-1)))

    def decisions(self, tokens):
        self._seen = []
        if self.tap == "router":
            hooks = [m.register_forward_hook(self._post) for m in self.experts]
        else:
            hooks = [m.register_forward_pre_hook(self._pre, with_kwargs=True) for m in self.experts]
        try:
            self.model(input_ids=tokens, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        B, T = tokens.shape
        out = []
        for module, dense, _ in self._seen:
            if dense.shape[0] != B * T:
                raise TargetError(f"{type(module).__name__} routed {dense.shape[0]} tokens of a call with "
                                  f"{B * T}: its decisions cannot be told apart by position")
            out.append(dense.reshape(B, T, -1))
        return torch.cat(out, -1)

    def kind(self, tokens) -> str:
        """The decision kind as the captured routing shows it: every token given the same
        number of experts (token choice top-k) or not (expert choice or capacity dropping),
        and an aux-loss-free bias where the router holds one."""
        if not self.experts:
            return "no router"
        self.decisions(tokens)
        counts = set()
        for _, _, slots in self._seen:
            counts |= set(slots.unique().tolist())
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


def _dense(idx, w, E: int) -> torch.Tensor:
    """[N, E'] float: w scattered at idx (ones without weights), E' = max(E, idx + 1) so an
    index past the experts (a dropped slot) stays a column of its own."""
    idx = idx.reshape(-1, idx.shape[-1]).long() if idx.dim() > 1 else idx.reshape(-1, 1).long()
    w = torch.ones_like(idx, dtype=torch.float64) if w is None else w.reshape(idx.shape)
    E = max(E, int(idx.max()) + 1) if idx.numel() else E
    return torch.zeros(idx.shape[0], E, dtype=w.dtype).scatter(1, idx, w)


def _slots(idx, w, E) -> torch.Tensor:
    """[N] routing slots each token fills: an index in [0, E) (transformers' experts loop
    drops a slot whose index is the expert count; the reference routers mark unchosen slots
    so, with a zero weight). A zero weight at an index in range is a filled slot: LongCat's
    zero-computation experts reach its experts module that way (transformers 5.25: moved to a
    dummy index in range, weight 0, their identity output added beside), and each token still
    chose top-k. Slots, not distinct experts: a random hash table sending both of a token's
    slots to expert 0 is still top-2."""
    idx = idx.reshape(-1, idx.shape[-1]) if idx.dim() > 1 else idx.reshape(-1, 1)
    real = (idx >= 0) & (idx < E) if isinstance(E, int) else torch.ones_like(idx, dtype=torch.bool)
    return real.sum(-1)


def _router_modules(model) -> list:
    """Router modules (class name with Router or Gating, or ending in Gate) that hold an
    expert count: their output carries the decisions (Llama 4, JetMoE)."""
    out = []
    for m in model.modules():
        name = type(m).__name__.lower()
        if ("router" in name or "gating" in name or name.endswith("gate")) and _router_width(m):
            out.append(m)
    return out


def _router_width(m) -> int | None:
    for name in ("num_experts", "out_features"):
        v = getattr(m, name, None)
        if isinstance(v, int) and v > 1:
            return v
    return None


def _router_output(module, output) -> torch.Tensor:
    """A router's decisions [N, E] from its output, in the layouts transformers' routers use;
    TargetError for any other (fail closed: an unread output is not 'no decision')."""
    E = _router_width(module)
    outs = output if isinstance(output, tuple) else (output,)
    # JetMoE: (slot index sorted by expert, token of each slot, gate of each slot, tokens per
    # expert, logits); the expert of the i-th sorted slot follows from the sizes
    if len(outs) >= 4 and isinstance(outs[3], (list, tuple, torch.Tensor)) and torch.is_tensor(outs[1]):
        sizes = torch.as_tensor(outs[3]).long()
        if sizes.dim() == 1 and len(sizes) == E and int(sizes.sum()) == outs[1].numel():
            N = outs[4].shape[0] if len(outs) > 4 and torch.is_tensor(outs[4]) else int(outs[1].max()) + 1
            expert = torch.repeat_interleave(torch.arange(E), sizes)
            gates = outs[2].reshape(-1).to(torch.float64)
            return torch.zeros(N, E, dtype=torch.float64).index_put_((outs[1].long(), expert), gates)
    # a dense score: zeros where not chosen (Llama 4's sigmoid of -inf outside the top-k)
    for t in outs:
        if torch.is_tensor(t) and t.is_floating_point() and t.shape[-1] == E:
            dense = t.reshape(-1, E)
            if bool(((dense == 0).sum(-1) > 0).all()):
                return dense
    raise TargetError(f"{type(module).__name__} returns {[tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in outs]}: "
                      f"no routing decision in a known layout (dense [N, {E}] with zeros, or JetMoE's)")


def _expert_tables(model) -> list:
    """The first nn.Embedding of each *MoE / *Moe module other than the token embedding:
    expert tables indexed by the routing decision (Doge's product-key experts)."""
    inputs = model.get_input_embeddings()
    out = []
    for m in model.modules():
        if "moe" in type(m).__name__.lower():
            tables = [c for c in m.children() if isinstance(c, torch.nn.Embedding) and c is not inputs]
            out += tables[:1]
    return out


def _expert_count(module) -> int | None:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(module, name, None)
        if isinstance(v, int):
            return v
    return None


def _n_experts(module, idx) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(module, name, None)
        if isinstance(v, int):
            return max(v, int(idx.max()) + 1)
    for p in module.parameters(recurse=False):
        return max(p.shape[0], int(idx.max()) + 1)
    return int(idx.max()) + 1
