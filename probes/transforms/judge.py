"""The verdict: a transformed step's gradients and loss against the single-device step.

Two references per trial t (a seeded batch), both computed on one process:
    r  the truth: the step in float64;
    b  the step as the model is given, in its own dtype (fp32, say), on one device.
g is the transform's gradient of parameter p (from the lowest rank that returned it). Per
trial, for x in (g, b) against r:
    scale_t(x)     = sum_p <x_p, r_p> / sum_p |r_p|^2       the least-squares scale of x on r
    signed_t(x)    = sum sign(r) (x - r) / sum |r|           trainprobes.numerics.bias's signed
                                                             relative error (< 0: too small)
    rel_t(x)       = |x - r| / |r|,   residual_t = |g - scale_t r| / |r|
    loss_rel_t(x)  = (L_x - L_r) / |L_r|
    scale_{t,p}(x) = <x_p, r_p> / |r_p|^2                    per parameter
The model's own arithmetic is biased against fp64 by itself (fp32 rounds systematically:
~1e-8 on the zoo's models, larger on deep ones), and that is not the transform's doing. So
the tests of "biased" are PAIRED: each takes the transform's statistic minus the single
device's on the same batch (scale_t(g) - scale_t(b), ...), which cancels the model's own
rounding and leaves what the transform adds. Magnitudes (scale, its CI, relative errors)
are reported against the fp64 truth.

Verdict kinds, in this order:
  wrong         a gradient or the loss is inf/NaN;
  inconsistent  ranks that hold the same parameter (a replica) or report the loss disagree
                (beyond replica_tol, relative; 0: any bit);
  exact         every gradient and loss equals the truth cast to the transform's dtype, bit
                for bit, on every trial;
  biased        a systematic signed difference: one of the paired t-tests of mean 0 over
                trials, on the scale, the signed relative error, the loss and every
                parameter's scale, rejects at alpha / m (Bonferroni over the m tests, so the
                false-positive rate of the whole verdict is at most alpha) with
                |mean| >= min_effect (a floor under which a significant effect is reported,
                not failed); CIs are Student-t, as trainprobes.numerics.bias.error_stats's;
  wrong         no test rejects but the transform adds a large difference: max over trials
                of |g - b| / |r| or of the loss's over noise_tol (more than rounding in the
                transform's dtype explains), or in any one parameter the median over trials
                of |g_p - b_p| / |r_p| over noise_tol (a small parameter can be all wrong
                inside the whole gradient's tolerance);
  noise         none of the above: zero-mean differences of rounding size.
A pass states what it rules out: the smallest scale error and signed relative bias the
trials would have detected at the same level with 80% power (trainprobes.power), of the
whole gradient and of the least resolved parameter (a small one resolves far less).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from scipy import stats
from trainprobes.power import POWER, min_detectable_effect

KINDS = ("exact", "noise", "biased", "inconsistent", "wrong")
EQUIVALENT = ("exact", "noise")
LOSS = "<loss>"
# largest per-trial relative error still called rounding noise, by the lowest precision
# in play (deep models in low precision may need more: pass noise_tol=)
NOISE_TOL = {"fp64": 1e-10, "fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}
PRECISION_ORDER = ("fp64", "fp32", "tf32", "fp16", "bf16")

__all__ = ["KINDS", "EQUIVALENT", "Observed", "Judgement", "judge", "NOISE_TOL", "lowest_precision"]


def lowest_precision(names) -> str:
    """The least precise of the format names (unknown names rank as fp8: least precise)."""
    order = {n: i for i, n in enumerate(PRECISION_ORDER)}
    return max(names, key=lambda n: order.get(n, len(order)))


def default_noise_tol(dtype: str) -> float:
    return NOISE_TOL.get(dtype, 0.25)


class Observed(NamedTuple):
    """What the ranks returned, per parameter: {name: {rank: [trials, numel] float64}}, the
    original dtype of each gradient, and the loss per reporting rank {rank: [trials]}."""

    grads: dict
    dtypes: dict
    losses: dict


@dataclass
class Judgement:
    kind: str
    metrics: dict
    evidence: dict
    message: str
    worst_parameter: str
    tests: dict = field(default_factory=dict)

    @property
    def equivalent(self) -> bool:
        return self.kind in EQUIVALENT


def t_tests(errors: torch.Tensor) -> tuple:
    """Two-sided one-sample t-tests of mean 0 down each column of [trials, K], over each
    column's finite entries (a trial where a statistic does not exist, a parameter whose
    fp64 gradient is zero, is left out): (mean, standard error, p, count). A column with no
    spread has p = 0 if its mean is not 0; one with fewer than 3 finite trials p = NaN."""
    finite = torch.isfinite(errors)
    n = finite.sum(0).double()
    x = torch.where(finite, errors, torch.zeros_like(errors))
    mean = x.sum(0) / n.clamp(min=1)
    dev = torch.where(finite, errors - mean, torch.zeros_like(errors))
    sd = ((dev * dev).sum(0) / (n - 1).clamp(min=1)).sqrt()
    se = sd / n.clamp(min=1).sqrt()
    t = torch.where(se > 0, mean / se, torch.zeros_like(mean))
    df = (n - 1).clamp(min=1)
    p = torch.as_tensor(2 * stats.t.sf(t.abs().numpy(), df.numpy()), dtype=torch.float64)
    p = torch.where(se > 0, p, (mean == 0).double())
    p = torch.where(n >= 3, p, torch.full_like(p, math.nan))
    return mean, se, p, n


def mean_ci(x: torch.Tensor, alpha: float) -> dict | None:
    """Mean, Student-t (1 - alpha) CI and spread over the finite trials (the interval of
    trainprobes.numerics.bias.error_stats); NaN with fewer than 3."""
    x = x[torch.isfinite(x)]
    n = x.numel()
    if n < 3:
        return {"bias": math.nan, "ci_low": math.nan, "ci_high": math.nan, "std": math.nan, "n": max(n, 1)}
    mean, std = x.mean().item(), x.std().item()
    half = float(stats.t.ppf(1 - alpha / 2, n - 1)) * std / math.sqrt(n)
    return {"bias": mean, "ci_low": mean - half, "ci_high": mean + half, "std": std, "n": n}


def _replicas(obs: Observed, replica_tol: float) -> list:
    rows = []
    for name, by_rank in obs.grads.items():
        ranks = sorted(by_rank)
        first = by_rank[ranks[0]]
        ref = first.abs().max().item() or 1.0
        for r in ranks[1:]:
            d = (by_rank[r] - first).abs().max().item()
            if not d <= replica_tol * ref:
                rows.append({"parameter": name, "ranks": [ranks[0], r], "max_difference": d,
                             "relative": d / ref})
    ranks = sorted(obs.losses)
    for r in ranks[1:]:
        a, b = obs.losses[ranks[0]], obs.losses[r]
        d = (a - b).abs().max().item()
        ref = a.abs().max().item() or 1.0
        if not d <= replica_tol * ref:
            rows.append({"parameter": LOSS, "ranks": [ranks[0], r], "max_difference": d,
                         "relative": d / ref})
    return sorted(rows, key=lambda x: -x["relative"])


def rounded(r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp64 truth as a value of `dtype` holds it, in float64: rounded once to nearest
    (trainprobes.reference.formats; torch's own casts to 16- and 8-bit formats go through
    fp32 and can round twice). An integer dtype (an int8 gradient) is not rounded: it is
    exact only where the truth is an integer."""
    if not dtype.is_floating_point or dtype == torch.float64:
        return r.double()
    if dtype == torch.float32:
        return r.to(dtype).double()
    from trainprobes.reference.formats import round_to
    return round_to(r, dtype)


