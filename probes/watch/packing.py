"""Packed-document isolation on the run's own batch: the model called exactly as the batch
says (every key its collator made), only one document's tokens changed at a time
(trainprobes.isolation.documents). The collator trap it catches: DataCollatorWithFlattening's
restarting position ids beside an all-ones 2-D attention_mask, which transformers reads as
one sequence per row under eager and sdpa attention (docs/isolation.md).

    check_batch(model, batch) -> Result (isolation.documents) or None (the batch is not packed)

It changes nothing of the run: the forwards run under torch.no_grad() in eval mode (dropout
off, so the check is deterministic; the model's mode is restored; under gradient
checkpointing without a cache, as the training forward had it: config.use_cache restored), inside keep_rng() (python's
`random`, numpy's and torch's CPU and CUDA generators come back as they were), on the
unwrapped model (no DDP collective is issued).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.isolation import Packing, documents
from trainprobes.watch.convention import document_starts
from trainprobes.watch.rng import keep_rng

SKIP = ("input_ids", "labels")  # perturbed here / the loss is not looked at
# per-token outputs compared: logits at this many vocabulary columns (drawn with the seed).
# The probe holds d + 2 outputs and float64 differences of them: full logits of a 32000-token
# vocabulary over 1 x 1024 tokens and 16 documents took 15 GiB. A leak reaches the logits
# through the hidden state, which moves every column, so a few columns show it.
COLUMNS = 32


def packing_of(batch: Mapping) -> Packing | None:
    """The documents of a batch, by every convention it holds (restarting position ids,
    seq_idx, cu_seq_lens_q: convention.document_starts); None when no row holds two."""
    starts = document_starts(batch)
    return None if starts is None else Packing.from_doc_ids(starts.long().cumsum(1))


def check_batch(model, batch: Mapping, *, seed: int = 0, target: str | None = None,
                max_documents: int | None = None):
    """max_documents: a batch of more documents is refused (InvalidArgument) before any
    forward: the check costs d + 2 forwards of the batch."""
    if not isinstance(batch, Mapping):
        raise InvalidType(f"batch is a {type(batch).__name__}; the packing check reads a dict of "
                          "tensors (input_ids, position_ids, ...) as a collator returns it")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InvalidArgument("batch['input_ids'] must be a [B, L] tensor of token ids, got "
                              f"{type(ids).__name__}{tuple(ids.shape) if isinstance(ids, torch.Tensor) else ''}")
    packing = packing_of(batch)
    if packing is None:
        return None
    d = len(packing.documents)
    if max_documents is not None and d > max_documents:
        raise InvalidArgument(
            f"the batch holds {d} documents: the check would take {d + 2} forwards of it, over "
            f"max_documents={max_documents} (a stall on this rank that the other ranks wait out); "
            "raise max_documents to check it")
    if not isinstance(model, torch.nn.Module):
        raise InvalidType(f"model is a {type(model).__name__}, not a torch.nn.Module")
    rest = {k: v for k, v in batch.items() if k not in SKIP}
    name = target or f"watch:batch[{type(model).__name__},{'+'.join(sorted(rest))}]"

    seen = {}  # the output's feature size and the columns kept, fixed at the first call

    def fn(tokens, _packing):
        out = model(input_ids=tokens, **rest)
        y = out.logits if hasattr(out, "logits") else out[0]
        if not isinstance(y, torch.Tensor) or y.dim() != 3 or y.shape[-1] <= COLUMNS:
            return y
        if "cols" not in seen:
            g = torch.Generator().manual_seed(seed)
            seen["features"] = y.shape[-1]
            seen["cols"] = torch.randperm(y.shape[-1], generator=g)[:COLUMNS].sort().values.to(y.device)
        return y.index_select(-1, seen["cols"])  # a copy: the full logits are freed

    modes = [(m, m.training) for m in model.modules()]  # each submodule's own (a frozen part)
    caches = _cache_off_in_training(model)
    if caches and "use_cache" in rest:
        rest["use_cache"] = False
    with keep_rng(), torch.no_grad():
        model.eval()
        for c in caches:
            c.use_cache = False
        try:
            r = documents(fn, ids, packing, fp64=False, causal=False, seed=seed, target=name)
        finally:
            for m, mode in modes:
                m.training = mode
            for c in caches:
                c.use_cache = True
    r.evidence["batch_keys"] = sorted(batch)
    if "cols" in seen:
        r.evidence["outputs_compared"] = (f"{COLUMNS} of {seen['features']} output columns (logits "
                                          f"at vocabulary ids drawn with seed {seed})")
    if caches:
        r.evidence["use_cache"] = ("False, as in the training forward: under gradient "
                                   "checkpointing transformers turns the cache off")
    r.evidence["mode"] = "eval (dropout off), no_grad, the batch's own keys"
    return r


def _cache_off_in_training(model) -> list:
    """The configs whose use_cache=True a training forward ignores: under gradient
    checkpointing (a module's `gradient_checkpointing` True) transformers 5.25 turns the
    cache off when training with grad enabled (merge_with_config_defaults,
    GradientCheckpointingLayer), and the check's eval, no_grad forwards would keep it; with
    a cache, packed position ids are not read into the mask: a leak the run does not have."""
    # the module that decides (LlamaModel: its own `gradient_checkpointing` and config),
    # not a checkpointed part elsewhere (a vision tower) beside an uncheckpointed text model
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()
                                  if getattr(m, "gradient_checkpointing", False) is True)
               if getattr(c, "use_cache", None) is True}
    return list(configs.values())

