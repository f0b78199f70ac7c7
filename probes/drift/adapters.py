"""Adapters for engines users have: HF transformers (training side) and vLLM (inference side).

Neither package is imported unless asked for, and each import failure says what to install.
`vllm_logprobs` is duck-typed on vLLM's output objects, so it reads them without vLLM:
    RequestOutput.prompt_token_ids: list[int]
    RequestOutput.outputs: list[CompletionOutput]
    CompletionOutput.token_ids: list[int]
    CompletionOutput.logprobs: list (one per generated position) of dict token_id -> Logprob,
        Logprob.logprob: float; the sampled token is always in its position's dict.
(vLLM fills `logprobs` only when SamplingParams(logprobs=k) is set; k=0 returns just the
sampled token. Which distribution they describe is vLLM's `logprobs_mode`: raw by default.)
"""
from __future__ import annotations

import math

import torch
from trainprobes.drift.io import Rollouts
from trainprobes.errors import InvalidArgument, InvalidType, MissingDependency
from trainprobes.validation import check_int, check_number


def _require(package: str, extra: str):
    try:
        return __import__(package)
    except ImportError:
        raise MissingDependency(f"this adapter needs {package!r}, which is not installed: "
                                f"pip install {extra}") from None


@torch.no_grad()
def hf_token_logprobs(model, input_ids, attention_mask=None, *, temperature: float = 1.0,
                      batch_size: int | None = None) -> tuple:
    """Training-side log-probs from a HF causal LM: log softmax(logits / T) of each token given
    its prefix, in one full-sequence forward per batch (the trainer's view).

    model: a transformers causal LM, or a local directory saved with save_pretrained (loaded
    with local_files_only=True: nothing is downloaded). input_ids: [B, L] ints, right-padded;
    attention_mask: [B, L] (1 = real). Returns (logprobs [B, L-1], mask [B, L-1]) aligned
    with tokens 1..L-1; entry (b, i) is log p(input_ids[b, i+1] | input_ids[b, :i+1]).
    """
    if isinstance(model, str):
        transformers = _require("transformers", "'trainprobes[hf]'")
        model = transformers.AutoModelForCausalLM.from_pretrained(model, local_files_only=True)
    if not callable(model):
        raise InvalidType(f"model={model!r} must be a transformers causal LM or a local path")
    check_number(temperature, "temperature", min=0, min_open=True)
    if batch_size is not None:
        check_int(batch_size, "batch_size", min=1)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise InvalidArgument(f"input_ids has shape {tuple(ids.shape)}, expected [B, L] with L >= 2")
    am = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask, dtype=torch.long)
    if am.shape != ids.shape:
        raise InvalidArgument(f"attention_mask has shape {tuple(am.shape)}, expected {tuple(ids.shape)}")
    step = batch_size or ids.shape[0]
    out = []
    for start in range(0, ids.shape[0], step):  # loop over batches
        b_ids, b_am = ids[start:start + step], am[start:start + step]
        logits = model(input_ids=b_ids, attention_mask=b_am).logits
        lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
        out.append(lp.gather(2, b_ids[:, 1:, None]).squeeze(2))
    mask = (am[:, 1:] > 0) & (am[:, :-1] > 0)
    return torch.where(mask, torch.cat(out), 0.0), mask


def vllm_logprobs(request_outputs, *, completion: int = 0) -> Rollouts:
    """Sampled-token log-probs from vLLM `LLM.generate` outputs, as [B, T] Rollouts.

    completion: which of the n completions per request to read. Raises naming the request and
    position when log-probs are missing (generate with SamplingParams(logprobs=0)).
    """
    check_int(completion, "completion", min=0, hint="which of the n completions per request")
    outs = list(request_outputs)
    if not outs:
        raise InvalidArgument("request_outputs is empty")
    rows, prompts = [], []
    for r, req in enumerate(outs):  # loop over requests
        try:
            comp = req.outputs[completion]
        except (AttributeError, IndexError, TypeError):
            raise InvalidArgument(f"request_outputs[{r}] has no outputs[{completion}]; expected vLLM "
                                  f"RequestOutput objects") from None
        ids, lps = list(comp.token_ids), comp.logprobs
        if lps is None:
            raise InvalidArgument(f"request_outputs[{r}].outputs[{completion}].logprobs is None: generate "
                                  f"with SamplingParams(logprobs=0) to get the sampled tokens' log-probs")
        if len(lps) != len(ids):
            raise InvalidArgument(f"request_outputs[{r}].outputs[{completion}] has {len(ids)} token_ids but "
                                  f"{len(lps)} logprobs positions")
        vals = []
        for i, (tok, pos) in enumerate(zip(ids, lps)):  # vLLM hands one dict per position
            try:
                entry = pos[tok]
            except (KeyError, TypeError, IndexError):
                raise InvalidArgument(f"request_outputs[{r}].outputs[{completion}].logprobs[{i}] has no entry "
                                      f"for the sampled token {tok}") from None
            v = getattr(entry, "logprob", entry)
            if not isinstance(v, (int, float)) or not math.isfinite(v) and v != -math.inf:
                raise InvalidArgument(f"request_outputs[{r}].outputs[{completion}].logprobs[{i}][{tok}] = "
                                      f"{v!r} is not a log-prob")
            vals.append(float(v))
        rows.append((ids, vals))
        prompts.append(list(getattr(req, "prompt_token_ids", None) or []))
    B, T = len(rows), max(len(ids) for ids, _ in rows)
    if T == 0:
        raise InvalidArgument("no request generated any token")
    token_ids = torch.zeros(B, T, dtype=torch.long)
    infer = torch.zeros(B, T)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (ids, vals) in enumerate(rows):  # loop over requests
        token_ids[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        infer[b, :len(vals)] = torch.tensor(vals)
        mask[b, :len(ids)] = True
    return Rollouts(infer_logprobs=infer, mask=mask, token_ids=token_ids, prompt_ids=prompts,
                    source="vllm")


def recompute_with_hf(model, rollouts: Rollouts, *, temperature: float = 1.0,
                      pad_id: int = 0) -> torch.Tensor:
    """Train-side log-probs [B, T] for the completion tokens of `rollouts` (which need
    prompt_ids and token_ids), with a HF causal LM over prompt + completion, right-padded."""
    if rollouts.prompt_ids is None or rollouts.token_ids is None:
        raise InvalidArgument("rollouts need prompt_ids and token_ids to recompute with a model")
    B, T = rollouts.token_ids.shape
    lens = [len(p) for p in rollouts.prompt_ids]
    if min(lens) < 1:
        raise InvalidArgument("every rollout needs a non-empty prompt_ids to condition the first token on")
    L = max(lens) + T
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(rollouts.prompt_ids):  # loop over sequences
        n = int(rollouts.mask[b].sum())
        ids[b, :lens[b]] = torch.as_tensor(p, dtype=torch.long)
        ids[b, lens[b]:lens[b] + T] = rollouts.token_ids[b]
        am[b, :lens[b] + n] = 1
    lp, _ = hf_token_logprobs(model, ids, am, temperature=temperature)
    at = torch.tensor(lens)[:, None] - 1 + torch.arange(T)[None, :]
    return torch.where(rollouts.mask, lp.gather(1, at), 0.0)
