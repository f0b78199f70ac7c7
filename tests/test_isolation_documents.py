"""Document isolation on toy packed models whose verdict is known from the mechanism."""
import pytest
import torch
from trainprobes.errors import InvalidType, TargetError
from trainprobes.isolation import Packing, documents
from trainprobes.isolation.controls import VOCAB, PackedAttention, rounding_noise

V, D = VOCAB, 16


def ToyAttention(mask="block"):
    return PackedAttention({"bidirectional": "none"}.get(mask, mask))


def RowSumNoise(mask="block"):
    return rounding_noise()


class _BatchMean(PackedAttention):
    def forward(self, tokens, packing):
        y = super().forward(tokens, packing)
        return y + y.mean(0, keepdim=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")
X = torch.randint(0, V, (1, 18), generator=torch.Generator().manual_seed(3))
P = Packing.of([6, 7, 5])


def test_a_block_diagonal_mask_isolates():
    r = documents(ToyAttention("block"), X, P, vocab=V)
    assert r.verdict == "pass" and r.metrics["isolated"] is True and r.metrics["causal"] is True
    assert r.metrics["n_leaks"] == 0 and r.metrics["max_cross_change"] == 0.0
    assert r.metrics["n_evaluations"] == 3 + 2  # d + 2
    assert all(c > 0 for c in r.evidence["self_change"])  # every perturbation did something


def test_a_causal_mask_over_the_whole_row_leaks_forward_only():
    r = documents(ToyAttention("causal"), X, P, vocab=V)
    assert r.verdict == "fail" and "TP-I1" in r.codes and r.metrics["isolated"] is False
    pairs = {(lk["source"], lk["affected"]) for lk in r.evidence["leaks"] if lk["kind"] == "structural"}
    assert pairs == {(0, 1), (0, 2), (1, 2)}
    assert all(lk["direction"] == "forward" for lk in r.evidence["leaks"])
    assert r.metrics["causal"] is True  # within the row nothing reads the future
    lm = torch.tensor(r.evidence["leak_max"])
    assert min(lm[0, 1], lm[0, 2], lm[1, 2]) > 0.01 and (lm.tril(-1) == 0).all()


def test_bidirectional_attention_leaks_both_ways_and_is_not_causal():
    r = documents(ToyAttention("bidirectional"), X, P, vocab=V)
    assert r.metrics["n_leaks"] == 6 and r.metrics["causal"] is False
    assert set(r.codes) == {"TP-I1", "TP-C1"}


def test_rounding_noise_from_other_documents_is_excused_by_the_fp64_twin():
    r = documents(RowSumNoise("block"), X, P, vocab=V, causal=False)
    assert r.metrics["max_cross_change"] > 0  # the other documents did move the bits
    assert r.metrics["isolated"] is True and r.verdict == "pass", r.message
    assert r.metrics["n_numerical"] > 0 and r.metrics["fp64"] == "used"
    assert r.metrics["n_fp64_evaluations"] <= 3 + 1


def test_without_a_twin_noise_is_unverified_not_excused_and_not_a_leak():
    r = documents(RowSumNoise("block"), X, P, vocab=V, fp64=False, causal=False)
    # unknown never passes: a leak within rounding noise is not excluded
    assert r.verdict == "fail" and r.codes == ["TP-I1"] and r.metrics["isolated"] is None
    assert r.metrics["n_unverified"] > 0 and "isolation unknown" in r.message
    r = documents(ToyAttention("causal"), X, P, vocab=V, fp64=False, causal=False)
    assert r.metrics["isolated"] is False  # far beyond rounding noise: structural without a twin


def test_a_twin_with_other_kernels_only_settles_rounding_noise():
    honest = ToyAttention("block").double()  # a "twin" that does not leak: must not excuse

    def twin(x, p):
        return honest(x, p)
    twin.substituted = ["attention: toy -> block"]
    r = documents(ToyAttention("causal"), X, P, vocab=V, fp64=twin, causal=False)
    assert r.metrics["isolated"] is False and r.metrics["n_fp64_evaluations"] == 0
    noisy = RowSumNoise()
    exact = RowSumNoise().double()

    def noisy_twin(x, p):
        return exact(x, p)
    noisy_twin.substituted = ["a kernel"]
    r = documents(noisy, X, P, vocab=V, fp64=noisy_twin, causal=False)
    assert r.metrics["isolated"] is True and "substituted: a kernel" in r.metrics["fp64"]


def test_a_twin_that_is_not_the_target_s_function_is_refused():
    """A leak-free "twin" of a leaking target would excuse the leak: it disagrees with the
    target on the unperturbed row, so it is refused and the leak stays structural."""
    honest = ToyAttention("block").double()
    r = documents(ToyAttention("causal"), X, P, vocab=V, fp64=lambda x, p: honest(x, p), causal=False)
    assert r.metrics["isolated"] is False and r.metrics["n_leaks"] == 3
    assert "not the target's function" in r.metrics["fp64"]


def test_batched_mode_takes_one_call():
    r = documents(ToyAttention("causal"), X, P, vocab=V, batched=True, causal=False)
    assert r.metrics["n_evaluations"] == 1 and r.metrics["isolated"] is False
    r = documents(ToyAttention("block"), X, P, vocab=V, batched=True, causal=False)
    assert r.metrics["n_evaluations"] == 1 and r.metrics["isolated"] is True


def test_documents_in_other_rows_count_as_leaks():
    x2 = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(4))
    r = documents(_BatchMean("block"), x2, [[4, 5], [9]], vocab=V, causal=False)
    assert r.metrics["isolated"] is False
    assert {lk["direction"] for lk in r.evidence["leaks"] if lk["kind"] == "structural"} == {"other row"}


def test_float_inputs_and_hidden_state_outputs():
    lin = torch.nn.Linear(D, D)

    def per_token(h, packing):  # no mixing across positions at all
        return lin(h)
    h = torch.randn(1, 18, D)
    r = documents(per_token, h, P, causal=False)
    assert r.metrics["isolated"] is True and r.metrics["fp64"] == "not needed"


def test_a_nondeterministic_target_is_not_called_leaky():
    g = torch.Generator().manual_seed(0)

    def noisy(tokens, packing):
        return torch.rand(*tokens.shape, 2, generator=g)
    r = documents(noisy, X, P, vocab=V)
    assert r.verdict == "fail" and r.codes == ["TP-C2"] and r.metrics["isolated"] is None


def test_bad_inputs_are_named():
    with pytest.raises(TargetError, match="lengths describe 1 row"):
        documents(ToyAttention(), X, [6, 7], vocab=V)
    with pytest.raises(InvalidType, match="fp64"):
        documents(ToyAttention(), X, P, fp64="yes")
    with pytest.raises(TargetError, match="token ids"):
        documents(ToyAttention(), [1, 2, 3], P)
