"""drift.localize end to end: every demo case (an injected fault with a known stage, op and
kind) is reproduced; the decomposition's shares add up; the vLLM residual convention is
handled (no false divergence at the first layer) and reading it as HF's is not."""
import copy

import pytest
import torch
from trainprobes.drift import faults
from trainprobes.drift.decompose import PARTS, localize
from trainprobes.drift.engines import Engine
from trainprobes.drift.localize import localize_layers
from trainprobes.drift.localize_demo import CASES, base_model, reproduced, run_case, sample
from trainprobes.gate import check_judgeable
from trainprobes.result import Result

pytest.importorskip("transformers")
from trainprobes.drift.vllm_style import VllmStyleLM  # noqa: E402
from trainprobes.isolation.hf import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_demo_case_reproduced(case):
    r = run_case(case)
    m = r.metrics
    assert reproduced(r), (m["kind"], m["first_layer"], m["op"], r.message)
    assert m["engines_agree"] is (case.kind in ("exact", "noise"))
    assert r.verdict == ("pass" if m["engines_agree"] else "fail") and r.reproduced
    assert sum(m[f"share_{p}"] for p in PARTS) == pytest.approx(1.0 if m["mean_abs_log_ratio"] else 0.0,
                                                                 abs=1e-9)
    if case.kind not in ("exact", "noise"):
        share = {"numeric": "numerics"}.get(case.kind, case.kind)
        assert m[f"share_{share}"] > 0.9 and m[f"share_{share}_ci_low"] > 0.5
        assert r.codes == ["TP-D4"]
    assert Result.from_json(r.to_json()) == r
    check_judgeable(r, "candidate")  # the gate's consistency rule (trainprobes.gate.rules.drift) holds
    for s in r.evidence["stages"]:
        assert f"own_error[{s['name']}]" in m and f"noise_floor[{s['name']}]" in m


def test_router_replay_removes_the_routing_drift():
    r = run_case(next(c for c in CASES if c.kind == "routing"))
    m = r.metrics
    assert m["routing_frac_decisions"] > 0 and m["routing_mismatch[model.layers.1.mlp.gate]"] > 0
    assert m["routing_mismatch[model.layers.0.mlp.gate]"] == 0  # before the fault: no flip
    assert m["share_routing"] > 0.9 and abs(m["share_unexplained"]) < 0.05


def test_fault_in_a_model_the_demo_does_not_use():
    """qwen2, 5 blocks, a bf16 attention in the last block: found there."""
    a = tiny_model("qwen2", "eager", seed=7, num_hidden_layers=5)
    b = copy.deepcopy(a)
    faults.in_dtype(b.model.layers[4].self_attn, torch.bfloat16)
    ids = torch.randint(0, 128, (6, 20), generator=torch.Generator().manual_seed(3))
    r = localize(Engine(a), Engine(b), ids)
    assert (r.metrics["kind"], r.metrics["first_layer"], r.metrics["op"]) == ("numeric", "model.layers.4",
                                                                             "attention")


@pytest.mark.parametrize("fault_block", [None, 0, 2])
def test_vllm_residual_convention(fault_block):
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=3)
    b = copy.deepcopy(a)
    if fault_block is not None:
        faults.in_dtype(b.model.layers[fault_block].mlp, torch.bfloat16)
    ids = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(1))
    engine = VllmStyleLM(b)
    loc = localize_layers(Engine(a), Engine(engine, convention="vllm"), ids)
    want = None if fault_block is None else f"model.layers.{fault_block}"
    assert loc.first_layer == want
    if fault_block != 0:  # block 0 carries no fault: its stream agrees to rounding
        assert _row(loc, "model.layers.0").free_error < 1e-5
    if fault_block is not None:
        assert loc.op == "mlp"
    naive = localize_layers(Engine(a), Engine(engine, convention="hf"), ids)
    assert naive.first_layer == "model.layers.0" and _row(naive, "model.layers.0").free_error > 0.1


def _row(loc, name):
    return next(r for r in loc.stages if r.name == name)


def test_sampled_tokens_come_from_the_engine():
    e = Engine(base_model("llama", layers=1), faults.top_p_logprobs(0.5))
    ids = sample(e, 3, 10, seed=0)
    with torch.no_grad():
        lp = e.logprobs(e.logits(ids))[:, :-1].gather(-1, ids[:, 1:, None])
    assert ids.shape == (3, 10) and bool(torch.isfinite(lp[:, 1:]).all())


def test_trainer_side_bf16_fault_is_numeric_not_stale_engine_weights():
    a = tiny_model("llama", "eager", seed=0, num_hidden_layers=3)
    b = copy.deepcopy(a)
    faults.in_dtype(a.model.layers[2].mlp, torch.bfloat16)  # the TRAINER's MLP in bf16
    ids = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(1))
    r = localize(Engine(a, name="trainer"), Engine(b, name="engine"), ids)
    m = r.metrics
    assert (m["kind"], m["first_layer"], m["op"]) == ("numeric", "model.layers.2", "mlp")
    assert m["n_stale_tensors"] == 0 and m["n_trainer_rounded_tensors"] == 3 and m["share_weights"] == 0
    assert "stale" not in r.message and "trainer holds 3 tensor(s) rounded" in r.message
    check_judgeable(r, "candidate")


def test_moe_block_wholly_in_bf16_is_found_at_its_mlp_with_its_router_flips():
    """Router and experts of one MoE block in bf16: found at that block's MLP; the router's
    flips are reported and replay assigns them their share (measured: routing 72%, numerics
    28%, so the kind is routing: the flips carry most of the drift)."""
    from trainprobes.drift.localize_demo import Case, _edit
    whole = Case("block 2's MoE block in bf16", "qwen2_moe",
                 _edit(lambda m: faults.in_dtype(m.model.layers[2].mlp, torch.bfloat16)), "model.layers.2", "mlp",
                 "routing")
    m = run_case(whole).metrics
    assert (m["first_layer"], m["op"], m["op_module"]) == ("model.layers.2", "mlp", "model.layers.2.mlp")
    assert m["routing_mismatch[model.layers.2.mlp.gate]"] > 0 and m["routing_mismatch[model.layers.1.mlp.gate]"] == 0
    assert m["share_routing"] > 0.1 and m["share_numerics"] > 0.1
    assert m["share_routing"] + m["share_numerics"] > 0.95 and m["kind"] in ("routing", "numeric")
