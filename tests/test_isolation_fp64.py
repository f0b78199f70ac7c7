"""The float64 twin is float64 inside: a packed tiny Llama's twin (the isolation probe's own,
built by PackedModel.fp64_twin, and the one built for any nn.Module target) agrees with the
same model written out by hand in float64 to the last few ulps, and Float64Mode rewrites
exactly the float32 requests (a .double() copy alone keeps transformers' float32 upcasts:
RMSNorm, rotary, eager softmax, off by ~1e-7)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from trainprobes.isolation.fp64 import Float64Mode, run_in_float64  # noqa: E402
from trainprobes.isolation.hf import PackedModel, tiny_model  # noqa: E402
from trainprobes.isolation.packing import Packing  # noqa: E402
from trainprobes.isolation.target import _twin_builder  # noqa: E402

LENGTHS = [10, 12, 8]


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@torch.no_grad()
def llama_by_hand(model, tokens, packing) -> torch.Tensor:
    """LlamaForCausalLM's forward written out in float64 from its (float64) weights, under the
    block-diagonal causal mask of `packing` with restarting position ids: every step in
    float64, nothing taken from transformers' code but the weights and the rotary
    frequencies."""
    cfg, m = model.config, model.model
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    pos = packing.position_ids(tokens.device).double()                       # [B, L]
    inv = m.rotary_emb.inv_freq     # the model's constant (computed in float32 at init), as given
    ang = pos[..., None] * inv                                                # [B, L, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    ids = packing.doc_ids(tokens.device)
    L = tokens.shape[1]
    allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    h = m.embed_tokens.weight[tokens]
    B = tokens.shape[0]
    for layer in m.layers:
        a = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = (x @ a.q_proj.weight.T).view(B, L, H, D).transpose(1, 2)
        k = (x @ a.k_proj.weight.T).view(B, L, KV, D).transpose(1, 2).repeat_interleave(H // KV, 1)
        v = (x @ a.v_proj.weight.T).view(B, L, KV, D).transpose(1, 2).repeat_interleave(H // KV, 1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        s = (q @ k.transpose(-1, -2)) / D ** 0.5
        p = s.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        h = h + (p @ v).transpose(1, 2).reshape(B, L, H * D) @ a.o_proj.weight.T
        x = _rms(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        mlp = layer.mlp
        h = h + (torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return _rms(h, m.norm.weight, cfg.rms_norm_eps) @ model.lm_head.weight.T


def _relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@torch.no_grad()
def test_the_packed_models_twin_is_float64_inside(impl):
    packing = Packing.of(LENGTHS)
    tokens = torch.randint(0, 128, (1, packing.length), generator=torch.Generator().manual_seed(0))
    twin = PackedModel(tiny_model("llama", impl), "mask_4d").fp64_twin()
    exact = llama_by_hand(twin.model, tokens, packing)
    out = twin(tokens, packing)
    assert out.dtype == torch.float64
    # float64 through and through: a few ulps of float64 (a float32 island is ~1e-7)
    assert _relative(out, exact) < 1e-13, _relative(out, exact)


@torch.no_grad()
def test_the_automatic_twin_of_any_module_is_float64_inside():
    """An nn.Module target with no fp64_twin of its own gets a float64 deep copy: that copy
    must not keep the float32 requests its code makes."""
    packing = Packing.of(LENGTHS)
    tokens = torch.randint(0, 128, (1, packing.length), generator=torch.Generator().manual_seed(1))

    class Plain(torch.nn.Module):      # a user's module: calls the model with a 4-D mask
        def __init__(self):
            super().__init__()
            self.inner = PackedModel(tiny_model("llama", "eager"), "mask_4d")

        def forward(self, x, p):
            return self.inner.model(input_ids=x, position_ids=p.position_ids(x.device),
                                    attention_mask=p.block_mask(self.inner.model.dtype, x.device)).logits
    plain = Plain()
    twin = _twin_builder(plain, None)()
    out = twin(tokens, packing)
    assert out.dtype == torch.float64
    exact = llama_by_hand(copy.deepcopy(plain.inner.model).double(), tokens, packing)
    assert _relative(out, exact) < 1e-13, _relative(out, exact)


def test_float64_mode_rewrites_float32_requests_only():
    x = torch.ones(3, dtype=torch.float64)
    with Float64Mode():
        assert x.float().dtype == torch.float64
        assert x.to(torch.float32).dtype == torch.float64
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float64
        assert x.to(torch.bfloat16).dtype == torch.bfloat16       # other requests unchanged
        assert x.to(torch.int64).dtype == torch.int64
    assert x.float().dtype == torch.float32                       # only while active


def test_run_in_float64_keeps_the_module_and_its_calls():
    lin = torch.nn.Linear(4, 4).double()

    class Up(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x).float()      # a deliberate float32 upcast
    m = Up()
    assert run_in_float64(m) is m
    assert m(torch.ones(1, 4, dtype=torch.float64)).dtype == torch.float64


def test_the_automatic_twin_runs_the_instances_own_forward():
    """A target whose forward is set on the instance (a patched model: liger's or accelerate's
    hooks bind forward per instance) is that forward: a twin running the class's forward
    instead computes another function and excused this leak, 1e-5 of the row's mean, as
    rounding (isolated; the twin moved 0)."""
    import types

    from trainprobes.isolation.documents import documents

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(32, 8)

        def forward(self, x, p):      # isolated: each token's own embedding
            return self.emb(x)

    def leaky(self, x, p):
        h = self.emb(x)
        return h + 1e-5 * h.mean(1, keepdim=True)
    m = Tokens()
    m.forward = types.MethodType(leaky, m)
    x = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(0))
    r = documents(m, x, [5, 7], causal=False)
    assert not r.metrics["isolated"] and r.metrics["n_leaks"] == 2, r.message


def test_float64_mode_makes_the_default_dtype_float64():
    """A tensor made in forward without a dtype is a float32 request too: XGLM's eager
    attention fills torch.full((), torch.finfo(attn_weights.dtype).min) (default dtype), which
    overflowed float32 in the twin (RuntimeError, the fp64 twin unavailable on 4 of xglm's map
    cells); Ministral3's attention scale divides integer position ids in the default dtype."""
    x = torch.ones(3, dtype=torch.float64)
    with Float64Mode():
        assert torch.full((), torch.finfo(x.dtype).min).dtype == torch.float64
        assert (torch.arange(4) / 3).dtype == torch.float64
        assert torch.zeros(2).dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32 and torch.zeros(2).dtype == torch.float32
