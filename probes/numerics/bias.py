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
import warnings
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
        with warnings.catch_warnings():
            # errors equal but for float64 rounding (a GEMM measured whole in every trial):
            # scipy warns of precision loss; its p-value is as tiny as the zero spread's
            warnings.filterwarnings("ignore", "Precision loss", RuntimeWarning)
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


def default_min_effect(dtype) -> float:
    """The practical-significance floor for results held in `dtype`: u / 16 = 2^-(p+4),
    u = 2^-p the format's unit roundoff (bf16 2.4e-4, fp16 3.1e-5, fp32 3.7e-9,
    fp8_e4m3fn 3.9e-3).

    Why u / 16: a relative bias b of every reduced gradient is a learning rate off by a
    factor 1 + b. The smallest mechanism of a format's own arithmetic that biases every
    result is one rounding of a constant to it (NCCL's premultiply by the rounded 1/n),
    which moves results by that constant's relative rounding error: up to u, and u/4 to
    u/2 for most n (bf16(1/3) and bf16(1/6): u/2). A stall (a ring at a large world) is
    many u. A 16th of u stays under all of these but for a constant that happens to lie
    within u/16 of a representable value, and is far below any learning rate's tuning
    resolution; a bias under it is significant only because enough trials resolve it."""
    return get_format(dtype).unit_roundoff / 16


# Two-stage confirmation (docs/numerics.md, "Bias vs variance"):
#   1. stage 1: `trials` seeded trials, t-test p1;
#   2. p1 < alpha/10 fails and p1 >= alpha passes; in between, `trials` more trials with
#      fresh seeds (the same seeded stream, continued) and the t-test on all of them, p2;
#   3. the reduction fails when p2 < alpha too.
# Its p-value, the smallest level at which it fails, is p* = min(10 p1, max(p1, p2)). It
# is valid: at any level x it rejects with probability x/10 + P(x/10 <= p1 < x, p2 < x)
# <= x under "no bias", so p* < alpha keeps the false-positive rate at or below alpha
# (design_alpha: 0.0029 at alpha = 0.01 for normal statistics; measured rates in the docs).
CONFIRM_FACTOR = 10


def design_alpha(alpha: float) -> float:
    """Type-I error of the two-stage design at level alpha for normal test statistics and
    equal stages: P(|Z1| > z_(a/20)) + P(z_(a/2) < |Z1| <= z_(a/20), |Z1 + Z2| / sqrt(2) > z_(a/2))."""
    from scipy import integrate
    check_number(alpha, "alpha", min=0, max=1, min_open=True, max_open=True, hint="e.g. 0.01")
    lo, hi = stats.norm.isf(alpha / 2), stats.norm.isf(alpha / (2 * CONFIRM_FACTOR))
    c = math.sqrt(2) * lo

    def continue_and_confirm(z1):  # density of Z1 times P(|z1 + Z2| > c), Z2 ~ N(0, 1)
        return stats.norm.pdf(z1) * (stats.norm.sf(c - z1) + stats.norm.cdf(-c - z1))
    return alpha / CONFIRM_FACTOR + 2 * integrate.quad(continue_and_confirm, lo, hi)[0]


def _run_trials(fn, reference, make_inputs, seeds, progress, done: int, total: int):
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
            progress(done + t + 1, total)
    return errors, nonfinite, zero_ref