def _exact(g: dict, r: dict, obs: Observed, loss, truth_loss) -> bool:
    for name, x in g.items():
        if not torch.equal(x, rounded(r[name], obs.dtypes.get(name) or torch.float32)):
            return False
    if loss is not None:
        if not torch.equal(loss, rounded(truth_loss, obs.dtypes.get(LOSS) or torch.float32)):
            return False
    return True


class Against(NamedTuple):
    """One set of gradients (and its loss) against the truth, per trial (module docstring)."""

    scale: torch.Tensor       # [T]
    signed: torch.Tensor      # [T]
    rel: torch.Tensor         # [T]
    residual: torch.Tensor    # [T]
    p_scale: torch.Tensor     # [T, P], NaN where r_p = 0
    p_rel: torch.Tensor       # [T, P]
    loss_rel: torch.Tensor | None
    rr: torch.Tensor          # [T, P] |r_p|^2


STATS = ("dot", "rr", "xx", "err2", "sgn", "ar")  # per trial and parameter, sums over elements


def truth_terms(r: torch.Tensor) -> tuple:
    """What sums() needs of the truth alone (|r|^2, sign(r), sum |r|): computed once where
    the transform and the base are both summed against the same r."""
    return (r * r).sum(1), torch.sign(r), r.abs().sum(1)


