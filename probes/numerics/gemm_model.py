"""A model's GEMMs: capture every nn.Linear's input and output gradient from one fp32 step,
and judge its three training GEMMs (numerics.gemm) under a recipe and an accumulator.

  1. hooks: a forward hook keeps each Linear's input x (flattened to tokens x in_features),
     a full backward hook its output gradient dy (tokens x out_features); the weight w is
     the Linear's own;
  2. one step in fp32: loss = the output's `loss` (HF models given labels), else loss_fn(out),
     else the mean square of the output; backward;
  3. fprop (x . w, K = in), dgrad (dy . w^T, K = out), wgrad (dy^T . x^T, K = tokens) each
     judged by gemm_bias; the rows sorted by risk: biased first, then by the accumulator's
     own relative bias (evidence accumulator_bias).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from trainprobes.errors import CannotJudge, InvalidArgument, TargetError
from trainprobes.numerics.gemm import DEFAULT_TOLERANCE, gemm_bias, linear_gemms
from trainprobes.result import Result


@dataclass
class Captured:
    """One Linear's operands from the step."""

    name: str
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor


def capture_linears(model: torch.nn.Module, batch, loss_fn=None, skipped: list | None = None) -> list[Captured]:
    """Steps 1-2: every nn.Linear's (x, w, dy) from one fp32 forward and backward; a Linear
    not on the loss's path is appended to `skipped` as {layer, gemm, reason}."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        raise InvalidArgument(f"the model ({type(model).__name__}) has no torch.nn.Linear: there "
                              "are no GEMMs to judge (modules of its own that call F.linear are not "
                              "seen; wrap them in nn.Linear)")
    seen: dict[str, dict] = {n: {} for n, _ in linears}
    hooks = []
    for name, mod in linears:
        def fwd(m, inp, out, name=name):
            seen[name]["x"] = inp[0].detach().reshape(-1, m.in_features).double()

        def bwd(m, grad_in, grad_out, name=name):
            seen[name]["dy"] = grad_out[0].detach().reshape(-1, m.out_features).double()
        hooks += [mod.register_forward_hook(fwd), mod.register_full_backward_hook(bwd)]
    try:
        model = model.float()
        model.zero_grad(set_to_none=True)
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        loss = getattr(out, "loss", None)
        if loss is None:
            if loss_fn is not None:
                loss = loss_fn(out)
            else:
                t = getattr(out, "logits", out)
                t = t[0] if isinstance(t, (tuple, list)) else t
                loss = t.float().pow(2).mean()
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    got = []
    for name, mod in linears:
        s = seen[name]
        if "x" not in s or "dy" not in s:
            if skipped is not None:  # not on the loss's path in this step: said, not dropped
                skipped.append({"layer": name, "gemm": "all", "reason": "not on the loss's path in "
                                "this step (no input or no output gradient)"})
            continue
        got.append(Captured(name, s["x"], mod.weight.detach().double(), s["dy"]))
    if not got:
        raise TargetError("no Linear received a gradient in the step: the loss does not depend on them")
    return got


def judge_model(model, batch, *, preset="h200-scaled-mm", recipe="exact", samples=512, trials=16,
                seed=0, alpha=0.01, tolerance=DEFAULT_TOLERANCE, loss_fn=None,
                target: str = "model", progress=None) -> list[Result]:
    """Step 3: one Result per (Linear, GEMM), riskiest first (module docstring).
    progress(done, total, name) is called before each GEMM."""
    results, skipped = [], []
    captured = list(capture_linears(model, batch, loss_fn, skipped))
    for i, c in enumerate(captured):
        for j, (gemm, a, b) in enumerate(linear_gemms(c.x, c.w, c.dy)):
            if progress is not None:
                progress(3 * i + j, 3 * len(captured), f"{c.name}.{gemm}")
            if not a.abs().sum() or not b.abs().sum():
                # an all-zero operand (a dead layer): nothing to judge, listed with the reason
                skipped.append({"layer": c.name, "gemm": gemm, "reason": "an all-zero operand"})
                continue
            try:
                r = gemm_bias(a, b, preset=preset, recipe=recipe, gemm=gemm, samples=samples,
                              trials=trials, seed=seed, alpha=alpha, tolerance=tolerance,
                              promotion=False, target=f"{target}:{c.name}.{gemm}")
            except InvalidArgument as e:
                raise type(e)(f"layer {c.name!r}: {e}") from None
            r.evidence["layer"] = c.name
            results.append(r)
    if not results:
        raise CannotJudge(f"no GEMM of the model could be judged: {skipped}")
    for r in results:
        r.evidence["skipped"] = skipped
    # riskiest first: biased, then by the accumulator's own share of the error (a recipe's
    # quantisation noise at these sample sizes would otherwise rank the rows at random)
    return sorted(results, key=lambda r: (not r.metrics["biased"],
                                          -abs(r.evidence["accumulator_bias"])))