def bias_probe(fn: Callable, reference: Callable, make_inputs: Callable, *, trials: int = 32,
               seed: int = 0, alpha: float = 0.01, min_effect: float = 0.0, confirm: bool = True,
               target: str = "callable", progress: Callable | None = None,
               tests: int = 1) -> Result:
    """Run fn and reference on `trials` seeded inputs and judge the bias of fn.

    make_inputs(generator) -> inputs; fn(inputs) and reference(inputs) -> tensors of the same
    shape (fn in low precision, reference in fp64). Trial t uses a generator seeded with the
    t-th seed drawn from `seed` (listed in the evidence), so any trial replays.
    progress(done, total) is called after each trial.

    min_effect: the smallest |bias| called biased. 0 here: a callable's format is unknown,
    so pass the floor of the format its results are held in (default_min_effect(dtype)).
    confirm: a borderline stage 1 (alpha/10 <= p < alpha) runs `trials` more trials before
    it fails (two-stage design above); False judges stage 1 alone at alpha.
    tests: the size of the family this test is corrected in (Holm, rounding_side_by_side):
    stage 2 then also runs from alpha/(10 tests), so the design's p-value is exact at every
    level the correction may ask for.
    """
    check_int(trials, "trials", min=3, hint="32 or more for a useful test")
    check_number(alpha, "alpha", min=0, max=1, min_open=True, max_open=True, hint="e.g. 0.01")
    check_number(min_effect, "min_effect", min=0, hint="e.g. default_min_effect('bf16')")
    check_int(tests, "tests", min=1, hint="the number of tests corrected together")
    stream = torch.Generator().manual_seed(check_seed(seed))
    seeds = torch.randint(0, 2**62, (trials,), generator=stream).tolist()
    errors, nonfinite, zero_ref = _run_trials(fn, reference, make_inputs, seeds, progress, 0, trials)
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
    p1, p2 = s["p_value"], None
    stages = [{"trials": trials, "finite_trials": s["trials"], "bias": s["bias"], "std": s["std"],
               "p_value": p1}]
    if confirm and alpha / (CONFIRM_FACTOR * tests) <= p1 < alpha:
        more = torch.randint(0, 2**62, (trials,), generator=stream).tolist()
        e2, nf2, zr2 = _run_trials(fn, reference, make_inputs, more, progress, trials, 2 * trials)
        seeds += more
        errors += e2
        nonfinite, zero_ref = nonfinite + nf2, zero_ref + zr2
        s = error_stats([e for e in errors if not math.isnan(e)], alpha=alpha, min_effect=min_effect)
        p2 = s["p_value"]
        stages.append({"trials": 2 * trials, "finite_trials": s["trials"], "bias": s["bias"],
                       "std": s["std"], "p_value": p2})
    if not confirm:
        design = "one stage: t-test at alpha"
        p = p1
    else:
        design = (f"two stages: fail at p1 < alpha/{CONFIRM_FACTOR}, pass at p1 >= alpha, else "
                  f"{trials} more trials and fail at p2 < alpha (pooled); "
                  f"p = min({CONFIRM_FACTOR} p1, max(p1, p2))")
        p = min(CONFIRM_FACTOR * p1, max(p1, p2)) if p2 is not None else \
            (min(1.0, CONFIRM_FACTOR * p1) if p1 < alpha else p1)
    s["p_value"] = p
    s["biased"] = p < alpha and abs(s["bias"]) >= min_effect
    s["nonfinite_trials"] = nonfinite
    s["zero_reference_trials"] = zero_ref
    # what "unbiased" rules out: the smallest |bias| the t-test finds with 80% power
    s["min_detectable_bias"] = min_detectable_effect(s["std"] / math.sqrt(s["trials"]), s["trials"] - 1, alpha)
    evidence.update({"stages": stages, "design": design, "p_design": p})
    verdict, codes, msg = _judgement(s, stages, len(errors))
    return Result(probe="numerics.bias", target=target, verdict=verdict, metrics=s,
                  evidence=evidence, seed=seed, codes=codes, message=msg)


