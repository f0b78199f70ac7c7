"""Impact: "bias compounds", shown on a small data-parallel training run.

Least squares y = X w* + noise, split over `world` simulated ranks. Every step each rank
computes its gradient in fp64, holds it in the wire format (as a bf16/fp16/fp8 gradient
buffer would), the gradients are all-reduced with trainprobes.reference.collectives (op "avg", the
chosen algorithm and rounding), and w takes an fp64 SGD step with the result. The same
seeded data and initial w run once per variant; the loss curves and the gap to the fp64
run are the evidence. FP8 gradients are scaled by a power of two per step (amax scaling,
as FP8 recipes do) so that the largest rank gradient times world fits below max_finite/2;
the scale is exact and undone after the reduction.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import ROUNDING_MODES, get_format
from trainprobes.result import Result
from trainprobes.validation import check_choice, check_int, check_number, check_seed, check_type

DEFAULT_VARIANTS = (("fp64", {"dtype": "fp64"}), ("fp16", {"dtype": "fp16"}), ("bf16", {"dtype": "bf16"}),
                    ("bf16 stochastic", {"dtype": "bf16", "rounding": "stochastic"}),
                    ("fp8_e4m3fn", {"dtype": "fp8_e4m3fn"}))


def least_squares(world, per_rank, features, noise, generator, mean: float = 0.0):
    """X (world, per_rank, features) ~ N(mean, 1), y = X w* + noise: the problem every impact
    run trains (numerics.gemm_impact too: world 1, mostly positive inputs)."""
    w_star = torch.randn(features, generator=generator, dtype=torch.float64)
    X = torch.randn(world, per_rank, features, generator=generator, dtype=torch.float64) + mean
    y = X @ w_star + noise * torch.randn(world, per_rank, generator=generator, dtype=torch.float64)
    return X, y


def train(X, y, *, steps, lr, gradient: Callable, progress=None) -> list[float]:
    """SGD from w = 0 on 0.5 mean (X w - y)^2, fp64 except the gradient: gradient(step, X, r)
    returns the update direction from the residuals r (the fp64 one is mean X^T r). The
    loss before every step and after the last."""
    w = torch.zeros(X.shape[-1], dtype=torch.float64)
    losses = []
    for step in range(steps):
        r = X @ w - y
        losses.append(0.5 * (r ** 2).mean().item())
        w = w - lr * gradient(step, X, r)
        if progress is not None:
            progress(step + 1, steps)
    r = X @ w - y
    losses.append(0.5 * (r ** 2).mean().item())
    return losses


def loss_gaps(curves: dict, reference: str) -> dict:
    """final_loss[label], loss_gap[label] (final loss over the reference's, minus 1) and
    max_gap[label] (the largest such gap at any step) of each curve."""
    ref = curves[reference]
    out = {}
    for label, c in curves.items():
        out[f"final_loss[{label}]"] = c[-1]
        out[f"loss_gap[{label}]"] = c[-1] / ref[-1] - 1 if ref[-1] > 0 else math.nan
        gaps = [a / b - 1 for a, b in zip(c, ref) if b > 0]
        out[f"max_gap[{label}]"] = max(gaps) if gaps else math.nan
    return out


def _allreduced(*, dtype, rounding, algorithm, seed, **kw):
    """The data-parallel gradient: each rank's mean X^T r held in `dtype` and all-reduced
    (op avg) by the emulated collective."""
    from trainprobes.reference.collectives import all_reduce

    fmt = get_format(dtype)
    g_seed = torch.Generator().manual_seed(seed)

    def gradient(step, X, r):
        world = X.shape[0]
        grads = torch.einsum("wbf,wb->wf", X, r) / X.shape[1]
        scale = 1.0
        if fmt.mantissa_bits <= 3 and fmt.name != "fp64":   # fp8/fp6/fp4: amax scaling
            amax = grads.abs().max().item()
            if amax > 0:
                scale = 2.0 ** math.floor(math.log2(fmt.max_finite / 2 / (world * amax)))
        rs = int(torch.randint(0, 2**62, (1,), generator=g_seed)) if rounding == "stochastic" else None
        return all_reduce(list((grads * scale).unbind(0)), op="avg", dtype=fmt.name, algorithm=algorithm,
                          rounding=rounding, seed=rs, **kw)[0] / scale
    return gradient


def impact(*, variants=DEFAULT_VARIANTS, world: int = 512, per_rank: int = 8, features: int = 16,
           steps: int = 40, lr: float = 0.05, noise: float = 0.1, algorithm: str = "ring", seed: int = 0,
           tol: float = 0.05, progress: Callable | None = None, **all_reduce_kwargs) -> Result:
    """Train the same least-squares model once per variant; compare the loss curves.

    variants: (label, {"dtype": ..., "rounding": ...}) pairs; the first is the reference
    (fp64). Fails (TP-B1) when a nearest-rounding variant's final loss exceeds the
    reference's by more than tol (relative). progress(label, step, steps) after each step.
    """
    variants = list(variants)
    if not variants:
        raise InvalidArgument(f"variants={variants!r} is empty; pass (label, {{'dtype': 'bf16'}}) pairs")
    for label, v in variants:
        check_type(dict, v, f"variants[{label!r}]", hint="{'dtype': ..., 'rounding': ...}")
        get_format(v.get("dtype", "fp64"), f"variants[{label!r}]['dtype']")
        check_choice(v.get("rounding", "nearest"), f"variants[{label!r}]['rounding']",
                     ROUNDING_MODES)
    check_int(steps, "steps", min=1)
    check_int(world, "world", min=1, hint="the number of ranks")
    check_number(lr, "lr", min=0, min_open=True)
    check_number(tol, "tol", min=0)
    g = torch.Generator().manual_seed(check_seed(seed))
    X, y = least_squares(world, per_rank, features, noise, g)
    curves = {}
    for label, v in variants:
        grad = _allreduced(dtype=v.get("dtype", "fp64"), rounding=v.get("rounding", "nearest"),
                           algorithm=algorithm, seed=seed, **all_reduce_kwargs)
        curves[label] = train(X, y, steps=steps, lr=lr, gradient=grad,
                              progress=None if progress is None else
                              (lambda s, t, label=label: progress(label, s, t)))
    ref_label = variants[0][0]
    metrics = {"steps": steps, "world": world, "reference": ref_label, "tol": tol,
               **loss_gaps(curves, ref_label)}
    worst, worst_label = 0.0, None
    for label, v in variants:
        gap = metrics[f"loss_gap[{label}]"]
        if v.get("rounding", "nearest") == "nearest" and label != ref_label and not (gap <= worst):
            worst, worst_label = gap, label
    bad = worst_label is not None and not (worst <= tol)
    msg = (f"final loss after {steps} steps on {world} ranks ({algorithm}) vs {ref_label}: "
           + ", ".join(f"{lab} {metrics[f'loss_gap[{lab}]']:+.1%}" for lab, _ in variants[1:]))
    if bad:
        msg += f"; {worst_label} is past tol={tol:g}: a biased reduction slows every step"
    return Result(probe="numerics.impact", target=f"least_squares[w={world},{algorithm}]",
                  verdict="fail" if bad else "pass", codes=["TP-B1"] if bad else [], seed=seed,
                  message=msg, metrics=metrics,
                  evidence={"curves": curves, "variants": [[lab, v] for lab, v in variants],
                            "plots": [{"kind": "line", "title": "training loss by gradient all-reduce format",
                                       "x": list(range(steps + 1)), "series": curves,
                                       "xlabel": "step", "ylabel": "loss", "logy": True}],
                            "lr": lr, "noise": noise, "per_rank": per_rank, "features": features})
