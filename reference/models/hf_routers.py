"""Routers for transformers MoE blocks whose causality is known from the mechanism, to put
in place of a block's own token-choice gate (`patch_gates`) as controls for the zoo sweep.

Each returns what the transformers 5 Mixtral-style gate returns, (router_logits [N, E],
top_k_weights [N, E], top_k_index [N, E]), over the N = B * T tokens of the call flattened;
an index equal to E marks a slot the experts skip (the eager experts loop drops
`expert_idx == num_experts`).

  ExpertChoiceRouter     each expert takes its top-c tokens of the whole call by probability
                         (Zhou et al. 2022): a token's experts depend on every other token,
                         the future included: non-causal by design (flaxformer's
                         ExpertsChooseMaskedRouter says as much).
  ProbabilityCapacityRouter  token choice top-k, then each expert keeps its c most probable
                         tokens of the call (probability-priority dropping): non-causal.
"""
from __future__ import annotations

import torch

__all__ = ["ExpertChoiceRouter", "ProbabilityCapacityRouter", "patch_gates"]


class _Router(torch.nn.Module):
    def __init__(self, gate, capacity_factor: float = 1.0):
        super().__init__()
        self.weight, self.top_k = gate.weight, gate.top_k
        self.num_experts, self.capacity_factor = gate.weight.shape[0], capacity_factor

    def _probs(self, h):
        logits = torch.nn.functional.linear(h.reshape(-1, self.weight.shape[1]), self.weight)
        return logits, torch.softmax(logits.float(), -1)

    def _capacity(self, n: int) -> int:
        return max(1, int(self.capacity_factor * n * self.top_k / self.num_experts))


class ExpertChoiceRouter(_Router):
    def forward(self, h):
        logits, p = self._probs(h)
        N, E = p.shape
        chosen = torch.zeros_like(p, dtype=torch.bool)
        top = p.topk(min(self._capacity(N), N), dim=0).indices        # [c, E]: tokens per expert
        chosen.scatter_(0, top, True)
        index = torch.where(chosen, torch.arange(E).expand(N, E), E)
        return logits, torch.where(chosen, p, 0.0).to(h.dtype), index


class ProbabilityCapacityRouter(_Router):
    def forward(self, h):
        logits, p = self._probs(h)
        N, E = p.shape
        val, idx = p.topk(self.top_k, -1)
        picked = torch.zeros_like(p).scatter(1, idx, val)                  # [N, E] token choice
        keep = torch.zeros_like(p, dtype=torch.bool)
        top = picked.topk(min(self._capacity(N), N), dim=0)                # most probable first
        keep.scatter_(0, top.indices, top.values > 0)
        index = torch.where(keep, torch.arange(E).expand(N, E), E)
        return logits, torch.where(keep, picked, 0.0).to(h.dtype), index


def patch_gates(model, router_cls, **kw) -> int:
    """Replace every MoE block's `gate` (a module with weight [E, D] and top_k) by
    router_cls(gate, **kw); returns how many were replaced.

    The block's experts are switched to transformers' eager loop, the one implementation
    that skips the index E these routers put in unchosen slots: the grouped_mm experts
    (transformers/integrations/moe.py, grouped_mm_experts_forward) sort E to the tail and
    mask it only under expert parallelism, and torch's CPU grouped_mm leaves the rows past
    offs[-1] uninitialised, so those slots would multiply whatever the allocator last left
    there (a NaN, late in a long process) by their weight 0."""
    n = 0
    for m in model.modules():
        g = getattr(m, "gate", None)
        if g is not None and hasattr(g, "top_k") and isinstance(getattr(g, "weight", None), torch.nn.Parameter):
            m.gate = router_cls(g, **kw)
            cfg = getattr(getattr(m, "experts", None), "config", None)
            if getattr(cfg, "_experts_implementation", "eager") != "eager":
                cfg._experts_implementation = "eager"
            n += 1
    return n
