"""The trainer's and the sampler's log-probs of the same tokens, read from the batches RL
trainers already hold, in their own field names and layouts. Each reader returns a TokenPair
that DriftMonitor.update (or compare) takes as it is:

    monitor.update(*verl_pair(batch))

No package is imported: the readers take the package's own container (verl DataProto,
NeMo-RL BatchedDataDict, OpenRLHF Experience) or a plain mapping of the same tensors.
The layouts, as the packages document them (read in their sources, see docs/drift_trl.md):

verl (verl/utils/debug/metrics.py calculate_debug_metrics; DataProto.batch, a TensorDict):
    old_log_probs [B, R]      the actor's (trainer's) log-probs of the response tokens
    rollout_log_probs [B, R]  the rollout engine's, with rollout.calculate_log_probs=True
    response_mask [B, R]      1 on real response tokens (responses right-padded); without it,
                              attention_mask[:, -R:] (prompt left-padded, response after it)
NeMo-RL (nemo_rl/algorithms/loss_functions.py ClippedPGLossDataDict; a BatchedDataDict):
    prev_logprobs [B, S]        the policy's log-probs over the whole sequence (prompt +
                                response, right-padded); entry i is the log-prob of token i
    generation_logprobs [B, S]  the generation backend's, same layout (0 on prompt tokens)
    token_mask [B, S]           1 on generated tokens; the loss reads [:, 1:] of all three
    sample_mask [B]             0 drops a whole sample
OpenRLHF (openrlhf/trainer/ppo_utils/experience.py Experience, a dataclass):
    action_log_probs [B, A]   the actor's log-probs of the action (response) tokens
    rollout_log_probs [B, A]  vLLM's, kept when the run asks for them
    action_mask [B, A]        True on real action tokens (right-padded by make_experience_batch)
    packed samples: [1, N] tensors of several responses end to end; pass lengths= (the
    responses' action counts) so each response stays one unit of the bias test.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from trainprobes.errors import InvalidArgument, InvalidType


class TokenPair(NamedTuple):
    """One batch's token log-probs: trainer's and sampler's, the mask of real tokens, and
    (packed inputs only) the length of each response. Unpacks into DriftMonitor.update."""

    train: torch.Tensor
    infer: torch.Tensor
    mask: torch.Tensor | None
    lengths: torch.Tensor | None = None


def _fields(container, source: str) -> Mapping:
    """The tensors of a package's container, by name."""
    if isinstance(container, Mapping):
        return container
    batch = getattr(container, "batch", None)  # verl DataProto: tensors in .batch
    if batch is not None and hasattr(batch, "keys"):
        return batch
    if hasattr(container, "__dataclass_fields__"):  # OpenRLHF Experience
        return {k: getattr(container, k) for k in container.__dataclass_fields__}
    raise InvalidType(f"{source}: got a {type(container).__name__}; expected the package's batch "
                      "(verl DataProto, NeMo-RL BatchedDataDict, OpenRLHF Experience) or a dict of "
                      "its tensors")


def _get(fields: Mapping, name: str, source: str, hint: str) -> torch.Tensor:
    try:
        has = name in fields.keys()
    except Exception:
        has = False
    value = fields[name] if has else None
    if value is None:
        present = sorted(str(k) for k in fields.keys() if fields[k] is not None)
        raise InvalidArgument(f"{source} has no {name!r} ({hint}); it holds {present}")
    if not isinstance(value, torch.Tensor):
        raise InvalidType(f"{source}[{name!r}] is a {type(value).__name__}, expected a tensor")
    return value.detach()