def _judgement(s: dict, stages: list, run: int, note: str = "") -> tuple[str, list, str]:
    """(verdict, codes, message) from a bias Result's metrics (s["biased"] already set)."""
    alpha, min_effect, biased = s["alpha"], s["min_effect"], s["biased"]
    direction = "too small" if s["bias"] < 0 else "too large"
    msg = (f"bias {s['bias']:+.3g} ({s['confidence']:.0%} CI [{s['ci_low']:+.3g}, {s['ci_high']:+.3g}]), "
           f"spread {s['std']:.3g}, p={s['p_value']:.2g}{note}: ")
    if biased:
        msg += f"biased, results {direction} on average; this compounds over steps"
    elif s["p_value"] < alpha:
        msg += (f"a significant bias below the floor min_effect={min_effect:.3g}, which does not "
                "matter; no bias that does")
    else:
        msg += ("no bias detected at alpha=" + f"{alpha:g}"
                + f" (rules out |bias| > {max(s['min_detectable_bias'], min_effect):.3g} at 80% power)")
    if len(stages) == 2:
        msg += (f"; stage 1 ({stages[0]['trials']} trials) was borderline (p={stages[0]['p_value']:.2g})"
                f", {stages[1]['trials']} trials " + ("confirm it" if s["p_value"] < alpha else
                                                      "do not confirm it"))
    signed = s["positive_trials"] + s["negative_trials"]
    if s["p_value"] < alpha and s["p_sign"] >= alpha and 2 * 0.5 ** signed >= alpha:
        msg += f"; too few non-zero trials ({signed}) for the sign test to confirm at alpha={alpha:g}"
    elif (s["p_sign"] < alpha) != (s["p_value"] < alpha):
        msg += ("; the sign test disagrees (" + ("the median is off but the mean is not"
                if s["p_sign"] < alpha else "a few large errors move the mean, most trials do not")
                + ")")
    if s["nonfinite_trials"]:
        msg += f"; {s['nonfinite_trials']} of {run} trials gave inf/NaN and were left out"
    if s["zero_reference_trials"]:
        msg += f"; {s['zero_reference_trials']} of {run} trials had a zero reference and were left out"
    verdict = "fail" if biased else ("warn" if s["nonfinite_trials"] or s["zero_reference_trials"] else "pass")
    return verdict, (["TP-B1"] if biased else []), msg


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
                    trials: int = 32, seed: int = 0, alpha: float = 0.01,
                    min_effect: float | None = None, confirm: bool = True, tests: int = 1,
                    scale: float = 1e-3, noise: float = 1.0, progress: Callable | None = None,
                    **collective_kwargs) -> Result:
    """Bias of the emulated all_reduce of `dtype` gradients against the fp64 reduction of the
    same inputs (same algorithm), on gradient-like data (see gradient_like).

    accum_dtype: the precision of each add before the per-hop rounding to the wire format
    (trainprobes.reference.collectives); fp32 here does NOT help, since fp32 add + rounding is exactly
    a correctly rounded bf16/fp16 add. reduce_dtype: run the whole reduction in this wire
    format (e.g. "fp32", as Megatron's grad_reduce_in_fp32 or NCCL NVLS .acc::f32 do) and
    round the result once to `dtype`.
    min_effect: None is default_min_effect(dtype), the floor of the format the results are
    held in; confirm, tests: as bias_probe's.
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
    if min_effect is None:
        min_effect = default_min_effect(fmt)

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
                     confirm=confirm, tests=tests, target=target, progress=progress)
    res.evidence.update({"dtype": fmt.name, "accum_dtype": accum_dtype, "reduce_dtype": wire.name,
                         "world": world, "numel": numel, "algorithm": algorithm, "op": op,
                         "rounding": rounding, "scale": scale, "noise": noise})
    return res


SIDE_BY_SIDE = (("round to nearest", {}), ("stochastic rounding", {"rounding": "stochastic"}),
                ("fp32 accumulation", {"reduce_dtype": "fp32"}))


def rounding_side_by_side(*, progress: Callable | None = None, **kwargs) -> list[Result]:
    """collective_bias three ways on the same seeded data: round to nearest in the wire
    format, stochastic rounding, and the reduction in fp32 rounded once at the end.
    Each Result's evidence["label"] names the row. The three tests are one family: their
    p-values are Holm-adjusted (holm) so that the chance of any false "biased" among them
    stays at or below alpha."""
    out = []
    for label, extra in SIDE_BY_SIDE:
        r = collective_bias(**{**kwargs, **extra}, tests=len(SIDE_BY_SIDE),
                            progress=None if progress is None else
                            (lambda d, t, label=label: progress(label, d, t)))
        r.evidence["label"] = label
        out.append(r)
    return holm(out)


def holm(results: list[Result]) -> list[Result]:
    """Holm-Bonferroni over bias Results of one command, in place: the k-th smallest of m
    p-values becomes max over j <= k of min(1, (m - j + 1) p_(j)) (step-down, valid under
    any dependence: the rows share their seeded data), and `biased` is judged again on it
    at the Results' alpha. A Result that measured nothing counts as p = 1. The p-value
    before adjustment is in evidence["p_unadjusted"]."""
    m = len(results)
    alphas = {r.metrics.get("alpha") for r in results if r.metrics.get("biased") is not None}
    if len(alphas) > 1:
        raise InvalidArgument(f"holm: the Results were tested at different alphas {sorted(alphas)}")

    def p_of(r):
        return r.metrics["p_value"] if r.metrics.get("biased") is not None else 1.0
    running = 0.0
    for k, r in enumerate(sorted(results, key=p_of)):
        p = p_of(r)
        running = max(running, min(1.0, (m - k) * p))
        if r.metrics.get("biased") is None:
            continue
        s = r.metrics
        r.evidence["p_unadjusted"] = p
        r.evidence["multiple_testing"] = {"method": "holm", "tests": m}
        s["p_value"] = running
        s["biased"] = running < s["alpha"] and abs(s["bias"]) >= s["min_effect"]
        r.verdict, r.codes, r.message = _judgement(
            s, r.evidence.get("stages", []), len(r.evidence.get("errors", [])),
            note=f" (Holm over {m} tests; {p:.2g} before)")
    return results