def sums(x: torch.Tensor, r: torch.Tensor, terms: tuple | None = None) -> torch.Tensor:
    """[6, T] sums over the elements of one parameter (x, r: [T, numel] float64): <x, r>,
    |r|^2, |x|^2, |x - r|^2, sum sign(r)(x - r), sum |r|. Sums over disjoint pieces add up,
    so ranks holding shards of a parameter each sum their own and one all-reduce joins them.
    terms: truth_terms(r), where the caller has them."""
    rr, sign, ar = truth_terms(r) if terms is None else terms
    d = x - r
    return torch.stack([(x * r).sum(1), rr, (x * x).sum(1), (d * d).sum(1), (sign * d).sum(1), ar])


def against_sums(S: torch.Tensor, loss, truth_loss) -> Against:
    """Against from [6, T, P] sums (STATS)."""
    dot, rr, xx, err2, sgn, ar = S
    RR = rr.sum(1)
    scale = dot.sum(1) / RR  # NaN on a trial whose fp64 gradient is zero (left out of tests)
    residual = ((xx.sum(1) - 2 * scale * dot.sum(1) + scale ** 2 * RR).clamp(min=0) / RR).sqrt()
    loss_rel = None if loss is None else (loss - truth_loss) / truth_loss.abs()
    return Against(scale, sgn.sum(1) / ar.sum(1), _relative(err2.sum(1), RR), residual, dot / rr,
                   (err2 / rr).sqrt(), loss_rel, rr)


def against(x: dict, r: dict, loss, truth_loss) -> Against:
    return against_sums(torch.stack([sums(x[n], r[n]) for n in r], 2), loss, truth_loss)


class Statistics(NamedTuple):
    """All the verdict reads, whether the gradients were gathered to one process or summed
    on the ranks that hold them (trainprobes.transforms.local): per trial and parameter
    sums of the transform's gradients `g` against the truth and of the base's `b` ([6, T, P],
    STATS; b None without a usable base), |g - b|^2 [T, P], whether every value equals the
    truth rounded to its dtype, the parameters with a non-finite value on some rank, the
    replica disagreements, the ranks that returned each parameter, and the losses."""

    names: list
    numel: list
    ranks: dict
    g: torch.Tensor
    b: torch.Tensor | None
    added2: torch.Tensor | None
    exact: bool
    nonfinite: list
    replicas: list
    loss: torch.Tensor | None
    truth_loss: torch.Tensor
    base_loss: torch.Tensor | None


def statistics(truth, obs: Observed, base=None, replica_tol: float = 0.0) -> Statistics:
    """Statistics from gradients gathered to one process (Observed)."""
    names = list(truth.grads)
    T = truth.loss.numel()
    g = {n: obs.grads[n][min(obs.grads[n])] for n in names}
    r = {n: truth.grads[n].reshape(T, -1) for n in names}
    loss = obs.losses[min(obs.losses)] if obs.losses else None
    # on any rank: a NaN on one replica is a NaN, not a disagreement between replicas
    nonfinite = [n for n in names if not all(bool(torch.isfinite(v).all()) for v in obs.grads[n].values())]
    if not all(bool(torch.isfinite(v).all()) for v in obs.losses.values()):
        nonfinite.append(LOSS)
    B = added2 = base_loss = bg = None
    if base is not None and all(bool(torch.isfinite(v).all()) for v in base.grads.values()) \
            and bool(torch.isfinite(base.loss).all()):
        bg = {n: base.grads[n].reshape(T, -1) for n in names}
        base_loss = base.loss.double()
    Gs, Bs, added = [], [], []
    for n in names:  # one parameter's temporaries at a time
        terms = truth_terms(r[n])
        Gs.append(sums(g[n], r[n], terms))
        if bg is not None:
            b = bg[n].double()
            Bs.append(sums(b, r[n], terms))
            added.append(((g[n] - b) ** 2).sum(1))
    G = torch.stack(Gs, 2)
    if bg is not None:
        B, added2 = torch.stack(Bs, 2), torch.stack(added, 1)
    return Statistics(names, [int(r[n].shape[1]) for n in names], {n: sorted(obs.grads[n]) for n in names},
                      G, B, added2, _exact(g, r, obs, loss, truth.loss), nonfinite,
                      _replicas(obs, replica_tol), loss, truth.loss, base_loss)


