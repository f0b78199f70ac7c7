"""`drift localize` on a GRPO generation batch: the trainer's model against the sampler's
in-process module, on the tokens the sampler drew (GRPODriftMonitor's `localize=` option).

The sampler side is what the user's `localize` callable returns for the trainer: a
trainprobes.drift.engines.Engine (its module and the function that turns its logits into
the log-probs it reports: temperature, top-p renormalisation, logprobs mode), or a bare
nn.Module, read as raw log-probs at the sampler's temperature. The trainer side is the
trainer's model with TRL's scoring, log_softmax(logits / T).

Bounded: at most `sequences` completions of the batch (the first ones), each prompt +
completion cut to `length` tokens; only completion tokens are scored (a top-p sampler's
log-probs are finite on its own samples only). Run under torch.no_grad with the RNG state
forked and every module's train/eval flag restored, outside the trainer's autocast (each
side runs in its own dtype): the run's bits do not move.
"""
from __future__ import annotations

import time

import torch
from trainprobes.drift.decompose import localize
from trainprobes.drift.engines import Engine
from trainprobes.drift.faults import temperature_logprobs
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.result import Result
from trainprobes.watch.rng import keep_rng

TARGET = "watch:grpo[localize]"


def sampler_engine(obj, temperature: float) -> Engine:
    """The sampler's Engine from what the user's callable returned."""
    if isinstance(obj, Engine):
        return obj
    if isinstance(obj, torch.nn.Module):
        return Engine(obj, temperature_logprobs(temperature), name="sampler")
    raise InvalidType(f"localize returned a {type(obj).__name__}; expected the sampler's nn.Module or a "
                      "trainprobes.drift.engines.Engine(module, logprobs=f) whose f turns its logits into the "
                      "log-probs it reports (e.g. trainprobes.drift.faults.top_p_logprobs(0.9, T))")


def batch_tokens(prompts: list, completions: list, sequences: int, length: int):
    """(input_ids, attention_mask, score_mask) [B, L], right-padded: prompt then completion,
    cut to `length`; score_mask marks completion tokens."""
    rows = [(list(p) + list(c))[:length] for p, c in zip(prompts[:sequences], completions[:sequences])]
    scored = [([0] * len(p) + [1] * len(c))[:length] for p, c in zip(prompts[:sequences], completions[:sequences])]
    n = max((len(r) for r in rows), default=0)
    if n < 2 or not any(sum(s) for s in scored):
        raise InvalidArgument(f"the batch has no completion token within the first {length} tokens of "
                              f"{len(rows)} sequences: raise localize_length")
    ids = torch.zeros((len(rows), n), dtype=torch.long)
    am = torch.zeros_like(ids)
    sm = torch.zeros_like(ids, dtype=torch.bool)
    for i, (r, s) in enumerate(zip(rows, scored)):  # a loop over sequences
        ids[i, :len(r)] = torch.as_tensor(r)
        am[i, :len(r)] = 1
        sm[i, :len(s)] = torch.as_tensor(s, dtype=torch.bool)
    return ids, am, sm


def localize_batch(trainer, engine: Engine, prompts: list, completions: list, *, sequences: int, length: int,
                   alpha: float, step: int) -> Result:
    """One localize Result for this batch; see the module docstring."""
    ids, am, sm = batch_tokens(prompts, completions, sequences, length)
    temperature = float(getattr(trainer.args, "temperature", 1.0) or 1.0)
    ref = Engine(trainer.model, temperature_logprobs(temperature), name="trainer")
    modules = {id(m): m for e in (ref, engine) for m in e.module.modules()}.values()
    modes = [(m, m.training) for m in modules]
    device = next(trainer.model.parameters()).device
    t0 = time.perf_counter()
    try:
        with keep_rng(), torch.no_grad(), torch.autocast(device.type, enabled=False):
            for m, _ in modes:
                m.training = False  # no dropout draw; restored below
            r = localize(ref, engine, ids.to(device), am.to(device), alpha=alpha, target=TARGET,
                         score_mask=sm.to(device))
    finally:
        for m, mode in modes:
            m.training = mode
    seconds = time.perf_counter() - t0
    r.metrics["localize_seconds"] = seconds
    r.evidence.update({"step": step, "sequences_cap": sequences, "length_cap": length,
                       "sequences_in_batch": len(completions), "tokens_in": int(am.sum()),
                       "completion_tokens_scored": int(sm.sum())})
    where = r.metrics.get("explained_by") or r.metrics.get("first_layer") or ""
    r.message = (f"step {step}, {int(ids.shape[0])} of {len(completions)} completions (cut to {length} tokens, "
                 f"{int(sm.sum())} completion tokens scored), {seconds:.2f} s: {r.message}"
                 + (f" [explained by {where}]" if where and where not in r.message else ""))
    return r
