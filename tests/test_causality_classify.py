"""trainprobes.causality.classify: structural vs numerical vs unverified, margins, the lazy
fp64 twin, and the documented example."""
import doctest
import importlib

import pytest
import torch
from trainprobes.causality.classify import Kind, Outputs, classify_changes, margins, near_tie, reduction_ulps

EPS = torch.finfo(torch.float32).eps


def where_of(a, b):
    return (a != b).any(-1).nonzero(as_tuple=True) if a.dim() > 2 else (a != b).nonzero(as_tuple=True)


def test_documented_example_runs():
    mod = importlib.import_module("trainprobes.causality.classify")
    assert doctest.testmod(mod).failed == 0


def test_margins_are_the_gap_below_the_kth_choice():
    s = torch.tensor([[[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]]])
    assert torch.allclose(margins(s, torch.zeros(1, 2, dtype=torch.long)),
                          torch.tensor([[0.2, 0.0]], dtype=torch.float64))
    two = torch.zeros(1, 2, 2, dtype=torch.long)  # top-2 ids: the gap below the 2nd best
    assert torch.allclose(margins(s, two), torch.tensor([[0.1, 0.2]], dtype=torch.float64))
    assert margins(s[..., :1], two).isinf().all()  # one expert: never a tie


def test_a_large_change_at_the_same_shape_is_structural_without_asking_fp64():
    before = torch.tensor([[1.0, 2.0]])
    after = torch.tensor([[1.5, 2.0]])

    def twin():
        raise AssertionError("fp64 asked though no change was near a tie")
    kind = classify_changes(where_of(before, after), Outputs(before), Outputs(after), fp64=twin)
    assert Kind.labels(kind) == ["structural"]


def test_reduction_noise_on_a_large_output_goes_to_fp64_not_straight_to_structural():
    """Same shape, a sum of T = 256 terms at 2**24 reordered: it moves by up to ~T ulps, far
    beyond a near-tie's 32. Without a twin: unverified (not structural); with one: what the
    twin shows. Beyond T ulps no reordering explains it: structural without asking."""
    T, big = 256, 2.0 ** 24
    ulp = big * EPS
    before = torch.full((1, T), big)
    after = before.clone()
    after[0, 10], after[0, 20] = big + 100 * ulp, big + 4 * T * ulp  # noise-sized, beyond it
    where = where_of(before, after)
    assert reduction_ulps(T) == T and reduction_ulps(4) == 32
    assert Kind.labels(classify_changes(where, Outputs(before), Outputs(after))) == ["unverified", "structural"]
    b64 = before.double()
    still = (Outputs(b64), Outputs(b64))  # fp64 does not move: rounding noise
    moved = (Outputs(b64), Outputs(after.double()))  # fp64 moves as much: a dependence
    assert Kind.labels(classify_changes(where, Outputs(before), Outputs(after), fp64=still)) == \
        ["numerical", "structural"]
    assert Kind.labels(classify_changes(where, Outputs(before), Outputs(after), fp64=moved)) == \
        ["structural", "structural"]
    # a twin with kernels substituted may lack the leak: it settles near-ties only
    kind = classify_changes(where, Outputs(before), Outputs(after), fp64=still, twin_settles_reduction=False)
    assert Kind.labels(kind) == ["unverified", "structural"]


def test_a_near_tie_is_judged_at_the_scores_largest_magnitude_not_their_largest_value():
    # top-2 routing over logits [5, -1000 + 1 ulp, -1000]: the 2nd and 3rd choices are one
    # ulp of 1000 apart, a rounding tie; 32 ulps of the largest *value* (5) is too tight
    ulp = 1000 * EPS
    scores = torch.tensor([[[5.0, -1000.0 + ulp, -1000.0]]])
    ids = torch.tensor([[[0, 1]]])
    where = (torch.tensor([0]), torch.tensor([0]))
    assert near_tie(where, Outputs(ids, scores), Outputs(torch.tensor([[[0, 2]]]), scores)).item()
    far = torch.tensor([[[5.0, -990.0, -1000.0]]])  # 10 apart: no rounding explains a flip
    assert not near_tie(where, Outputs(ids, far), Outputs(ids, far)).item()


