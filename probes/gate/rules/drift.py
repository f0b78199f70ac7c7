"""The rules of trainprobes.drift: compare and localize Results read against themselves."""
from __future__ import annotations

import math

from trainprobes.gate.rules.base import REL, Reader, Significance, close, fmt, p_agree


def _student(m: float, se: float, units: int, alpha: float) -> tuple:
    """(t, p, half) as trainprobes.drift.stats._student writes them for one estimate."""
    from scipy import stats
    df = max(units - 1, 1)
    t = m / se if se > 0 else (0.0 if m == 0 else math.copysign(math.inf, m))
    p = float(2 * stats.t.sf(abs(t), df)) if units >= 2 else math.nan
    return t, p, float(stats.t.ppf(1 - alpha / 2, df)) * se


def _drift(rd: Reader) -> None:
    """trainprobes.drift.compare: the cluster-robust t-test over units of mean_log_ratio."""
    from trainprobes.power import min_detectable_effect

    mean, se, alpha = rd.num("mean_log_ratio"), rd.num("se_mean"), rd.num("alpha")
    units = rd.count("n_units")
    if not 0 < alpha < 1:
        rd.fail(f"metric alpha={fmt(alpha)} is not a significance level in (0, 1)")
    if not (se >= 0 or math.isnan(se)):
        rd.fail(f"metric se_mean={fmt(se)} is negative")
    t, p_mean, half = _student(mean, se, units, alpha)
    rd.agree("t_stat", rd.num("t_stat"), t, "mean_log_ratio / se_mean")
    p_agree(rd, "p_mean", rd.num("p_mean"), p_mean, "the t-test over n_units of t_stat")
    tiny = REL * (abs(mean) + abs(half))
    rd.agree("ci_low", rd.num("ci_low"), mean - half, "mean_log_ratio - t se_mean", tiny=tiny)
    rd.agree("ci_high", rd.num("ci_high"), mean + half, "mean_log_ratio + t se_mean", tiny=tiny)
    p_excess = rd.num("p_excess")
    small_noise = rd.num("k2_kl") <= rd.num("noise_kl_max")
    want = max(p_mean, p_excess) if small_noise else p_mean
    p_agree(rd, "p_value", rd.num("p_value"), want,
             "max(p_mean, p_excess)" if small_noise else "p_mean (k2_kl > noise_kl_max)")
    mdb = rd.opt("min_detectable_bias")
    if mdb is not None:
        rd.agree("min_detectable_bias", mdb, min_detectable_effect(se, units - 1, alpha),
                 "the 80%-power effect of se_mean")
    n_tok, n_out, frac = rd.opt("n_tokens"), rd.opt("n_ratio_outside"), rd.opt("frac_ratio_outside")
    if None not in (n_tok, n_out, frac) and n_tok > 0:
        rd.agree("frac_ratio_outside", frac, n_out / n_tok, "n_ratio_outside / n_tokens")
    mabs, mx = rd.opt("mean_abs_log_ratio"), rd.opt("max_abs_log_ratio")
    # the token figures are accumulated in float32 blocks (trainprobes.drift.tokens)
    if None not in (mabs, mx) and not (abs(mean) <= mabs * (1 + 1e-5) and mabs <= mx * (1 + 1e-5)):
        rd.fail(f"|mean_log_ratio|={fmt(abs(mean))}, mean_abs_log_ratio={fmt(mabs)}, "
                f"max_abs_log_ratio={fmt(mx)}: a mean is at most its mean magnitude, at most "
                "the largest")
    # the ratio rho = exp(-x): its quantiles are ordered and lie in [min_ratio, max_ratio]
    qs = [rd.opt(f"ratio_p{q}") for q in ("0.1", "1", "5", "50", "95", "99", "99.9")]
    lo_r, hi_r = rd.opt("min_ratio"), rd.opt("max_ratio")
    chain = [v for v in [lo_r, *qs, hi_r] if v is not None]
    if any(b < a * (1 - 1e-6) for a, b in zip(chain, chain[1:])):
        rd.fail(f"min_ratio, ratio_p0.1 ... ratio_p99.9, max_ratio = {[fmt(v) for v in chain]} "
                "are not in order, as quantiles of one distribution are")
    if None not in (lo_r, hi_r, mx) and lo_r > 0 and math.isfinite(hi_r):
        rd.agree("max_abs_log_ratio", mx, max(-math.log(lo_r), math.log(hi_r)),
                 "the larger of |log min_ratio| and |log max_ratio|", rel=1e-5)
    for name in ("tail_share", "ess_token", "ess_seq", "frac_seq_ratio_outside",
                 "frac_seq_geo_ratio_outside", "frac_ratio_outside"):
        v = rd.opt(name)
        if v is not None and not 0 <= v <= 1 * (1 + 1e-9):
            rd.fail(f"metric {name}={fmt(v)} is not a fraction")
    pm, px = rd.opt("mean_abs_prob_diff"), rd.opt("max_abs_prob_diff")
    if None not in (pm, px) and not 0 <= pm <= px * (1 + 1e-5):
        rd.fail(f"mean_abs_prob_diff={fmt(pm)} beside max_abs_prob_diff={fmt(px)}")
    seqs = rd.count("n_sequences", optional=True)
    if n_tok is not None and units > n_tok:
        rd.fail(f"n_units={units} exceeds n_tokens={fmt(n_tok)}: a unit holds tokens")
    if None not in (seqs, n_tok) and seqs > n_tok:
        rd.fail(f"n_sequences={seqs} exceeds n_tokens={fmt(n_tok)}")
    if rd.opt("n_units") is not None and units < 1:
        rd.fail("n_units=0: the probe tests over at least one unit")

