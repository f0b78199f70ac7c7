"""What today's parity checks would say, side by side with the probe.

Each compares the transform's output with the single-device step in the model's own dtype
(the way those tests run), on the same trials, and says whether it would have flagged it:
    loss_rtol_5pct  |L - L_1| > 0.05 |L_1| on some trial: Megatron-LM's golden loss curves
                    (rtol 0.05) and DeepSpeed's pipeline-vs-data-parallel test (0.05)
    grad_rtol_1e-5  not torch.allclose(g, g_1, rtol=1e-5, atol=4e-5) for some parameter:
                    PyTorch's pipelining tests (test_schedule_multiproc.py)
    loss_bitwise    L != L_1 in any bit on some trial: torchtitan's loss_compare.py
                    --assert-equal
None where the transform reports no loss.
"""
from __future__ import annotations

import torch

CHECKS = ("loss_rtol_5pct", "grad_rtol_1e-5", "loss_bitwise")
__all__ = ["CHECKS", "compare_tolerances"]


def compare_tolerances(same, obs) -> dict:
    """{check: flagged (bool) or None} for a step.Truth in the model's dtype and an Observed."""
    T = same.loss.numel()
    grads_ok = True
    for name, ref in same.grads.items():
        mine = obs.grads[name][min(obs.grads[name])]
        if not torch.allclose(mine, ref.reshape(T, -1).double(), rtol=1e-5, atol=4e-5):
            grads_ok = False
            break
    out = {"grad_rtol_1e-5": not grads_ok, "loss_rtol_5pct": None, "loss_bitwise": None}
    if obs.losses:
        loss = obs.losses[min(obs.losses)]
        ref = same.loss.double()
        out["loss_rtol_5pct"] = bool(((loss - ref).abs() > 0.05 * ref.abs()).any())
        out["loss_bitwise"] = not torch.equal(loss.to(same.loss.dtype), same.loss)
    return out