@pytest.mark.parametrize("fp64_moves, want", [(0.0, "numerical"), (1e-6, "structural")])
def test_a_near_tie_goes_to_the_fp64_scaling_test(fp64_moves, want):
    before = torch.tensor([[1.0, 2.0]])
    after = before + torch.tensor([[4 * EPS, 0.0]])
    base64 = before.double()
    twin = (Outputs(base64), Outputs(base64 + torch.tensor([[fp64_moves, 0.0]], dtype=torch.float64)))
    where = where_of(before, after)
    assert Kind.labels(classify_changes(where, Outputs(before), Outputs(after))) == ["unverified"]
    assert Kind.labels(classify_changes(where, Outputs(before), Outputs(after), fp64=twin)) == [want]
    # a lazy twin that has nothing to offer leaves it unverified, never excused
    assert Kind.labels(classify_changes(where, Outputs(before), Outputs(after), fp64=lambda: None)) == ["unverified"]


def test_integer_decisions_are_near_a_tie_only_by_their_routing_margin():
    scores = torch.tensor([[[0.5, 0.5 - EPS, 0.0], [0.9, 0.05, 0.05]]])
    ids = scores.argmax(-1)
    flipped = torch.tensor([[1, 1]])
    where = where_of(ids, flipped)
    kind = classify_changes(where, Outputs(ids, scores), Outputs(flipped, scores))
    assert Kind.labels(kind) == ["unverified", "structural"]
    assert near_tie(where, Outputs(ids, scores), Outputs(flipped), margin_tol=1.0).all()
    # the fp64 choice does not change at the near-tie: numerical; it does: structural
    same = (Outputs(ids, scores.double()), Outputs(ids, scores.double()))
    moved = (Outputs(ids, scores.double()), Outputs(flipped, scores.double()))
    assert Kind.labels(classify_changes(where, Outputs(ids, scores), Outputs(flipped, scores), fp64=same)) == \
        ["numerical", "structural"]
    assert Kind.labels(classify_changes(where, Outputs(ids, scores), Outputs(flipped, scores), fp64=moved)) == \
        ["structural", "structural"]


def test_a_float_decision_with_scores_is_near_a_tie_by_its_own_change_too():
    # hidden states judged beside router scores (an MoE block returning (hidden, logits)):
    # an ulp of change in the hidden state is rounding noise whatever the router's margin,
    # and a large change at a near-tie of the router may be a noise flip of an expert
    hidden = torch.tensor([[[1.0, 2.0], [1.0, 2.0]]])
    after = hidden.clone()
    after[0, 0, 0] += EPS          # one ulp
    after[0, 1, 0] += 0.5          # a real change
    scores = torch.tensor([[[0.7, 0.2, 0.1], [0.7, 0.2, 0.1]]])  # far from a tie at any k
    where = where_of(hidden, after)
    kind = classify_changes(where, Outputs(hidden, scores), Outputs(after, scores))
    assert Kind.labels(kind) == ["unverified", "structural"]
    tied = torch.tensor([[[0.5, 0.5 - EPS, 0.0], [0.5, 0.5 - EPS, 0.0]]])
    assert margins(tied, hidden).tolist() == [[EPS, EPS]]  # hidden states: the nearest tie at any k
    kind = classify_changes(where, Outputs(hidden, tied), Outputs(after, tied))
    assert Kind.labels(kind) == ["unverified", "unverified"]


def test_another_shape_sends_every_change_to_fp64():
    before = torch.tensor([[1.0, 2.0]])
    after = torch.tensor([[1.5, 2.5]])  # large changes, as a shape-dependent kernel can make
    where = where_of(before, after)
    twin = (Outputs(before.double()), Outputs(before.double() + torch.tensor([[0.0, 0.5]], dtype=torch.float64)))
    kind = classify_changes(where, Outputs(before), Outputs(after), fp64=twin, same_shape=False)
    assert Kind.labels(kind) == ["numerical", "structural"]


def test_no_changes_no_kinds():
    x = torch.ones(2, 3)
    kind = classify_changes(where_of(x, x), Outputs(x), Outputs(x))
    assert kind.shape == (0,) and kind.dtype == torch.long


def test_a_change_to_infinity_is_judged_by_the_twin_s_own_move_not_scaled_by_it():
    """An fp32 change to inf (or NaN) has no size to scale: 1e-3 x inf excused any fp64
    move, so a leak that overflowed fp32 (finite, large in fp64) passed as rounding noise.
    The twin's move alone decides there: beyond fp64 noise it is structural."""
    before = torch.tensor([[1.0, 2.0, 3.0]])
    after = torch.tensor([[float("inf"), float("nan"), float("-inf")]])
    where = where_of(before, after)
    b64 = before.double()
    leak = (Outputs(b64), Outputs(b64 + torch.tensor([[1e40, 5.0, 0.0]], dtype=torch.float64)))
    kind = classify_changes(where, Outputs(before), Outputs(after), fp64=leak, same_shape=False)
    assert Kind.labels(kind) == ["structural", "structural", "numerical"]
