"""The kinds of layer a config lists, and which layers a shrunk model keeps so that it holds
at least one of each.

A config names its layers' kinds in several ways (transformers 5.24):
  per-layer lists     layer_types, layers_block_type, mlp_layer_types, attention_layers,
                      no_rope_layers, ...: one entry per layer
  index lists         attn_layer_indices, full_attn_idxs, hybrid_layer_ids, moe_layers: the
                      layers of one kind (strictly increasing layer numbers)
  cyclic patterns     recurrent_gemma's block_types ('recurrent', 'recurrent', 'attention'),
                      repeated over the depth
  periods             jamba's attn_layer_period / attn_layer_offset
  source lists        kolibri1_1's kv_source_layers (5.25): per layer, the index of the
                      earlier layer whose keys and values it reads; its kinds are "own" and
                      "shares", and a kept layer keeps its source
The per-layer kinds are read with getattr, so the properties and attribute maps that derive
them (bamba's layers_block_type from attn_layer_indices, recurrent_gemma's from block_types)
are read as the model reads them.

Steps of `plan(cfg, full)`:
  1. each layer's signature: its entry in every per-layer list, its membership of every index
     list, its entry of every cyclic pattern;
  2. the first layer of each signature, in order (at least 2 layers); where that needs more
     than MAX_LAYERS layers, a greedy cover of every (list, kind) pair instead;
  3. the layers a kept layer reads from (source lists) are kept too;
  4. `apply` cuts the stored per-layer lists to those layers, renumbers the index lists and
     the source lists' entries, and writes the cyclic patterns out over the kept layers.
`kinds(cfg)` is what `shrink` checks afterwards: a shrunk config that lost a kind is refused
(a listed failure), never built silently without it.

A default config may hold only some of the kinds its model can run (granitemoehybrid and
bamba default to Mamba layers only, lfm2 to attention only; MiniMax-M3's default lists no
sparse layer, Laguna's and Mellum's no sliding one). The kinds a model can take are read from
its modeling file (`source_kinds`): the keys of the per-kind mask mapping its forward builds
(`causal_mask_mapping = {"full_attention": ..., "linear_attention": ...}`, laguna's
`mask_creation_functions`) and the kinds its layers compare theirs with
(`config.layer_types[layer_idx] == "minimax_m3_sparse"`). `widen(cfg, model_type)` gives the
config one layer of each; a kind it cannot give (a setting it needs is unset, the config
derives its kinds from other fields, its own kinds are not named in the file) is recorded
with why in changed[NOT_PROBED], and `shrink.build` does the same for kinds the model fails
with (it is built without them): the map lists each such gap, never drops it silently.
"""
from __future__ import annotations

import re

__all__ = ["layer_count", "kinds", "plan", "apply", "source_kinds", "widen", "NOT_PROBED", "MAX_LAYERS", "KIND_FIELDS"]

# the names configs give their layer count, first match wins
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "decoder_layers")
MAX_LAYERS = 6           # enough for one layer of each kind at tiny cost
_MAX_COVER = 8           # a greedy cover may take up to this many when the kinds need them
# per-layer kind lists read with getattr (some are properties or attribute-map aliases)
KIND_FIELDS = ("layer_types", "layers_block_type", "mlp_layer_types", "attention_layers",
               "attn_layers", "no_rope_layers", "indexer_types", "block_types")
_INDEX_NAME = re.compile(r"(idx|idxs|indices|ids|_layers)$")


def _get(cfg, name):
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - a property that cannot be computed lists nothing
        return None


def _is_index_list(name: str, v, full: int) -> bool:
    return (bool(_INDEX_NAME.search(name)) and isinstance(v, (list, tuple)) and len(v) > 0
            and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
            and all(a < b for a, b in zip(v, v[1:])) and 0 <= v[0] and v[-1] < full)


def _is_per_layer(v, full: int) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) == full
            and all(isinstance(e, (str, int, float, bool)) for e in v))


def _is_source_list(name: str, v, full: int) -> bool:
    """Per layer, the earlier layer (or itself) it reads from: layer numbers, not kinds."""
    return ("source" in name and isinstance(v, (list, tuple)) and len(v) == full
            and all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e <= i for i, e in enumerate(v)))


def _sources(cfg, full: int) -> dict:
    names = [k for k in vars(cfg) if not k.startswith("_")]
    return {n: list(v) for n in names if _is_source_list(n, v := _get(cfg, n), full)}


def _fields(cfg, full: int) -> tuple[dict, dict, dict]:
    """(per-layer lists, index lists, cyclic patterns) of cfg, each {name: value}; source
    lists enter the per-layer lists as their kinds ("own" / "shares")."""
    per, idx, cyc = {}, {}, {}
    names = [k for k in vars(cfg) if not k.startswith("_")] + list(KIND_FIELDS)
    for name in dict.fromkeys(names):
        v = _get(cfg, name)
        if _is_source_list(name, v, full):
            per[name] = ["own" if e == i else "shares" for i, e in enumerate(v)]
        elif _is_index_list(name, v, full) and not (len(v) == full and name in KIND_FIELDS):
            idx[name] = list(v)
        elif _is_per_layer(v, full):
            per[name] = list(v)
        elif (name in KIND_FIELDS and isinstance(v, (list, tuple)) and 1 < len(v) < full
              and all(isinstance(e, str) for e in v)):
            cyc[name] = list(v)
    return per, idx, cyc


