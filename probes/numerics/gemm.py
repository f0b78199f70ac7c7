"""The bias of a low-precision GEMM: a recipe and an accumulator model against fp64.

A GEMM C = A B^T (A: M x K, B: N x K, K the reduction axis) is judged on a sample of its
output elements, each one dot product of K terms:
  1. sample S elements by Latin hypercube strata (row i from each of S strata of M, column j
     from a random permutation of S strata of N), so the sample covers every part of C;
  2. quantise the sampled rows of A and B as the recipe does (per-tensor and NVFP4 tensor
     scales from the whole tensors' amax), emulate each dot product under the accumulator
     (trainprobes.reference.gemm, exact to the model), apply the epilogue scales;
  3. against the fp64 product of the unquantised operands, split the S elements into
     `trials` groups (stratum s in group s mod trials) and take each group's signed relative
     error sum(sign(ref) (low - ref)) / sum(|ref|) (numerics.bias.signed_relative_error):
     the groups are independent, so numerics.bias.error_stats gives the relative bias, its
     CI and the t-test (the bias probe's statistics);
  4. beside it: SQNR (10 log10 sum ref^2 / sum err^2: torchao's metric, symmetric), the
     maximum relative error max |err| / rms(ref) (a per-element |err / ref| is unbounded on
     zero-mean operands, where some exact outputs are near 0), the growth of the accumulator's
     own error with K (rms error over rms of the exact partial sums at K/16 .. K, a log-log
     fit: ~0.5 for rounding noise, ~1 for a bias), stall_k (the K by which half the sampled
     dot products had a fused add absorbed whole by the running sum; inf: none within K);
  5. verdict: exact (every sampled output equals fp64), biased (is_biased: the CI excludes
     0 and is not shown below the tolerance, i.e. some end of it lies beyond +-tolerance:
     fail closed, a point estimate below the tolerance does not clear it), noise (the whole
     CI within +-tolerance: any bias is shown not to matter), else inconclusive (the CI
     holds 0 and reaches past +-tolerance: the sample can neither show a bias nor rule one
     out; a cannot-judge Result, verdict error and TP-E1, never a pass); and
     the promotion interval: the largest N_C (F 2^j <= K) whose CI lies within +-tolerance
     (is_within, the rule of noise: a CI that holds 0 and reaches past the tolerance does
     not show a fix) (K: none needed; NaN: none found).
What the sample rules out is the bias error_stats can detect with 80% power
(min_detectable_bias): a smaller bias may exist in the unsampled elements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.bias import error_stats
from trainprobes.power import min_detectable_effect
from trainprobes.reference.gemm import check_operands, dot_products, get_preset
from trainprobes.reference.recipes import get_recipe, hadamard, quantize, rotate
from trainprobes.result import Result
from trainprobes.validation import check_choice, check_int, check_number, check_seed

GEMMS = ("fprop", "dgrad", "wgrad")
# the operands' roles in each of a Linear's three GEMMs (Y = X W^T, dX = dY W, dW = dY^T X)
ROLES = {"fprop": ("activation", "weight"), "dgrad": ("grad", "weight"),
         "wgrad": ("grad", "activation")}
VERDICTS = ("exact", "noise", "biased", "inconclusive")


@dataclass(frozen=True)
class Sampled:
    """The sampled dot products of one GEMM: fp64 reference, emulated output, and the exact
    product of the quantised operands (the accumulator's own reference)."""

    ref: torch.Tensor
    low: torch.Tensor
    quantised: torch.Tensor
    partial_low: dict
    partial_quantised: dict
    first_absorbed: torch.Tensor


# The smallest |relative bias| a GEMM verdict calls biased, unless the user states one: every
# output (and so every weight update through wgrad) off by 0.01%, a learning rate off by a
# factor 1.0001. It sits below bf16's own rounding floor (u/16 = 2.4e-4, numerics.bias) on
# purpose: one rounding of a result is a one-off, while an accumulator's bias grows with K
# (about linearly) and has the same sign at every step.
DEFAULT_TOLERANCE = 1e-4


def is_biased(ci_low: float, ci_high: float, tolerance: float) -> bool:
    """The one rule of a biased verdict (and the gate's): the CI excludes 0 (a bias exists)
    and is not within +-tolerance (not shown not to matter)."""
    return bool((ci_low > 0 or ci_high < 0) and not is_within(ci_low, ci_high, tolerance))


def is_within(ci_low: float, ci_high: float, tolerance: float) -> bool:
    """The one rule of a pass (noise) and of a promotion interval that fixes a bias (and the
    gate's): the whole CI within +-tolerance, any bias shown not to matter. A CI that holds 0
    and reaches past the tolerance is neither biased nor within: it shows nothing."""
    return bool(max(abs(ci_low), abs(ci_high)) <= tolerance)



def _strata(n: int, S: int, g: torch.Generator, permute: bool) -> torch.Tensor:
    order = torch.randperm(S, generator=g) if permute else torch.arange(S)
    u = torch.rand(S, generator=g, dtype=torch.float64)
    return ((order.double() + u) * n / S).floor().long().clamp(max=n - 1)


def _checkpoints(K: int, F: int) -> list[int]:
    marks = sorted({max(F, (K // d) // F * F) for d in (16, 8, 4, 2)} | {K})
    return [k for k in marks if 0 < k <= K]


def _quantised_rows(x, rows, recipe, role, g, tensor_amax):
    """Quantise only the rows needed (2-D weight tiles: the whole 16-row tiles they sit in)."""
    tile = 16 if recipe.weight_2d and role == "weight" and recipe.scaling == "nvfp4" else 1
    if tile == 1:
        q = quantize(x[rows], recipe, role, generator=g, tensor_amax=tensor_amax)
        return q.values, q.scale.expand(len(rows), 1) if q.scale.dim() else q.scale.reshape(1, 1).expand(len(rows), 1)
    if x.shape[0] % tile:
        raise InvalidArgument(f"recipe {recipe.name!r} tiles weights 16 x 16: {x.shape[0]} rows is "
                              "not a multiple of 16")
    tiles = torch.unique(rows // tile)
    idx = (tiles[:, None] * tile + torch.arange(tile)).reshape(-1)
    q = quantize(x[idx], recipe, role, generator=g, tensor_amax=tensor_amax)
    pos = torch.searchsorted(tiles, rows // tile) * tile + rows % tile
    return q.values[pos], q.scale.reshape(1, 1).expand(len(rows), 1)


@dataclass(frozen=True)
class Prepared:
    """The sampled rows of one GEMM, quantised: what every accumulator model is run on."""

    qa: torch.Tensor
    qb: torch.Tensor
    scale: torch.Tensor
    ref: torch.Tensor
    rows: tuple
    scale_error: tuple  # (a, b): each operand's quantisation as a scale error (_scale_error)


def _scale_error(x: torch.Tensor, q: torch.Tensor) -> float:
    """<x, q - x> / <x, x>: the part of the quantisation error q - x along x itself, i.e. q
    = (1 + rho) x + an error uncorrelated with x. A GEMM of two such operands is off by about
    rho_a + rho_b in every output, in the direction of the true value: a recipe's own bias.
    Round to nearest on a floating grid has rho != 0 (the cell of each power of two is
    lopsided, half a spacing above it and a quarter below), and rounding values that already
    lie on another grid under a scale that is not a power of two maps each of their few
    significands to a fixed error that no averaging removes."""
    den = (x * x).sum().item()
    return (x * (q - x)).sum().item() / den if den else math.nan


def prepare_gemm(a, b, *, recipe, gemm: str, samples: int, seed: int) -> Prepared:
    """Steps 1-2 of the module docstring up to the accumulator."""
    recipe = get_recipe(recipe)
    M, K = a.shape
    N = b.shape[0]
    g = torch.Generator().manual_seed(seed)
    i, j = _strata(M, samples, g, False), _strata(N, samples, g, True)
    ra, rb = ROLES[gemm]
    ref = (a[i].double() * b[j].double()).sum(-1)
    if recipe.hadamard_wgrad and gemm == "wgrad":
        blocks = hadamard(K, torch.Generator().manual_seed(seed + 1))
        a, b = rotate(a.double(), blocks), rotate(b.double(), blocks)
    amax_a, amax_b = a.abs().amax().item(), b.abs().amax().item()
    qa, sa = _quantised_rows(a, i, recipe, ra, torch.Generator().manual_seed(seed + 2), amax_a)
    qb, sb = _quantised_rows(b, j, recipe, rb, torch.Generator().manual_seed(seed + 3), amax_b)
    check_operands(qa, qb, f"gemm {gemm} under recipe {recipe.name!r}")
    rho = (_scale_error(a[i].double(), qa * sa), _scale_error(b[j].double(), qb * sb))
    return Prepared(qa, qb, (sa * sb).reshape(-1), ref, (i, j), rho)


def sample_gemm(prep: Prepared, acc) -> Sampled:
    """Emulate the prepared dot products under the accumulator `acc`."""
    acc = get_preset(acc)
    K = prep.qa.shape[1]
    marks = _checkpoints(K, acc.fused_terms)
    trace: dict = {}
    prods = prep.qa * prep.qb
    low, parts = dot_products(prods, acc, marks, trace)
    quantised = {k: prods[:, :k].sum(-1) * prep.scale for k in marks}
    return Sampled(prep.ref, low * prep.scale, quantised[K],
                   {k: v * prep.scale for k, v in parts.items()}, quantised, trace["first_absorbed"])


def _trial_errors(ref, low, trials: int) -> list[float]:
    S = ref.numel()
    err = torch.sign(ref) * (low - ref)
    group = torch.arange(S) % trials
    num = torch.zeros(trials, dtype=torch.float64).index_add_(0, group, err)
    den = torch.zeros(trials, dtype=torch.float64).index_add_(0, group, ref.abs())
    return torch.where(den > 0, num / den, torch.full_like(den, math.nan)).tolist()


def growth_exponent(points: list[dict]) -> float:
    """Least-squares slope of log(relative rms error) on log(k); NaN with < 2 non-zero points."""
    pts = [(math.log(p["k"]), math.log(p["relative_rms_error"])) for p in points
           if p["relative_rms_error"] > 0 and math.isfinite(p["relative_rms_error"])]
    if len(pts) < 2:
        return math.nan
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else math.nan


def _stall_k(first: torch.Tensor) -> float:
    """The K by which half the dot products had a fused add absorbed (inf: not within K)."""
    stalled = first[first >= 0].sort().values
    half = (first.numel() + 1) // 2
    return float(stalled[half - 1].item()) if stalled.numel() >= half else math.inf


def gemm_bias(a, b, *, preset="h200-scaled-mm", recipe="exact", gemm="fprop", samples=2048,
              trials=32, seed=0, alpha=0.01, tolerance=DEFAULT_TOLERANCE, promotion=True,
              target: str | None = None) -> Result:
    """Judge C = a @ b.T (a: M x K, b: N x K) under `recipe` and the accumulator `preset`
    against fp64 (module docstring). gemm names the operands' roles (fprop: activation x
    weight, dgrad: grad x weight, wgrad: grad x activation). tolerance: the smallest |relative
    bias| that matters (DEFAULT_TOLERANCE); promotion: also search the promotion interval
    that keeps a biased GEMM's CI within +-tolerance.
    metrics: preset, recipe, gemm, k, samples, trials, relative_bias, ci_low, ci_high, std,
    p_value, alpha, tolerance, min_detectable_bias, max_relative_error, sqnr_db,
    growth_exponent, stall_k, promote_every_needed, biased, gemm_verdict."""
    acc = get_preset(preset)
    rec = get_recipe(recipe)
    check_choice(gemm, "gemm", GEMMS)
    # the operands stay in their own float dtype (a 4096 x 16384 fp32 operand is 256 MiB, 512
    # MiB in float64): only the sampled rows are converted, exactly, to float64
    a, b = (t if torch.is_tensor(t) and t.is_floating_point() else
            torch.as_tensor(t).to(torch.float64) for t in (a, b))
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise InvalidArgument(f"a has shape {tuple(a.shape)}, b {tuple(b.shape)}: expected (M, K) "
                              "and (N, K), the reduction axis last in both")
    for name, t in (("a", a), ("b", b)):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            raise InvalidArgument(f"gemm {gemm}: operand {name} holds {int(bad.sum())} non-finite "
                                  f"value(s), the first at {tuple(int(x) for x in torch.nonzero(bad)[0])}; "
                                  "a GEMM of them has no relative error to judge")
        if not bool(t.any()):
            raise InvalidArgument(f"gemm {gemm}: operand {name} is all zeros: nothing to judge "
                                  "(every output is 0, so no relative error exists)")
    check_int(trials, "trials", min=3, hint="32 or more")
    check_int(samples, "samples", min=trials, hint=f"at least trials={trials}")
    check_number(alpha, "alpha", min=0, max=1, min_open=True, max_open=True, hint="e.g. 0.01")
    seed = check_seed(seed)
    floor = check_number(tolerance, "tolerance", min=0, hint="a relative bias, e.g. 1e-4")
    M, K = a.shape
    N = b.shape[0]
    if M * N < trials:
        raise InvalidArgument(f"gemm {gemm}: the GEMM has M*N = {M} x {N} = {M * N} output(s), fewer "
                              f"than trials={trials} groups: use more rows (M*N >= {trials}) or "
                              "fewer --trials (at least 3)")
    S = min(samples, M * N)
    S -= S % trials
    prep = prepare_gemm(a, b, recipe=rec, gemm=gemm, samples=S, seed=seed)
    s = sample_gemm(prep, acc)
    errors = _trial_errors(s.ref, s.low, trials)
    finite = [e for e in errors if math.isfinite(e)]
    if len(finite) < 3:
        raise InvalidArgument(f"gemm {gemm}: the sampled exact outputs are all 0 in "
                              f"{trials - len(finite)} of {trials} groups: no relative error exists")
    st = error_stats(finite, alpha=alpha, min_effect=floor)
    err = s.low - s.ref
    sum_sq_ref, sum_sq_err = (s.ref ** 2).sum().item(), (err ** 2).sum().item()
    rms_ref = math.sqrt(sum_sq_ref / S)
    max_abs_err = err.abs().max().item()
    growth = []
    for k in sorted(s.partial_low):
        e = s.partial_low[k] - s.partial_quantised[k]
        den = s.partial_quantised[k].pow(2).mean().sqrt().item()
        growth.append({"k": k, "relative_rms_error": e.pow(2).mean().sqrt().item() / den if den else math.nan})
    exact = max_abs_err == 0.0
    biased = not exact and is_biased(st["ci_low"], st["ci_high"], floor)
    shown_small = is_within(st["ci_low"], st["ci_high"], floor)
    verdict = ("exact" if exact else "biased" if biased else "noise" if shown_small
               else "inconclusive")
    promo, needed = [], float(K)
    if promotion and verdict == "biased":
        needed = math.nan
        F = acc.fused_terms
        n = (K // F) * F
        if n == K:  # promoting every K is no promotion: the run above
            n //= 2
        while n >= F:
            if acc.promote_every is None or n < acc.promote_every:
                cand = acc.with_(promote_every=n)
                sc = sample_gemm(prep, cand)
                e2 = [e for e in _trial_errors(sc.ref, sc.low, trials) if math.isfinite(e)]
                s2 = error_stats(e2, alpha=alpha, min_effect=floor)
                inside = is_within(s2["ci_low"], s2["ci_high"], floor)
                promo.append({"promote_every": n, "relative_bias": s2["bias"], "ci_low": s2["ci_low"],
                              "ci_high": s2["ci_high"], "within": inside})
                if inside:
                    needed = float(n)
                    break
            n //= 2
    metrics = {"preset": acc.name, "recipe": rec.name, "gemm": gemm, "k": K, "samples": S,
               "trials": st["trials"], "relative_bias": st["bias"], "ci_low": st["ci_low"],
               "ci_high": st["ci_high"], "std": st["std"], "p_value": st["p_value"],
               "alpha": alpha, "tolerance": floor,
               "min_detectable_bias": min_detectable_effect(st["std"] / math.sqrt(st["trials"]),
                                                            st["trials"] - 1, alpha),
               "max_relative_error": max_abs_err / rms_ref if rms_ref else math.nan,
               "sqnr_db": 10 * math.log10(sum_sq_ref / sum_sq_err) if sum_sq_err else math.inf,
               "growth_exponent": growth_exponent(growth), "stall_k": _stall_k(s.first_absorbed),
               "promote_every_needed": needed, "biased": None if verdict == "inconclusive" else biased,
               "gemm_verdict": verdict}
    q_err = s.quantised - s.ref
    acc_err = s.low - s.quantised
    den = s.ref.abs().sum().item()
    evidence = {"errors": errors, "shape": [M, N, K], "accumulator": acc.describe(),
                "accumulator_source": acc.source, "recipe_source": rec.source,
                "sum_sq_ref": sum_sq_ref, "sum_sq_err": sum_sq_err, "max_abs_err": max_abs_err,
                "growth": growth, "promotion": promo,
                "quantisation_bias": (torch.sign(s.ref) * q_err).sum().item() / den if den else math.nan,
                "operand_scale_error": {"a": prep.scale_error[0], "b": prep.scale_error[1]},
                "accumulator_bias": (torch.sign(s.ref) * acc_err).sum().item() / den if den else math.nan,
                "stall": {"stalled_outputs": int((s.first_absorbed >= 0).sum().item()),
                          "stall_k": metrics["stall_k"]},
                "sampling": f"{S} of {M * N} output elements, Latin hypercube strata over rows and "
                            f"columns, in {trials} interleaved groups"}
    msg = _message(metrics) + _cause(metrics, evidence)
    return Result(probe="numerics.gemm", target=target or f"{gemm}[{rec.name},{acc.name},K={K}]",
                  verdict={"biased": "fail", "inconclusive": "error"}.get(verdict, "pass"),
                  metrics=metrics, evidence=evidence, seed=seed,
                  codes={"biased": ["TP-B1"], "inconclusive": ["TP-E1"]}.get(verdict, []),
                  message=msg)


def _message(m: dict) -> str:
    head = (f"{m['gemm']} K={m['k']} under {m['recipe']} with the {m['preset']} accumulator: "
            f"relative bias {m['relative_bias']:+.3g} ({1 - m['alpha']:.0%} CI "
            f"[{m['ci_low']:+.3g}, {m['ci_high']:+.3g}]), SQNR {m['sqnr_db']:.1f} dB, max error "
            f"{m['max_relative_error']:.3g} of rms, {m['samples']} sampled outputs: ")
    if m["gemm_verdict"] == "exact":
        return head + (f"exact on every sampled output (the inexact share of all {m['samples']} "
                       f"sampled is 0: below {3 / m['samples']:.2g} of the outputs at 95%)")
    if m["gemm_verdict"] == "noise":
        if m["ci_low"] > 0 or m["ci_high"] < 0:
            return head + (f"a significant bias whose whole CI lies within +-{m['tolerance']:.3g} "
                           "(the tolerance): shown not to matter at that tolerance")
        return head + f"noise (the whole CI lies within +-{m['tolerance']:.3g}, the tolerance)"
    if m["gemm_verdict"] == "inconclusive":
        return head + (f"cannot judge: the CI holds 0 and reaches past +-{m['tolerance']:.3g} (the "
                       f"tolerance), so this sample neither shows a bias nor rules one out (it "
                       f"rules out |bias| > {m['min_detectable_bias']:.3g} at 80% power); sample "
                       "more outputs, or state the tolerance that matters to you")
    fix = (f"; promoting to fp32 every {int(m['promote_every_needed'])} keeps it within "
           f"{m['tolerance']:.3g}" if math.isfinite(m["promote_every_needed"]) else
           "; no promotion interval keeps it within the tolerance")
    return head + ("biased: outputs too small on average" if m["relative_bias"] < 0 else
                   "biased: outputs too large on average") + fix


def _cause(m: dict, ev: dict) -> str:
    """Which share of a biased verdict is the recipe's and which the accumulator's."""
    if m["gemm_verdict"] != "biased":
        return ""
    q, acc = ev["quantisation_bias"], ev["accumulator_bias"]
    if not abs(q) > abs(acc):
        return f" (the accumulator's share: {acc:+.3g}; the recipe's quantisation: {q:+.3g})"
    rho = ev["operand_scale_error"]
    return (f" (the recipe's quantisation: {q:+.3g}, the accumulator's {acc:+.3g}; the recipe "
            f"scales operand a by 1{rho['a']:+.3g} and b by 1{rho['b']:+.3g} on average: rounding "
            "errors correlated with the values, a bias of these operands' values under this "
            "recipe, not of the accumulator)")


def linear_gemms(x, w, dy):
    """The three GEMMs of a Linear y = x w^T as (gemm, a, b) with C = a b^T:
    fprop x (T, in) . w (out, in) -> K = in; dgrad dy (T, out) . w^T (in, out) -> K = out;
    wgrad dy^T (out, T) . x^T (in, T) -> K = T."""
    x, w, dy = (torch.as_tensor(t).to(torch.float64) for t in (x, w, dy))
    return [("fprop", x, w), ("dgrad", dy, w.t().contiguous()),
            ("wgrad", dy.t().contiguous(), x.t().contiguous())]
