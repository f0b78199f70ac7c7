"""Reference MoE routers with known causal properties: positive and negative controls.

Every router maps router logits `[B, T, E]` (batch, position, expert) to a pair
`(decision, scores)`: the decision is what training acts on (expert ids `[B, T, k]`, -1 for a
dropped slot, or a 0/1 assignment mask `[B, T, E]`), and `scores` `[B, T, E]` are the routing
scores the decision was taken from (its runner-up gap is the routing margin). Capacity is
computed from the number of tokens a router sees, as in the papers, so it changes with the
sequence length (truncation) but not with token values (perturbation).

Known verdicts (perturb = future tokens change; truncate = the inference view, prefix only):

  router                 perturb  truncate  why
  topk_softmax           causal   causal    per-token softmax and top-k
  topk_sigmoid           causal   causal    per-token sigmoid and top-k
  group_limited_topk     causal   causal    DeepSeek-V3: per-token groups, static bias
  capacity_by_position   causal   leaky     slots granted in position order (ties by position),
                                            but capacity C = ceil(f*T*k/E) depends on T
  capacity_gshard_order  leaky    leaky     all first choices before any second choice: a later
                                            token's first choice outranks an earlier second one
  drop_by_probability    leaky    leaky     a token keeps its slot only if later tokens bid lower
  expert_choice          leaky    leaky     each expert picks its top-C tokens of the sequence
                                            (flaxformer ExpertsChooseMaskedRouter: not for decoders)
  batch_prioritized      leaky    leaky     V-MoE BPR: priority sorted over the whole batch;
                                            also not batch-isolated
  sequence_normalized    leaky    leaky     logits standardised over the sequence axis
"""
from __future__ import annotations

import math

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_int, check_number, check_tensor

__all__ = [
    "topk_softmax", "topk_sigmoid", "group_limited_topk", "capacity_by_position",
    "capacity_gshard_order", "drop_by_probability", "expert_choice", "batch_prioritized", "sequence_normalized",
    "capacity", "KNOWN_VERDICTS",
]

# name -> (causal under perturbation, causal under truncation)
KNOWN_VERDICTS = {
    "topk_softmax": (True, True),
    "topk_sigmoid": (True, True),
    "group_limited_topk": (True, True),
    "capacity_by_position": (True, False),
    "capacity_gshard_order": (False, False),
    "drop_by_probability": (False, False),
    "expert_choice": (False, False),
    "batch_prioritized": (False, False),
    "sequence_normalized": (False, False),
}


def _check_logits(logits, k: int | None = None) -> None:
    check_tensor(logits, "logits", kind="floating", ndim=3, hint="router logits [B, T, E]")
    if k is not None:
        check_int(k, "k", min=1, max=logits.shape[-1], hint="experts per token, at most E")