def _relative(err2: torch.Tensor, ref2: torch.Tensor) -> torch.Tensor:
    """sqrt(err2 / ref2), and where the reference is zero: 0 if the error is, else inf (a
    difference from a zero gradient is never rounding)."""
    out = (err2 / ref2).sqrt()
    return torch.where(ref2 > 0, out, torch.where(err2 == 0, torch.zeros_like(out),
                                                  torch.full_like(out, math.inf)))


def judge(truth, obs: Observed, *, alpha: float, min_effect: float, noise_tol: float,
          replica_tol: float = 0.0, base=None) -> Judgement:
    """The verdict (module docstring) of one probe: truth and base are step.Truth (base the
    single-device step in the model's dtype; None: the tests compare with the truth alone)."""
    return judge_statistics(statistics(truth, obs, base, replica_tol), alpha=alpha,
                            min_effect=min_effect, noise_tol=noise_tol, replica_tol=replica_tol)


def judge_statistics(st: Statistics, *, alpha: float, min_effect: float, noise_tol: float,
                     replica_tol: float = 0.0) -> Judgement:
    """The verdict from Statistics (however they were summed)."""
    names, loss, nonfinite, replicas = st.names, st.loss, st.nonfinite, st.replicas
    T = st.truth_loss.numel()
    a = against_sums(st.g, loss, st.truth_loss)
    b = None
    if st.b is not None:
        b = against_sums(st.b, st.base_loss if loss is not None else None, st.truth_loss)
        added = _relative(st.added2.sum(1), a.rr.sum(1))
        p_added = _relative(st.added2, a.rr)  # [T, P]
        err2 = st.added2
        added_loss = None if loss is None else ((loss - st.base_loss) / st.truth_loss.abs()).abs()
    else:
        added = a.rel
        p_added = a.p_rel
        err2 = st.g[3]
        added_loss = None if loss is None else a.loss_rel.abs()

    # each trial's added error over the parameter's typical gradient (its RMS over trials): a
    # small parameter all wrong on a few trials (a bug of uneven batches) stands out, and a
    # trial whose own fp64 gradient nearly cancels does not (why p_added is read by median)
    p_peak = _relative(err2, a.rr.mean(0, keepdim=True).expand_as(err2))  # [T, P]

    def paired(x, y):
        return x if y is None else x - y

    # the family of tests (paired: transform minus single device), Bonferroni over its size;
    # NaN marks a trial where a statistic does not exist (a zero fp64 gradient)
    shift = 1.0 if b is None else 0.0
    cols = {"scale": paired(a.scale, b and b.scale) - shift,
            "signed_relative_error": paired(a.signed, b and b.signed)}
    if a.loss_rel is not None:
        cols["loss"] = paired(a.loss_rel, b and b.loss_rel)
    if len(names) > 1:
        for i, n in enumerate(names):
            cols[n] = paired(a.p_scale[:, i], b and b.p_scale[:, i]) - shift
    mean, se, p, count = t_tests(torch.stack(list(cols.values()), 1))
    keep = [k for k, pv in zip(cols, p.tolist()) if not math.isnan(pv)]  # >= 3 trials measured
    m = max(len(keep), 1)
    level = alpha / m
    significant = [k for k, pv, mu in zip(cols, p.tolist(), mean.tolist())
                   if k in keep and pv < level and abs(mu) >= min_effect]
    tests = {k: {"mean": mu, "se": s_, "p": pv, "trials": int(c), "significant": k in significant}
             for k, mu, s_, pv, c in zip(cols, mean.tolist(), se.tolist(), p.tolist(), count.tolist())}

    s_scale, s_signed = mean_ci(a.scale - 1, alpha), mean_ci(a.signed, alpha)
    mde_scale = min_detectable_effect(tests["scale"]["se"], tests["scale"]["trials"] - 1, level)
    mde_signed = min_detectable_effect(tests["signed_relative_error"]["se"],
                                       tests["signed_relative_error"]["trials"] - 1, level)
    # the whole gradient's resolution says nothing of a small parameter's (8 LayerNorm
    # elements among 100k weights): each parameter's own, and the least resolved one
    mde_param = {n: min_detectable_effect(tests[n]["se"], tests[n]["trials"] - 1, level)
                 for n in names if n in tests}
    resolved = {n: v for n, v in mde_param.items() if not math.isnan(v)}
    weakest = max(resolved, key=resolved.get) if resolved else None
    metrics = {
        "trials": T, "alpha": alpha, "alpha_per_test": level, "tests": m, "paired": b is not None,
        "min_effect": min_effect, "noise_tol": noise_tol, "replica_tol": replica_tol, "power": POWER,
        "scale": 1 + s_scale["bias"], "scale_ci_low": 1 + s_scale["ci_low"],
        "scale_ci_high": 1 + s_scale["ci_high"], "scale_error": s_scale["bias"],
        "scale_error_se": s_scale["std"] / math.sqrt(s_scale["n"]),
        "added_scale_error": tests["scale"]["mean"], "added_scale_error_p": tests["scale"]["p"],
        "signed_relative_error": s_signed["bias"], "signed_relative_error_ci_low": s_signed["ci_low"],
        "signed_relative_error_ci_high": s_signed["ci_high"],
        "signed_relative_error_se": s_signed["std"] / math.sqrt(s_signed["n"]),
        "added_signed_relative_error": tests["signed_relative_error"]["mean"],
        "added_signed_relative_error_p": tests["signed_relative_error"]["p"],
        "max_relative_error": float(a.rel.max()), "mean_relative_error": float(a.rel.mean()),
        "max_added_error": float(added.max()), "mean_residual": float(a.residual.mean()),
        "min_detectable_scale_error": mde_scale, "min_detectable_relative_bias": mde_signed,
        "min_detectable_parameter_scale_error": resolved[weakest] if weakest else mde_scale,
        "n_parameters": len(names), "n_biased_parameters": sum(1 for k in significant if k in names),
        "n_inconsistent": len(replicas), "loss_reported": loss is not None,
    }
    if b is not None:
        metrics["single_device_max_relative_error"] = float(b.rel.max())
    if a.loss_rel is not None:
        s_loss = mean_ci(a.loss_rel, alpha)
        metrics.update({"loss_relative_error": s_loss["bias"],
                        "loss_relative_error_se": s_loss["std"] / math.sqrt(s_loss["n"]),
                        "loss_scale": 1 + s_loss["bias"], "loss_scale_ci_low": 1 + s_loss["ci_low"],
                        "loss_scale_ci_high": 1 + s_loss["ci_high"],
                        "max_loss_relative_error": float(a.loss_rel.abs().nan_to_num(0.0).max()),
                        "max_added_loss_error": float(added_loss.max())})
        if "loss" in tests:
            metrics["added_loss_error"] = tests["loss"]["mean"]
            metrics["added_loss_error_p"] = tests["loss"]["p"]
            metrics["min_detectable_loss_error"] = min_detectable_effect(
                tests["loss"]["se"], tests["loss"]["trials"] - 1, level)

    table = []
    for i, n in enumerate(names):
        col = tests.get(n)
        ps = a.p_scale[:, i]
        table.append({"parameter": n, "numel": st.numel[i], "ranks": st.ranks[n],
                      "scale": float(ps.mean()),
                      "scale_se": float(ps.std() / math.sqrt(T)) if T > 1 else math.nan,
                      "p": None if col is None else col["p"], "biased": n in significant,
                      "min_detectable_scale_error": mde_param.get(n, math.nan),
                      "max_relative_error": float(a.p_rel[:, i].max()),
                      "mean_relative_error": float(a.p_rel[:, i].mean()),
                      # the median over trials: one trial whose fp64 gradient nearly cancels
                      # must not turn rounding into "wrong"; a wrong shard is wrong on most
                      "median_added_error": float(p_added[:, i].nan_to_num(0.0).median()),
                      "max_added_error": float(p_added[:, i].nan_to_num(0.0).max()),
                      "peak_added_error": float(p_peak[:, i].nan_to_num(0.0).max())})
    evidence = {"parameters": table, "tests": tests, "replica_disagreements": replicas[:20],
                "per_trial": {"scale": a.scale.tolist(), "signed_relative_error": a.signed.tolist(),
                              "relative_error": a.rel.tolist(), "added_error": added.tolist(),
                              "loss_relative_error": None if a.loss_rel is None else a.loss_rel.tolist()}}
    kind, where, msg = _verdict(names, metrics, tests, table, significant, replicas, nonfinite,
                                st.exact, noise_tol, alpha, level, weakest)
    metrics["transform_verdict"] = kind
    metrics["equivalent"] = kind in EQUIVALENT
    metrics["worst_parameter"] = where
    return Judgement(kind, metrics, evidence, msg, where, tests)


