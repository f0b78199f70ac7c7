"""Impact of a low-precision weight-gradient GEMM on training: the loss gap to fp64.

numerics.impact's least-squares run (the same problem, SGD loop and loss-gap metrics), with
the gradient mean X^T r computed as the weight-gradient GEMM a training step runs: the
residuals r (the output gradient, T tokens) against the inputs X, K = T, under a recipe
(both operands quantised as that recipe quantises a gradient and an activation) and an
accumulator model, every output emulated (numerics.gemm.prepare_gemm and sample_gemm on
all `features` outputs). The inputs are mostly positive (mean 1, as post-activation inputs
are), where a truncating accumulator loses the same sign in every product.

  1. the fp64 run is the reference; one run per (recipe, preset);
  2. loss_gap[label]: final loss over fp64's minus 1 (numerics.impact.loss_gaps); the
     accumulator's share of it, accumulator_gap[label]: the gap minus the same recipe's gap
     under the fp32 accumulator (when fp32 is among the presets);
  3. fail (TP-B1) when a run's gap exceeds tol: its weight gradients are off in one
     direction at every step, and the loss shows it.
A (recipe, preset) pair the preset was not measured on (numerics.gemm.combination: bf16
products or block scales under an fp8 tensor core's accumulator) is not run unless
what_if, and the Result lists it with the reason (evidence not_run, what_if).
"""
from __future__ import annotations

from typing import Callable

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.gemm import combination, prepare_gemm, sample_gemm
from trainprobes.numerics.impact import least_squares, loss_gaps, train
from trainprobes.reference.gemm import get_preset
from trainprobes.reference.recipes import get_recipe
from trainprobes.result import Result
from trainprobes.validation import check_int, check_number, check_seed

RECIPES = ("bf16", "fp8-tensor", "fp8-rowwise", "mxfp8", "nvfp4")
PRESETS = ("h200-scaled-mm", "h200-scaled-mm-signfill", "deepseek-v3", "fp32")
REFERENCE = "fp64"


def label(recipe: str, preset: str) -> str:
    return f"{recipe} x {preset}"


def _emulated(recipe, acc, seed: int):
    """The gradient mean X^T r as the wgrad GEMM (1 x T) . (features x T)^T, emulated."""
    def gradient(step, X, r):
        x = X.reshape(-1, X.shape[-1])
        T, F = x.shape
        # every one of the F outputs once; a fresh seed per step for stochastic rounding and
        # the Hadamard signs
        p = prepare_gemm(r.reshape(1, -1), x.t().contiguous(), recipe=recipe, gemm="wgrad",
                         samples=F, seed=seed + 4 * step, every=True)
        low = sample_gemm(p, acc).low
        out = torch.zeros(F, dtype=torch.float64)
        out[p.rows[1]] = low
        return out / T
    return gradient


def _exact(step, X, r):
    return torch.einsum("wbf,wb->f", X, r) / (X.shape[0] * X.shape[1])


