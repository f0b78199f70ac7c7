"""The parts of a localisation: log-prob semantics from the vectors alone
(trainprobes.drift.semantics), weight sync (trainprobes.drift.weights), routing flips
(trainprobes.drift.routing) and replay (trainprobes.drift.patching.replay_router)."""
import copy
import math

import pytest
import torch
from trainprobes.drift import faults
from trainprobes.drift.patching import Call, replay_router
from trainprobes.drift.routing import routing
from trainprobes.drift.semantics import semantics
from trainprobes.drift.weights import checksum, checksums, weight_sync
from trainprobes.errors import InvalidArgument

pytestmark = pytest.mark.usefixtures("one_torch_thread")
G = torch.Generator().manual_seed(0)
Z = torch.randn(8, 12, 50, generator=G) * 3          # logits [B, T, V]
TOK = torch.randint(0, 50, (8, 12), generator=G)
MASK = torch.ones(8, 12, dtype=torch.bool)


def _sampled(lp):
    return torch.multinomial(lp.exp().reshape(-1, lp.shape[-1]), 1,
                             generator=torch.Generator().manual_seed(1)).reshape(lp.shape[:2])


@pytest.mark.parametrize("t_a, t_b", [(1.0, 0.7), (0.7, 0.49), (1.0, 1.3)])
def test_temperature_slope_is_the_ratio(t_a, t_b):
    s = semantics(faults.temperature_logprobs(t_a)(Z), faults.temperature_logprobs(t_b)(Z), TOK, MASK)
    assert s.temperature and not s.renormalised
    assert s.slope == pytest.approx(t_a / t_b, rel=1e-6)
    x = (faults.temperature_logprobs(t_b)(Z) - faults.temperature_logprobs(t_a)(Z)).gather(
        -1, TOK[..., None]).squeeze(-1)
    assert torch.allclose(s.parts["temperature"], x.double(), atol=1e-5)


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_renormalisation_constant_is_log_mass_kept(top_p):
    lp_a, lp_b = torch.log_softmax(Z, -1), faults.top_p_logprobs(top_p)(Z)
    tok = _sampled(lp_b)
    s = semantics(lp_a, lp_b, tok, MASK)
    assert s.renormalised and not s.temperature
    kept = torch.isfinite(lp_b)
    mass = torch.where(kept, lp_a.exp(), 0.0).sum(-1)
    assert torch.allclose(s.parts["renormalisation"], -mass.log().double(), atol=1e-5)
    assert s.mean_log_mass_kept == pytest.approx(mass.log().mean().item(), abs=1e-5)


def test_rounding_noise_is_neither():
    lp_a = torch.log_softmax(Z, -1)
    lp_b = torch.log_softmax(Z.bfloat16().float(), -1)
    s = semantics(lp_a, lp_b, TOK, MASK)
    assert not s.temperature and not s.renormalised
    assert abs(s.slope - 1) < 1e-3


def test_semantics_shape_mismatch():
    with pytest.raises(InvalidArgument, match="same"):
        semantics(Z, Z[:, :-1], TOK, MASK)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))


def test_weight_sync_names_the_stale_tensor_only():
    a = _model()
    b = copy.deepcopy(a).to(torch.bfloat16)
    faults.stale(b[1].weight)
    rows = {r.name: r.status for r in weight_sync(a, b)}
    assert rows == {"0.weight": "exact", "0.bias": "exact", "1.weight": "mismatch", "1.bias": "exact"}
    ca, cb = checksums(a, torch.bfloat16), checksums(b)
    assert [n for n in ca if ca[n] != cb[n]] == ["1.weight"]


def test_truncating_conversion_is_rounding_not_mismatch():
    a = _model()
    b = copy.deepcopy(a).to(torch.bfloat16)
    with torch.no_grad():  # round toward zero instead of to nearest even
        b[0].weight.copy_((a[0].weight.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16())
    rows = {r.name: r for r in weight_sync(a, b)}
    assert rows["0.weight"].status == "rounding" and rows["0.weight"].max_ulps <= 1


def test_missing_tensor_and_checksum_sensitivity():
    a, b = _model(), torch.nn.Sequential(torch.nn.Linear(16, 32))
    assert [r.name for r in weight_sync(a, b) if r.status == "missing"] == ["1.weight", "1.bias"]
    t = torch.randn(100, generator=G)
    u = t.clone()
    u[37] = torch.nextafter(u[37], torch.tensor(math.inf))
    assert checksum(t) != checksum(u) and checksum(t) == checksum(t.clone())
    assert checksum(t.flip(0)) != checksum(t)  # order matters


def _call(idx, probs):
    return Call({}, probs, idx, probs)


def test_routing_flips_and_margins():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.35, 0.25], [0.6, 0.3, 0.1], [0.34, 0.33, 0.33]])
    ia = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])
    ib = torch.tensor([[1, 0], [0, 2], [0, 1], [0, 2]])  # same set, flip, same, flip
    r = routing({"r0": [_call(ia, probs)], "r1": [_call(ia, probs)]},
                {"r0": [_call(ib, probs)], "r1": [_call(ia, probs)]}, torch.ones(2, 2, dtype=torch.bool))
    f = r.routers[0]
    assert f.n_flipped == 2 and f.frac_flipped == 0.5
    assert f.max_margin_flipped == pytest.approx(0.1) and f.median_margin_flipped == pytest.approx(0.0, abs=0.011)
    assert r.routers[1].n_flipped == 0
    assert r.frac_tokens_any_layer == 0.5 and r.frac_decisions == 0.25


