"""Routing replay weights the replayed experts as the router was MEASURED to (its returned
weights against softmax top-k, renormalised and not), never from an attribute: transformers
5's Mixtral router always renormalises and has no norm_topk_prob. A router that matches
neither is cannot judge."""
import copy

import pytest
import torch
from trainprobes.drift import faults
from trainprobes.drift.engines import Engine
from trainprobes.drift.patching import router_weights
from trainprobes.errors import CannotJudge

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
TF5 = int(tf.__version__.split(".")[0]) >= 5


def _mixtral(layers=3):
    cfg = tf.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                           num_local_experts=16, num_experts_per_tok=2)
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = tf.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(30)  # peaked next-token distributions, as in the demo
    return m


def _router_out(gate, n=64, seed=0):
    x = torch.randn(n, gate.weight.shape[1], generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return gate(x)


@pytest.mark.skipif(not TF5, reason="the fact holds for transformers 5 (measured on 5.25.0)")
def test_mixtral_router_measured_renormalising_without_the_attribute():
    """transformers 5.25.0: MixtralTopKRouter renormalises its top-k and has no norm_topk_prob
    (the attribute the replay used to read, defaulting to 'raw')."""
    gate = _mixtral().model.layers[0].mlp.gate
    assert not hasattr(gate, "norm_topk_prob")
    assert router_weights(gate, _router_out(gate)) == "renormalised"


@pytest.mark.parametrize("norm", [True, False])
def test_qwen2_moe_router_measured_either_way(norm):
    from trainprobes.isolation.hf import tiny_model
    m = tiny_model("qwen2_moe", "eager", num_hidden_layers=1, num_experts=8, num_experts_per_tok=2,
                   norm_topk_prob=norm)
    gate = m.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight.normal_(generator=torch.Generator().manual_seed(0))  # HF inits it to zeros: a tie
    assert router_weights(gate, _router_out(gate)) == ("renormalised" if norm else "raw")
    gate.norm_topk_prob = not norm  # its forward reads the attribute: the measure follows what it does
    assert router_weights(gate, _router_out(gate)) == ("raw" if norm else "renormalised")


def _scaled(module, scale):
    """A router whose weights are scaled after the softmax top-k (DeepSeek's routed_scaling_factor)."""
    def post(m, args, out):
        logits, w, idx = out
        return logits, w * scale, idx
    module.register_forward_hook(post)


def test_router_matching_neither_rule_is_cannot_judge():
    gate = _mixtral(1).model.layers[0].mlp.gate
    _scaled(gate, 2.5)
    with pytest.raises(CannotJudge, match="neither softmax top-k renormalised nor raw"):
        router_weights(gate, _router_out(gate))
    sig = torch.randn(8, 6)  # a sigmoid router: weights that are no softmax
    idx = sig.topk(2, -1).indices
    with pytest.raises(CannotJudge, match="sigmoid"):
        router_weights(torch.nn.Identity(), (sig, sig.sigmoid().gather(-1, idx), idx))


def test_router_whose_topk_holds_all_the_mass_is_cannot_judge():
    logits = torch.tensor([[30.0, 29.0, 0.0, 0.0]] * 4)
    idx = torch.tensor([[0, 1]] * 4)
    w = logits.softmax(-1).gather(-1, idx)
    with pytest.raises(CannotJudge, match="cannot be measured"):
        router_weights(torch.nn.Identity(), (logits, w, idx))


def _pair(fault):
    from trainprobes.drift.localize_demo import sample
    a = _mixtral()
    b = copy.deepcopy(a)
    fault(a, b)
    t, e = Engine(a, name="trainer"), Engine(b, name="engine")
    return t, e, sample(e, 8, 24, 1)


@pytest.mark.skipif(not TF5, reason="transformers 5's Mixtral router (measured on 5.25.0)")
def test_mixtral_bf16_routers_drift_is_routing():
    """Every router in bf16 against fp32: replaying the trainer's choices removes the drift
    (measured 1.000; 0.756 with the weights left raw, as the attribute default had it)."""
    from trainprobes.drift.decompose import localize

    def bf16_routers(a, b):
        for layer in b.model.layers:
            faults.in_dtype(layer.mlp.gate, torch.bfloat16)
    t, e, ids = _pair(bf16_routers)
    r = localize(t, e, ids)
    assert r.metrics["kind"] == "routing" and r.metrics["routing_frac_decisions"] > 0
    assert r.metrics["share_routing"] >= 0.9 and r.metrics["share_routing_ci_low"] >= 0.9


def test_unmeasurable_router_in_localize_is_cannot_judge():
    from trainprobes.drift.decompose import localize

    def scaled_bf16(a, b):
        for m in (a, b):
            for layer in m.model.layers:
                _scaled(layer.mlp.gate, 2.5)
        for layer in b.model.layers:
            faults.in_dtype(layer.mlp.gate, torch.bfloat16)
    t, e, ids = _pair(scaled_bf16)
    with pytest.raises(CannotJudge, match="routing replay"):
        localize(t, e, ids)


def test_cast_in_an_engine_pre_hook_is_blamed_on_the_module():
    """An engine that rounds lm_head's inputs to bf16 in a forward pre-hook (inputs quantised
    on the way in): the recording hook sees the input before the engine's pre-hook, so the cast
    is lm_head's, not the hand-off's before it (it was 'into lm_head' with the hook appended)."""
    from trainprobes.drift.decompose import localize
    from trainprobes.drift.localize_demo import base_model, sample
    a = base_model("llama", layers=2)
    b = copy.deepcopy(a)
    b.lm_head.register_forward_pre_hook(lambda m, args: (args[0].bfloat16().float(),))
    t, e = Engine(a, name="trainer"), Engine(b, name="engine")
    r = localize(t, e, sample(e, 6, 16, 1))
    assert (r.metrics["kind"], r.metrics["first_layer"], r.metrics["op"]) == ("numeric", "lm_head", "lm_head")
    verdict = {s["name"]: s["verdict"] for s in r.evidence["stages"]}
    assert verdict["into lm_head"] == "exact" and verdict["lm_head"] == "beyond"


@pytest.mark.skipif(not TF5, reason="transformers 5's Mixtral router (measured on 5.25.0)")
def test_late_router_is_the_answer_not_the_first_stage_beyond_noise():
    """Every router in bf16: block 0's router logits are beyond noise but none of its decisions
    flip (its numerics share ~0); the flips start at block 1 and replaying them removes the
    drift. The answer is block 1's router; block 0 is named beside it as first beyond noise."""
    from trainprobes.drift.decompose import localize

    def bf16_routers(a, b):
        for layer in b.model.layers:
            faults.in_dtype(layer.mlp.gate, torch.bfloat16)
    t, e, ids = _pair(bf16_routers)
    r = localize(t, e, ids)
    m = r.metrics
    flips = {k[len("routing_mismatch["):-1]: v for k, v in m.items() if k.startswith("routing_mismatch[")}
    first_flip = next(k for k, v in flips.items() if v > 0)
    assert m["first_layer"] == "model.layers.0" and flips["model.layers.0.mlp.gate"] == 0
    assert abs(m["share_numerics[model.layers.0]"]) < 0.05
    assert (m["explained_by"], m["explained_by_op"], m["explained_by_module"]) == (
        "model.layers.1", "router", first_flip)
    from trainprobes.gate import check_judgeable
    check_judgeable(r, "candidate")  # the gate reads the answer as consistent
    bad = copy.deepcopy(r)
    bad.metrics["explained_by"], bad.metrics["explained_by_module"] = "model.layers.0", "model.layers.0.mlp.gate"
    with pytest.raises(CannotJudge, match="do not flip"):
        check_judgeable(bad, "candidate")


@pytest.mark.skipif(not TF5, reason="transformers 5's Mixtral router (measured on 5.25.0)")
def test_a_small_numeric_fault_first_and_a_router_later_names_the_router():
    """Block 0's experts in bf16 (beyond noise, no decision flips there, numerics share 0.6%)
    and block 1's router in bf16 (its flips carry 99% of the drift): the answer is block 1's
    router; block 0 is named beside it as the first stage beyond noise."""
    from trainprobes.drift.decompose import localize

    def early_numeric_late_router(a, b):
        faults.in_dtype(b.model.layers[0].mlp.experts, torch.bfloat16)
        faults.in_dtype(b.model.layers[1].mlp.gate, torch.bfloat16)
    t, e, ids = _pair(early_numeric_late_router)
    r = localize(t, e, ids)
    m = r.metrics
    assert (m["kind"], m["first_layer"], m["op"]) == ("routing", "model.layers.0", "mlp")
    assert (m["explained_by"], m["explained_by_op"], m["explained_by_module"]) == (
        "model.layers.1", "router", "model.layers.1.mlp.gate")
    assert m["routing_mismatch[model.layers.0.mlp.gate]"] == 0 < m["routing_mismatch[model.layers.1.mlp.gate]"]
    assert m["share_routing"] > 0.9 and abs(m["share_numerics[model.layers.0]"]) < 0.05
    assert r.message.startswith("routing: explained by model.layers.1 (op router: model.layers.1.mlp.gate")
    assert "first stage beyond noise model.layers.0" in r.message
