"""Tiny configs for every registered transformers causal LM: `shrink(config)`.

A config is shrunk by its own size attributes, whatever each model calls them (hidden_size,
d_model, n_embd, ...), the nested sub-configs included (text_config of multimodal-style
configs, per-block configs); per-layer lists (layer_types, hybrid patterns) are cut to the new
depth, keeping every kind of layer the full model has where a few layers can hold them. The
shrunk model is first built on the meta device, where no parameter storage is allocated, and
its parameters counted: a model still above `max_params` is refused, named with its largest
tensor, before anything is allocated. A model that cannot be shrunk, built or run is a
`Failure` with the reason (exception type and first line), never skipped silently.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.zoo import layers
from trainprobes.zoo.layers import MAX_LAYERS, layer_count

__all__ = ["shrink", "build", "survey", "Built", "Failure", "causal_lm_types", "SIZES", "MAX_PARAMS", "all_configs",
           "count_params"]

MAX_PARAMS = 5_000_000  # a tiny model; the largest shrunk zoo model is far below
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, WINDOW, STATE = 64, 4, 2, 16, 64, 128, 8, 8

# attribute name -> size: every name a registered config uses for that size (transformers 5.24)
SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "dim", "embed_dim", "model_dim",
                     "word_embed_proj_dim", "hidden_dim", "embedding_size", "emb_dim"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                     "decoder_attention_heads", "num_q_heads", "global_num_attention_heads",
                     "linear_num_value_heads", "linear_num_key_heads", "swa_num_attention_heads",
                     "num_attention_heads_per_layer"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                     "n_head_kv", "num_kv_groups", "global_num_key_value_heads",
                     "swa_num_key_value_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "head_size", "qk_rope_head_dim",
                     "qk_nope_head_dim", "v_head_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "global_head_dim", "qk_head_dim", "index_head_dim", "swa_head_dim",
                     "rope_head_dim", "nope_head_dim", "attn_head_dim"), HEAD_DIM),
    **dict.fromkeys(("rotary_dim", "rotary_emb_dim"), 8),
    **dict.fromkeys(("vocab_size_per_layer_input", "shape_vocab_size", "pronunciation_vocab_size",
                     "type_vocab_size_extra"), VOCAB),
    **dict.fromkeys(("hidden_size_per_layer_input", "lru_width", "attention_dim", "audio_hidden_size",
                     "expert_ffn_hidden_size", "zero_expert_num", "num_kv_shared_layers"), 0),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "o_lora_rank", "time_decay_rank",
                     "rank", "lora_rank"), 16),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff",
                     "moe_intermediate_size", "shared_expert_intermediate_size", "expert_dim",
                     "moe_ffn_hidden_size", "dense_intermediate_size", "shared_intermediate_size",
                     "mlp_hidden_size", "expert_hidden_size", "intermediate_size_mlp",
                     "ffn_intermediate_size", "decoder_ffn_dim", "moe_shared_expert_intermediate_size",
                     "linear_intermediate_size", "inner_hidden_size", "hidden_act_dim"), FFN),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts", "n_experts", "expert_num"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_k", "num_selected_experts", "moe_topk",
                     "top_k", "experts_per_token", "num_experts_per_token", "moe_top_k", "top_k_experts"), 2),
    # group-limited routing (DeepSeek-V3: 8 groups, 4 kept) kept as a mechanism: 2 groups of 2
    # of the 4 experts, 1 kept, so a token's group choice still decides its experts (one
    # group would make the group step select everything)
    **dict.fromkeys(("n_group", "num_expert_group", "moe_n_group"), 2), "topk_group": 1,
    **dict.fromkeys(("n_groups", "mamba_n_groups", "mamba_ngroups"), 1),   # SSM groups divide the heads
    **dict.fromkeys(("vocab_size", "text_vocab_size", "unpadded_vocab_size"), VOCAB),
    # every mechanism counted in positions, below the probes' documents (10, 12 tokens) so the
    # tiny model still has it: sliding windows, Llama 4's attention chunks, ModernBERT's local
    # attention, recurrent_gemma's local window, Doge's dynamic-mask window, and the tokens a
    # DeepSeek sparse-attention indexer selects (index_topk 2048 of 30 tokens selects them all)
    **dict.fromkeys(("sliding_window", "attention_window", "local_window_size", "window_size",
                     "sliding_window_size", "swa_window_size", "local_attention_window",
                     "attention_chunk_size", "local_attention", "attention_window_size",
                     "keep_window_size", "local_attention_window_len", "index_topk",
                     # DeepSeek-V4: tokens pooled into one compressed KV entry, per layer kind
                     # (128 for its heavily compressed layers: no entry in a 30-token row)
                     "compress_rates"), WINDOW),
    # MiniMax-M3's block-sparse indexer: blocks of 4 keys, 2 of them kept per query
    "index_block_size": 4, "index_topk_blocks": 2,
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size", "d_state", "mamba_state_dim",
                     "linear_state_size"), STATE),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "ssm_num_heads", "linear_num_heads"), 4),
    **dict.fromkeys(("mamba_head_dim", "ssm_head_dim", "mamba_d_head"), 16),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank", "dt_rank"), 4),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                     "max_sequence_length", "n_ctx", "original_max_position_embeddings"), 256),
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id",
              "decoder_start_token_id", "mask_token_id", "unk_token_id")


@dataclass
class Built:
    model_type: str
    model: object                 # the tiny model, float32, eval mode, on the CPU
    config: object
    n_params: int
    changed: dict = field(default_factory=dict)   # attribute -> (full, shrunk)

    @property
    def not_probed(self) -> str | None:
        """The layer kinds the modeling file names that the tiny model lacks, with why."""
        gaps = [f"{k[:-len(layers.NOT_PROBED)]}{why}" for k, (_, why) in self.changed.items()
                if k.endswith(layers.NOT_PROBED)]
        return "; ".join(gaps) or None


@dataclass(frozen=True)
class Failure:
    model_type: str
    stage: str                    # "config", "shrink", "meta", "build", "forward"
    reason: str                   # exception type and first line

    @classmethod
    def of(cls, model_type, stage, e: BaseException) -> "Failure":
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return cls(model_type, stage, f"{type(e).__name__}: {first}")


def causal_lm_types() -> list[str]:
    """Every model type transformers registers for AutoModelForCausalLM, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check_model_type(model_type: str, what: str = "--model") -> str:
    """model_type if transformers registers it for AutoModelForCausalLM, else InvalidArgument
    (exit 2) naming the close ones: a typo is refused, never measured as a row that fails."""
    types = causal_lm_types()
    if model_type not in types:
        import difflib

        from trainprobes.errors import InvalidArgument
        close = difflib.get_close_matches(model_type, types, n=5, cutoff=0.5)
        raise InvalidArgument(f"{what} {model_type!r} is not a causal-LM model type of this "
                              f"transformers ({len(types)} registered)"
                              + (f"; close: {', '.join(close)}" if close else ""))
    return model_type