_LOCALIZE_KINDS = ("exact", "noise", "numeric", "routing", "weights", "temperature", "renormalisation")
_LOCALIZE_PARTS = ("weights", "routing", "temperature", "renormalisation", "numerics", "unexplained")


def _localize(rd: Reader) -> None:
    """trainprobes.drift.decompose.localize: the per-stage metrics are the stage table's, the
    first stage beyond noise is first_layer, a verdict per stage follows from its ratio, the
    shares are the evidence's, lie in their intervals and sum to 1, and the kind is the found
    part with the largest share (or exact / noise, which agree and pass)."""
    agree = rd.flag("engines_agree")
    kind = rd.label("kind")
    if kind not in _LOCALIZE_KINDS:
        rd.fail(f"metric kind={kind!r} is not one of {_LOCALIZE_KINDS}")
    if agree != (kind in ("exact", "noise")):
        rd.fail(f"engines_agree={agree} beside kind={kind!r}: the probe agrees exactly on exact and noise")
    rd.codes_agree("TP-D4", not agree, f"engines_agree={agree}")
    first = rd.label("first_layer")
    stages = rd.evidence("stages", list)
    from_dumps = rd.ev.get("from") == "dumps"
    margin = rd.num("margin")
    alpha = None if from_dumps else rd.num("alpha")
    beyond = []
    for i, st in enumerate(stages):
        if not isinstance(st, dict) or not isinstance(st.get("name"), str):
            rd.fail(f"evidence['stages'][{i}] is not a stage row")
        name = st["name"]
        for key in ("free_error", "noise_floor") + (() if from_dumps else ("own_error",)):
            rd.agree(f"{key}[{name}]", rd.num(f"{key}[{name}]"), rd.field(st, key, f"stages[{i}]"),
                     f"evidence['stages'][{i}][{key!r}]")
        if from_dumps:
            div = st.get("divergent")
            if div != (st["free_error"] > margin * st["noise_floor"]):
                rd.fail(f"stage {name!r}: divergent={div!r} is not free_error > margin x noise_floor")
            if div:
                beyond.append(name)
            continue
        own, ratio, p = st["own_error"], rd.field(st, "ratio", f"stages[{i}]"), rd.field(st, "p_value", f"stages[{i}]")
        v = st.get("verdict")
        if v == "exact" and own != 0 or v == "noise" and own == 0:
            rd.fail(f"stage {name!r}: verdict {v!r} beside own_error {fmt(own)}")
        low = rd.field(st, "min_ratio", f"stages[{i}]")
        high = rd.field(st, "max_ratio", f"stages[{i}]")
        past = ratio > margin and (p < alpha / len(stages) or low > margin / 4) or high > margin ** 2
        if v == "beyond" and not st.get("nonfinite") and not past:
            rd.fail(f"stage {name!r} is beyond noise, but its ratio {fmt(ratio)} <= margin {fmt(margin)}, "
                    f"or its p {fmt(p)} >= alpha / stages and a sequence's ratio {fmt(low)} <= margin / 4; "
                    f"and its largest sequence ratio {fmt(high)} <= margin^2")
        if v == "noise" and past:
            rd.fail(f"stage {name!r} is called noise, but its ratio {fmt(ratio)} > margin and p "
                    f"{fmt(p)} < alpha / stages or every sequence's ratio > margin / 4, or a sequence's "
                    f"ratio {fmt(high)} > margin^2")
        if v != "exact" and high < ratio * (1 - 1e-9):
            rd.fail(f"stage {name!r}: max_ratio {fmt(high)} is below the geometric mean ratio {fmt(ratio)}")
        if v != "exact" and low > ratio * (1 + 1e-9):
            rd.fail(f"stage {name!r}: min_ratio {fmt(low)} exceeds the geometric mean ratio {fmt(ratio)}")
        if v == "beyond":
            beyond.append(name)
    flipped = [k[len("routing_mismatch["):-1] for k, v in rd.m.items()
               if k.startswith("routing_mismatch[") and isinstance(v, (int, float)) and v > 0]
    routed = not beyond and kind == "routing" and flipped and flipped[0].startswith(first + ".")
    if first != (beyond[0] if beyond else "") and not routed:
        rd.fail(f"metric first_layer={first!r}, but the first stage beyond noise in the table is "
                f"{(beyond[0] if beyond else '')!r}")
    _units(rd)
    explained = rd.m.get("explained_by")  # absent from reports written before it existed
    names = {st["name"] for st in stages}
    if explained and explained not in names:
        rd.fail(f"metric explained_by={explained!r} is not a stage of the table")
    if explained and rd.m.get("explained_by_op") == "router" and rd.m.get("explained_by_module") not in flipped:
        rd.fail(f"explained_by_module={rd.m.get('explained_by_module')!r} is a router whose decisions do not flip")
    if from_dumps:
        if kind != ("noise" if not beyond else "numeric"):
            rd.fail(f"kind={kind!r} from dumps: 'numeric' when a stage diverges, else 'noise'")
        return
    mean, mean_abs, mx = rd.num("mean_log_ratio"), rd.num("mean_abs_log_ratio"), rd.num("max_abs_log_ratio")
    if not (abs(mean) <= mean_abs * (1 + REL) and mean_abs <= mx * (1 + REL)):
        rd.fail(f"|mean_log_ratio| {fmt(abs(mean))} <= mean_abs_log_ratio {fmt(mean_abs)} <= "
                f"max_abs_log_ratio {fmt(mx)} does not hold")
    shares = rd.evidence("shares", dict)
    total = 0.0
    for part in _LOCALIZE_PARTS + tuple(k for k in shares if k.startswith("numerics[")):
        row = shares.get(part)
        if row is None:
            rd.fail(f"evidence['shares'] has no {part!r}")
        keys = (("", "share"),) if "[" in part else (("", "share"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high"))
        vals = []
        for s, k in keys:
            v = rd.num(f"share_{part}{s}")
            rd.agree(f"share_{part}{s}", v, rd.field(row, k, f"shares[{part!r}]"),
                     f"evidence['shares'][{part!r}][{k!r}]")
            vals.append(v)
        if len(vals) == 1:
            continue
        if not vals[1] - 1e-12 <= vals[0] <= vals[2] + 1e-12:
            rd.fail(f"share_{part}={fmt(vals[0])} lies outside its interval [{fmt(vals[1])}, {fmt(vals[2])}]")
        total += vals[0]
    if not close(total, 1.0 if mean_abs else 0.0, 0, 1e-9):
        rd.fail(f"the shares sum to {fmt(total)}: the parts add up to the drift, so they sum to 1 (0 without drift)")
    by_stage = [k for k in shares if k.startswith("numerics[")]
    rd.agree("share_numerics", rd.num("share_numerics"), sum(rd.num(f"share_{k}") for k in by_stage),
             "the sum of share_numerics[stage]", 0, 1e-9)
    stale = rd.count("n_stale_tensors")
    rows = rd.evidence("weights", list)
    if stale != sum(isinstance(w, dict) and w.get("status") == "mismatch" for w in rows):
        rd.fail(f"n_stale_tensors={stale} is not the tensors evidence['weights'] calls mismatch")
    unmatched = rd.count("n_unmatched_tensors")
    if unmatched != sum(isinstance(w, dict) and w.get("status") == "missing" for w in rows):
        rd.fail(f"n_unmatched_tensors={unmatched} is not the tensors evidence['weights'] calls missing")
    held = rd.count("n_trainer_rounded_tensors")
    if held != sum(isinstance(w, dict) and w.get("status") == "trainer_rounded" for w in rows):
        rd.fail(f"n_trainer_rounded_tensors={held} is not the tensors evidence['weights'] calls trainer_rounded")
    temperature, renorm = rd.flag("temperature"), rd.flag("renormalised")
    slope, lo, hi = rd.num("temperature_slope"), rd.num("temperature_slope_ci_low"), rd.num("temperature_slope_ci_high")
    if not lo - 1e-12 <= slope <= hi + 1e-12:
        rd.fail(f"temperature_slope {fmt(slope)} lies outside its interval [{fmt(lo)}, {fmt(hi)}]")
    if not close(slope - lo, hi - slope, 1e-6, 1e-12):
        rd.fail(f"temperature_slope_ci_low {fmt(lo)} and _ci_high {fmt(hi)} are not the slope "
                f"{fmt(slope)} -/+ one half-width, as the probe writes them")
    if temperature and lo <= 1 <= hi:
        rd.fail("temperature is true, but the slope's interval holds 1")
    mass, frac = rd.num("mean_log_mass_kept"), rd.num("frac_positions_renormalised")
    if renorm and not (mass < 0 and 0 < frac <= 1) or not renorm and mass != 0:
        rd.fail(f"renormalised={renorm} beside mean_log_mass_kept {fmt(mass)}, frac_positions_renormalised "
                f"{fmt(frac)}")
    flips = {r.get("name"): r for r in rd.evidence("routing", list) if isinstance(r, dict)}
    dec = rd.opt("routing_frac_decisions")
    if flips:
        fr = [rd.num(f"routing_mismatch[{n}]") for n in flips]
        for n, f in zip(flips, fr):
            rd.agree(f"routing_mismatch[{n}]", f, rd.field(flips[n], "frac_flipped", "routing"),
                     f"evidence['routing'][{n!r}]['frac_flipped']")
        rd.agree("routing_frac_decisions", rd.num("routing_frac_decisions"), sum(fr) / len(fr),
                 "the mean of routing_mismatch over routers (each sees every token)")
        anyl = rd.num("routing_frac_tokens_any_layer")
        if not max(fr) - 1e-12 <= anyl <= min(1.0, sum(fr)) + 1e-12:
            rd.fail(f"routing_frac_tokens_any_layer {fmt(anyl)} is not between the largest and the sum "
                    "of the per-router fractions")
    found = {"weights": stale > 0, "temperature": temperature, "renormalisation": renorm,
             "routing": bool(dec) and rd.num("share_routing_ci_low") > 0, "numeric": bool(by_stage)}
    named = {"numeric": "numerics"}
    if kind == "exact" and (mean_abs != 0 or any(s.get("verdict") != "exact" for s in stages) or stale):
        rd.fail("kind 'exact' beside a drift, a stage that is not exact or a stale tensor")
    cands = [k for k, v in found.items() if v]
    if kind == "noise" and cands:
        rd.fail(f"kind 'noise' beside parts found: {cands}")
    if kind not in ("exact", "noise"):
        best = max(cands, key=lambda k: rd.num(f"share_{named.get(k, k)}")) if cands else None
        if kind != best:
            rd.fail(f"kind={kind!r}, but the found part with the largest share is {best!r}")


# drift.verdict.classify: biased <=> drift_verdict "biased", and biased = p_value < alpha and
# not |mean_log_ratio| < min_bias; drift.verdict.judge: heavy_tailed -> TP-D2 (warn)
FLAG_LABELS = {"drift.compare": ("drift_verdict", ("clean", "noisy", "heavy-tailed"), ("biased",))}
TESTS = {"drift.compare": Significance("p_value", "alpha", "mean_log_ratio", "min_bias")}
SIDE_FLAGS = {"drift.compare": (("heavy_tailed", True, "TP-D2"),)}
RULES = {"drift.compare": _drift, "drift.localize": _localize}


def _units(rd: Reader) -> None:
    """n_units beside n_sequences (trainprobes.drift.units): the sequences themselves from
    MIN_SEQUENCES on; below, spans of them, at least MIN_UNITS, at most about SPAN_UNITS."""
    from trainprobes.drift.units import MIN_SEQUENCES, MIN_UNITS, SPAN_UNITS
    units, seqs = rd.count("n_units", optional=True), rd.count("n_sequences", optional=True)
    if units is None or seqs is None:  # reports written before units existed
        return
    most = seqs if seqs >= MIN_SEQUENCES else seqs * math.ceil(SPAN_UNITS / max(seqs, 1))
    least = seqs if seqs >= MIN_SEQUENCES else MIN_UNITS
    n_tok = rd.count("n_tokens", optional=True)
    if not least <= units <= most or n_tok is not None and units > max(n_tok, seqs):
        rd.fail(f"n_units={units} beside n_sequences={seqs}: the units are the sequences from {MIN_SEQUENCES} on, "
                f"else {MIN_UNITS} to {most} spans of them (and never more than the tokens)")
