"""Confirmed zoo findings, kept as controls: each names the cell, the verdict it had when
confirmed, the call (bug or by design) and the library code that causes it, and the
reproduction script (transformers and torch pinned, no downloads, exit 0 when it reproduces).
trainprobes.zoo.confirm measures each again: a library upgrade that changes it shows as a
control no longer reproduced. `annotate(cells)` writes the call into the map's cells: a cell confirmed
by design is no longer counted as a finding, and says why."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Finding", "FINDINGS", "annotate"]


@dataclass(frozen=True)
class Finding:
    model_type: str
    probe: str
    variant: str
    verdict: str          # what the probe said when the finding was confirmed
    call: str             # "bug" or "by design"
    cause: str            # library file and function
    why: str
    script: str           # the reproduction, under scripts/zoo_findings/


_NO_POSITION_IDS = ("{model}.forward builds its mask with masking_utils.create_causal_mask but without "
                    "position_ids, so _preprocess_mask_arguments never calls find_packed_sequence_indices "
                    "and the mask stays causal over the whole packed row (Llama-derived models pass them)")
_PACKED = "scripts/zoo_findings/packed_position_ids_dropped.py"
# learned absolute positions, masks from the pre-packing template: position ids index the
# position table only; packing by position ids was never a feature of these (a 4-D mask isolates)
_ABSOLUTE_POSITIONS = ("bert", "bert-generation", "big_bird", "biogpt", "camembert", "data2vec-text", "electra",
                       "ernie", "megatron-bert", "opt", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
                       "xglm", "xlm-roberta", "xlm-roberta-xl", "xmod")
_EAGER_ONLY = ("big_bird", "megatron-bert", "rembert", "xglm")   # their causal-LM class refuses sdpa
_ABSOLUTE_WHY = ("the forward takes position_ids only to index learned absolute position embeddings and builds "
                 "its mask with create_causal_mask without them, as its template always did: packing by "
                 "restarting position ids is not a feature of this family (a 4-D block mask isolates it). "
                 "AFMoE and GPT-OSS are bugs instead: Llama-template RoPE models whose siblings pass them")


def _base(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    return MODEL_MAPPING_NAMES.get(model_type, "the base model")


def _module(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    return model_type_to_module_name(model_type)
_DOGE = ("transformers/models/doge/modeling_doge.py: DogeCDMoE.forward", "scripts/zoo_findings/doge_router_mixes_tokens.py")
_DOGE_WHY = ("router_gate(hidden_states).view(2, bsz * seq_len, -1) splits the flattened token axis, not the "
             "last one: a token's expert keys come from other tokens of the call, later ones and other rows included "
             "(the file's own comment: 'routing is not causal in a full forward pass')")
_DSV4 = ("transformers/models/deepseek_v4/modeling_deepseek_v4.py: DeepseekV4CSACompressor.forward",
         "scripts/zoo_findings/deepseek_v4_compressed_attention_packing.py")
_DSV4_WHY = ("the compressor pools every compress_rate consecutive tokens of the row into one KV entry and masks "
             "entries by position alone ((position_ids + 1) // compress_rate), never by the attention mask: "
             "packed documents share the entries of earlier ones. The paper's compressed attention has no "
             "per-document reset; packing is unsupported, and nothing refuses it")

FINDINGS = (
    Finding("afmoe", "isolation", "sdpa,position_ids_no_cache", "leaky", "bug",
            "transformers/models/afmoe/modeling_afmoe.py: AfmoeModel.forward",
            _NO_POSITION_IDS.format(model="AfmoeModel"), "scripts/zoo_findings/afmoe_packed_position_ids.py"),
    Finding("afmoe", "isolation", "eager,position_ids_no_cache", "leaky", "bug",
            "transformers/models/afmoe/modeling_afmoe.py: AfmoeModel.forward",
            "as under sdpa: the mask is built without the position ids",
            "scripts/zoo_findings/afmoe_packed_position_ids.py"),
    Finding("gpt_oss", "isolation", "eager,position_ids_no_cache", "leaky", "bug",
            "transformers/models/gpt_oss/modeling_gpt_oss.py: GptOssModel.forward",
            _NO_POSITION_IDS.format(model="GptOssModel"), _PACKED),

    *(Finding(mt, "isolation", f"{impl},position_ids_no_cache", "leaky", "by design",
              f"transformers/models/{_module(mt)}/modeling_{_module(mt)}.py: {_base(mt)}.forward",
              _ABSOLUTE_WHY, f"{_PACKED} --by-design") for mt in _ABSOLUTE_POSITIONS for impl in ("eager", "sdpa")
      if not (impl == "sdpa" and mt in _EAGER_ONLY)),
    Finding("doge", "router", "perturb", "non-causal", "bug", _DOGE[0], _DOGE_WHY, _DOGE[1]),
    Finding("doge", "batch", "", "variant", "bug", _DOGE[0],
            "the same token mixing crosses the rows of a batch: a row's logits depend on the others", _DOGE[1]),
    Finding("doge", "router", "truncate", "non-causal", "bug", _DOGE[0], _DOGE_WHY, _DOGE[1]),
    *(Finding("doge", "isolation", f"{impl},{conv}", "leaky", "bug", _DOGE[0],
              "the router's token mixing carries one document's tokens into another's routing, whatever the mask",
              _DOGE[1]) for impl in ("sdpa", "eager") for conv in ("mask_4d", "position_ids_no_cache")),
    Finding("deepseek_v4", "isolation", "eager,mask_4d", "leaky", "by design", _DSV4[0], _DSV4_WHY, _DSV4[1]),
    Finding("deepseek_v4", "isolation", "eager,position_ids_no_cache", "leaky", "by design", _DSV4[0],
            _DSV4_WHY, _DSV4[1]),
)


def annotate(cells) -> None:
    """Write each confirmed finding's call into its cell (in place): 'confirmed bug' or 'by
    design', with the cause and the script; a by-design cell stops counting as a finding.
    A cell whose verdict is no longer the confirmed one is left as measured."""
    by = {(f.model_type, f.probe, f.variant): f for f in FINDINGS}
    for c in cells:
        f = by.get((c.model_type, c.probe, c.variant))
        if f is None or c.verdict != f.verdict:
            continue
        if f.call == "by design":
            c.finding, c.expected = False, None
            c.reason += f"; by design ({f.cause}: {f.script})"
        else:
            c.reason += f"; confirmed bug ({f.cause}: {f.script})"