def layer_count(cfg) -> tuple[str | None, int | None]:
    """(the config's layer-count attribute, its value), or (None, None) where it has none."""
    for name in LAYER_COUNTS:
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return name, v
    return None, None


def kinds(cfg, full: int | None = None) -> dict[str, frozenset]:
    """{field: the set of kinds its layers take} for every per-layer list, index list
    (membership: True / False) and cyclic pattern of cfg."""
    if full is None:
        full = layer_count(cfg)[1]
    if not full:
        return {}
    per, idx, cyc = _fields(cfg, full)
    out = {k: frozenset(map(repr, v)) for k, v in per.items()}
    out.update({k: frozenset(repr(i in set(v)) for i in range(full)) for k, v in idx.items()})
    out.update({k: frozenset(map(repr, v[:full])) for k, v in cyc.items()})
    return out


def _signatures(cfg, full: int) -> list[tuple]:
    per, idx, cyc = _fields(cfg, full)
    sets = {k: set(v) for k, v in idx.items()}
    return [tuple(repr(v[i]) for v in per.values()) + tuple(i in s for s in sets.values())
            + tuple(v[i % len(v)] for v in cyc.values()) for i in range(full)]


def plan(cfg, full: int) -> list[int]:
    """The layers (numbers in the full model, increasing) a shrunk model keeps: one of each
    signature, at least 2; a greedy cover of every field's kinds where the signatures need
    more than MAX_LAYERS."""
    sig = _signatures(cfg, full)
    first = list(dict.fromkeys(sig))
    keep = sorted(sig.index(s) for s in first)
    if len(keep) > MAX_LAYERS:
        want = {(f, s[f]) for s in sig for f in range(len(s))}
        keep = []
        while want:
            best = max(range(full), key=lambda i: (len({(f, sig[i][f]) for f in range(len(sig[i]))} & want), -i))
            keep.append(best)
            want -= {(f, sig[best][f]) for f in range(len(sig[best]))}
        keep = sorted(keep)
    for i in range(full):   # at least 2 layers: a pass through a layer boundary
        if len(keep) >= min(2, full):
            break
        if i not in keep:
            keep = sorted(keep + [i])
    keep = keep[:_MAX_COVER]
    for v in _sources(cfg, full).values():   # a layer that reads another's keys keeps that layer
        keep = sorted(set(keep) | {v[i] for i in keep})
    return keep


def apply(cfg, full: int, keep: list[int], changed: dict, prefix: str = "") -> None:
    """Cut cfg's stored per-layer lists to `keep`, renumber its index lists and write its
    cyclic patterns out over the kept layers (the depth itself is set by the caller)."""
    stored = vars(cfg)
    per, idx, cyc = _fields(cfg, full)
    where = {j: n for n, j in enumerate(keep)}
    sources = _sources(cfg, full)
    for name, v in per.items():
        if name in stored and stored[name] is not None:
            old = stored[name]
            new = [where[old[i]] if name in sources else old[i] for i in keep]
            setattr(cfg, name, type(old)(new) if isinstance(old, (list, tuple)) else new)
            changed[prefix + name] = (f"{full} entries", f"{len(keep)} entries")
    for name, v in idx.items():
        if name in stored and stored[name] is not None:
            new = [where[i] for i in v if i in where]
            setattr(cfg, name, type(stored[name])(new))
            changed[prefix + name] = (list(v), new)
    for name, v in cyc.items():
        if name in stored and stored[name] is not None:
            new = [v[i % len(v)] for i in keep]
            setattr(cfg, name, type(stored[name])(new))
            changed[prefix + name] = (list(v), new)


# where a modeling file names its attention layers' kinds (transformers 5.24):
#   the keys of the per-kind mask mapping its forward builds: causal_mask_mapping = {"full_attention":
#     ..., "linear_attention": ...} (or item by item), laguna's / mellum's mask_creation_functions
#   the strings its layers compare their own kind with: config.layer_types[layer_idx] ==
#     "sliding_attention" (laguna, mellum), == "minimax_m3_sparse" (MiniMax-M3's indexer), a
#     layer_type in ("a", "b")
# mlp_layer_types and other per-layer lists are not attention kinds: never read here
_MAPPING = re.compile(r"(?:causal_mask_mapping|mask_creation_functions)\s*=\s*\{(.*?)\n\s*\}", re.S)
_KEY = re.compile(r'"([a-z_0-9]+)"\s*:')
_SET_KEY = re.compile(r'causal_mask_mapping\["([a-z_0-9]+)"\]\s*=')
_LAYER_TYPE = r"(?<![A-Za-z0-9_])layer_types?(?:\[[^\]]*\])?"
_COMPARED = re.compile(_LAYER_TYPE + r'\s*(?:==|!=)\s*"([a-z_0-9]+)"')
_COMPARED_R = re.compile(r'"([a-z_0-9]+)"\s*(?:==|!=)\s*(?:[\w.]*\.)?' + _LAYER_TYPE)
_IN = re.compile(_LAYER_TYPE + r"\s*(?:not\s+)?in\s*[(\[{]([^)\]}]*)[)\]}]")
_STRING = re.compile(r'"([a-z_0-9]+)"')
# what a kind needs from the config to be built at all
_NEEDS = {"sliding_attention": ("sliding_window",), "chunked_attention": ("attention_chunk_size",)}