def _scale(x: float) -> str:
    """A scale factor as text: 4 digits, or 1 plus its error where 4 digits read 1 (a
    significant 1 + 5e-8 must not print as "x1")."""
    return f"{x:.4g}" if not math.isfinite(x) or abs(x - 1) >= 5e-4 else f"1{x - 1:+.3g}"


def _verdict(names, metrics, tests, table, significant, replicas, nonfinite, exact, noise_tol,
             alpha, level, weakest=None) -> tuple:
    """(kind, worst parameter, message) in the order of the module docstring."""
    T, m = metrics["trials"], metrics["tests"]

    def worst(key):
        rows = [x for x in table if not math.isnan(x[key])]
        return max(rows, key=lambda x: x[key])["parameter"] if rows else names[0]

    loss = metrics["loss_reported"]
    if nonfinite:
        return "wrong", nonfinite[0], (
            f"wrong: non-finite values (inf/NaN) in {nonfinite[:4]}: an overflow in a narrow "
            f"format (fp16 loss scaling, a compression hook) or NaN in the data")
    if replicas:
        bad = sorted({x["parameter"] for x in replicas})
        top = replicas[0]
        why = (f"rounding-sized (<= noise_tol {noise_tol:g}): the replicas reduce in different orders "
               f"or formats, so they drift apart step by step (pass replica_tol= to accept it)"
               if top["relative"] <= noise_tol else
               "the ranks report different losses: return the loss the trainer logs, the whole "
               "batch's (each rank's own piece reduced over the ranks), or None on a rank that logs "
               "none" if bad == [LOSS] else
               "a reduction missing over the group that replicates it (sequence-parallel "
               "LayerNorm weights, a bias of a row-parallel layer) or rank-dependent computation "
               "(an unsynchronised dropout seed)")
        return "inconsistent", top["parameter"], (
            f"inconsistent: ranks {top['ranks']} hold different values for replicated "
            f"{bad[:4]} (max difference {top['max_difference']:.3g}, {top['relative']:.2g} of the "
            f"largest value): {why}")
    if exact:
        return "exact", worst("max_relative_error"), (
            f"exact: every gradient{' and the loss' if loss else ''} equal the fp64 single-device "
            f"step rounded to the transform's dtype, bit for bit, on all {T} trials")
    if significant:
        params = [k for k in significant if k in {x["parameter"] for x in table}]
        where = max(params, key=lambda k: abs(tests[k]["mean"])) if params else (
            LOSS if significant == ["loss"] else worst("mean_relative_error"))
        parts = []
        if "scale" in significant or "signed_relative_error" in significant:
            parts.append(f"gradients scaled by {_scale(metrics['scale'])} ({1 - alpha:.0%} CI "
                         f"[{_scale(metrics['scale_ci_low'])}, {_scale(metrics['scale_ci_high'])}]), signed "
                         f"relative error {metrics['signed_relative_error']:+.3g}")
        if params:
            scale_of = {x["parameter"]: x["scale"] for x in table}
            shown = ", ".join(f"{k} x{_scale(scale_of[k])}" for k in
                              sorted(params, key=lambda k: -abs(tests[k]["mean"]))[:4])
            parts.append(f"in {len(params)} of {len(names)} parameters ({shown})")
        if "loss" in significant:
            parts.append(f"loss x{_scale(metrics['loss_scale'])} (CI [{_scale(metrics['loss_scale_ci_low'])}, "
                         f"{_scale(metrics['loss_scale_ci_high'])}])")
        rest = (f"; beyond the scale a residual of {metrics['mean_residual']:.2g} remains"
                if metrics["mean_residual"] > noise_tol else "")
        return "biased", where, (
            "biased: " + "; ".join(parts) + rest + f" (p < {level:.2g} per test against the single "
            f"device: a normalisation, a missing or repeated scaling, or a reduction in a narrow "
            f"format)")
    added_loss = metrics.get("max_added_loss_error", 0.0)
    if metrics["max_added_error"] > noise_tol or added_loss > noise_tol:
        where = worst("max_relative_error")
        return "wrong", where, (
            f"wrong: the transform moves the gradients by up to {metrics['max_added_error']:.3g} "
            f"(relative; the loss by {added_loss:.3g}) from the single-device step, more than "
            f"rounding explains (noise_tol {noise_tol:g}), with no consistent sign or scale "
            f"(worst: {where}): look for the wrong data shard, an unsynchronised random seed "
            f"(dropout) or a stale or missing reduction")
    # the whole gradient's error is dominated by its largest parameters: a small one (a
    # LayerNorm weight) can be 100% wrong inside the whole's noise_tol, so each is judged too
    # ... and on any one trial against its typical size (a bug of a few trials, in one parameter)
    off = sorted((x for x in table if max(x["median_added_error"], x["peak_added_error"]) > noise_tol),
                 key=lambda x: -max(x["median_added_error"], x["peak_added_error"]))
    if off:
        shown = ", ".join(f"{x['parameter']} {x['median_added_error']:.3g} / {x['peak_added_error']:.3g}"
                          for x in off[:4])
        return "wrong", off[0]["parameter"], (
            f"wrong: in {len(off)} of {len(names)} parameters the transform moves the gradient by "
            f"more than rounding explains (relative error added per trial, the median / the largest "
            f"against the parameter's typical gradient: {shown}; noise_tol {noise_tol:g}), though "
            f"the whole gradient's ({metrics['max_added_error']:.3g}) "
            f"is within it: look for the wrong data shard or a missing reduction of "
            f"{off[0]['parameter']}")
    unseen = "" if loss else "; the step reports no loss, so loss-level bugs are not checked"
    low = max(metrics["min_detectable_scale_error"], metrics["min_effect"])
    low_signed = max(metrics["min_detectable_relative_bias"], metrics["min_effect"])
    low_param = max(metrics["min_detectable_parameter_scale_error"], metrics["min_effect"])
    one = (f", and in any one parameter > {low_param:.2g} (least resolved: {weakest})"
           if weakest is not None and low_param > low else "")
    return "noise", worst("max_relative_error"), (
        f"noise: zero-mean differences (max relative error {metrics['max_relative_error']:.2g} "
        f"against fp64, {metrics['max_added_error']:.2g} added by the transform <= noise_tol "
        f"{noise_tol:g}); rules out a scale error of the whole gradient > {low:.2g}{one}, and a "
        f"signed relative bias > {low_signed:.2g} ({POWER:.0%} power at alpha {alpha:g}/{m} per "
        f"test, {T} trials){unseen}")


