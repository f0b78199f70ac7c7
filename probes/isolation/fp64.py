"""A float64 twin that stays float64 inside: transformers' modeling code upcasts to float32 on
purpose in a few places, which a `.double()` copy keeps doing. Measured on the tiny
GraniteMoE-SWA twin, a prefix and the full row differed by 2.8e-9 after attention and 2.4e-7
after an RMSNorm: float32 rounding, which then passes for a real change when the twin is asked
to settle a near tie (a truncated prefix is called non-causal). The sites:
  eager_attention_forward   softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
  *RMSNorm.forward          hidden_states.to(torch.float32) ... .to(input_dtype)
  *RotaryEmbedding.forward  inv_freq_expanded.float() @ position_ids_expanded.float()
`Float64Mode` rewrites every float32 request made while it is active (a dtype argument,
`.float()`, `.to(torch.float32)`, `.type(torch.float32)`, the default dtype) into float64, so those sites compute
in float64 too; `run_in_float64(model)` makes a model's every call run under it. The
isolation probe's automatic twins (PackedModel.fp64_twin, the deep copy of an nn.Module
target) and the zoo's (trainprobes.zoo.targets.fp64_copy) run under it; on a packed tiny
Llama a `.double()` copy alone is 7e-8 to 8e-8 (relative) from the same model written out in float64,
this one within 1e-13 (tests/test_isolation_fp64.py).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Float64Mode", "run_in_float64"]

_F32 = torch.float32
_F64 = torch.float64


def _swap(v):
    if v is _F32:
        return _F64
    if isinstance(v, (list, tuple)) and any(e is _F32 for e in v):
        return type(v)(_F64 if e is _F32 else e for e in v)
    return v


class Float64Mode(TorchFunctionMode):
    """Within it, float32 as a requested dtype means float64 (nothing else changes), the
    default dtype included: a tensor made without a dtype (XGLM's torch.full((),
    torch.finfo(float64).min) overflowed float32; integer positions divided in Ministral3's
    attention scale) is float64 too."""

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(_F64)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.set_default_dtype(self._default)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func, args = torch.Tensor.double, args[:1]
        args = tuple(_swap(a) for a in args)
        kwargs = {k: _swap(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def run_in_float64(model):
    """Make every call of `model` (an nn.Module already in float64) run under Float64Mode;
    returns the model."""
    # the instance's own forward where it has one (a patched model: liger or accelerate bind
    # forward per instance), else its class's: the twin must compute the target's function
    inner = model.forward

    def forward(*args, **kwargs):
        with Float64Mode():
            return inner(*args, **kwargs)
    model.forward = forward
    return model
