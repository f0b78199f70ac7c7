"""drift.localize fails closed and finds what lies outside the hooked stages: non-finite
engine log-probs, post-lm_head faults (a soft-cap dropped, a logit rescale), a batch leak."""
import copy
import math

import pytest
import torch
from trainprobes.drift import faults
from trainprobes.drift.decompose import localize
from trainprobes.drift.engines import Engine
from trainprobes.drift.localize import localize_layers
from trainprobes.errors import InvalidArgument
from trainprobes.gate import check_judgeable

pytest.importorskip("transformers")
from trainprobes.isolation.hf import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IDS = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(1))


def _nan_half(z):
    lp = torch.log_softmax(z.float(), -1)
    lp[::2] = math.nan
    return lp


def _neginf_but_zero(z):
    lp = torch.full(z.shape, -math.inf)
    lp[..., 0] = 0.0
    return lp


@pytest.mark.parametrize("lp_b, words", [(_nan_half, r"NaN or \+inf"), (_neginf_but_zero, "finite log-prob")])
def test_nonfinite_engine_logprobs_cannot_be_judged(lp_b, words):
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=2)
    ids = IDS.clamp_min(1)  # no token is id 0: every scored token is -inf under _neginf_but_zero
    with pytest.raises(InvalidArgument, match=words):
        localize(Engine(a), Engine(copy.deepcopy(a), lp_b), ids)


class _Scaled(torch.nn.Module):
    """The model's forward rescales its logits (a temperature inside the module)."""

    def __init__(self, inner, k):
        super().__init__()
        self.inner, self.k = inner, k

    def forward(self, input_ids, attention_mask=None):
        return self.inner(input_ids, attention_mask=attention_mask, use_cache=False).logits * self.k


def test_logit_rescale_after_lm_head_is_a_temperature():
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=2)
    r = localize(Engine(_Scaled(a, 1.0)), Engine(_Scaled(copy.deepcopy(a), 1.02)), IDS)
    m = r.metrics
    assert r.verdict == "fail" and m["kind"] == "temperature" and m["op"] == "post_processing"
    assert m["temperature_slope"] == pytest.approx(1.02, rel=1e-4)
    assert all(s["verdict"] == "exact" for s in r.evidence["stages"] if s["role"] != "post_processing")
    check_judgeable(r, "candidate")


def test_dropped_final_logit_softcap_is_found_after_lm_head():
    tf = pytest.importorskip("transformers")
    cfg = tf.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128, head_dim=8, sliding_window=8,
                          query_pre_attn_scalar=8, final_logit_softcapping=30.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    a = tf.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        a.lm_head.weight.mul_(30.0)  # logits large enough for the cap to bite
    b = copy.deepcopy(a)
    b.config.final_logit_softcapping = None
    r = localize(Engine(a), Engine(b), IDS)
    m = r.metrics
    assert (r.verdict, m["kind"], m["first_layer"], m["op"]) == ("fail", "numeric", "after lm_head",
                                                                  "post_processing")
    assert m["share_unexplained"] < 0.05
    check_judgeable(r, "candidate")


def test_same_post_processing_is_exact_after_lm_head():
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=2)
    r = localize(Engine(_Scaled(a, 1.5)), Engine(_Scaled(copy.deepcopy(a), 1.5)), IDS)
    assert r.metrics["kind"] == "exact" and r.evidence["stages"][-1]["verdict"] == "exact"


def _with_head_scaled(seed=0):
    a = tiny_model("llama", "eager", seed=seed, num_hidden_layers=2)
    with torch.no_grad():
        a.lm_head.weight.mul_(30.0)  # peaked distributions, as a trained LM's
    return a


@pytest.mark.parametrize("name, lp_b", [
    ("bf16 log-softmax", lambda z: torch.log_softmax(z.bfloat16(), -1).float()),
    ("logits rounded to bf16 first", lambda z: torch.log_softmax(z.bfloat16().float(), -1)),
    ("a soft-cap inside the log-prob function", lambda z: torch.log_softmax(30 * torch.tanh(z.float() / 30), -1)),
])
def test_engine_logprob_function_is_judged_on_the_same_logits(name, lp_b):
    """Every stage exact, the drift from the engine's log-prob function alone (as large as a bf16
    lm_head's): was 'noise', engines agreeing."""
    a = _with_head_scaled()
    r = localize(Engine(a), Engine(copy.deepcopy(a), lp_b), IDS)
    m = r.metrics
    assert (r.verdict, m["kind"], m["first_layer"], m["op"]) == ("fail", "numeric", "log-probs", "logprobs"), name
    assert m["share_numerics[log-probs]"] > 0.5
    check_judgeable(r, "candidate")


