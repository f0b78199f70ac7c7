"""End to end: log-probs at batch size 1 vs inside batches, judged as drift, with the share of
a measured drift that batch variance explains."""
import pytest
import torch
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.isolation.end_to_end import end_to_end

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, H = 32, 64
G = torch.Generator().manual_seed(0)
E = torch.randint(-4, 4, (V, H), generator=G).float()   # integer-valued: exact logits
W = torch.randint(-4, 4, (H, V), generator=G).float() / 8
SEQS = torch.randint(0, V, (12, 10), generator=G)


def _logprobs(logits, ids):
    return torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]


def exact_lm(ids):
    """Logits are sums of exact products (|sum| < 2^24): the same bits in any batch."""
    return _logprobs(E[ids] @ W, ids)


def batch_rounded_lm(ids):
    """In batches of more than one sequence the logits take a zero-mean perturbation of ~1e-3
    (a kernel switching paths by batch size, as a deterministic pseudo-random rounding)."""
    logits = E[ids] @ W
    if ids.shape[0] > 1:
        logits = logits + 2e-3 * torch.sin(997.0 * logits + 31.0 * torch.arange(V))
    return _logprobs(logits, ids)


def test_an_invariant_model_gives_identical_log_probs():
    r = end_to_end(exact_lm, SEQS, sizes=(3, 4), vocab=V)
    assert r.verdict == "pass" and r.metrics["batch_invariant"] is True
    assert r.metrics["drift_verdict"] == "clean" and r.metrics["max_abs_diff"] == 0.0
    assert r.metrics["n_evaluations"] == 12 + 4 + 3  # alone, then ceil(12/3) + ceil(12/4)


def test_batch_variance_alone_is_noisy_drift_and_its_share_of_a_measured_drift():
    train = -torch.rand(12, 9, generator=G) - 1
    infer = train + 0.02 * torch.randn(12, 9, generator=G)   # the user's measured mismatch
    r = end_to_end(batch_rounded_lm, SEQS, sizes=(5,), vocab=V, measured=(train, infer))
    m = r.metrics
    assert m["batch_invariant"] is False and "TP-I2" in r.codes and r.verdict == "fail"
    assert m["drift_verdict"] == "noisy" and 0 < m["frac_tokens_differ"] <= 1
    expect = (m["std_log_ratio"] / m["measured_std_log_ratio"]) ** 2
    assert m["variance_share"] == pytest.approx(expect) and 0 < m["variance_share"] < 1
    assert r.evidence["drift"]["metrics"]["n_tokens"] == 12 * 9


def test_shares_are_shares_or_none():
    """A share of the measured drift is at most all of it, and a share of its bias exists
    only where it has one: a measured drift far smaller than the batch variance (an fp32
    pair) gave variance_share 3e6 ("explains 298717213%"), and a bias share of -919 or 0.47
    was the ratio of two means indistinguishable from zero."""
    g = torch.Generator().manual_seed(1)
    train = -torch.rand(12, 9, generator=g) - 1
    tiny = end_to_end(batch_rounded_lm, SEQS, sizes=(5,), vocab=V,
                      measured=(train, train + 1e-6 * torch.randn(12, 9, generator=g)))
    m = tiny.metrics
    assert m["variance_share"] is None and m["variance_ratio"] > 1e6
    assert "times the measured drift's variance" in tiny.message and "explains" not in tiny.message
    noisy = end_to_end(batch_rounded_lm, SEQS, sizes=(5,), vocab=V,
                       measured=(train, train + 0.02 * torch.randn(12, 9, generator=g)))
    n = noisy.metrics
    assert 0 < n["variance_share"] == n["variance_ratio"] < 1
    for r in (tiny, noisy):  # neither measured drift's mean is told from zero
        assert r.metrics["bias_share"] is None
    biased = end_to_end(batch_rounded_lm, SEQS, sizes=(5,), vocab=V,
                        measured=(train, train + 0.05 + 0.02 * torch.randn(12, 9, generator=g)))
    b = biased.metrics
    assert b["bias_share"] == pytest.approx(b["mean_log_ratio"] / b["measured_mean_log_ratio"])


def test_sequences_keep_their_own_log_probs_through_the_shuffle():
    """Batched rows are put back in order: an invariant model matches row for row, and a
    model that tags each row by its content shows no mix-up."""
    def by_content(ids):
        return ids[:, 1:].float() * -0.01
    r = end_to_end(by_content, SEQS, sizes=(5, 7), vocab=V)
    assert r.metrics["batch_invariant"] is True


def test_bad_inputs_are_named():
    with pytest.raises(InvalidArgument, match="token ids"):
        end_to_end(exact_lm, torch.randn(3, 4))
    with pytest.raises(InvalidArgument, match="sizes"):
        end_to_end(exact_lm, SEQS, sizes=(1,))
    with pytest.raises(TargetError, match="per-token log-probs"):
        end_to_end(lambda ids: ids.float().sum(), SEQS, sizes=(2,))
    with pytest.raises(InvalidArgument, match="measured"):
        end_to_end(exact_lm, SEQS, sizes=(2,), measured=3)


def test_a_nondeterministic_model_is_not_called_batch_variant():
    """Dropout left on, or atomics: every call differs, batch or not. Only a difference
    that reproduces (the batch again, the sequence alone again) is batch variance."""
    g = torch.Generator().manual_seed(0)

    def jittery(ids):
        lp = exact_lm(ids)
        return lp + 1e-6 * torch.randn(lp.shape, generator=g)
    r = end_to_end(jittery, SEQS, sizes=(4,), vocab=V)
    assert r.codes == ["TP-C2"] and r.metrics["batch_invariant"] is None and r.verdict == "fail"
    r = end_to_end(batch_rounded_lm, SEQS, sizes=(5,), vocab=V)  # variance reproduces
    assert r.codes[0] == "TP-I2" and r.metrics["n_evaluations"] == 12 + 3 + 2
