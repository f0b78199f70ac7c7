"""Engine pairs with injected faults and a known answer (controls of `trainprobes drift
localize --demo`): tiny random HF models (trainprobes.isolation.hf.tiny_model, no download)
with the lm_head scaled so next-token distributions are peaked like a trained LM's.
Each case names the stage, op and kind `localize` must report."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from trainprobes.drift.engines import Engine, raw_logprobs
from trainprobes.drift.faults import in_dtype, norm_epsilon, stale, temperature_logprobs, top_p_logprobs
from trainprobes.result import Result

LOGIT_SCALE = 30.0
T = 0.7


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    build: Callable            # (trainer module copy) -> (engine module, engine logprobs)
    first_layer: str
    op: str
    kind: str
    trainer_logprobs: Callable = raw_logprobs
    attn: str = "eager"        # the engine's attention implementation


def _same(m):
    return m, raw_logprobs


def _edit(f, logprobs=raw_logprobs):
    def build(m):
        f(m)
        return m, logprobs
    return build


def _whole_model(family: str, tag: str = "") -> tuple:
    """The cases with no fault inside the model, the same in every family: identical engines,
    eager vs sdpa attention, and the two log-prob conventions."""
    return (
        Case(f"identical engines{tag}", family, _same, "", "", "exact"),
        Case(f"eager vs sdpa attention, fp32{tag}", family, _same, "", "", "noise", attn="sdpa"),
        Case(f"temperature applied twice by the engine{tag}", family,
             lambda m: (m, temperature_logprobs(T * T)), "", "", "temperature",
             trainer_logprobs=temperature_logprobs(T)),
        Case(f"engine returns top-p 0.9 renormalised log-probs{tag}", family,
             lambda m: (m, top_p_logprobs(0.9)), "", "", "renormalisation"),
    )


LLAMA = _whole_model("llama") + (
    Case("block 2's MLP in bf16", "llama",
         _edit(lambda m: in_dtype(m.model.layers[2].mlp, torch.bfloat16)),
         "model.layers.2", "mlp", "numeric"),
    Case("block 0's input norm epsilon 1e-6 -> 1e-3", "llama",
         _edit(lambda m: norm_epsilon(m.model.layers[0].input_layernorm, 1e-3)),
         "model.layers.0", "norm", "numeric"),
    Case("stale v_proj in the last block (missed by the refit)", "llama",
         _edit(lambda m: stale(m.model.layers[3].self_attn.v_proj.weight)),
         "model.layers.3", "attention", "weights"),
)
# the same faults in a Qwen2-MoE (32 experts, top-4, a shared expert). Its MLP fault is in
# the experts: the whole MoE block in bf16 puts its router in bf16 too, whose flips then
# carry most of the drift (kind routing, measured 72%: docs/drift.md)
QWEN2_MOE = _whole_model("qwen2_moe", " (MoE)") + (
    Case("block 2's experts in bf16 (MoE)", "qwen2_moe",
         _edit(lambda m: in_dtype(m.model.layers[2].mlp.experts, torch.bfloat16)),
         "model.layers.2", "mlp", "numeric"),
    Case("block 1's post-attention norm epsilon 1e-6 -> 1e-3 (MoE)", "qwen2_moe",
         _edit(lambda m: norm_epsilon(m.model.layers[1].post_attention_layernorm, 1e-3)),
         "model.layers.1", "norm", "numeric"),
    Case("stale o_proj in block 2 (MoE)", "qwen2_moe",
         _edit(lambda m: stale(m.model.layers[2].self_attn.o_proj.weight)),
         "model.layers.2", "attention", "weights"),
    Case("block 1's router in bf16 (MoE)", "qwen2_moe",
         _edit(lambda m: in_dtype(m.model.layers[1].mlp.gate, torch.bfloat16)),
         "model.layers.1", "router", "routing"),
)
CASES = LLAMA + QWEN2_MOE


def base_model(family: str, attn: str = "eager", seed: int = 0, layers: int = 4):
    from trainprobes.isolation.hf import tiny_model

    # many experts: near-ties a bf16 router can turn are as common as in real MoEs (R3: ~10%)
    extra = {"num_experts": 32, "num_experts_per_tok": 4} if family == "qwen2_moe" else {}
    m = tiny_model(family, attn, seed=seed, num_hidden_layers=layers, **extra)
    with torch.no_grad():
        m.lm_head.weight.mul_(LOGIT_SCALE)
    return m


@torch.no_grad()
def sample(engine: Engine, n_seq: int, length: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    """Token sequences [n_seq, length] sampled from what the engine reports (so a
    renormalising engine never scores a token it could not emit)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n_seq, 2), generator=g)
    while ids.shape[1] < length:  # loop over positions: full forward each step, tiny model
        p = engine.logprobs(engine.logits(ids)[:, -1]).exp()
        ids = torch.cat([ids, torch.multinomial(p, 1, generator=g)], 1)
    return ids


def run_case(case: Case, *, n_seq: int = 8, length: int = 24, seed: int = 0, **options) -> Result:
    from trainprobes.drift.decompose import localize

    a = base_model(case.family, "eager", seed)
    b = base_model(case.family, case.attn, seed) if case.attn != "eager" else copy.deepcopy(a)
    module, logprobs = case.build(b)
    trainer = Engine(a, case.trainer_logprobs, name="trainer")
    engine = Engine(module, logprobs, name="engine")
    ids = sample(engine, n_seq, length, seed + 1)
    r = localize(trainer, engine, ids, seed=seed, target=f"demo: {case.name}", **options)
    r.evidence["expect"] = {"first_layer": case.first_layer, "op": case.op, "kind": case.kind}
    r.expected = "pass" if case.kind in ("exact", "noise") else "fail"
    # a control is reproduced only at its stage, op and kind: a fail elsewhere is a miss
    r.metrics["matches_known_verdict"] = reproduced(r)
    return r


def reproduced(r: Result) -> bool:
    e = r.evidence["expect"]
    return (r.metrics["kind"] == e["kind"] and r.metrics["first_layer"] == e["first_layer"]
            and r.metrics["op"] == e["op"])


def run_demo(*, progress=None, **options) -> list:
    out = []
    for i, c in enumerate(CASES):  # loop over cases
        if progress is not None:
            progress(i, len(CASES), c.name)
        out.append(run_case(c, **options))
    return out


def example_trainer():
    """Import-path factory (`--target trainprobes.drift.localize_demo:example_trainer`): the
    demo's tiny Llama, fp32, eager attention."""
    return base_model("llama")


def example_engine():
    """`--engine trainprobes.drift.localize_demo:example_engine`: the same weights with block
    2's MLP computing in bf16 (expect kind numeric at model.layers.2, op mlp)."""
    m = base_model("llama")
    in_dtype(m.model.layers[2].mlp, torch.bfloat16)
    return m


def example_engine_sdpa():
    """`--engine trainprobes.drift.localize_demo:example_engine_sdpa`: sdpa attention, fp32
    (expect noise)."""
    return base_model("llama", "sdpa")