def capacity(n_tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(capacity_factor * n_tokens * k / n_experts), at least 1
    (GShard / Switch Transformer expert capacity)."""
    check_number(capacity_factor, "capacity_factor", min=0, min_open=True, hint="e.g. 1.25")
    return max(1, math.ceil(capacity_factor * n_tokens * k / n_experts))


def topk_softmax(logits: torch.Tensor, k: int = 2):
    """Mixtral/Switch token choice: softmax over experts, top-k per token. Causal."""
    _check_logits(logits, k)
    probs = logits.softmax(dim=-1)
    return probs.topk(k, dim=-1).indices, probs


def topk_sigmoid(logits: torch.Tensor, k: int = 2):
    """Token choice with independent sigmoid scores, top-k per token. Causal."""
    _check_logits(logits, k)
    scores = logits.sigmoid()
    return scores.topk(k, dim=-1).indices, scores


def group_limited_topk(logits: torch.Tensor, k: int = 2, n_groups: int = 4, topk_groups: int = 2,
                       bias: torch.Tensor | None = None):
    """DeepSeek-V3 routing: sigmoid scores plus a static per-expert bias choose the experts;
    experts are split into n_groups, a group scores the sum of its best two, only the
    topk_groups best groups are eligible. Every step is per token: causal.

    bias: [E]; default a fixed ramp in [-0.05, 0.05] (the load-balancing bias is a parameter
    updated between steps, never a function of the current batch)."""
    _check_logits(logits, k)
    B, T, E = logits.shape
    check_int(n_groups, "n_groups", min=1)
    check_int(topk_groups, "topk_groups", min=1)
    if E % n_groups or not 1 <= topk_groups <= n_groups or k > topk_groups * E // n_groups:
        raise InvalidArgument(f"n_groups={n_groups!r}, topk_groups={topk_groups!r}, k={k!r} do not "
                              f"fit E={E}: need E % n_groups == 0 and k <= topk_groups * E / n_groups")
    if bias is None:
        bias = torch.linspace(-0.05, 0.05, E, dtype=logits.dtype)
    scores = logits.sigmoid()
    biased = scores + bias.to(scores)
    grouped = biased.view(B, T, n_groups, E // n_groups)
    group_score = grouped.topk(min(2, E // n_groups), dim=-1).values.sum(-1)
    keep_group = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
        -1, group_score.topk(topk_groups, dim=-1).indices, True)
    eligible = keep_group.repeat_interleave(E // n_groups, dim=-1)
    ids = biased.masked_fill(~eligible, float("-inf")).topk(k, dim=-1).indices
    return ids, scores


def _rank_in_expert(expert: torch.Tensor, priority: torch.Tensor) -> torch.Tensor:
    """For slots [G, N] with expert ids and priorities, the rank of each slot among the
    slots of its group that chose the same expert, highest priority first, ties broken by
    slot index (stable sorts, so the order is specified, unlike torch.topk's)."""
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, torch.sort(expert.gather(-1, order), dim=-1, stable=True).indices)
    sorted_expert = expert.gather(-1, order)
    idx = torch.arange(expert.shape[-1], device=expert.device).expand_as(expert)
    # first index of each expert's run in the sorted order
    new_run = torch.ones_like(sorted_expert, dtype=torch.bool)
    new_run[..., 1:] = sorted_expert[..., 1:] != sorted_expert[..., :-1]
    run_start = torch.cummax(torch.where(new_run, idx, torch.zeros_like(idx)), dim=-1).values
    return torch.empty_like(idx).scatter_(-1, order, idx - run_start)


def _drop(logits, k, capacity_factor, priority_of, per_batch=False):
    """Token choice top-k, then capacity: a slot is kept if its rank among the slots that
    chose its expert is below C. Slots are ordered position-major ([t0 k0, t0 k1, t1 k0 ...]),
    so priority ties fall to the earlier token. Returns ids with -1 where dropped."""
    _check_logits(logits, k)
    B, T, E = logits.shape
    probs = logits.softmax(dim=-1)
    top = probs.topk(k, dim=-1)
    G = 1 if per_batch else B
    expert = top.indices.reshape(G, -1)
    priority = priority_of(top.values, probs).reshape(G, -1)
    n_tokens = B * T if per_batch else T
    keep = _rank_in_expert(expert, priority) < capacity(n_tokens, E, k, capacity_factor)
    ids = torch.where(keep.view(B, T, k), top.indices, torch.full_like(top.indices, -1))
    return ids, probs


def capacity_by_position(logits: torch.Tensor, k: int = 1, capacity_factor: float = 1.0):
    """Token choice with capacity; slots are granted in position order within a sequence
    (GShard-style cumsum, but position-major over the k choices; ranking all first choices
    before any second choice, as GShard does, would let later tokens take earlier tokens'
    second slots). Causal under perturbation; capacity depends on T, so truncation differs."""
    def by_position(top_values, probs):
        B, T, k_ = top_values.shape
        return -torch.arange(T * k_, dtype=torch.float64, device=top_values.device).expand(
            B, T * k_).reshape(B, T, k_)
    return _drop(logits, k, capacity_factor, by_position)


def capacity_gshard_order(logits: torch.Tensor, k: int = 2, capacity_factor: float = 1.0):
    """Token choice top-k with capacity, slots granted in GShard's order: every token's first
    choice in position order, then every token's second choice, ... (the top-2 dispatch of
    GShard / Switch-style cumsum per choice). Leaky for k >= 2: a later token's first choice
    takes the slot an earlier token's second choice would have had."""
    def k_major(top_values, probs):
        B, T, k_ = top_values.shape
        j = torch.arange(k_, dtype=torch.float64, device=top_values.device)[None, :]
        t = torch.arange(T, dtype=torch.float64, device=top_values.device)[:, None]
        return -(j * T + t).expand(B, T, k_)
    return _drop(logits, k, capacity_factor, k_major)


def drop_by_probability(logits: torch.Tensor, k: int = 1, capacity_factor: float = 1.0):
    """Token choice with capacity; when an expert overflows it keeps the tokens with the
    highest router probability in the sequence. Leaky: later tokens outbid earlier ones."""
    return _drop(logits, k, capacity_factor, lambda top_values, probs: top_values)


def batch_prioritized(logits: torch.Tensor, k: int = 1, capacity_factor: float = 1.0):
    """V-MoE batch-prioritised routing (Riquelme et al. 2021): all B*T tokens of the batch
    are ranked by their top router probability and served in that order, with capacity
    for the whole batch. Leaky within a sequence and across sequences of the batch."""
    return _drop(logits, k, capacity_factor,
                 lambda top_values, probs: top_values[..., :1].expand_as(top_values),
                 per_batch=True)


def expert_choice(logits: torch.Tensor, capacity_factor: float = 1.0):
    """Expert choice (Zhou et al. 2022): every expert takes its top-C tokens of the sequence,
    C = ceil(f * T / E). Returns a 0/1 mask [B, T, E] of (token, expert) assignments. Leaky."""
    _check_logits(logits)
    B, T, E = logits.shape
    probs = logits.softmax(dim=-1)
    C = min(T, capacity(T, E, 1, capacity_factor))
    chosen = probs.topk(C, dim=1).indices  # [B, C, E]: token positions per expert
    mask = torch.zeros(B, T, E, dtype=torch.long, device=logits.device).scatter_(1, chosen, 1)
    return mask, probs


def sequence_normalized(logits: torch.Tensor, k: int = 1):
    """Router logits standardised over the sequence axis before the top-k (a normalisation
    layer applied on the wrong axis, cf. dm-haiku#700). Leaky: the mean and std include
    future tokens."""
    _check_logits(logits, k)
    mean = logits.mean(dim=1, keepdim=True)
    z = (logits - mean) / (logits.std(dim=1, keepdim=True, correction=0) + 1e-6)
    probs = z.softmax(dim=-1)
    return probs.topk(k, dim=-1).indices, probs