@pytest.mark.parametrize("lp_a, lp_b", [
    (faults.temperature_logprobs(0.7), lambda z: torch.log_softmax(z.float() * (1 / 0.7), -1)),  # same T
    (lambda z: torch.log_softmax(z.float(), -1), lambda z: torch.log_softmax(z.double(), -1).float()),
])
def test_logprob_functions_that_differ_by_rounding_are_noise(lp_a, lp_b):
    a = _with_head_scaled()
    r = localize(Engine(a, lp_a), Engine(copy.deepcopy(a), lp_b), IDS)
    row = r.evidence["stages"][-1]
    assert row["name"] == "log-probs" and row["verdict"] == "noise" and r.metrics["kind"] == "noise"


def test_cross_sequence_leak_is_not_excused_by_the_batch_floor():
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=3)
    b = copy.deepcopy(a)
    b.model.layers[1].mlp.register_forward_hook(lambda mod, args, y: y + 1e-2 * y.mean(0, keepdim=True))
    loc = localize_layers(Engine(a), Engine(b), IDS)
    assert (loc.first_layer, loc.op) == ("model.layers.1", "mlp")


class _KwWrapper(torch.nn.Module):
    """forward(**kw): Engine cannot pass use_cache=False, so the HF model builds a KV cache."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask=None, **kw):
        return self.m(input_ids, attention_mask=attention_mask, **kw).logits


def test_wrapper_taking_kwargs_is_localised_to_the_op():
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=3)
    b = copy.deepcopy(a)
    faults.in_dtype(b.model.layers[1].mlp, torch.bfloat16)
    loc = localize_layers(Engine(_KwWrapper(a)), Engine(_KwWrapper(b)), IDS)
    assert (loc.first_layer, loc.op) == ("m.model.layers.1", "mlp")


class _PlainLM(torch.nn.Module):
    """No config: the vocabulary is the embedding's rows."""

    def __init__(self, vocab, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, vocab, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def test_plain_modules_with_other_vocabularies_cannot_be_judged():
    with pytest.raises(InvalidArgument, match="128 ids and the engine's 130"):
        localize_layers(Engine(_PlainLM(128), name="trainer"), Engine(_PlainLM(130)), IDS)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        localize_layers(Engine(_PlainLM(128)), Engine(_PlainLM(128)), IDS + 100)


def test_an_engine_that_splits_the_batch_is_refused_saying_so():
    import types
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=2)
    b = copy.deepcopy(a)
    inner = b.forward

    def halves(self, input_ids=None, attention_mask=None, use_cache=None, **kw):
        return types.SimpleNamespace(logits=torch.cat([inner(input_ids=input_ids[i:i + 3], use_cache=False).logits
                                                       for i in (0, 3)]))
    b.forward = types.MethodType(halves, b)
    with pytest.raises(InvalidArgument, match="runs the batch in parts of 3 rows"):
        localize(Engine(a), Engine(b), IDS)


def _minus_inf_before(k):
    """Log-probs -inf at the first k positions (a prompt the engine never sampled)."""
    def lp_b(z):
        lp = torch.log_softmax(z.float(), -1)
        lp[:, :k] = -math.inf
        return lp
    return lp_b


def test_score_mask_limits_the_judged_tokens_and_dropped_ones_count_once():
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=2)
    # 5 of 15 scored positions per row -inf: 2/3 judged, above the 50% floor (the dropped were
    # subtracted twice before: 60 - 30 - 30 < 45, refused)
    r = localize(Engine(a), Engine(copy.deepcopy(a), _minus_inf_before(5)), IDS)
    assert r.metrics["n_dropped_tokens"] == 30 and r.metrics["n_tokens"] == 60
    eng = Engine(copy.deepcopy(a), _minus_inf_before(10))
    with pytest.raises(InvalidArgument, match=r"only 30 of 90 scored tokens .*\(60 are -inf\)"):
        localize(Engine(a), eng, IDS)
    sm = torch.zeros(IDS.shape, dtype=torch.bool)
    sm[:, 11:] = True  # tokens 11.. are scored at positions 10..: every scored one finite
    r = localize(Engine(a), eng, IDS, score_mask=sm)
    assert r.metrics["n_tokens"] == 30 and r.metrics["n_dropped_tokens"] == 0
    with pytest.raises(InvalidArgument, match="score_mask has shape"):
        localize(Engine(a), eng, IDS, score_mask=sm[:, 1:])
