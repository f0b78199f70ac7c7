"""The bias of a low-precision GEMM: a recipe and an accumulator model against fp64.

A GEMM C = A B^T (A: M x K, B: N x K, K the reduction axis) is judged on a sample of its
output elements, each one dot product of K terms. What is estimated is the whole GEMM's
relative bias B = sum(sign(ref) err) / sum|ref| over all M N outputs: a ratio of sums that
the outputs with the largest |ref| dominate, i.e. the heavy rows and columns (a "massive
activation" token 100x the others' scale carries as much of B as a hundred ordinary ones).
So the sample is drawn in proportion to size:
  1. sample S elements by probability-proportional-to-size Latin hypercube strata: row i
     with probability p_i = |a_i| / sum|a| (L2 norms), one draw from each of S equal strata
     of the rows' cumulative p (a row holding 2/S of the norm mass contains a whole stratum:
     it is drawn for certain, as often as its share says); column j likewise from a random
     permutation of S strata of q_j = |b_j| / sum|b|. Each draw (i, j) has expected count
     S p_i q_j; its Horvitz-Thompson weight is w = 1 / (S p_i q_j), so weighted sums
     estimate the whole GEMM's sums without bias (|ref_ij| <= |a_i| |b_j| bounds every
     output, and an accumulator's error likewise, so the weighted terms stay bounded: the
     heavy outputs are sampled often and weighted little). Rows or columns of norm 0 have
     only zero outputs and errors, and are never drawn. A GEMM of M N <= S outputs is
     judged on every output once instead (weight 1; its ratios known, each CI the point);
  2. quantise the sampled rows of A and B as the recipe does (per-tensor and NVFP4 tensor
     scales from the whole tensors' amax; each distinct row once, so a row drawn twice is
     one quantisation), emulate each dot product under the accumulator
     (trainprobes.reference.gemm, exact to the model), apply the epilogue scales;
  3. against the fp64 product of the unquantised operands, split the S draws into `trials`
     interleaved groups (stratum s in group s mod trials) and estimate two ratios with
     their CIs, each from the groups' weighted totals Y_g = sum w y, X_g = sum w |ref|: the
     ratio R = sum Y / sum X and the groups' linearised pseudo-values R + (Y_g - R X_g) /
     mean(X) (their mean is R, their spread the ratio's standard error), given to
     numerics.bias.error_stats (the t-test and CI the bias probe uses):
       relative_bias    y = sign(ref) (low - ref): outputs shrunk toward zero (< 0) or
                        grown; what truncation toward zero gives;
       relative_offset  y = low - ref: a constant shift whatever the output's sign; what
                        rounding toward -inf gives (sign-fill right shifts), and what the
                        signed metric cannot see on zero-mean outputs (the shift is
                        positive on half of them in the direction of the true value and
                        negative on the other half).
     Two tests, so each CI is at 1 - alpha/2 (Bonferroni): the verdict's false-positive
     rate stays at most alpha;
  4. beside them: SQNR (10 log10 sum w ref^2 / sum w err^2: torchao's metric, symmetric),
     the maximum relative error max |err| / rms(ref) (a per-element |err / ref| is
     unbounded on zero-mean operands, where some exact outputs are near 0), the growth of
     the accumulator's own error with K (weighted rms error over rms of the exact partial
     sums at K/16 .. K, a log-log fit: ~0.5 for rounding noise, ~1 for a bias), stall_k (the
     K by which half the GEMM's outputs, by weight, had a fused add absorbed whole by the
     running sum; inf: none within K);
  5. verdict (gemm_verdict): exact (every sampled output equals fp64), biased (is_biased for
     either ratio: its CI excludes 0 and is not shown below the tolerance, i.e. some end of
     it lies beyond +-tolerance: fail closed, a point estimate below the tolerance does not
     clear it), noise (both CIs within +-tolerance: any bias is shown not to matter), else
     inconclusive (a CI holds 0 and reaches past +-tolerance: the sample can neither show a
     bias nor rule one out; a cannot-judge Result, verdict error and TP-E1, never a pass);
     and the promotion interval: the largest N_C (F 2^j <= K) whose two CIs lie within
     +-tolerance (is_within, the rule of noise: a CI that holds 0 and reaches past the
     tolerance does not show a fix) (K: none needed; NaN: none found).
What a sample covers: a bias the groups' spread can detect with 80% power
(min_detectable_bias) for the CIs; for exact, that every sampled output is exact bounds
the inexact outputs' share of the sampling mass sum |a_i| |b_j| below 3/S (95%, the rule of
three): inexact outputs lighter than that can remain unseen (the message says so).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.bias import error_stats
from trainprobes.numerics.gemm_defaults import DEFAULT_SAMPLES, DEFAULT_TOLERANCE, DEFAULT_TRIALS
from trainprobes.power import min_detectable_effect
from trainprobes.reference.gemm import check_operands, dot_products, get_preset, promotion_runs
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
    """The sampled dot products of one GEMM: fp64 reference, emulated output, the exact
    product of the quantised operands (the accumulator's own reference), and each draw's
    Horvitz-Thompson weight."""

    ref: torch.Tensor
    low: torch.Tensor
    quantised: torch.Tensor
    partial_low: dict
    partial_quantised: dict
    first_absorbed: torch.Tensor
    weight: torch.Tensor


# the two ratios judged (step 3 of the module docstring): (metric prefix, what it measures)
RATIOS = (("", "signed"), ("offset_", "offset"))


def is_biased(ci_low: float, ci_high: float, tolerance: float) -> bool:
    """The one rule of a biased verdict (and the gate's): the CI excludes 0 (a bias exists)
    and is not within +-tolerance (not shown not to matter)."""
    return bool((ci_low > 0 or ci_high < 0) and not is_within(ci_low, ci_high, tolerance))


def is_within(ci_low: float, ci_high: float, tolerance: float) -> bool:
    """The one rule of a pass (noise) and of a promotion interval that fixes a bias (and the
    gate's): the whole CI within +-tolerance, any bias shown not to matter. A CI that holds 0
    and reaches past the tolerance is neither biased nor within: it shows nothing."""
    return bool(max(abs(ci_low), abs(ci_high)) <= tolerance)


def judge(exact: bool, cis, tolerance: float) -> str:
    """gemm_verdict from the CIs of the ratios (step 5; the gate's rule too): biased when any
    is biased, noise when all lie within the tolerance, else inconclusive."""
    if exact:
        return "exact"
    if any(is_biased(lo, hi, tolerance) for lo, hi in cis):
        return "biased"
    return "noise" if all(is_within(lo, hi, tolerance) for lo, hi in cis) else "inconclusive"


def _pps_strata(norms: torch.Tensor, S: int, g: torch.Generator, permute: bool):
    """Step 1 for one axis: S indices, one from each of S equal strata of the cumulative
    p = norms / sum(norms) (a random permutation of the strata when `permute`), and p of
    each index drawn."""
    p = norms / norms.sum()
    cdf = torch.cumsum(p, 0)
    cdf = cdf / cdf[-1]
    order = torch.randperm(S, generator=g) if permute else torch.arange(S)
    u = (order.double() + torch.rand(S, generator=g, dtype=torch.float64)) / S
    idx = torch.searchsorted(cdf, u, right=True).clamp(max=norms.numel() - 1)
    # a stratum point exactly on a boundary after a row of norm 0 cannot pick that row:
    # searchsorted(right=True) skips empty intervals, and clamp only guards u -> 1
    return idx, p[idx]


# a GEMM of at most BY_OUTPUT x samples outputs is multiplied in full to size its sample: that
# product costs a few percent of emulating the sample's dot products
BY_OUTPUT = 64


def _by_output(a, b, amax_a: float, amax_b: float, S: int, g: torch.Generator):
    """Step 1 for a GEMM small enough to multiply in full: S strata over the M N outputs
    themselves, each output sized half by its share of sum |ref| and half by its share of
    sum |a_i| |b_j|. Row and column norms alone miss outputs much larger than their norms
    suggest (a row of a aligned with a row of b: |ref| ~ |a_i| |b_j|, sqrt(K) times a random
    pair's), which can carry the whole bias while a sample of S rarely draws them; the
    norm half keeps every output whose error can be non-zero drawable (an output near 0
    can still carry an error of order u |a_i| |b_j|)."""
    N = b.shape[0]
    if _in_fp32(a, amax_a) and _in_fp32(b, amax_b):
        ref = (a.float() @ b.float().T).double().abs().reshape(-1)
    else:
        ref = (a.double() @ b.double().T).abs().reshape(-1)
    norm = torch.outer(_row_norms(a, amax_a), _row_norms(b, amax_b)).reshape(-1)
    total = ref.sum()
    size = (ref / total if total > 0 else 0) + norm / norm.sum()
    idx, p = _pps_strata(size, S, g, False)
    i, j = idx // N, idx % N
    share = size / size.sum()
    design = {"kind": "outputs by size", "draws": S, "rows_drawn": int(torch.unique(i).numel()),
              "columns_drawn": int(torch.unique(j).numel()),
              "outputs_certain": int((share >= 2.0 / S).sum()), "heaviest_output_share": share.max().item()}
    return i, j, 1.0 / (S * p), design


def _in_fp32(x: torch.Tensor, amax: float) -> bool:
    """x is held in fp32 or narrower and its squares and products stay in fp32's range."""
    return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and 1e-15 < amax < 1e15


def _row_norms(x: torch.Tensor, amax: float) -> torch.Tensor:
    """L2 norms of x's rows in float64 (computed in fp32 where its range holds them)."""
    if _in_fp32(x, amax):
        return torch.linalg.vector_norm(x.float(), dim=1).double()
    return torch.linalg.vector_norm(x, dim=1, dtype=torch.float64)


def _checkpoints(K: int, F: int) -> list[int]:
    marks = sorted({max(F, (K // d) // F * F) for d in (16, 8, 4, 2)} | {K})
    return [k for k in marks if 0 < k <= K]


def _quantised_rows(x, rows, gathered, recipe, role, g, tensor_amax):
    """Quantise each distinct row needed once (a row drawn twice is one quantisation; 2-D
    weight tiles: the whole 16-row tiles they sit in); `gathered` is x[rows] in float64."""
    tile = 16 if recipe.weight_2d and role == "weight" and recipe.scaling == "nvfp4" else 1
    if tile == 1:
        uniq, inv = torch.unique(rows, return_inverse=True)
        first = torch.zeros(len(uniq), dtype=torch.long).scatter_(0, inv, torch.arange(len(rows)))
        q = quantize(gathered[first], recipe, role, generator=g, tensor_amax=tensor_amax)
        scale = q.scale.reshape(-1, 1) if q.scale.dim() else q.scale.reshape(1, 1)
        return q.values[inv], scale[inv] if scale.shape[0] > 1 else scale.expand(len(rows), 1)
    if x.shape[0] % tile:
        raise InvalidArgument(f"recipe {recipe.name!r} tiles weights 16 x 16: {x.shape[0]} rows is "
                              "not a multiple of 16")
    tiles = torch.unique(rows // tile)
    idx = (tiles[:, None] * tile + torch.arange(tile)).reshape(-1)
    q = quantize(x[idx].double(), recipe, role, generator=g, tensor_amax=tensor_amax)
    pos = torch.searchsorted(tiles, rows // tile) * tile + rows % tile
    return q.values[pos], q.scale.reshape(1, 1).expand(len(rows), 1)


@dataclass(frozen=True)
class Prepared:
    """The sampled dot products of one GEMM, quantised: what every accumulator model is run
    on (prods: the exact products of the quantised rows, block scales folded in)."""

    prods: torch.Tensor
    scale: torch.Tensor
    ref: torch.Tensor
    rows: tuple
    scale_error: tuple  # (a, b): each operand's quantisation as a scale error (_scale_error)
    weight: torch.Tensor  # each draw's Horvitz-Thompson weight 1 / (S p_i q_j)
    design: dict          # what the sample covers (step 1 and the exact verdict's message)
    formats: tuple        # the element formats the tensor core multiplies (a, b)


def _scale_error(x: torch.Tensor, q: torch.Tensor) -> float:
    """<x, q - x> / <x, x>: the part of the quantisation error q - x along x itself, i.e. q
    = (1 + rho) x + an error uncorrelated with x. A GEMM of two such operands is off by about
    rho_a + rho_b in every output, in the direction of the true value: a recipe's own bias.
    Round to nearest on a floating grid has rho != 0 (the cell of each power of two is
    lopsided, half a spacing above it and a quarter below), and rounding values that already
    lie on another grid under a scale that is not a power of two maps each of their few
    significands to a fixed error that no averaging removes. Over the sampled rows, which
    are drawn by norm: the rows that carry the GEMM count most."""
    x, q = x.reshape(-1), q.reshape(-1)
    den = torch.dot(x, x).item()
    return (torch.dot(x, q) - den).item() / den if den else math.nan


# the formats an operand's values may hold, narrowest first (what the tensor core sees under
# a recipe that quantises nothing): a cast to each round-trips the values or not
_HELD = (("fp8_e4m3fn", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2),
         ("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32))


def held_in(t: torch.Tensor) -> str:
    """The narrowest of _HELD (then "fp64") that holds every value of t exactly."""
    for name, dtype in _HELD:
        if t.dtype == dtype or torch.equal(t.to(dtype).to(t.dtype), t):
            return name
    return "fp64"


def _fits(acc, recipe, formats) -> str | None:
    """None where the accumulator preset was measured for what the tensor core multiplies
    under `recipe` (formats: the two operands' element formats), else why not."""
    if acc.inputs is None:
        return None
    if recipe.scaling in ("mx", "nvfp4") and not acc.block_scales:
        return (f"recipe {recipe.name!r} applies {recipe.block}-element block scales inside the "
                f"MMA, and the {acc.name} accumulator was measured without them")
    bad = [f"{side} holds {f}" for side, f in zip("ab", formats) if f not in acc.inputs]
    if bad:
        return (f"the {acc.name} accumulator models products of {'/'.join(acc.inputs)} operands, "
                f"and under recipe {recipe.name!r} operand {' and '.join(bad)}")
    return None


def combination(acc, recipe, gemm: str, formats=None) -> str | None:
    """Why the preset `acc` was not measured for `recipe` in `gemm` (None: it was). formats:
    the operands' formats where the recipe quantises nothing (held_in of their values)."""
    ra, rb = ROLES[gemm]
    formats = formats or (recipe.element_for(ra), recipe.element_for(rb))
    return _fits(acc, recipe, formats)


def what_works(acc, gemm: str) -> str:
    """The recipes (and operands) a preset was measured for, for a refusal's message."""
    from trainprobes.reference.recipes import RECIPES
    ok = [r for r in RECIPES.values() if r.scaling != "none"
          and combination(acc, r, gemm) is None]
    return (f"recipes {', '.join(r.name for r in ok) or '(none)'}, or 'exact' on operands that "
            f"hold {'/'.join(acc.inputs)} values; or the fp32 preset for these products")


def _scan(t: torch.Tensor, name: str, gemm: str) -> float:
    """One pass over an operand: finite, not all zeros; returns its amax."""
    lo, hi = torch.aminmax(t)
    lo, hi = lo.item(), hi.item()
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = ~torch.isfinite(t)
        raise InvalidArgument(f"gemm {gemm}: operand {name} holds {int(bad.sum())} non-finite "
                              f"value(s), the first at {tuple(int(x) for x in torch.nonzero(bad)[0])}; "
                              "a GEMM of them has no relative error to judge")
    if lo == 0 and hi == 0:
        raise InvalidArgument(f"gemm {gemm}: operand {name} is all zeros: nothing to judge "
                              "(every output is 0, so no relative error exists)")
    return max(-lo, hi)


def prepare_gemm(a, b, *, recipe, gemm: str, samples: int, seed: int, every: bool = False) -> Prepared:
    """Steps 1-2 of the module docstring up to the accumulator. every: all M N outputs once
    (weight 1) instead of a sample (numerics.gemm_impact's small GEMMs)."""
    recipe = get_recipe(recipe)
    M, K = a.shape
    N = b.shape[0]
    g = torch.Generator().manual_seed(seed)
    amax_a, amax_b = _scan(a, "a", gemm), _scan(b, "b", gemm)
    if every:
        i, j = torch.arange(M).repeat_interleave(N), torch.arange(N).repeat(M)
        weight = torch.ones(M * N, dtype=torch.float64)
        design = {"kind": "every output", "draws": M * N, "rows_drawn": M, "columns_drawn": N,
                  "rows_certain": M, "columns_certain": N}
    elif M * N <= BY_OUTPUT * samples:
        i, j, weight, design = _by_output(a, b, amax_a, amax_b, samples, g)
    else:
        na, nb = _row_norms(a, amax_a), _row_norms(b, amax_b)
        i, pi = _pps_strata(na, samples, g, False)
        j, qj = _pps_strata(nb, samples, g, True)
        weight = 1.0 / (samples * pi * qj)
        pa, pb = na / na.sum(), nb / nb.sum()
        design = {"kind": "pps", "draws": samples,
                  "rows_drawn": int(torch.unique(i).numel()), "columns_drawn": int(torch.unique(j).numel()),
                  "rows_certain": int((pa >= 2.0 / samples).sum()),
                  "columns_certain": int((pb >= 2.0 / samples).sum()),
                  "heaviest_row_share": pa.max().item(), "heaviest_column_share": pb.max().item()}
    ra, rb = ROLES[gemm]
    ai, bj = a[i].double(), b[j].double()
    ref = torch.bmm(ai.unsqueeze(1), bj.unsqueeze(2)).reshape(-1)
    if recipe.scaling == "none" and recipe.element is None:  # 'exact': the operands as given
        formats = (held_in(a[torch.unique(i)]), held_in(b[torch.unique(j)]))
        one = torch.ones(len(i), 1, dtype=torch.float64)
        qa, qb, sa, sb, rho = ai, bj, one, one, (0.0, 0.0)
    else:
        if recipe.hadamard_wgrad and gemm == "wgrad":
            blocks = hadamard(K, torch.Generator().manual_seed(seed + 1))
            a, b = rotate(a.double(), blocks), rotate(b.double(), blocks)
            amax_a, amax_b = a.abs().amax().item(), b.abs().amax().item()
            ai, bj = a[i], b[j]
        qa, sa = _quantised_rows(a, i, ai, recipe, ra, torch.Generator().manual_seed(seed + 2), amax_a)
        qb, sb = _quantised_rows(b, j, bj, recipe, rb, torch.Generator().manual_seed(seed + 3), amax_b)
        rho = (_scale_error(ai, qa * sa), _scale_error(bj, qb * sb))
        formats = (recipe.element_for(ra), recipe.element_for(rb))
    if "fp64" in formats:  # values of fp32 width or less (and every recipe's) multiply exactly
        check_operands(qa, qb, f"gemm {gemm} under recipe {recipe.name!r}")
    return Prepared(qa * qb, (sa * sb).reshape(-1), ref, (i, j), rho, weight, design, formats)


def sample_gemm(prep: Prepared, acc) -> Sampled:
    """Emulate the prepared dot products under the accumulator `acc`."""
    acc = get_preset(acc)
    prods = prep.prods
    K = prods.shape[1]
    marks = _checkpoints(K, acc.fused_terms)
    trace: dict = {}
    low, parts = dot_products(prods, acc, marks, trace)
    sums = torch.cumsum(prods, -1) if len(marks) > 1 else None
    quantised = {k: (sums[:, k - 1] if sums is not None else prods.sum(-1)) * prep.scale for k in marks}
    return Sampled(prep.ref, low * prep.scale, quantised[K],
                   {k: v * prep.scale for k, v in parts.items()}, quantised,
                   trace["first_absorbed"], prep.weight)


def group_ratios(y, x, weight, trials: int) -> tuple[float, list[float]]:
    """Step 3: the ratio sum(w y) / sum(w x) over all draws and the `trials` groups'
    linearised pseudo-values (draw s in group s mod trials). NaN when sum(w x) is 0."""
    group = torch.arange(y.numel()) % trials
    Y = torch.zeros(trials, dtype=torch.float64).index_add_(0, group, weight * y)
    X = torch.zeros(trials, dtype=torch.float64).index_add_(0, group, weight * x)
    tx = X.sum().item()
    if not tx > 0:
        return math.nan, [math.nan] * trials
    R = Y.sum().item() / tx
    return R, (R + (Y - R * X) / (tx / trials)).tolist()


def _ratio_stats(ref, low, weight, trials: int, alpha: float, floor: float,
                 census: bool = False) -> dict:
    """error_stats of each ratio (RATIOS), at alpha / 2 each. census: every output drawn
    once, so each ratio is the whole GEMM's itself (no sampling spread: its CI is the point)."""
    err = low - ref
    ys = {"": torch.sign(ref) * err, "offset_": err}
    out = {}
    for prefix, _ in RATIOS:
        R, pseudo = group_ratios(ys[prefix], ref.abs(), weight, trials)
        if census:
            pseudo = [R] * trials
        if not math.isfinite(R):
            raise InvalidArgument(f"the {ref.numel()} sampled exact outputs are all 0: no relative "
                                  "error exists")
        out[prefix] = (error_stats(pseudo, alpha=alpha / 2, min_effect=floor), pseudo)
    return out


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


def stall_k(first: torch.Tensor, weight: torch.Tensor) -> tuple[float, float]:
    """(the K by which half the outputs, by weight, had a fused add absorbed, inf: not within
    K; the stalled outputs' weighted share)."""
    total = weight.sum().item()
    stalled = first >= 0
    share = weight[stalled].sum().item() / total
    if share < 0.5:
        return math.inf, share
    order = torch.argsort(first[stalled])
    k, w = first[stalled][order], torch.cumsum(weight[stalled][order], 0)
    return float(k[torch.searchsorted(w, torch.tensor(0.5 * total, dtype=w.dtype)).clamp(max=len(k) - 1)].item()), share


def _weighted_ratio(num: torch.Tensor, den: torch.Tensor, w: torch.Tensor) -> float:
    d = (w * den).sum().item()
    return (w * num).sum().item() / d if d else math.nan


def _promotion(prep, acc, trials, alpha, floor):
    """The promotion search (step 5): candidates F 2^j below K (and below a preset's own
    interval), largest first, each judged by both ratios; stops at the first within."""
    promo, needed = [], math.nan
    F, K = acc.fused_terms, prep.prods.shape[1]
    n = F  # the largest F 2^j below K (promoting every K or more is no promotion: the run
    while 2 * n < K:  # above); F 2^j, as halving K // F * F split a fused add (K = 4000: 2000)
        n *= 2
    if n >= K:
        n = 0
    run = promotion_runs(prep.prods, acc)
    while n >= F:
        if acc.promote_every is None or n < acc.promote_every:
            # the candidate's output alone (no partial sums, no trace): the emulator runs each
            # interval of n products at once, the groups' exponents shared by the candidates
            low = run(n) * prep.scale
            st = _ratio_stats(prep.ref, low, prep.weight, trials, alpha, floor,
                              prep.design["kind"] == "every output")
            inside = all(is_within(st[p][0]["ci_low"], st[p][0]["ci_high"], floor) for p, _ in RATIOS)
            promo.append({"promote_every": n, "relative_bias": st[""][0]["bias"],
                          "ci_low": st[""][0]["ci_low"], "ci_high": st[""][0]["ci_high"],
                          "relative_offset": st["offset_"][0]["bias"],
                          "offset_ci_low": st["offset_"][0]["ci_low"],
                          "offset_ci_high": st["offset_"][0]["ci_high"], "within": inside})
            if inside:
                needed = float(n)
                break
        n //= 2
    return promo, needed


def gemm_bias(a, b, *, preset="h200-scaled-mm", recipe="exact", gemm="fprop",
              samples=DEFAULT_SAMPLES, trials=DEFAULT_TRIALS, seed=0, alpha=0.01, tolerance=DEFAULT_TOLERANCE, promotion=True,
              what_if: bool = False, target: str | None = None) -> Result:
    """Judge C = a @ b.T (a: M x K, b: N x K) under `recipe` and the accumulator `preset`
    against fp64 (module docstring). gemm names the operands' roles (fprop: activation x
    weight, dgrad: grad x weight, wgrad: grad x activation). tolerance: the smallest |relative
    bias| that matters (DEFAULT_TOLERANCE); promotion: also search the promotion interval
    that keeps a biased GEMM's CIs within +-tolerance. A preset states the operands it was
    measured on (Accumulator.inputs, block_scales): other products (fp32 or bf16 operands
    under an fp8 tensor core's model, block scales it never saw) are refused, naming what
    works, unless what_if=True, which judges them and says in the Result that no hardware
    runs that combination (metrics what_if, evidence combination).
    metrics: preset, recipe, gemm, k, samples, trials, relative_bias, ci_low, ci_high, std,
    p_value, relative_offset, offset_ci_low, offset_ci_high, offset_std, offset_p_value,
    alpha, confidence, tolerance, min_detectable_bias, max_relative_error, sqnr_db,
    growth_exponent, stall_k, promote_every_needed (K where no search ran: not biased, or
    promotion=False; read promotion_searched), promotion_searched, rows_drawn, columns_drawn,
    biased, gemm_verdict."""
    acc = get_preset(preset)
    rec = get_recipe(recipe)
    check_choice(gemm, "gemm", GEMMS)
    # the operands stay in their own float dtype (a 4096 x 16384 fp32 operand is 256 MiB, 512
    # MiB in float64): only the sampled rows are converted, exactly, to float64 (fp8 tensors,
    # which torch reduces little on the CPU, to fp32)
    a, b = (t if torch.is_tensor(t) and t.dtype in (torch.float64, torch.float32, torch.bfloat16,
                                                     torch.float16) else
            t.float() if torch.is_tensor(t) and t.is_floating_point() else
            torch.as_tensor(t).to(torch.float64) for t in (a, b))
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise InvalidArgument(f"a has shape {tuple(a.shape)}, b {tuple(b.shape)}: expected (M, K) "
                              "and (N, K), the reduction axis last in both")
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
    # a GEMM of no more outputs than the sample judges every one of them once: drawn with
    # replacement, S = M N draws miss about a third of the outputs (an inexact one among
    # them read as exact), and the ratio is then known, not estimated
    census = M * N <= samples
    S = M * N if census else samples - samples % trials
    # the sampled rows in float64 (a, b, their quantised values, the products, their partial
    # sums) and a recipe's temporaries: about 8 arrays of S x K float64 at the peak
    from trainprobes.budget import check_fits
    # and a random Hadamard transform (wgrad) rotates both whole operands first: a float64
    # copy and its rotation, 16 bytes per element (measured: 4.1x the fp32 operands)
    rotated = 16 * (M + N) * K if rec.hadamard_wgrad and gemm == "wgrad" else 0
    check_fits(8 * 8 * S * K + rotated, f"gemm {gemm}: {S} samples of K={K}" + (
        f" and recipe {rec.name!r}'s Hadamard rotation of both whole operands ({M + N} x {K}, "
        "float64, twice)" if rotated else ""), fix="lower samples (--samples)" + (
        ", or the tokens of the step (K)" if rotated else ""))
    prep = prepare_gemm(a, b, recipe=rec, gemm=gemm, samples=S, seed=seed, every=census)
    unmeasured = combination(acc, rec, gemm, prep.formats)
    if unmeasured and not what_if:
        raise InvalidArgument(f"gemm {gemm}: {unmeasured}: a combination no hardware runs (its "
                              f"bias would be the model's, not a machine's). What works with "
                              f"{acc.name}: {what_works(acc, gemm)}; what_if=True (CLI --what-if) "
                              "judges it anyway, named as a what-if")
    s = sample_gemm(prep, acc)
    try:
        ratios = _ratio_stats(s.ref, s.low, s.weight, trials, alpha, floor, census)
    except InvalidArgument as e:
        raise InvalidArgument(f"gemm {gemm}: {e}") from None
    st, so = ratios[""][0], ratios["offset_"][0]
    w = s.weight
    err = s.low - s.ref
    sum_sq_ref, sum_sq_err = (w * s.ref ** 2).sum().item(), (w * err ** 2).sum().item()
    weight_sum = w.sum().item()
    rms_ref = math.sqrt(sum_sq_ref / weight_sum)
    max_abs_err = err.abs().max().item()
    growth = []
    for k in sorted(s.partial_low):
        e = s.partial_low[k] - s.partial_quantised[k]
        den = (w * s.partial_quantised[k] ** 2).sum().item()
        growth.append({"k": k, "relative_rms_error": math.sqrt((w * e ** 2).sum().item() / den) if den else math.nan})
    sk, stalled_share = stall_k(s.first_absorbed, w)
    exact = max_abs_err == 0.0
    cis = [(r[0]["ci_low"], r[0]["ci_high"]) for r in ratios.values()]
    verdict = judge(exact, cis, floor)
    biased = verdict == "biased"
    promo, needed = [], float(K)
    searched = bool(promotion and biased)  # a biased GEMM with promotion=False: not searched
    if searched:
        promo, needed = _promotion(prep, acc, trials, alpha, floor)
    metrics = {"preset": acc.name, "recipe": rec.name, "gemm": gemm, "k": K, "samples": S,
               "trials": st["trials"], "relative_bias": st["bias"], "ci_low": st["ci_low"],
               "ci_high": st["ci_high"], "std": st["std"], "p_value": st["p_value"],
               "relative_offset": so["bias"], "offset_ci_low": so["ci_low"],
               "offset_ci_high": so["ci_high"], "offset_std": so["std"], "offset_p_value": so["p_value"],
               "alpha": alpha, "confidence": 1 - alpha / 2, "tolerance": floor,
               "min_detectable_bias": min_detectable_effect(st["std"] / math.sqrt(st["trials"]),
                                                            st["trials"] - 1, alpha / 2),
               "max_relative_error": max_abs_err / rms_ref if rms_ref else math.nan,
               "sqnr_db": 10 * math.log10(sum_sq_ref / sum_sq_err) if sum_sq_err else math.inf,
               "growth_exponent": growth_exponent(growth), "stall_k": sk,
               "promote_every_needed": needed, "promotion_searched": searched,
               "rows_drawn": prep.design["rows_drawn"], "columns_drawn": prep.design["columns_drawn"],
               "what_if": bool(unmeasured),
               "biased": None if verdict == "inconclusive" else biased, "gemm_verdict": verdict}
    q_err = s.quantised - s.ref
    acc_err = s.low - s.quantised
    sign, mag = torch.sign(s.ref), s.ref.abs()
    evidence = {"errors": ratios[""][1], "offset_errors": ratios["offset_"][1],
                "shape": [M, N, K], "accumulator": acc.describe(),
                "accumulator_source": acc.source, "recipe_source": rec.source,
                "sum_sq_ref": sum_sq_ref, "sum_sq_err": sum_sq_err, "weight_sum": weight_sum,
                "max_abs_err": max_abs_err, "growth": growth, "promotion": promo,
                "quantisation_bias": _weighted_ratio(sign * q_err, mag, w),
                "operand_scale_error": {"a": prep.scale_error[0], "b": prep.scale_error[1]},
                "accumulator_bias": _weighted_ratio(sign * acc_err, mag, w),
                "accumulator_offset": _weighted_ratio(acc_err, mag, w),
                "stall": {"stalled_outputs": int((s.first_absorbed >= 0).sum().item()),
                          "stalled_share": stalled_share, "stall_k": sk},
                "design": prep.design, "operand_formats": list(prep.formats),
                "combination": unmeasured or f"{acc.name} was measured on these operands",
                "sampling": _sampling(prep.design, M, N, trials)}
    msg = _message(metrics, prep.design) + _cause(metrics, evidence)
    if unmeasured:
        msg = f"WHAT-IF, no hardware runs this ({unmeasured}): " + msg
    return Result(probe="numerics.gemm", target=target or f"{gemm}[{rec.name},{acc.name},K={K}]",
                  verdict={"biased": "fail", "inconclusive": "error"}.get(verdict, "pass"),
                  metrics=metrics, evidence=evidence, seed=seed,
                  codes={"biased": ["TP-B1"], "inconclusive": ["TP-E1"]}.get(verdict, []),
                  message=msg)


def _sampling(design: dict, M: int, N: int, trials: int) -> str:
    S = design["draws"]
    if design["kind"] == "every output":
        return f"every one of the {S} outputs once (weight 1): the ratios are the whole GEMM's, their CIs the points"
    head = f"{S} of {M * N} output elements drawn "
    tail = (f" (probability-proportional-to-size Latin hypercube strata, Horvitz-Thompson weights: "
            f"{design['rows_drawn']} of {M} rows, {design['columns_drawn']} of {N} columns")
    if design["kind"] == "outputs by size":
        return (head + "in proportion to half |ref_ij| and half |a_i| |b_j| (the GEMM multiplied "
                "in full to size them)" + tail + f"; the {design['outputs_certain']} output(s) holding "
                f"2/S of the size or more drawn for certain), in {trials} interleaved groups")
    return (head + "in proportion to row and column norms" + tail + f"; the {design['rows_certain']} "
            f"row(s) and {design['columns_certain']} column(s) holding 2/S of the norm mass or more "
            f"drawn for certain), in {trials} interleaved groups. Not seen by this design: a bias "
            "held by a few outputs far larger than their norms suggest (rows of a aligned with rows "
            f"of b); GEMMs of at most {BY_OUTPUT} x samples outputs are sized output by output")


def _ci(m: dict, prefix: str) -> str:
    return f"[{m[prefix + 'ci_low']:+.3g}, {m[prefix + 'ci_high']:+.3g}]"


def _message(m: dict, design: dict) -> str:
    head = (f"{m['gemm']} K={m['k']} under {m['recipe']} with the {m['preset']} accumulator: "
            f"relative bias {m['relative_bias']:+.3g} ({m['confidence']:.1%} CI {_ci(m, '')}), "
            f"offset {m['relative_offset']:+.3g} (CI {_ci(m, 'offset_')}), SQNR {m['sqnr_db']:.1f} dB, "
            f"max error {m['max_relative_error']:.3g} of rms, {m['samples']} sampled outputs: ")
    if design["kind"] == "every output":
        head = head.replace(f"{m['samples']} sampled outputs", f"every one of the {m['samples']} outputs")
        if m["gemm_verdict"] == "exact":
            return head + "exact"
    if m["gemm_verdict"] == "exact":
        if design["kind"] == "outputs by size":
            return head + (f"exact on every sampled output. What that covers: outputs drawn in "
                           f"proportion to half |ref| and half |a_i| |b_j|; outputs that are not exact "
                           f"hold less than {3 / m['samples']:.2g} of that size (95%)")
        return head + (f"exact on every sampled output. What that covers: {m['rows_drawn']} rows and "
                       f"{m['columns_drawn']} columns drawn in proportion to their norms (the "
                       f"{design['rows_certain']} row(s) and {design['columns_certain']} column(s) "
                       f"holding 2/S of the norm mass or more for certain); outputs that are not "
                       f"exact hold less than {3 / m['samples']:.2g} of the norm mass sum |a_i| |b_j| "
                       "(95%): lighter ones can remain unseen")
    if m["gemm_verdict"] == "noise":
        shown = [name for p, name in RATIOS if m[p + "ci_low"] > 0 or m[p + "ci_high"] < 0]
        if shown:
            return head + (f"a significant {' and '.join(shown)} bias whose whole CI lies within "
                           f"+-{m['tolerance']:.3g} (the tolerance): shown not to matter at that tolerance")
        return head + f"noise (both CIs lie within +-{m['tolerance']:.3g}, the tolerance)"
    if m["gemm_verdict"] == "inconclusive":
        return head + (f"cannot judge: a CI holds 0 and reaches past +-{m['tolerance']:.3g} (the "
                       f"tolerance), so this sample neither shows a bias nor rules one out (it "
                       f"rules out |bias| > {m['min_detectable_bias']:.3g} at 80% power); sample "
                       "more outputs, or state the tolerance that matters to you")
    need = m["promote_every_needed"]
    fix = ("; the promotion interval was not searched" if not m["promotion_searched"] else
           f"; promoting to fp32 every {int(need)} keeps it within {m['tolerance']:.3g}"
           if math.isfinite(need) else "; no promotion interval keeps it within the tolerance")
    signed = is_biased(m["ci_low"], m["ci_high"], m["tolerance"])
    shift = "down" if m["relative_offset"] < 0 else "up"
    if signed:
        found = ("outputs too small in magnitude on average" if m["relative_bias"] < 0 else
                 "outputs too large in magnitude on average")
        if is_biased(m["offset_ci_low"], m["offset_ci_high"], m["tolerance"]):
            found += f", and shifted {shift} on average"
    else:
        found = (f"every output shifted {shift} on average whatever its sign (an offset, as "
                 "rounding toward -inf gives), which the signed bias cannot show: it cancels "
                 "between the positive and the negative outputs")
    return head + "biased: " + found + fix


def _cause(m: dict, ev: dict) -> str:
    """Which share of a biased verdict is the recipe's and which the accumulator's."""
    if m["gemm_verdict"] != "biased":
        return ""
    q, acc = ev["quantisation_bias"], ev["accumulator_bias"]
    if not abs(q) > abs(acc):
        return (f" (the accumulator's share: {acc:+.3g}, offset {ev['accumulator_offset']:+.3g}; "
                f"the recipe's quantisation: {q:+.3g})")
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