def _same_shape(source: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t.shape != ref.shape:
            raise InvalidArgument(f"{source}[{name!r}] has shape {tuple(t.shape)}, expected "
                                  f"{tuple(ref.shape)} like {ref_name!r}")


def verl_pair(batch) -> TokenPair:
    """verl's batch (DataProto or dict): old_log_probs vs rollout_log_probs on the response
    tokens, masked by response_mask (or the response part of attention_mask)."""
    src = "verl batch"
    f = _fields(batch, src)
    train = _get(f, "old_log_probs", src, "the actor's recomputed log-probs")
    infer = _get(f, "rollout_log_probs", src, "set actor_rollout_ref.rollout.calculate_log_probs=True")
    if train.ndim != 2:
        raise InvalidArgument(f"{src}['old_log_probs'] has shape {tuple(train.shape)}, expected "
                              "[batch, response_length]")
    _same_shape(src, "old_log_probs", train, rollout_log_probs=infer)
    if f.get("response_mask") is not None:
        mask = _get(f, "response_mask", src, "")
    elif f.get("attention_mask") is not None:
        am = _get(f, "attention_mask", src, "")
        if am.ndim != 2 or am.shape[0] != train.shape[0] or am.shape[1] < train.shape[1]:
            raise InvalidArgument(f"{src}['attention_mask'] has shape {tuple(am.shape)}; expected "
                                  f"[{train.shape[0]}, prompt + {train.shape[1]}] (prompt then response)")
        mask = am[:, -train.shape[1]:]
    else:
        raise InvalidArgument(f"{src} has neither 'response_mask' nor 'attention_mask': padding "
                              "cannot be told from tokens")
    _same_shape(src, "old_log_probs", train, response_mask=mask)
    return TokenPair(train, infer, mask.bool())


def nemo_rl_pair(data) -> TokenPair:
    """NeMo-RL's loss data (BatchedDataDict or dict): prev_logprobs vs generation_logprobs,
    dropping position 0 as its loss does, masked by token_mask and sample_mask."""
    src = "NeMo-RL data"
    f = _fields(data, src)
    train = _get(f, "prev_logprobs", src, "the policy's log-probs of the generated tokens")
    infer = _get(f, "generation_logprobs", src, "the generation backend's log-probs")
    token_mask = _get(f, "token_mask", src, "1 on generated tokens")
    if train.ndim != 2 or train.shape[1] < 2:
        raise InvalidArgument(f"{src}['prev_logprobs'] has shape {tuple(train.shape)}, expected "
                              "[batch, sequence_length >= 2]")
    _same_shape(src, "prev_logprobs", train, generation_logprobs=infer, token_mask=token_mask)
    mask = token_mask[:, 1:].bool()
    if f.get("sample_mask") is not None:
        sm = _get(f, "sample_mask", src, "")
        if sm.shape != (train.shape[0],):
            raise InvalidArgument(f"{src}['sample_mask'] has shape {tuple(sm.shape)}, expected "
                                  f"({train.shape[0]},): one flag per sample")
        mask = mask & sm.bool()[:, None]
    return TokenPair(train[:, 1:], infer[:, 1:], mask)


def openrlhf_pair(experience, lengths=None) -> TokenPair:
    """OpenRLHF's Experience (or dict): action_log_probs vs rollout_log_probs, masked by
    action_mask. Packed [1, N] samples need lengths= (one count per response)."""
    src = "OpenRLHF experience"
    f = _fields(experience, src)
    train = _get(f, "action_log_probs", src, "the actor's log-probs of the action tokens")
    infer = _get(f, "rollout_log_probs", src, "vLLM's log-probs; the run must keep them")
    _same_shape(src, "action_log_probs", train, rollout_log_probs=infer)
    mask = f.get("action_mask")
    if mask is not None:
        mask = _get(f, "action_mask", src, "")
        _same_shape(src, "action_log_probs", train, action_mask=mask)
        mask = mask.bool()
    if lengths is None:
        if train.ndim != 2:
            raise InvalidArgument(f"{src}['action_log_probs'] has shape {tuple(train.shape)}, "
                                  "expected [batch, actions]")
        return TokenPair(train, infer, mask)
    if train.ndim != 2 or train.shape[0] != 1:
        raise InvalidArgument(f"lengths= is for packed samples ([1, N] tensors); "
                              f"action_log_probs has shape {tuple(train.shape)}")
    lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
    n = train.shape[1]
    if int(lengths.sum()) > n or int(lengths.min()) < 1:
        raise InvalidArgument(f"lengths {lengths.tolist()} must be positive and sum to at most the "
                              f"{n} packed actions")
    used = int(lengths.sum())  # the rest is padding after the last response
    m = mask[0, :used] if mask is not None else None
    return TokenPair(train[0, :used], infer[0, :used], m, lengths)