def gemm_impact(*, recipes=RECIPES, presets=PRESETS, tokens: int = 4096, features: int = 16,
                steps: int = 30, lr: float = 0.05, noise: float = 0.1, mean: float = 1.0,
                seed: int = 0, tol: float = 0.02, what_if: bool = False,
                progress: Callable | None = None) -> Result:
    """Train the least-squares model once in fp64 and once per (recipe, preset) with the
    weight gradient emulated (module docstring). progress(label, step, steps)."""
    recipes = [get_recipe(r).name for r in recipes]
    presets = [get_preset(p).name for p in presets]
    if not recipes or not presets:
        raise InvalidArgument(f"recipes={recipes!r}, presets={presets!r}: name at least one of each")
    check_int(tokens, "tokens", min=32, hint="K of the weight-gradient GEMM, e.g. 4096")
    check_int(features, "features", min=1)
    check_int(steps, "steps", min=1)
    check_number(lr, "lr", min=0, min_open=True)
    check_number(tol, "tol", min=0)
    check_number(mean, "mean")
    seed = check_seed(seed)
    for r in recipes:
        if r == "exact":
            raise InvalidArgument("recipe 'exact' quantises nothing, and the residuals are float64: "
                                  "their products are not exact for the emulator; pick a recipe "
                                  f"that quantises, e.g. {', '.join(RECIPES)}")
        block = get_recipe(r).block
        if block and tokens % block:
            raise InvalidArgument(f"tokens={tokens!r}: recipe {r!r} quantises 1 x {block} blocks "
                                  f"along K = tokens; use a multiple of {block}, e.g. "
                                  f"{(tokens // block + 1) * block}")
    X, y = least_squares(1, tokens, features, noise, torch.Generator().manual_seed(seed), mean)

    def tick(name):
        return None if progress is None else (lambda s, t: progress(name, s, t))
    pairs, not_run, imagined = [], [], []
    for r in recipes:
        for p in presets:
            why = combination(get_preset(p), get_recipe(r), "wgrad")
            if why and not what_if:
                not_run.append({"recipe": r, "preset": p, "reason": why})
                continue
            pairs.append((r, p))
            if why:
                imagined.append({"recipe": r, "preset": p, "reason": why})
    if not pairs:
        raise InvalidArgument(f"no recipe x preset named was measured on what it would judge: "
                              f"{not_run[0]['reason']}; pair fp8 recipes with fp8 presets, or use "
                              "the fp32 preset (what_if=True runs them anyway)")
    curves = {REFERENCE: train(X, y, steps=steps, lr=lr, gradient=_exact, progress=tick(REFERENCE))}
    for r, p in pairs:
        name = label(r, p)
        curves[name] = train(X, y, steps=steps, lr=lr, progress=tick(name),
                             gradient=_emulated(get_recipe(r), get_preset(p), seed))
    metrics = {"steps": steps, "tokens": tokens, "features": features, "reference": REFERENCE,
               "tol": tol, **loss_gaps(curves, REFERENCE)}
    for r, p in pairs:
        if (r, "fp32") in pairs:
            metrics[f"accumulator_gap[{label(r, p)}]"] = (
                metrics[f"loss_gap[{label(r, p)}]"] - metrics[f"loss_gap[{label(r, 'fp32')}]"])
    runs = [n for n in curves if n != REFERENCE]
    # a NaN gap (a diverged run) is past any tolerance: `not gap <= tol`
    over = [n for n in runs if not metrics[f"loss_gap[{n}]"] <= tol]
    msg = (f"final loss after {steps} steps, weight gradient K={tokens} emulated, vs fp64: "
           + ", ".join(f"{n} {metrics[f'loss_gap[{n}]']:+.2%}" for n in runs))
    if over:
        msg += (f"; past tol={tol:g}: {', '.join(over)} (a weight gradient off in one direction "
                "at every step slows or stops training)")
    if imagined:
        msg += "; WHAT-IF, no hardware runs " + ", ".join(label(w["recipe"], w["preset"]) for w in imagined)
    if not_run:
        msg += f"; not run ({len(not_run)} pairs no hardware runs): " + ", ".join(
            label(w["recipe"], w["preset"]) for w in not_run)
    return Result(probe="numerics.impact", target=f"least_squares[wgrad K={tokens},{features} features]",
                  verdict="fail" if over else "pass", codes=["TP-B1"] if over else [], seed=seed,
                  message=msg, metrics=metrics,
                  evidence={"curves": curves, "recipes": recipes, "presets": presets,
                            "over_tol": over, "lr": lr, "noise": noise, "mean": mean,
                            "not_run": not_run, "what_if": imagined,
                            "plots": [{"kind": "line", "title": "training loss by weight-gradient "
                                       "GEMM (recipe x accumulator)", "x": list(range(steps + 1)),
                                       "series": curves, "xlabel": "step", "ylabel": "loss",
                                       "logy": True}]})
