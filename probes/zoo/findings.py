"""Confirmed zoo findings, kept as controls: each names the cell, the verdict it had when
confirmed, the call (CALLS: a bug, a bug the library keeps on purpose, by design), the
library code that causes it, the reproduction script (no downloads, exit 0 when it
reproduces), and its life across transformers releases: the versions it was measured on,
the later releases it was checked against and still reproduced on, and the release and
source change that fixed it upstream (`Fix`). trainprobes.zoo.confirm measures each again and
says what changed (a fix upstream is news, not a failed control). `annotate(cells)` writes
the call into the map's cells: a cell confirmed by design is no longer counted as a finding,
and says why."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

__all__ = ["Finding", "FINDINGS", "Fix", "Versions", "annotate", "CALLS", "BUG", "KEPT", "BY_DESIGN"]


# the calls: a bug (a finding: the cell contradicts the design), a bug the library keeps on
# purpose (still a finding: what the user trains differs from the design, and the library says
# it will not change), by design (the cell's leak is the design's: no longer a finding)
BUG, KEPT, BY_DESIGN = "bug", "bug, kept on purpose", "by design"
CALLS = (BUG, KEPT, BY_DESIGN)


class Versions(NamedTuple):
    transformers: str
    torch: str


class Fix(NamedTuple):
    version: str          # the first transformers release on which it no longer reproduces
    change: str           # the source change that fixed it


MEASURED = Versions(transformers="5.24.0", torch="2.13.0")


@dataclass(frozen=True)
class Finding:
    model_type: str
    probe: str
    variant: str
    verdict: str          # what the probe said when the finding was confirmed
    call: str             # one of CALLS
    cause: str            # library file and function
    why: str
    script: str           # the reproduction, under scripts/zoo_findings/
    measured_on: Versions = MEASURED
    checked_on: tuple = ()    # later transformers releases measured again: it still reproduced
    fixed: Fix | None = None  # fixed upstream: where and how

    def life(self) -> str:
        """Its versions in one line: where it was measured, rechecked and fixed."""
        m = self.measured_on
        out = f"measured on transformers {m.transformers} (torch {m.torch})"
        if self.checked_on:
            out += f"; still reproduces on {', '.join(self.checked_on)}"
        if self.fixed is not None:
            out += f"; fixed upstream in {self.fixed.version}: {self.fixed.change}"
        return out

    def recorded_reproducing(self, transformers_version: str) -> bool:
        """Was it measured reproducing on this transformers release?"""
        return transformers_version in (self.measured_on.transformers, *self.checked_on)


def _base(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    return MODEL_MAPPING_NAMES.get(model_type, "the base model")


def _module(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    return model_type_to_module_name(model_type)


def _forward(model_type: str) -> str:
    return f"transformers/models/{_module(model_type)}/modeling_{_module(model_type)}.py: {_base(model_type)}.forward"


# Packed rows with restarting position ids, the training call (no cache): eager and sdpa keep
# the documents apart through the mask, which masking_utils builds from the position ids only if
# the forward hands them to create_causal_mask; flash attention keeps them apart in the kernel,
# which reads them from the position ids its attention layers receive
# (_flash_attention_forward -> _is_packed_sequence). One rule for every model
# (scripts/zoo_findings/packed_position_ids_dropped.py measures each part of it):
#   - the attention layers receive the position ids and the model supports flash attention, the
#     mask is built without them: a bug (eager and sdpa compute another function than flash
#     attention on the same batch; one argument missing). Learned absolute positions are no
#     reason: GPT-2, GPT-Neo and GPTBigCode hand them to the mask and are isolated.
#   - no flash attention and the attention layers never receive them: packing by position ids
#     is offered by no attention path of the model: by design (a 4-D mask isolates).
_PACKED = "scripts/zoo_findings/packed_position_ids_dropped.py"
# transformers 5.25.0 fixed the BERT family: BertModel._create_attention_masks and its copies
# pass position_ids to create_causal_mask / create_bidirectional_mask (which gained the
# argument), so the packed documents are found and masked apart under eager and sdpa
_BERT_FAMILY = ("bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie", "roberta",
                "roberta-prelayernorm", "roc_bert", "xlm-roberta", "xlm-roberta-xl", "xmod")
_BERT_FIX = Fix("5.25.0", "BertModel._create_attention_masks (and its copies in the family) passes position_ids to "
                          "create_causal_mask / create_bidirectional_mask, which gained the argument")
_DROPPED = ("gpt_oss", "afmoe", "opt", "biogpt", *_BERT_FAMILY)
_NO_PACKING_PATH = ("big_bird", "megatron-bert", "rembert", "xglm")
_ONLY_EAGER = ("big_bird", "gpt_oss", "megatron-bert", "rembert", "xglm")   # the causal-LM class refuses sdpa
_DROPPED_WHY = ("{base}.forward builds its mask with masking_utils.create_causal_mask without position_ids, so "
                "_preprocess_mask_arguments never calls find_packed_sequence_indices and eager/sdpa attend over the "
                "whole packed row; its attention layers receive the position ids, from which flash attention reads "
                "the documents (_flash_attention_forward -> _is_packed_sequence): the same batch is isolated there"
                "{extra}")
_DROPPED_EXTRA = {
    "biogpt": "; BioGPT also fills attention_mask with ones when none is given, which skips packing detection too "
              "(OPT keeps it None on purpose, its comment says)",
    "gpt_oss": "; the Llama template it follows passes them", "afmoe": "; the Llama template it follows passes them"}
_NO_PATH_WHY = ("{base}.forward builds its mask without position_ids, and no attention path of the model reads "
                "documents from them: no flash attention support, and its attention modules never receive them. "
                "Packing by position ids is not offered by this model at all; a 4-D block mask isolates it")
_DOGE = ("transformers/models/doge/modeling_doge.py: DogeCDMoE.forward", "scripts/zoo_findings/doge_router_mixes_tokens.py")
_DOGE_WHY = ("router_gate(hidden_states).view(2, bsz * seq_len, -1) splits the flattened token axis, not the "
             "last one: a token's expert keys come from other tokens of the call, later ones and other rows included. "
             "Kept on purpose, the file's comment says: 'routing is not causal in a full forward pass ... It is kept "
             "as-is so existing checkpoints give the same outputs'; whoever trains Doge's MoE trains a router that "
             "reads the future")
_DSV4 = ("transformers/models/deepseek_v4/modeling_deepseek_v4.py: DeepseekV4CSACompressor.forward",
         "scripts/zoo_findings/deepseek_v4_compressed_attention_packing.py")
_DSV4_WHY = ("the compressor pools every compress_rate consecutive tokens of the row into one KV entry and masks "
             "entries by position alone ((position_ids + 1) // compress_rate), never by the attention mask: "
             "packed documents share the entries of earlier ones. The paper's compressed attention has no "
             "per-document reset; packing is unsupported, and nothing refuses it")
_M3 = ("transformers/models/minimax_m3_vl/modeling_minimax_m3_vl.py: MiniMaxM3VLIndexer.forward",
       "scripts/zoo_findings/minimax_m3_sparse_indexer_packing.py")
_M3_WHY = ("the sparse layers' indexer marks keys as future by comparing key slots with query position ids "
           "(k_positions > position_ids) and anchors its local blocks at position_ids // block_size: with restarting "
           "position ids a later document's queries select the first document's blocks, build_block_mask's "
           "intersection with the document mask leaves them no key, and a row masked everywhere (min_dtype, not "
           "-inf) attends uniformly to the whole row, other documents and the future included. The model hands "
           "position_ids to create_causal_mask and threads them to the indexer to anchor it at content positions "
           "(its comment): packing is meant to work. The bug is that future leak: with slot position ids and the "
           "4-D mask no query is left without a key and earlier documents stay still, while later ones still move "
           "(block top-k over the whole row before the document mask: the sparse design, as DeepSeek-V4's "
           "compressor, by design)")

# the later releases each finding was measured on again, where it still reproduced
# (trainprobes zoo --findings on transformers 5.25.0, torch 2.13.0)
_STILL_525 = ("5.25.0",)

_CONFIRMED = (
    *(Finding(mt, "isolation", f"{impl},position_ids_no_cache", "leaky", BUG, _forward(mt),
              _DROPPED_WHY.format(base=_base(mt), extra=_DROPPED_EXTRA.get(mt, "")),
              "scripts/zoo_findings/afmoe_packed_position_ids.py" if mt == "afmoe" else _PACKED,
              fixed=_BERT_FIX if mt in _BERT_FAMILY else None)
      for mt in _DROPPED for impl in ("eager", "sdpa") if not (impl == "sdpa" and mt in _ONLY_EAGER)),
    *(Finding(mt, "isolation", f"{impl},position_ids_no_cache", "leaky", BY_DESIGN, _forward(mt),
              _NO_PATH_WHY.format(base=_base(mt)), f"{_PACKED} --by-design")
      for mt in _NO_PACKING_PATH for impl in ("eager", "sdpa") if not (impl == "sdpa" and mt in _ONLY_EAGER)),
    *(Finding("minimax_m3_vl_text", "isolation", f"{impl},{conv}", "leaky", BUG, _M3[0], _M3_WHY, _M3[1])
      for impl in ("sdpa", "eager") for conv in ("position_ids_no_cache", "mask_4d")),
    Finding("doge", "router", "perturb", "non-causal", KEPT, _DOGE[0], _DOGE_WHY, _DOGE[1]),
    Finding("doge", "batch", "", "variant", KEPT, _DOGE[0],
            "the same token mixing crosses the rows of a batch: a row's logits depend on the others", _DOGE[1]),
    Finding("doge", "router", "truncate", "non-causal", KEPT, _DOGE[0], _DOGE_WHY, _DOGE[1]),
    *(Finding("doge", "isolation", f"{impl},{conv}", "leaky", KEPT, _DOGE[0],
              "the router's token mixing carries one document's tokens into another's routing, whatever the mask",
              _DOGE[1]) for impl in ("sdpa", "eager") for conv in ("mask_4d", "position_ids_no_cache")),
    Finding("deepseek_v4", "isolation", "eager,mask_4d", "leaky", BY_DESIGN, _DSV4[0], _DSV4_WHY, _DSV4[1]),
    Finding("deepseek_v4", "isolation", "eager,position_ids_no_cache", "leaky", BY_DESIGN, _DSV4[0],
            _DSV4_WHY, _DSV4[1]),
)
FINDINGS = tuple(f if f.fixed else replace(f, checked_on=_STILL_525) for f in _CONFIRMED)


def annotate(cells) -> None:
    """Write each confirmed finding's call into its cell (in place): the call, the cause and
    the script; a by-design cell stops counting as a finding. A cell whose verdict is no
    longer the confirmed one is left as measured."""
    by = {(f.model_type, f.probe, f.variant): f for f in FINDINGS}
    for c in cells:
        f = by.get((c.model_type, c.probe, c.variant))
        if f is None or c.verdict != f.verdict:
            continue
        if f.call == BY_DESIGN:
            c.finding, c.expected = False, None
            c.reason += f"; by design ({f.cause}: {f.script})"
        else:
            c.reason += f"; confirmed {f.call} ({f.cause}: {f.script})"
