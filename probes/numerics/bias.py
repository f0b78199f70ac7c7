"""Bias vs variance of a low-precision computation against its fp64 reference.

Rounding error that averages out is variance; rounding error with a sign is bias, and bias
compounds over steps. Over seeded trials this module measures, per trial, the signed
relative error in the direction of the true value,
    e = sum(sign(ref) * (low - ref)) / sum(|ref|)      (e < 0: results too small),
and tests mean(e) == 0:
  1. one-sample t-test on e (the mean is what compounds over steps); CI from Student's t;
  2. exact sign test (binomial on the count of e > 0 among e != 0): no assumption of
     symmetry or finite variance, valid for the discrete, tie-heavy errors of narrow
     formats, but it tests the median;
  3. Wilcoxon signed-rank (symmetric-distribution test of location), reported only.
The verdict is "biased" when the t-test rejects at alpha and |bias| >= min_effect; when the
sign test disagrees the message says so (a mean moved by a few large errors, or a median
moved with a mean that is not).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from scipy import stats
from trainprobes.errors import InvalidArgument
from trainprobes.power import min_detectable_effect
from trainprobes.reference.formats import ROUNDING_MODES, get_format
from trainprobes.result import Result
from trainprobes.validation import check_choice, check_int, check_number, check_seed


def signed_relative_error(low, ref) -> float:
    """sum(sign(ref) * (low - ref)) / sum(|ref|), in float64; negative means too small.

    NaN when ref is all zeros or low is not finite (the caller counts those)."""
    low = torch.as_tensor(low).to(torch.float64).reshape(-1)
    ref = torch.as_tensor(ref).to(torch.float64).reshape(-1)
    if low.shape != ref.shape:
        raise InvalidArgument(f"low has {low.numel()} elements, ref has {ref.numel()}: the callable and "
                         "its reference must return the same shape")
    denom = ref.abs().sum()
    if denom == 0 or not torch.isfinite(low).all():
        return math.nan
    return (torch.sign(ref) * (low - ref)).sum().item() / denom.item()


def error_stats(errors, *, alpha: float = 0.01, min_effect: float = 0.0) -> dict:
    """Bias, confidence interval, spread and tests for per-trial signed errors (finite only)."""
    check_number(alpha, "alpha", min=0, max=1, min_open=True, max_open=True, hint="e.g. 0.01")
    check_number(min_effect, "min_effect", min=0)
    e = torch.as_tensor(errors, dtype=torch.float64).reshape(-1)
    e = e[torch.isfinite(e)]
    n = e.numel()
    if n < 3:
        raise InvalidArgument(f"only {n} finite trial errors; need at least 3 (raise trials=)")
    mean, std = e.mean().item(), e.std().item()
    sem = std / math.sqrt(n)
    if std == 0.0:  # every trial made the same error: no spread to test against
        p_t = 1.0 if mean == 0.0 else 0.0
        lo = hi = mean
    else:
        p_t = float(stats.ttest_1samp(e.numpy(), 0.0).pvalue)
        half = stats.t.ppf(1 - alpha / 2, n - 1) * sem
        lo, hi = mean - half, mean + half
    pos, neg = int((e > 0).sum()), int((e < 0).sum())
    p_sign = float(stats.binomtest(pos, pos + neg, 0.5).pvalue) if pos + neg else 1.0
    nz = e[e != 0]
    p_w = float(stats.wilcoxon(nz.numpy()).pvalue) if nz.numel() >= 1 and nz.abs().max() > 0 else 1.0
    biased = p_t < alpha and abs(mean) >= min_effect
    return {"trials": n, "bias": mean, "ci_low": lo, "ci_high": hi, "confidence": 1 - alpha,
            "std": std, "rms": math.sqrt(mean * mean + std * std * (n - 1) / n),
            "p_value": p_t, "p_sign": p_sign, "p_wilcoxon": p_w,
            "positive_trials": pos, "negative_trials": neg, "zero_trials": n - pos - neg,
            "alpha": alpha, "min_effect": min_effect, "biased": biased}


def bias_probe(fn: Callable, reference: Callable, make_inputs: Callable, *, trials: int = 32,
               seed: int = 0, alpha: float = 0.01, min_effect: float = 0.0,
               target: str = "callable", progress: Callable | None = None) -> Result:
    """Run fn and reference on `trials` seeded inputs and judge the bias of fn.

    make_inputs(generator) -> inputs; fn(inputs) and reference(inputs) -> tensors of the same
    shape (fn in low precision, reference in fp64). Trial t uses a generator seeded with the
    t-th of `trials` seeds drawn from `seed` (listed in the evidence), so any trial replays.
    progress(done, total) is called after each trial.
    """
    check_int(trials, "trials", min=3, hint="32 or more for a useful test")
    check_number(alpha, "alpha", min=0, max=1, min_open=True, max_open=True, hint="e.g. 0.01")
    seeds = torch.randint(0, 2**62, (trials,), generator=torch.Generator().manual_seed(check_seed(seed))).tolist()
    errors, nonfinite, zero_ref = [], 0, 0
    for t, s in enumerate(seeds):
        inputs = make_inputs(torch.Generator().manual_seed(s))
        low, ref = fn(inputs), reference(inputs)
        err = signed_relative_error(low, ref)
        if math.isnan(err):
            # a relative error needs a non-zero reference; tell that apart from inf/NaN output
            if torch.as_tensor(ref).abs().sum().item() == 0:
                zero_ref += 1
            else:
                nonfinite += 1
        errors.append(err)
        if progress is not None:
            progress(t + 1, trials)
    finite = [e for e in errors if not math.isnan(e)]
    evidence = {"errors": errors, "trial_seeds": seeds}
    if len(finite) < 3 and zero_ref >= nonfinite:
        return Result(probe="numerics.bias", target=target, verdict="error", seed=seed,
                      metrics={"trials": trials, "zero_reference_trials": zero_ref,
                               "nonfinite_trials": nonfinite, "biased": None},
                      evidence=evidence, codes=["TP-E1"],
                      message=f"{zero_ref} of {trials} trials have a reference that is exactly 0, so "
                      "no relative error exists: make_inputs must give a non-zero reference sum")
    if len(finite) < 3:
        return Result(probe="numerics.bias", target=target, verdict="fail", seed=seed,
                      metrics={"trials": trials, "nonfinite_trials": nonfinite, "biased": None},
                      evidence=evidence,
                      codes=["TP-B1"], message=f"{nonfinite} of {trials} trials gave inf/NaN "
                      "(overflow, or NaN in the inputs): no bias can be measured")
    s = error_stats(finite, alpha=alpha, min_effect=min_effect)
    s["nonfinite_trials"] = nonfinite
    s["zero_reference_trials"] = zero_ref
    # what "unbiased" rules out: the smallest |bias| the t-test finds with 80% power
    s["min_detectable_bias"] = min_detectable_effect(s["std"] / math.sqrt(s["trials"]), s["trials"] - 1, alpha)
    biased = s["biased"]
    direction = "too small" if s["bias"] < 0 else "too large"
    msg = (f"bias {s['bias']:+.3g} ({s['confidence']:.0%} CI [{s['ci_low']:+.3g}, {s['ci_high']:+.3g}]), "
           f"spread {s['std']:.3g}, p={s['p_value']:.2g}: ")
    msg += (f"biased, results {direction} on average; this compounds over steps" if biased
            else "no bias detected at alpha=" + f"{alpha:g}"
            + f" (rules out |bias| > {max(s['min_detectable_bias'], min_effect):.3g} at 80% power)")
    signed = s["positive_trials"] + s["negative_trials"]
    if s["p_value"] < alpha and s["p_sign"] >= alpha and 2 * 0.5 ** signed >= alpha:
        msg += f"; too few non-zero trials ({signed}) for the sign test to confirm at alpha={alpha:g}"
    elif (s["p_sign"] < alpha) != (s["p_value"] < alpha):
        msg += ("; the sign test disagrees (" + ("the median is off but the mean is not"
                if s["p_sign"] < alpha else "a few large errors move the mean, most trials do not")
                + ")")
    if nonfinite:
        msg += f"; {nonfinite} of {trials} trials gave inf/NaN and were left out"
    if zero_ref:
        msg += f"; {zero_ref} of {trials} trials had a zero reference and were left out"
    verdict = "fail" if biased else ("warn" if nonfinite or zero_ref else "pass")
    codes = ["TP-B1"] if biased else []
    return Result(probe="numerics.bias", target=target, verdict=verdict, metrics=s,
                  evidence=evidence, seed=seed, codes=codes, message=msg)


def _check_scale_noise(scale, noise) -> None:
    # scale 0 makes every reference sum 0 (no relative error exists); NaN/inf make every
    # trial non-finite, which would read as a biased reduction (TP-B1) instead of bad input
    check_number(scale, "scale", min=0, min_open=True, hint="e.g. 1e-3")
    check_number(noise, "noise", min=0, hint="a multiple of scale, e.g. 1.0")


def gradient_like(world: int, numel: int, *, generator: torch.Generator, scale: float = 1e-3,
                  noise: float = 1.0, fmt=None) -> list[torch.Tensor]:
    """Per-rank tensors shaped like data-parallel gradients: one signal shared by all ranks
    plus independent per-rank noise (std noise * scale), rounded to `fmt` when given (ranks
    hold their gradients in the wire format)."""
    check_int(world, "world", min=1, hint="the number of ranks")
    check_int(numel, "numel", min=1, hint="elements per rank")
    _check_scale_noise(scale, noise)
    signal = torch.randn(numel, generator=generator, dtype=torch.float64) * scale
    x = signal + torch.randn(world, numel, generator=generator, dtype=torch.float64) * (noise * scale)
    if fmt is not None:
        x = get_format(fmt).round(x)
    return list(x.unbind(0))


def collective_bias(*, dtype="bf16", world: int = 1024, numel: int = 256, algorithm: str = "ring",
                    op: str = "sum", rounding: str = "nearest", accum_dtype=None, reduce_dtype=None,
                    trials: int = 32, seed: int = 0, alpha: float = 0.01, min_effect: float = 0.0,
                    scale: float = 1e-3, noise: float = 1.0, progress: Callable | None = None,
                    **collective_kwargs) -> Result:
    """Bias of the emulated all_reduce of `dtype` gradients against the fp64 reduction of the
    same inputs (same algorithm), on gradient-like data (see gradient_like).

    accum_dtype: the precision of each add before the per-hop rounding to the wire format
    (trainprobes.reference.collectives); fp32 here does NOT help, since fp32 add + rounding is exactly
    a correctly rounded bf16/fp16 add. reduce_dtype: run the whole reduction in this wire
    format (e.g. "fp32", as Megatron's grad_reduce_in_fp32 or NCCL NVLS .acc::f32 do) and
    round the result once to `dtype`.
    """
    from trainprobes.reference.collectives import OPS, all_reduce
    from trainprobes.reference.schedules import ALGORITHMS

    # checked here so a typo fails before any data is made
    check_choice(algorithm, "algorithm", ALGORITHMS)
    check_choice(op, "op", OPS)
    check_choice(rounding, "rounding", ROUNDING_MODES)
    _check_scale_noise(scale, noise)
    fmt = get_format(dtype)
    wire = get_format(reduce_dtype, "reduce_dtype") if reduce_dtype is not None else fmt
    if accum_dtype is not None:
        get_format(accum_dtype, "accum_dtype")

    def make(g):
        # the rounding seed comes from the trial's generator too: one seed replays a trial
        x = gradient_like(world, numel, generator=g, scale=scale, noise=noise, fmt=fmt)
        return x, int(torch.randint(0, 2**62, (1,), generator=g))

    def low(inputs):
        x, rs = inputs
        out = all_reduce(x, op=op, dtype=wire.name, accum_dtype=accum_dtype, algorithm=algorithm,
                         rounding=rounding, seed=rs if rounding == "stochastic" else None,
                         **collective_kwargs)[0]
        return fmt.round(out) if wire is not fmt else out

    def ref(inputs):
        return all_reduce(inputs[0], op=op, dtype="fp64", algorithm=algorithm, **collective_kwargs)[0]

    how = fmt.name + (f",accum={get_format(accum_dtype, 'accum_dtype').name}" if accum_dtype is not None else "") \
        + (f",reduce_in={wire.name}" if wire is not fmt else "")
    target = f"all_reduce[{how},{algorithm},{op},{rounding},w={world},n={numel}]"
    res = bias_probe(low, ref, make, trials=trials, seed=seed, alpha=alpha, min_effect=min_effect,
                     target=target, progress=progress)
    res.evidence.update({"dtype": fmt.name, "accum_dtype": accum_dtype, "reduce_dtype": wire.name,
                         "world": world, "numel": numel, "algorithm": algorithm, "op": op,
                         "rounding": rounding, "scale": scale, "noise": noise})
    return res


SIDE_BY_SIDE = (("round to nearest", {}), ("stochastic rounding", {"rounding": "stochastic"}),
                ("fp32 accumulation", {"reduce_dtype": "fp32"}))


def rounding_side_by_side(*, progress: Callable | None = None, **kwargs) -> list[Result]:
    """collective_bias three ways on the same seeded data: round to nearest in the wire
    format, stochastic rounding, and the reduction in fp32 rounded once at the end.
    Each Result's evidence["label"] names the row."""
    out = []
    for label, extra in SIDE_BY_SIDE:
        r = collective_bias(**{**kwargs, **extra},
                            progress=None if progress is None else
                            (lambda d, t, label=label: progress(label, d, t)))
        r.evidence["label"] = label
        out.append(r)
    return out
