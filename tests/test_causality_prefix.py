"""The near-tie search's prefix brackets (brackets.py, near_tie.py) against targets whose
decisions follow the sequence length, and run-to-run noise met at a tie: what a bracket
sought at the inputs' length finds, the prefix must not lose."""
import math

import pytest
import torch
from trainprobes.causality.check import check

W = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) / 8


def X(seed, B=1, T=256):
    return torch.randn(B, T, 64, generator=torch.Generator().manual_seed(seed))


class CapacityRouter(torch.nn.Module):
    """Top-1 with a per-sequence capacity ceil(cf x T / E) (GShard/tutel size it from the
    tokens in the call), granted in position order (causal); dropped tokens decide -1. leak:
    minus leak x the sequence-mean logit. At half the length the capacity halves and every
    token near the middle is dropped whatever its value: no tie there."""

    def __init__(self, leak=0.0, cf=0.5, E=8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, E, generator=torch.Generator().manual_seed(1)) / 8)
        self.leak, self.cf, self.E = leak, cf, E

    def forward(self, x):
        logits = x @ self.w
        e = (logits - self.leak * logits.mean(1, keepdim=True)).argmax(-1)
        oh = torch.nn.functional.one_hot(e, self.E)
        keep = (oh.cumsum(1) * oh).sum(-1) <= math.ceil(self.cf * x.shape[1] / self.E)
        return torch.where(keep, e, -1)


@pytest.mark.parametrize("seed", range(6))
def test_a_leak_behind_a_capacity_sized_from_the_length_fails_as_at_full_length(seed):
    """Before: the prefix (half the capacity) dropped every tie, the search found no second
    value and the leak passed in 2 of 6 seeds (and reached 1-18 ties, not ~25, in the rest)."""
    res = check(CapacityRouter(leak=1e-3), X(seed), seed=seed)
    ties = res.evidence["near_tie_search"]
    assert res.verdict == "fail" and "TP-C1" in res.codes, (res.message, ties)
    assert ties["length"] == 256 and ties["reached"] >= 16


@pytest.mark.parametrize("seed", range(3))
def test_a_causal_capacity_router_is_bracketed_at_full_length_at_the_old_cost(seed):
    """The prefix decides differently from the inputs at their own values (capacity follows
    T): it is not used, so no bracket is sought twice (before: ~55 calls against ~25)."""
    res = check(CapacityRouter(), X(seed), seed=seed)
    ties = res.evidence["near_tie_search"]
    assert res.verdict == "pass" and ties["length"] == 256 and not ties["rebracketed"]
    assert ties["reached"] >= 16 and ties["evaluations"] <= 28, ties


def top4_keys(x):
    """A sparse-attention key selection as the decision: a [B, T, T] mask of each query's
    top-4 keys among those at or before it. Its width is the length."""
    T = x.shape[1]
    s = x[..., :16] @ x[..., 16:32].transpose(-1, -2)
    idx = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).topk(4, -1).indices
    return torch.zeros(s.shape, dtype=torch.bool).scatter(-1, idx, True)


def test_a_decision_whose_shape_follows_the_length_is_bracketed_at_full_length():
    """Before: TargetError 'decisions changed shape ... between calls with the same batch and
    length' (the prefix's [L, L] mask compared with the inputs' [L, T])."""
    for seed in range(3):
        res = check(top4_keys, X(seed, T=64), seed=seed)
        ties = res.evidence["near_tie_search"]
        assert res.verdict == "pass" and ties["length"] == 64 and ties["reached"] > 16


def seq_mean_top2(x):
    logits = x @ W
    return (logits - 1e-3 * logits.mean(dim=1, keepdim=True)).topk(2, -1).indices


@pytest.mark.parametrize("seed", range(3))
def test_ties_bracketed_again_are_counted_as_decisions_not_top_k_slots(seed):
    """Before: after bracketing again, 'reached' counted differing top-2 slots (56 of 32 ties
    tried) and the message said 'n of 56 decisions'."""
    res = check(seq_mean_top2, X(seed), seed=seed)
    ties = res.evidence["near_tie_search"]
    assert res.verdict == "fail"
    assert ties["reached"] <= ties["tried"] and 2 * ties["reached"] >= ties["held"], ties


def rare_noise(x):
    """Scores jitter by 1e-7 of themselves per call (as atomics would): never a flip at random
    margins, only at a tie, and then not always."""
    logits = x @ W
    return (logits * (1 + 1e-7 * torch.randn(logits.shape))).topk(2, -1).indices


@pytest.mark.parametrize("seed", [7, 9, 11, 13, 17, 67])
def test_rare_noise_at_a_tie_is_nondeterminism_even_when_no_end_moved(seed):
    """Before: the unchanged ends ran again only if the perturbed call moved one, and an end
    noise flipped at the inputs' length was taken for a length move and moved away from the
    boundary. Of seeds 0-89, 29 passed and 6 were called possible leaks (these seeds passed);
    the full-length search called 89 TP-C2. Now 3 pass and 1 warns."""
    torch.manual_seed(1000 + seed)
    res = check(rare_noise, X(seed), seed=seed)
    assert res.codes == ["TP-C2"], (res.verdict, res.message)


@pytest.mark.xfail(strict=True, reason="3 of seeds 0-89 still pass (6, 36, 79) and 1 warns "
                   "(31) where the full-length search passed 1 (83): brackets sought on the "
                   "prefix meet less noise at the inputs' length (with near_tie.SHORT = 0 the "
                   "search matches the full-length one seed for seed); cause not pinned down")
@pytest.mark.parametrize("seed", [6, 36])
def test_rare_noise_at_a_tie_is_never_a_pass(seed):
    torch.manual_seed(1000 + seed)
    res = check(rare_noise, X(seed), seed=seed)
    assert res.codes == ["TP-C2"], (res.verdict, res.message)


def test_near_tie_leaks_none_of_whose_first_records_is_structural_give_a_message():
    """Before (on main too): 64 ties before one late cut, the 20 records kept (the first
    flips) all unverified (no twin for a plain function) and a later flip structural: the
    message's next() over the records raised StopIteration out of check()."""
    res = check(seq_mean_top2, X(0, B=2), seed=0, near_ties=64, cuts=[254])
    assert res.verdict == "fail" and "TP-C1" in res.codes
    assert res.metrics["n_near_tie_leaks"] > 0 and "near-tie" in res.message