def source_kinds(model_type: str) -> frozenset:
    """The attention-layer kinds the model type's modeling file names: the keys of its per-kind
    mask mapping and the kinds its layers compare theirs with (empty where it names none, or
    the source cannot be read)."""
    import inspect
    import sys

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    try:
        src = inspect.getsource(sys.modules[getattr(transformers, names[model_type]).__module__])
    except (OSError, TypeError, KeyError, AttributeError):
        return frozenset()
    keys = set(_SET_KEY.findall(src)) | set(_COMPARED.findall(src)) | set(_COMPARED_R.findall(src))
    for m in _MAPPING.finditer(src):
        keys |= set(_KEY.findall(m.group(1)))
    for m in _IN.finditer(src):
        keys |= set(_STRING.findall(m.group(1)))
    return frozenset(keys)


NOT_PROBED = "layer_types:not_probed"   # changed[...] = (kinds, why) where widen cannot give them


def widen(cfg, model_type: str, changed: dict, prefix: str = "") -> None:
    """Where cfg's layer_types takes only some of the kinds its modeling file names (and
    nothing else), give the kept layers one of each, after those the config had (the first
    layers keep the default's kinds); index lists of attention layers (attn_layer_indices,
    full_attn_idxs) follow the "full_attention" layers. A kind the config cannot take (a
    sliding layer without a sliding_window; more kinds than layers) is recorded in
    changed[NOT_PROBED] with why. A config that uses kinds the file does not name (falcon_h1's
    'hybrid' layers carry both attention and Mamba) is left as it is, and the kinds it lacks
    are recorded there too."""
    want = source_kinds(model_type)
    _, n = layer_count(cfg)
    have = _get(cfg, "layer_types")
    if not want or not n:
        return
    have = list(have) if have is not None else []
    # full attention is every file's default kind, named or not (MiniMax-M3 compares with
    # "minimax_m3_sparse" only: its other layers are full attention)
    if have and not set(have) <= want | {"full_attention"}:
        absent = sorted(want - set(have))
        if absent:   # not widened, and said so
            changed[prefix + NOT_PROBED] = (absent, f"{', '.join(absent)}: not given, the config's own kinds "
                                                    f"{sorted(set(have) - want)} are not named in the modeling "
                                                    f"file (a 'hybrid' layer may carry them)")
        return
    lacking = {k: [a for a in _NEEDS.get(k, ()) if not _get(cfg, a)] for k in want - set(have)}
    missing = sorted(k for k, lack in lacking.items() if not lack)
    cannot = {k: f"the config sets no {', '.join(lack)}" for k, lack in lacking.items() if lack}
    if missing and len(set(have) | set(missing)) > n:
        cannot.update({k: f"{len(set(have) | set(missing))} kinds, {n} layers" for k in missing})
        missing = []
    if missing:
        cannot.update(_give(cfg, have, missing, n, changed, prefix))
    if cannot:   # never silent: what the tiny model lacks, and why
        changed[prefix + NOT_PROBED] = (sorted(cannot), "; ".join(f"{k}: {w}" for k, w in sorted(cannot.items())))


def _give(cfg, have: list, missing: list, n: int, changed: dict, prefix: str) -> dict:
    """Write the missing kinds into cfg's last layers; {kind: why} for those it could not."""
    base = have[:n] if len(have) >= n else (have + [have[-1] if have else missing[0]] * n)[:n]
    # the last layers take the missing kinds: the first keeps the default's kind
    new = base[:n - len(missing)] + missing
    stored = vars(cfg)
    attn = [i for i, k in enumerate(new) if k == "full_attention"]
    for name in list(stored):
        if re.search(r"attn|attention", name) and _INDEX_NAME.search(name) and (
                stored[name] is None or isinstance(stored[name], (list, tuple))):
            changed[prefix + name] = (stored[name], attn)
            setattr(cfg, name, attn)
    try:   # stored, or an alias (zamba: attribute_map to layers_block_type)
        setattr(cfg, "layer_types", new)
    except (AttributeError, NotImplementedError):
        pass   # a property derived from the index lists set above (bamba's layers_block_type)
    got = set(_get(cfg, "layer_types") or ())
    lost = [k for k in missing if k not in got]
    if len(lost) < len(missing):
        changed[prefix + "layer_types:widened"] = (sorted(set(have)), new)   # the kinds it had, the new list
    return {k: "the config derives its layer kinds from fields not set here" for k in lost}
