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


def test_batched_mode_takes_one_batched_call_and_one_alone():
    """One call holds the perturbed copies; one call alone shows that the batch did not
    change the unperturbed row (a batch-isolated target), since no single call can. A leak
    found costs the batched call once more (it must reproduce)."""
    r = documents(ToyAttention("causal"), X, P, vocab=V, batched=True, causal=False)
    assert r.metrics["n_evaluations"] == 2 + 1 and r.metrics["isolated"] is False
    r = documents(ToyAttention("block"), X, P, vocab=V, batched=True, causal=False)
    assert r.metrics["n_evaluations"] == 2 and r.metrics["isolated"] is True
    assert r.metrics["batched"] is True


def test_batched_mode_falls_back_when_the_copies_talk_to_each_other():
    """A target whose rows see the batch mean gives every copy in one call the same shift,
    so the copies alone cannot show that row 0's documents move row 1's: the batched call
    must be checked against a call alone, and the probe falls back to one call per
    document (d + 3 in all), where the other-row leak shows."""
    x2 = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(4))
    r = documents(_BatchMean("block"), x2, [[4, 5], [9]], vocab=V, causal=False, batched=True)
    assert r.metrics["isolated"] is False and r.verdict == "fail"
    assert r.metrics["batched"] is False and "batch" in r.evidence["batched_fallback"]
    # batched, alone twice, one per document, and the 3 that moved another document again
    assert r.metrics["n_evaluations"] == 3 + 3 + 3
    assert {lk["direction"] for lk in r.evidence["leaks"] if lk["kind"] == "structural"} == {"other row"}


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


class _Overflows(PackedAttention):
    """Later documents add exp(0.45 x the sum of document 0's ids): finite (e^80) for X,
    beyond float32 (e^103) for its perturbation, finite in the fp64 twin. A real leak."""

    def forward(self, tokens, packing):
        y = super().forward(tokens, packing)
        first = packing.doc_ids(tokens.device) == 0
        s = (tokens * first).sum(1, keepdim=True).to(y.dtype)
        return torch.where(first[..., None], y, y + torch.exp(0.45 * s[..., None]))


def test_a_leak_that_overflows_float32_is_not_excused_as_rounding():
    r = documents(_Overflows("block"), X, P, vocab=V, causal=False)
    assert r.metrics["fp64"] == "used" and r.metrics["isolated"] is False
    assert {(lk["source"], lk["affected"]) for lk in r.evidence["leaks"]
            if lk["kind"] == "structural"} == {(0, 1), (0, 2)}


class _BannedIds(PackedAttention):
    """Outputs -inf in three columns (logits of banned ids, log-probs of impossible tokens)."""

    def forward(self, tokens, packing):
        y = super().forward(tokens, packing).clone()
        y[..., :3] = float("-inf")
        return y


def test_outputs_that_stay_minus_infinity_are_no_change():
    r = documents(_BannedIds("block"), X, P, vocab=V, causal=False)
    lm = torch.tensor(r.evidence["leak_max"])
    assert r.metrics["isolated"] is True and r.metrics["max_cross_change"] == 0.0
    assert (lm - lm.diag().diag() == 0).all() and lm.diag().isfinite().all()
    noisy = _BannedIds("block", noise=True)  # other documents move the rounding: the twin
    r = documents(noisy, X, P, vocab=V, causal=False)  # must not be refused over -inf == -inf
    assert r.metrics["fp64"] == "used" and r.metrics["isolated"] is True, r.metrics["fp64"]


class _NanLast(PackedAttention):
    """Causal over the whole row (document 0 leaks into 1 and 2), with the last document's
    outputs NaN (a query that may attend to nothing): a leak into it cannot show."""

    def forward(self, tokens, packing):
        y = super().forward(tokens, packing).clone()
        y[packing.doc_ids(tokens.device) == packing.doc_ids().max()] = float("nan")
        return y


def test_documents_whose_outputs_are_nan_cannot_be_called_isolated():
    r = documents(_NanLast("causal"), X[:, :13], [6, 7], vocab=V, causal=False)
    assert r.metrics["isolated"] is None and r.verdict == "fail" and r.codes == ["TP-I1"]
    assert r.metrics["n_blind_tokens"] == 7 and "NaN" in r.message
    r = documents(lambda t, p: torch.full((*t.shape, 4), float("nan")), X, P, vocab=V)
    assert r.metrics["isolated"] is None and r.verdict == "fail"
    r = documents(_NanLast("causal"), X, P, vocab=V, causal=False)  # a leak that shows
    assert r.metrics["isolated"] is False and r.metrics["max_cross_change"] > 0