# formats a step can leave undeclared, finest first (fp8 cannot be on gloo's wire)
UNDECLARED = ("fp16", "bf16")


def undeclared_format(per_trial_added, dtype: str, declared) -> dict | None:
    """The narrower format whose rounding explains an error the step's declared precision
    does not: the per-trial added error's median lies between 1/20 and 4 unit roundoffs of
    it (one rounding of a sum is about u/2 relative; a normalisation bug is x0.25-x4,
    hundreds of bf16 roundoffs). Of the formats that fit, the one nearest u/2 (log scale).
    None when nothing fits or the format is already declared or in play."""
    x = torch.as_tensor([v for v in per_trial_added if math.isfinite(v)], dtype=torch.float64)
    if x.numel() == 0:
        return None
    err = float(x.median())
    order = {n: i for i, n in enumerate(PRECISION_ORDER)}
    from trainprobes.reference.formats import get_format
    fits = []
    for name in UNDECLARED:
        if name in declared or order.get(name, 99) <= order.get(dtype, 99):
            continue
        u = 2.0 ** -(get_format(name).mantissa_bits + 1)
        if u / 20 <= err <= 4 * u:
            fits.append((abs(math.log(err / (u / 2))), name, u))
    if not fits:
        return None
    _, name, u = min(fits)
    return {"format": name, "unit_roundoff": u, "median_added_error": err}


def declaration_hint(found: dict) -> str:
    f = found["format"]
    return (f" The error (median {found['median_added_error']:.2g} relative per trial) is the size "
            f"of rounding in {f} (unit roundoff {found['unit_roundoff']:.2g}), a format the step "
            f"did not declare: if it reduces or computes in {f} (a compression hook, a "
            f"reduce_dtype), declare it, precisions=(\"{f}\",) (command line: --precisions {f}), "
            f"and it is judged at {f}'s noise_tol {default_noise_tol(f):g}; until then the verdict "
            f"stands.")
