"""Reference routers: the mechanisms their known verdicts rest on, checked directly."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainprobes.reference import routing as r

ROUTERS = list(r.KNOWN_VERDICTS)


def logits(B=3, T=40, E=8, seed=0, dtype=torch.float32):
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def brute_rank(expert, priority):
    """Rank of each slot among its expert's slots: higher priority first, then lower index."""
    out = []
    for g in range(len(expert)):
        row = []
        for n in range(len(expert[g])):
            row.append(sum(1 for m in range(len(expert[g])) if expert[g][m] == expert[g][n] and
                           (priority[g][m] > priority[g][n] or
                            (priority[g][m] == priority[g][n] and m < n))))
        out.append(row)
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 12), st.integers(1, 4), st.integers(0, 10_000))
def test_rank_in_expert_matches_brute_force(G, N, E, seed):
    g = torch.Generator().manual_seed(seed)
    expert = torch.randint(0, E, (G, N), generator=g)
    priority = torch.randint(0, 3, (G, N), generator=g).float()  # many ties on purpose
    got = r._rank_in_expert(expert, priority)
    assert got.tolist() == brute_rank(expert.tolist(), priority.tolist())


@pytest.mark.parametrize("name", ROUTERS)
def test_output_shapes_and_scores(name):
    x = logits()
    dec, scores = getattr(r, name)(x)
    assert dec.shape[:2] == x.shape[:2] and not dec.is_floating_point()
    assert scores.shape == x.shape and scores.is_floating_point()


@pytest.mark.parametrize("name", ["capacity_by_position", "drop_by_probability", "batch_prioritized"])
@pytest.mark.parametrize("cf", [0.5, 1.0])
def test_capacity_is_respected(name, cf):
    x = logits(T=64)
    ids, _ = getattr(r, name)(x, capacity_factor=cf)
    B, T, E = x.shape
    per_batch = name == "batch_prioritized"
    C = r.capacity(B * T if per_batch else T, E, 1, cf)
    counts = torch.stack([(ids == e).flatten(0 if per_batch else 1).sum(-1) for e in range(E)])
    assert counts.max() <= C
    assert (ids == -1).any()  # cf <= 1 with a random router overflows some expert


def test_position_priority_drops_only_later_tokens():
    x = logits(T=64)
    ids, probs = r.capacity_by_position(x, capacity_factor=0.5)
    chosen = probs.argmax(-1)
    for b in range(x.shape[0]):
        for e in range(x.shape[-1]):
            pos = (chosen[b] == e).nonzero().flatten()
            kept = ids[b, pos, 0] == e
            # kept slots are exactly the first C tokens that chose e, in position order
            assert kept.tolist() == sorted(kept.tolist(), reverse=True)


def test_gshard_order_serves_every_first_choice_before_any_second_choice():
    x = logits(B=2, T=24, E=4)
    ids, probs = r.capacity_gshard_order(x, k=2, capacity_factor=0.5)
    top = probs.topk(2, dim=-1).indices
    C = r.capacity(24, 4, 2, 0.5)
    for b in range(2):
        slots = [(j, t) for j in range(2) for t in range(24)]  # k-major, then position
        used = {e: 0 for e in range(4)}
        for j, t in slots:
            e = int(top[b, t, j])
            assert int(ids[b, t, j]) == (e if used[e] < C else -1)
            used[e] += 1


def test_probability_priority_keeps_the_most_confident():
    x = logits(T=64)
    ids, probs = r.drop_by_probability(x, capacity_factor=0.5)
    top = probs.max(-1)
    for b in range(x.shape[0]):
        for e in range(x.shape[-1]):
            mine = top.indices[b] == e
            kept = mine & (ids[b, :, 0] == e)
            dropped = mine & (ids[b, :, 0] == -1)
            if kept.any() and dropped.any():
                assert top.values[b][kept].min() >= top.values[b][dropped].max()


def test_expert_choice_gives_every_expert_its_capacity():
    x = logits(T=40, E=8)
    mask, _ = r.expert_choice(x, capacity_factor=1.0)
    assert (mask.sum(1) == math.ceil(40 / 8)).all()


def test_group_limited_picks_only_from_the_best_groups():
    x = logits(E=8)
    bias = torch.linspace(-0.05, 0.05, 8)
    ids, scores = r.group_limited_topk(x, k=2, n_groups=4, topk_groups=2, bias=bias)
    grouped = (scores + bias).view(*x.shape[:2], 4, 2)
    best_groups = grouped.sum(-1).topk(2, dim=-1).indices  # group size 2: the top-2 sum is the sum
    assert all(set((ids[b, t] // 2).tolist()) <= set(best_groups[b, t].tolist())
               for b in range(x.shape[0]) for t in range(x.shape[1]))


@pytest.mark.parametrize("name", ROUTERS)
def test_prefix_view_matches_known_truncation_verdict(name):
    """The truncation half of KNOWN_VERDICTS, without the probe: prefixes decide alike iff causal."""
    x = logits(T=48, seed=1)
    fn = getattr(r, name)
    full = fn(x)[0]
    same = all(torch.equal(fn(x[:, :c + 1])[0], full[:, :c + 1]) for c in range(0, 47, 3))
    assert same == r.KNOWN_VERDICTS[name][1]


@pytest.mark.parametrize("bad, exc, match", [
    (torch.randn(4, 8), ValueError,
     r"^logits has shape \(4, 8\), expected 3 dimensions \(router logits \[B, T, E\]\)$"),
    (torch.randint(0, 3, (2, 4, 8)), TypeError,
     r"^logits has dtype torch.int64, expected a floating-point tensor"),
    ([[[0.5]]], TypeError, r"^logits has type list, expected a torch.Tensor"),
])
def test_bad_logits_are_named(bad, exc, match):
    with pytest.raises(exc, match=match):
        r.topk_softmax(bad)


def test_bad_arguments_say_what_would_work():
    with pytest.raises(ValueError, match=r"k=9 must be an int in \[1, 8\]"):
        r.topk_softmax(logits(), k=9)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        r.capacity_by_position(logits(), capacity_factor=0)
    with pytest.raises(ValueError, match="n_groups=3"):
        r.group_limited_topk(logits(), n_groups=3)