# (expand, heads, head dim) of a Mamba-2 mixer: the config checks heads * head dim == expand *
# hidden (bamba, falcon_h1, nemotron_h, mamba2, zamba2, granitemoehybrid)
_MAMBA_HEADS = (("mamba_expand", "mamba_n_heads", "mamba_d_head"), ("expand", "mamba_num_heads", "mamba_head_dim"),
                ("expand", "num_heads", "head_dim"), ("mamba_expand", "n_mamba_heads", "mamba_headdim"))


_UNSET_MOE = ("n_routed_experts", "num_experts_per_tok")
_MOE_SWITCHES = ("is_moe", "enable_moe_block")


def _hidden_name(d) -> str:
    return next((k for k in ("hidden_size", "d_model") if isinstance(d.get(k), int)), "hidden_size")


def _min_depth(cfg) -> int:
    """The depth a layer pattern set by a step needs to show both of its kinds (a MoE layer
    every k-th layer: k + 1 layers), at most MAX_LAYERS."""
    n = 2
    for name in ("full_attn_every", "decoder_sparse_step", "global_attn_every_n_layers", "moe_layer_freq"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and 1 < v < MAX_LAYERS:
            n = max(n, v + 1)
    return n


def _shrink_one(cfg, changed: dict, prefix: str = "") -> None:
    """Shrink cfg in place by the names in SIZES, its depth and its per-layer lists."""
    d = vars(cfg)
    unset = _UNSET_MOE
    for switch in _MOE_SWITCHES:   # a type whose MoE variant is a flag (doge, gemma4): the router on
        if d.get(switch) is False:
            setattr(cfg, switch, True)
            changed[prefix + switch] = (False, True)
            unset = _UNSET_MOE + ("num_experts", "top_k_experts", "moe_intermediate_size")
    for name, size in SIZES.items():
        v = d.get(name)
        if size == 0:  # sizes that follow from others: a small fixed value, or none at all
            size = {"hidden_size_per_layer_input": 16, "lru_width": HIDDEN, "attention_dim": HIDDEN,
                    "audio_hidden_size": HIDDEN, "expert_ffn_hidden_size": FFN,
                    "zero_expert_num": 2, "num_kv_shared_layers": 0}[name]
        if v is None and name in d and name in unset:
            # a MoE type whose default leaves its expert counts unset (deepseek_v2, dots1):
            # the modeling file builds its routed layers from them all the same
            setattr(cfg, name, size)
            changed[prefix + name] = (None, size)
        elif isinstance(v, int) and not isinstance(v, bool) and v > size:
            if name in ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                        "n_head_kv") and v == 1:
                continue
            setattr(cfg, name, size)
            changed[prefix + name] = (v, size)
        elif isinstance(v, list) and v and all(isinstance(e, int) and not isinstance(e, bool) for e in v) \
                and max(v) > size:   # a size per layer (gemma3n's intermediate_size)
            setattr(cfg, name, [min(e, size) for e in v])
            changed[prefix + name] = (f"per layer, up to {max(v)}", f"per layer, up to {size}")
        elif isinstance(v, dict) and v and all(isinstance(e, int) and not isinstance(e, bool) for e in v.values()) \
                and max(v.values()) > size:   # a size per layer kind (DeepSeek-V4's compress_rates)
            setattr(cfg, name, {k: min(e, size) for k, e in v.items()})
            changed[prefix + name] = (dict(v), dict(getattr(cfg, name)))
    lname, full = layer_count(cfg)
    if lname is not None and full > 2:
        keep = layers.plan(cfg, full)
        for i in range(full):      # a depth a step pattern needs, filled with the first layers
            if len(keep) >= min(_min_depth(cfg), full):
                break
            keep = sorted(set(keep) | {i})
        n = len(keep)
        layers.apply(cfg, full, keep, changed, prefix)
        try:
            setattr(cfg, lname, n)
        except NotImplementedError:  # an alias of other depths (prophetnet): set those
            for alt in ("num_encoder_layers", "num_decoder_layers", "encoder_layers", "decoder_layers"):
                if isinstance(d.get(alt), int):
                    setattr(cfg, alt, min(d[alt], n))
        changed[prefix + lname] = (full, n)
        for key in ("first_k_dense_replace", "num_dense_layers", "first_dense_layers"):
            if isinstance(d.get(key), int) and d[key] >= n:
                setattr(cfg, key, n - 1)   # keep at least one MoE layer
                changed[prefix + key] = (d[key], n - 1)
    vocab = d.get("vocab_size")
    if isinstance(vocab, int):
        for key in _TOKEN_IDS:
            v = d.get(key)
            if isinstance(v, int) and v >= vocab:
                setattr(cfg, key, vocab - 1)
            elif isinstance(v, list):
                setattr(cfg, key, [min(t, vocab - 1) for t in v])
    for key, v in list(d.items()):  # hybrid patterns by period: one of each kind in 2 layers
        if key.endswith("_period") and isinstance(v, int) and not isinstance(v, bool) and v > 2:
            setattr(cfg, key, 2)
            changed[prefix + key] = (v, 2)
            off = key.replace("_period", "_offset")
            if isinstance(d.get(off), int):
                changed[prefix + off] = (d[off], 1)
                setattr(cfg, off, 1)
    if "head_dim" in d and d["head_dim"] is None and isinstance(d.get("num_attention_heads"), int) \
            and isinstance(d.get("hidden_size"), int):
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads  # the model would derive it
    for expand, heads, head in _MAMBA_HEADS:   # Mamba-2 heads tile expand * hidden exactly
        if all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) for k in (expand, heads)) \
                and head in d and isinstance(d.get(_hidden_name(d)), int):
            inner = d[expand] * d[_hidden_name(d)]
            if isinstance(d.get("mamba_d_ssm"), int):
                inner = d["mamba_d_ssm"] = min(d["mamba_d_ssm"], inner)
            if inner % d[heads] == 0:
                setattr(cfg, head, inner // d[heads])
    if isinstance(d.get("kv_lora_rank"), int) and isinstance(d.get("num_key_value_heads"), int):
        # latent attention expands the compressed KV to every query head
        cfg.num_key_value_heads = cfg.num_attention_heads
    if all(isinstance(d.get(k), int) for k in ("qk_nope_head_dim", "qk_rope_head_dim")) and "qk_head_dim" in d:
        cfg.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim  # derived at __init__
    for key, v in list(d.items()):  # nested configs: text_config, vision_config, mamba_config, ...
        if hasattr(v, "to_dict") and hasattr(v, "model_type") and key != "_parent":
            _shrink_one(v, changed, f"{prefix}{key}.")
        elif isinstance(v, dict) and key.endswith("_config") and v:
            for name, size in SIZES.items():
                if isinstance(v.get(name), int) and not isinstance(v[name], bool) and v[name] > size:
                    changed[f"{prefix}{key}.{name}"] = (v[name], size)
                    v[name] = size


def shrink(config, *, widen: bool = True):
    """A shrunk deep copy of a transformers config (or a model type's default config, given
    its name): every size it names made tiny (hidden 64, 4 heads, 2 KV heads, head dim 16,
    FFN 64, 4 experts choosing 2, 2-6 layers, vocabulary 128, windows 8, Mamba state 8), and
    (widen) one layer of every attention kind its modeling file names (layers.widen).
    Returns (config, changed): changed maps attribute -> (full, shrunk)."""
    if isinstance(config, str):
        from transformers import CONFIG_MAPPING
        if config not in CONFIG_MAPPING:
            raise InvalidArgument(f"model type {config!r} is not registered with transformers")
        config = CONFIG_MAPPING[config]()
    cfg = copy.deepcopy(config)
    changed: dict = {}
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    for c in all_configs(cfg):   # a default holding one kind of a hybrid: one layer of each
        if widen and getattr(c, "model_type", None) in names:
            layers.widen(c, c.model_type, changed, "" if c is cfg else f"{_path(cfg, c)}.")
    before = {id(c): layers.kinds(c) for c in all_configs(cfg)}
    paths = {id(c): _path(cfg, c) for c in all_configs(cfg)}
    _shrink_one(cfg, changed)
    out = _rederived(cfg)
    after = {paths[id(c)]: layers.kinds(c2) for c, c2 in zip(all_configs(cfg), all_configs(out))}
    lost = [f"{paths[k] + '.' if paths[k] else ''}{f}: {sorted(v - after[paths[k]].get(f, frozenset()))}"
            for k, ks in before.items() for f, v in ks.items()
            if f not in SIZES and v - after[paths[k]].get(f, frozenset())]
    if lost:  # refused, never built without a kind of layer the model has
        raise InvalidArgument(f"shrinking would drop layer kinds ({'; '.join(lost)})")
    return out, changed


def all_configs(cfg) -> list:
    """cfg and its nested sub-configs, depth first, in attribute order."""
    out = [cfg]
    for k, v in vars(cfg).items():
        if hasattr(v, "to_dict") and hasattr(v, "model_type") and k != "_parent":
            out += all_configs(v)
    return out


def _path(root, c, prefix="") -> str:
    if c is root:
        return prefix
    for k, v in vars(root).items():
        if hasattr(v, "to_dict") and hasattr(v, "model_type") and k != "_parent":
            p = _path(v, c, f"{prefix}.{k}" if prefix else k)
            if p is not None and (p or v is c):
                return p
    return None


def _rederived(cfg):
    """The config built again from its shrunk values, so that what __init__ derives from
    the sizes (head_dim from hidden // heads, rope dimensions, layer patterns) follows them;
    the shrunk copy itself where a class cannot take its own to_dict() back."""
    try:
        again = type(cfg)(**{k: v for k, v in cfg.to_dict().items()
                            if k not in ("transformers_version", "model_type")})
    except Exception:  # noqa: BLE001 - keep the values as set
        return cfg
    return again


def _count_on_meta(cfg, model_cls) -> int:
    with torch.device("meta"):
        model = model_cls._from_config(cfg)
    return sum(p.numel() for p in model.parameters()), model


def _model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    return getattr(transformers, names[model_type])


def _for_class(cfg, model_cls):
    """The config the causal-LM class takes: the composite config itself, or its text /
    decoder sub-config where the class is registered for the text model alone."""
    want = getattr(model_cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return cfg
    for key in ("text_config", "decoder", "language_config", "llm_config"):
        sub = getattr(cfg, key, None)
        if sub is not None and isinstance(sub, want):
            return sub
    try:
        sub = cfg.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001
        return cfg
    return sub if isinstance(sub, want) else cfg


def build(model_type: str, *, attn_implementation: str | None = None, seed: int = 0,
          max_params: int = MAX_PARAMS, forward: bool = True) -> Built | Failure:
    """The tiny random model of model_type (float32, eval, CPU), built from shrink() after
    counting its parameters on the meta device; with forward=True one forward pass of 16
    tokens must run and give finite logits [1, 16, V]. A Failure names the stage and reason.
    Where the model fails only with the layer kinds widen() gave it, it is built without
    them and `not_probed` says which and why (never a silent narrower model)."""
    kw = dict(attn_implementation=attn_implementation, seed=seed, max_params=max_params, forward=forward)
    b = _build(model_type, widen=True, **kw)
    added, gaps = ([], {}) if isinstance(b, Built) else _widened(model_type)
    if not added:
        return b
    plain = _build(model_type, widen=False, **kw)
    if isinstance(plain, Built):
        failed = f"{', '.join(added)}: the model fails with them ({b.stage}: {b.reason})"
        kinds, why = gaps.pop(layers.NOT_PROBED, ([], None))   # what widen() could not give, kept
        plain.changed.update(gaps)
        plain.changed[layers.NOT_PROBED] = (sorted(set(kinds) | set(added)), "; ".join(filter(None, (why, failed))))
    return plain


def _widened(model_type: str) -> tuple[list, dict]:
    """(the kinds widen() adds to model_type's default config, the gaps it records)."""
    try:
        _, changed = shrink(model_type)
    except Exception:  # noqa: BLE001 - a config that cannot be shrunk widens nothing here
        return [], {}
    added = sorted({k for key, (had, now) in changed.items() if key.endswith(":widened")
                    for k in set(now) - set(had)})
    return added, {k: v for k, v in changed.items() if k.endswith(layers.NOT_PROBED)}


def _on_meta(model_type: str, *, widen: bool = True, attn_implementation=None):
    """(config, changed, model class, parameter count, the model on the meta device) of the
    shrunk model_type, nothing allocated; a Failure (stage shrink or meta) where it cannot be."""
    from transformers import CONFIG_MAPPING
    try:
        cfg, changed = shrink(CONFIG_MAPPING[model_type](), widen=widen)
    except Exception as e:  # noqa: BLE001 - listed with the reason, never skipped
        return Failure.of(model_type, "shrink", e)
    try:
        model_cls = _model_class(model_type)
        cfg = _for_class(cfg, model_cls)
        if getattr(cfg, "is_decoder", True) is False:
            # the causal-LM head of an encoder family (BertLMHeadModel, RobertaForCausalLM, ...)
            # is causal only as a decoder: "add `is_decoder=True`" says its own warning
            cfg.is_decoder = True
            changed["is_decoder"] = (False, True)
        if attn_implementation is not None:
            cfg._attn_implementation = attn_implementation
        n, meta = _count_on_meta(cfg, model_cls)
    except Exception as e:  # noqa: BLE001
        return Failure.of(model_type, "meta", e)
    return cfg, changed, model_cls, n, meta


def count_params(model_type: str) -> int | None:
    """The shrunk model's parameter count, counted on the meta device (nothing allocated);
    None where it cannot be shrunk or counted (building it fails the same way)."""
    m = _on_meta(model_type)
    return None if isinstance(m, Failure) else m[3]


def _build(model_type: str, *, widen: bool, attn_implementation, seed, max_params, forward) -> Built | Failure:
    m = _on_meta(model_type, widen=widen, attn_implementation=attn_implementation)
    if isinstance(m, Failure):
        return m
    cfg, changed, model_cls, n, meta = m
    if n > max_params:
        big = max(meta.named_parameters(), key=lambda kv: kv[1].numel())
        return Failure(model_type, "meta", f"{n:,} parameters after shrinking (limit {max_params:,}); "
                                           f"largest {big[0]} {tuple(big[1].shape)}")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
            model = model_cls._from_config(cfg, **kw)
        model = model.float().eval()
        if hasattr(model, "set_default_language"):  # X-MOD: one adapter per language
            model.set_default_language(next(iter(model.config.languages)))
    except Exception as e:  # noqa: BLE001
        return Failure.of(model_type, "build", e)
    built = Built(model_type, model, model.config, n, changed)
    if forward:
        try:
            vocab = _vocab(model)
            ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            if logits.shape[:2] != (1, 16) or not torch.isfinite(logits).all():
                raise RuntimeError(f"logits of shape {tuple(logits.shape)}, finite: "
                                   f"{bool(torch.isfinite(logits).all())}")
        except Exception as e:  # noqa: BLE001
            return Failure.of(model_type, "forward", e)
    return built


def _vocab(model) -> int:
    emb = model.get_input_embeddings()
    n = getattr(emb, "num_embeddings", None) or getattr(model.config, "vocab_size", None) or VOCAB
    return int(min(n, VOCAB))


def survey(model_types=None, *, progress=None) -> dict:
    """build() every type (default attention): {"built": {type: n_params}, "failed": {type:
    "stage: reason"}, "not_probed": {type: the layer kinds it lacks, and why}, "seconds": wall
    time}; every registered type is in one of the first two."""
    import time
    t = time.perf_counter()
    built, failed, gaps = {}, {}, {}
    for mt in model_types or causal_lm_types():
        r = build(mt)
        if isinstance(r, Failure):
            failed[mt] = f"{r.stage}: {r.reason}"
        else:
            built[mt] = r.n_params
            if r.not_probed:
                gaps[mt] = r.not_probed
        if progress:
            progress(f"{mt}: {'built' if mt in built else failed[mt]}")
    return {"built": built, "failed": failed, "not_probed": gaps, "seconds": round(time.perf_counter() - t, 1)}
