"""A shrunk zoo model keeps one layer of every kind its config lists, checked over every
registered causal-LM type whose config declares layer kinds, and widened to the kinds its
modeling file masks for where the default holds one kind of a hybrid."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from trainprobes.errors import InvalidArgument  # noqa: E402
from trainprobes.zoo import layers  # noqa: E402
from trainprobes.zoo.shrink import build, causal_lm_types, shrink  # noqa: E402

# every name a transformers 5.24 config uses for its layers' kinds: per-layer lists, index
# lists of one kind, cyclic patterns, periods (read here with getattr, as the model reads them)
PER_LAYER = ("layer_types", "layers_block_type", "mlp_layer_types", "attention_layers", "attn_layers",
             "no_rope_layers", "block_types", "indexer_types")
INDEX = ("attn_layer_indices", "full_attn_idxs", "hybrid_layer_ids", "moe_layers")
PERIOD = ("attn_layer_period", "expert_layer_period")
ATTENTION = {"full_attention", "sliding_attention", "chunked_attention", "indexed_attention"}


def _declared(cls) -> set:
    names = set()
    for k in cls.__mro__:
        names |= set(getattr(k, "__annotations__", {}))
    return names


def _typed():
    from transformers import CONFIG_MAPPING
    out = []
    for mt in causal_lm_types():
        cls = CONFIG_MAPPING[mt]
        subs = [c for c in getattr(cls, "sub_configs", {}).values() if isinstance(c, type)]
        if any(_declared(c) & set(PER_LAYER + INDEX + PERIOD) for c in (cls, *subs)):
            out.append(mt)
    return out


def _kinds(cfg, name):
    try:
        v = getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - a property that cannot be computed
        return None
    if v is None or isinstance(v, (int, float, str)) or not v:
        return None
    return set(map(str, v))


def _text(cfg):
    return [c for c in (cfg, getattr(cfg, "text_config", None)) if c is not None]


@pytest.mark.slow   # about 8 s: every typed config built three times
def test_every_registered_type_keeps_each_layer_kind_its_config_lists():
    from transformers import CONFIG_MAPPING
    typed = _typed()
    assert len(typed) > 60                       # the set is read, not empty
    lost, refused = [], []
    for mt in typed:
        try:
            full = CONFIG_MAPPING[mt]()
            small, changed = shrink(full)
        except InvalidArgument as e:
            if "drop layer kinds" in str(e):
                refused.append(f"{mt}: {e}")
            continue
        except Exception:  # noqa: BLE001 - a config that cannot be built is listed by build()
            continue
        for f_cfg, s_cfg in zip(_text(full), _text(small)):
            n = getattr(s_cfg, "num_hidden_layers", None)
            for name in PER_LAYER:
                a, b = _kinds(f_cfg, name), _kinds(s_cfg, name)
                if a and not a <= (b or set()):
                    lost.append(f"{mt}.{name}: {sorted(a - (b or set()))}")
            widened = any(k.endswith(":widened") for k in changed)
            for name in INDEX * (not widened):   # a widened default's index lists follow the new kinds
                a, b = _kinds(f_cfg, name), _kinds(s_cfg, name)
                if a and (not b or (n and len(b) == n) != (len(a) == f_cfg.num_hidden_layers)):
                    lost.append(f"{mt}.{name}: {sorted(a)} -> {sorted(b or [])}")
        # a hybrid's default holding one family of kinds gets the other its mask mapping names
        want = layers.source_kinds(mt)
        have = _kinds(small, "layer_types")
        if want & ATTENTION and want - ATTENTION and have and have <= want:
            if not (have & ATTENTION and have - ATTENTION):
                lost.append(f"{mt}: layer_types {sorted(have)}, its modeling file masks {sorted(want)}")
    assert not refused, refused
    assert not lost, lost


def test_the_hybrids_named_in_the_issue_keep_attention_and_their_recurrent_layers():
    for mt, recurrent in (("granitemoehybrid", "linear_attention"), ("lfm2", "conv"), ("bamba", "linear_attention"),
                          ("jamba", "linear_attention"), ("qwen3_next", "linear_attention"),
                          ("recurrent_gemma", "linear_attention")):
        cfg, changed = shrink(mt)
        kinds = set(cfg.layer_types)
        assert recurrent in kinds and kinds & ATTENTION, (mt, kinds)
        assert cfg.num_hidden_layers == len(cfg.layer_types) <= layers.MAX_LAYERS
    cfg, _ = shrink("zamba2")                   # hybrid_layer_ids renumbered with the layers kept
    assert cfg.hybrid_layer_ids == [i for i, k in enumerate(cfg.layers_block_type) if k == "hybrid"] != []


def test_a_built_hybrid_has_both_kinds_of_module():
    from trainprobes.zoo.cells import _recurrent_class
    model = build("granitemoehybrid", forward=False).model
    names = {type(m).__name__ for m in model.modules()}
    assert any(_recurrent_class(n) for n in names)
    assert any(n.endswith("Attention") for n in names), names


def test_shrink_refuses_a_plan_that_would_drop_a_kind(monkeypatch):
    monkeypatch.setattr(layers, "plan", lambda cfg, full: [0, 1])   # linear, linear: no full layer
    with pytest.raises(InvalidArgument, match="drop layer kinds"):
        shrink("qwen3_next")


def test_plan_covers_every_kind_and_renumbers_index_lists():
    from transformers import CONFIG_MAPPING
    cfg = CONFIG_MAPPING["bamba"](num_hidden_layers=12, attn_layer_indices=[4, 9])
    keep = layers.plan(cfg, 12)
    assert keep == [0, 4]
    changed = {}
    layers.apply(cfg, 12, keep, changed)
    assert cfg.attn_layer_indices == [1] and changed["attn_layer_indices"] == ([4, 9], [1])


def test_kinds_named_only_in_the_modeling_file_are_probed():
    """Kinds a default config does not list, read from the modeling file: MiniMax-M3's sparse
    layers (its indexer compares config.layer_types[i] with "minimax_m3_sparse"), Laguna's and
    Mellum's sliding layers (compared, and keys of their mask_creation_functions); the MLP
    kinds compared in the same files ("sparse", "dense") are not attention kinds."""
    assert layers.source_kinds("minimax_m3_vl_text") == {"minimax_m3_sparse"}
    assert layers.source_kinds("laguna") == {"full_attention", "sliding_attention"}
    for mt, kind in (("minimax_m3_vl_text", "minimax_m3_sparse"), ("laguna", "sliding_attention"),
                     ("mellum", "sliding_attention")):
        b = build(mt, forward=False)
        assert {kind, "full_attention"} <= set(b.config.layer_types) and b.not_probed is None, (mt, b.not_probed)


def test_a_kind_that_cannot_be_given_is_listed_with_why_never_dropped_silently():
    # a setting the kind needs is absent: Qwen2's sliding layers without a sliding_window
    b = build("qwen2", forward=False)
    assert set(b.config.layer_types) == {"full_attention"}
    assert b.not_probed == "sliding_attention: the config sets no sliding_window"
    # the model fails with the kinds: built without them, and the failure named
    b = build("zaya", forward=False)
    assert "conv, hybrid_sliding: the model fails with them (meta: KeyError" in b.not_probed
    from trainprobes.zoo.cells import row
    gap, = [c for c in row("qwen2", probes=(), implementations=("sdpa",)) if c.variant == "layer kinds"]
    assert gap.probe == "build" and gap.verdict == "n/a" and gap.reason.startswith("not probed: sliding_attention")