def test_replay_replaces_only_rows_whose_set_differs():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    probs = logits.softmax(-1)
    own = torch.tensor([[0, 1], [2, 1]])
    pk = probs.gather(-1, own)
    w = pk / pk.sum(-1, keepdim=True)  # a renormalising router's own weights
    _, w2, i2 = replay_router(torch.nn.Identity(), (logits, w, own), torch.tensor([[1, 0], [0, 2]]))
    assert torch.equal(i2[0], own[0]) and torch.equal(w2[0], w[0])  # same set: untouched
    assert torch.equal(i2[1], torch.tensor([0, 2]))
    p = probs[1, [0, 2]]
    assert torch.allclose(w2[1], p / p.sum())
    _, w3, _ = replay_router(torch.nn.Identity(), (logits, pk, own), torch.tensor([[1, 0], [0, 2]]))
    assert torch.allclose(w3[1], p)  # a router measured not to renormalise: raw probabilities


def test_carriers_by_probability_position_and_heaviest_with_text():
    from trainprobes.drift.carriers import carriers

    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"
    x = torch.zeros(4, 6, dtype=torch.float64)
    x[2, 5] = -3.0
    x[1, 0] = 0.5
    lp = torch.full((4, 6), -0.1, dtype=torch.float64)
    lp[2, 5] = -9.0  # a rare token carries the drift
    tok = torch.arange(24).reshape(4, 6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    c = carriers(x, mask, lp, tok, Tok(), top=3)
    assert [h["position"] for h in c["heaviest_tokens"]] == [5, 0]  # zeros are not listed
    assert c["heaviest_tokens"][0] == {"sequence": 2, "position": 5, "token_id": 17, "log_ratio": -3.0,
                                       "p_train": pytest.approx(math.exp(-9)), "text": "<17>"}
    rare = [r for r in c["by_probability"] if r["p_low"] == 0.0][0]
    assert rare["n"] == 1 and rare["share_sq"] == pytest.approx(9 / 9.25)
    assert sum(r["n"] for r in c["by_position"]) == 24
    assert c["by_sequence_mean_abs"][2] == pytest.approx(0.5)


def test_trainer_side_rounding_is_not_a_stale_engine_tensor():
    """The trainer holds a tensor in bf16, the engine the fp32 value: the trainer's side lost
    precision; the engine's tensor is not stale."""
    a = _model()
    b = copy.deepcopy(a)
    a[1].to(torch.bfloat16)
    rows = {r.name: r for r in weight_sync(a, b)}
    assert rows["1.weight"].status == "trainer_rounded" and rows["1.weight"].max_ulps <= 0.5
    assert "trainer holds" in rows["1.weight"].note and rows["0.weight"].status == "exact"
    faults.stale(b[0].weight)  # and a real stale engine tensor beside it is still named
    rows = {r.name: r for r in weight_sync(a, b)}
    assert rows["0.weight"].status == "mismatch" and "engine's float32 tensor differs" in rows["0.weight"].note


def _tied():
    from trainprobes.reference.models.stack import TinyStack
    m = TinyStack(seed=0)
    m.head.weight = m.embed.weight  # an lm_head tied to the input embedding
    return m


def test_tied_tensors_are_compared_under_every_name():
    """A trainer that ties its lm_head to the embedding and an engine holding an equal untied
    copy hold the same tensors by name (the alias was 'missing', and kind 'weights')."""
    a = _tied()
    b = copy.deepcopy(a)
    b.head.weight = torch.nn.Parameter(b.embed.weight.detach().clone())
    for x, y in ((a, b), (b, a)):
        assert {r.status for r in weight_sync(x, y)} == {"exact"}
        assert checksums(x) == checksums(y)
    faults.stale(b.head.weight)  # the engine's untied copy missed by the refit: named
    assert [r.name for r in weight_sync(a, b) if r.status != "exact"] == ["head.weight"]


def test_tensors_without_a_counterpart_are_not_called_stale():
    """An engine whose module holds the same weights under other names (a fused or wrapped
    projection) and computes the same: exact, with the unmatched tensors said, not 'weights'."""
    from trainprobes.drift.decompose import localize
    from trainprobes.drift.engines import Engine

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    a = _tied()
    b = copy.deepcopy(a)
    b.blocks[1].mix = Wrapped(b.blocks[1].mix)
    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(0))
    r = localize(Engine(a, name="trainer"), Engine(b, name="engine"), ids)
    m = r.metrics
    assert m["kind"] == "exact" and m["n_stale_tensors"] == 0 and m["n_unmatched_tensors"] == 4
    assert "blocks.1.mix.inner.weight" in r.message and "not compared" in r.message


def test_one_ulp_in_the_same_dtype_is_a_mismatch_not_rounding():
    """bf16 on both sides, the engine's weight one ulp off everywhere (a refit missed where a
    small update moved each weight by one ulp): there is no conversion to round, so it is stale
    (it was 'rounding', and no tensor was named)."""
    a = _model().bfloat16()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[1].weight.view(torch.int16).add_(1)
    rows = {r.name: r for r in weight_sync(a, b)}
    assert rows["1.weight"].status == "mismatch" and rows["1.weight"].max_ulps <= 1
    assert rows["1.weight"].frac_mismatched == 1.0
