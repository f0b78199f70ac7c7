"""Batch invariance: controls whose verdict is known from the mechanism."""
import pytest
import torch
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.isolation import batch_invariance
from trainprobes.isolation.controls import exact_matmul, integer_rows, split_by_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

G = torch.Generator().manual_seed(0)
XI = integer_rows()


def test_an_exact_matmul_is_batch_invariant():
    r = batch_invariance(exact_matmul, XI, sizes=(2, 3, 8), seed=1)
    assert r.verdict == "pass" and r.codes == []
    assert r.metrics["batch_invariant"] is True and r.metrics["max_abs_diff"] == 0.0
    assert r.metrics["breaking_sizes"] == [] and r.metrics["deterministic"] is True
    # 6 alone + 1 determinism + 3 sizes x 3 trials + the pool as given + 1 repeat
    assert r.metrics["n_evaluations"] == 6 + 1 + 9 + 1 + 1


def test_a_reduction_split_by_batch_size_is_caught_with_the_sizes_that_break_it():
    r = batch_invariance(split_by_batch, XI, sizes=(2, 3, 8), seed=1)
    assert r.verdict == "fail" and r.codes == ["TP-I2"]
    m = r.metrics
    assert m["batch_invariant"] is False and m["breaking_sizes"] == [2, 3, 6, 8]
    assert 0 < m["frac_outputs_differ"] <= 1 and m["max_abs_diff"] > 0 and m["max_ulps"] >= 1
    assert r.evidence["examples"] and {s["size"] for s in r.evidence["by_size"]} == {2, 3, 6, 8}


def test_variance_that_starts_at_a_size_names_that_size():
    def big_batches_round(a):  # invariant below 5 rows, bf16 partial sums from 5 on
        return split_by_batch(a) if a.shape[0] >= 5 else exact_matmul(a)
    r = batch_invariance(big_batches_round, XI, sizes=(2, 4, 5, 8))
    assert r.metrics["breaking_sizes"] == [5, 6, 8] and r.metrics["first_breaking_size"] == 5


def test_companions_that_change_a_row_are_named():
    def leaks_the_batch_mean(a):  # a row's output depends on the other rows' values
        return a + 1e-3 * a.mean(0, keepdim=True)
    r = batch_invariance(leaks_the_batch_mean, torch.randn(8, 4, generator=G), sizes=(4,), trials=3)
    assert r.metrics["batch_invariant"] is False and r.metrics["companion_dependent"] is True
    r = batch_invariance(split_by_batch, XI, sizes=(4,), trials=3)
    assert r.metrics["companion_dependent"] is False  # only the batch size matters there


def test_a_nondeterministic_target_is_not_called_variant():
    noise = torch.Generator().manual_seed(5)

    def noisy(a):
        return a + torch.rand(a.shape, generator=noise)
    r = batch_invariance(noisy, XI, sizes=(2,))
    assert r.verdict == "fail" and r.codes == ["TP-C2"] and r.metrics["batch_invariant"] is None


def test_atol_and_the_output_picker():
    r = batch_invariance(lambda a: (split_by_batch(a), "aux"), XI, sizes=(2, 3), output=0, atol=1e9)
    assert r.metrics["batch_invariant"] is True


@pytest.mark.parametrize("kwargs, err, match", [
    ({"sizes": (1,)}, InvalidArgument, "sizes"), ({"sizes": ()}, InvalidArgument, "empty"),
    ({"trials": 0}, InvalidArgument, "trials"), ({"atol": -1.0}, InvalidArgument, "atol")])
def test_bad_arguments_are_named(kwargs, err, match):
    with pytest.raises(err, match=match):
        batch_invariance(exact_matmul, XI, **kwargs)


def test_a_target_that_drops_rows_is_refused():
    with pytest.raises(TargetError, match="one output row per input row"):
        batch_invariance(lambda a: a[:1], XI, sizes=(2,))
    with pytest.raises(InvalidArgument, match="rows"):
        batch_invariance(exact_matmul, torch.tensor(1.0))


def test_equal_infinities_and_integer_outputs_are_measured_as_they_differ():
    def masked(a):  # -inf and NaN columns, the same in every batch: no difference at all
        y = exact_matmul(a)
        y[:, 0], y[:, 1] = float("-inf"), float("nan")
        return y
    r = batch_invariance(masked, XI, sizes=(2, 3, 4))
    m = r.metrics
    assert m["batch_invariant"] is True and m["max_abs_diff"] == 0.0 and m["max_ulps"] == 0.0
    assert m["mean_abs_diff"] == 0.0 and m["companion_dependent"] is False

    def ids(a):  # integer outputs off by 500 in batches of 3 or more
        return exact_matmul(a).long() + 500 * (a.shape[0] > 2)
    r = batch_invariance(ids, XI, sizes=(2, 3))
    assert r.metrics["breaking_sizes"] == [3, 6] and r.metrics["max_abs_diff"] == 500.0


class _Flaky:
    """exact_matmul (invariant) whose calls numbered in `noisy` add jitter, as atomics do now
    and then: nondeterministic, not batch-variant. The two fixed determinism checks (the
    first row alone, the largest batch) land on clean calls."""

    def __init__(self, noisy):
        self.noisy, self.calls = set(noisy), 0

    def __call__(self, a):
        y = exact_matmul(a)
        if self.calls in self.noisy:
            y = y + 1e-3
        self.calls += 1
        return y


@pytest.mark.parametrize("noisy", [{10}, {3}], ids=["a batch call", "a row alone"])
def test_occasional_nondeterminism_is_not_called_batch_variance(noisy):
    # calls: 6 rows alone (0-5), row 0 again (6), 3 sizes x 3 trials (7-15), the pool, a repeat
    r = batch_invariance(_Flaky(noisy), XI, sizes=(2, 3, 8), seed=1)
    assert r.codes == ["TP-C2"] and r.metrics["batch_invariant"] is None, r.message


def test_a_target_that_writes_into_its_input_gets_its_own_copy():
    """In-place kernels (fused add + norm, relu(inplace=True)) write into their input: the
    row views of the pool were changed under the probe, so the second call of row 0 alone
    saw other values (TP-C2 for a deterministic, invariant op) and the caller's tensor was
    corrupted."""
    pool = XI.clone()

    def halves_in_place(a):
        return exact_matmul(a.mul_(0.5))
    r = batch_invariance(halves_in_place, pool, sizes=(2, 3))
    assert r.metrics["batch_invariant"] is True and r.verdict == "pass", r.message
    assert torch.equal(pool, XI)