def test_a_twin_of_integer_decisions_must_make_the_target_s_decisions():
    """A capacity router shared over the row (earlier documents take later ones' slots)
    leaks; a "twin" that is the fixed router (no capacity, in fp64) never changes the later
    documents' decisions, so it excused every leak: integer outputs skipped the check that
    the twin computes the target's function."""
    from trainprobes.reference import routing
    emb = torch.randn(V, 4, generator=torch.Generator().manual_seed(0))

    def leaky(tokens, packing):
        return routing.capacity_by_position(emb[tokens].float(), k=1, capacity_factor=1.0)[0]

    def fixed_router(tokens, packing):
        return routing.topk_softmax(emb[tokens].double(), 1)[0]
    x = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(0))
    r = documents(leaky, x, [8, 8, 8], vocab=V, causal=False, fp64=fixed_router)
    assert r.metrics["isolated"] is False and r.metrics["n_numerical"] == 0
    assert "not the target's function" in r.metrics["fp64"] and "decisions" in r.metrics["fp64"]


class _OnceNoisy(PackedAttention):
    """Isolating, but one call (the 4th: document 1's perturbation) comes back shifted by
    1e-3, as an occasional atomic or a stray kernel does: nondeterminism that the two
    baseline calls do not see."""

    def __init__(self):
        super().__init__("block")
        self.calls = 0

    def forward(self, tokens, packing):
        self.calls += 1
        y = super().forward(tokens, packing)
        return y + 1e-3 if self.calls == 4 else y


def test_a_change_that_does_not_reproduce_is_nondeterminism_not_a_leak():
    m = _OnceNoisy()
    r = documents(lambda t, p: m(t, p), X, P, vocab=V, causal=False)
    assert r.codes == ["TP-C2"] and r.metrics["isolated"] is None, r.message
    r = documents(ToyAttention("causal"), X, P, vocab=V, causal=False)  # a leak reproduces
    assert r.metrics["isolated"] is False and r.metrics["n_evaluations"] == 3 + 2 + 2


class _CountsTwins(PackedAttention):
    """Counts the fp64 twins built: a float64 copy of a real model is 2-4x its memory."""

    built = 0

    def fp64_twin(self):
        _CountsTwins.built += 1
        twin = PackedAttention(self.mask, noise=self.noise)
        twin.load_state_dict(self.state_dict())
        return twin.double()


def test_the_fp64_twin_is_built_only_when_a_change_needs_it():
    _CountsTwins.built = 0
    r = documents(_CountsTwins("block"), X, P, vocab=V)  # isolated: nothing to judge
    assert r.metrics["isolated"] is True and _CountsTwins.built == 0
    r = documents(_CountsTwins("block", noise=True), X, P, vocab=V, causal=False)
    assert r.metrics["n_numerical"] > 0 and _CountsTwins.built == 1


def test_a_pair_the_twin_never_ran_reports_no_fp64_change_not_zero():
    """With a substituted twin only near-tie changes go to it: a pair judged structural by its
    size alone was never run in fp64, and reporting its fp64 change as 0 read as "the twin
    shows no leak" (the zoo's DeepSeek-V4 cells said "output change 0.105 (fp64 0)")."""
    emb = torch.nn.Embedding(V, 4)

    def leaky(e, gid):   # document 0 reaches document 1 in full, document 2 reaches 0 by ~1 ulp
        y = e.clone()
        y[gid == 1] += e[gid == 0].mean(0)
        y[gid == 0] += 1e-7 * e[gid == 2].mean(0)
        return y

    def fn(x, p):
        return leaky(emb(x)[0], p.global_doc_ids()[0])[None]

    def twin(x, p):
        return leaky(emb(x)[0].double(), p.global_doc_ids()[0])[None]
    twin.substituted = ["a kernel"]
    r = documents(fn, X, P, vocab=V, fp64=twin, causal=False)
    assert r.metrics["isolated"] is False and r.metrics["n_fp64_evaluations"] > 0
    first = next(lk for lk in r.evidence["leaks"] if (lk["source"], lk["affected"]) == (0, 1))
    assert first["kind"] == "structural" and first["fp64_change"] is None, first
    assert "(fp64 0)" not in r.message
