"""The rules of trainprobes.numerics: bias, reveal, stall and GEMM Results read against themselves."""
from __future__ import annotations

import math

from trainprobes.gate.rules.base import P_REL, P_TINY, REL, Reader, Significance, close, fmt, p_agree, t_p


def _bias(rd: Reader) -> None:
    """trainprobes.numerics.bias: error_stats over per-trial signed errors, the two-stage
    design (and Holm) on its p-value."""
    from scipy import stats
    from trainprobes.power import min_detectable_effect

    if rd.m.get("biased") is None:  # nothing measured: too few finite trials (verdict fail)
        trials, nonfinite = rd.count("trials"), rd.count("nonfinite_trials")
        if not (nonfinite <= trials and trials - nonfinite < 3):
            rd.fail(f"biased=None (nothing measured) but only {nonfinite} of {trials} trials are "
                    "non-finite: the probe measures whenever 3 are finite")
        return
    n, bias, std = rd.count("trials"), rd.num("bias"), rd.num("std")
    alpha, conf = rd.num("alpha"), rd.num("confidence")
    lo, hi, p = rd.num("ci_low"), rd.num("ci_high"), rd.num("p_value")
    if n < 3 or not math.isfinite(bias) or not (math.isfinite(std) and std >= 0):
        rd.fail(f"trials={n}, bias={fmt(bias)}, std={fmt(std)}: the probe measures at least 3 "
                "finite trials, whose mean and spread are finite")
    if not 0 < alpha < 1:
        rd.fail(f"metric alpha={fmt(alpha)} is not a significance level in (0, 1)")
    rd.agree("confidence", conf, 1 - alpha, "1 - alpha")
    # 1. the standard error, from std and trials alone; the CI is bias -/+ t * se
    se = std / math.sqrt(n)
    half = 0.0 if std == 0 else float(stats.t.ppf(1 - alpha / 2, n - 1)) * se
    tiny = REL * (abs(bias) + half)
    rd.agree("ci_low", lo, bias - half, "bias - t(1 - alpha/2, trials - 1) std / sqrt(trials)",
             tiny=tiny)
    rd.agree("ci_high", hi, bias + half, "bias + t(1 - alpha/2, trials - 1) std / sqrt(trials)",
             tiny=tiny)
    rd.agree("rms", rd.num("rms"), math.sqrt(bias * bias + std * std * (n - 1) / n),
             "sqrt(bias^2 + std^2 (trials - 1) / trials)")
    rd.agree("min_detectable_bias", rd.num("min_detectable_bias"),
             min_detectable_effect(se, n - 1, alpha), "the 80%-power effect of std / sqrt(trials)")
    # 2. the signs of the trials
    pos, neg, zero = (rd.count(k) for k in ("positive_trials", "negative_trials", "zero_trials"))
    if pos + neg + zero != n:
        rd.fail(f"positive_trials + negative_trials + zero_trials = {pos} + {neg} + {zero} is "
                f"not trials={n}")
    if (bias > 0 and not pos) or (bias < 0 and not neg) or (bias == 0 and std == 0 and zero != n) \
            or (std == 0 and bias != 0 and max(pos, neg) != n) or (not pos + neg and bias != 0):
        rd.fail(f"bias={fmt(bias)} (std={fmt(std)}) cannot be the mean of {pos} positive, "
                f"{neg} negative and {zero} zero trials")
    want = float(stats.binomtest(pos, pos + neg, 0.5).pvalue) if pos + neg else 1.0
    p_agree(rd, "p_sign", rd.num("p_sign"), want, "the sign test of positive_trials")
    # 3. the stages and the design's p-value
    stages = rd.evidence("stages", list)
    if len(stages) not in (1, 2):
        rd.fail(f"evidence['stages'] holds {len(stages)} stages; the design runs 1 or 2")
    ps = []
    for i, s in enumerate(stages):
        where = f"evidence['stages'][{i}]"
        sn = rd.as_count(rd.field(s, "finite_trials", where), f"{where}['finite_trials']")
        sb, ss, sp = (rd.field(s, k, where) for k in ("bias", "std", "p_value"))
        if sn >= 2 and not close(sp, t_p(sb, ss / math.sqrt(sn), sn - 1), P_REL, 1e-300) \
                and not (sp < P_TINY and t_p(sb, ss / math.sqrt(sn), sn - 1) < P_TINY):
            rd.fail(f"{where}['p_value']={fmt(sp)} is not the t-test of its bias and std")
        ps.append(sp)
    last = stages[-1]
    total = rd.as_count(rd.field(last, "trials", "evidence['stages'][-1]"), "stages[-1].trials")
    for k, v in (("finite_trials", n), ("bias", bias), ("std", std)):
        if not close(rd.field(last, k, "evidence['stages'][-1]"), v):
            rd.fail(f"metric {'trials' if k == 'finite_trials' else k}={fmt(v)} is not the last "
                    f"stage's {k}={fmt(last[k])}")
    nonfinite, zero_ref = rd.count("nonfinite_trials"), rd.count("zero_reference_trials")
    if total - n != nonfinite + zero_ref:
        rd.fail(f"nonfinite_trials + zero_reference_trials = {nonfinite} + {zero_ref} is not the "
                f"{total - n} of {total} trials run that were left out")
    if len(stages) == 2 and rd.field(stages[1], "trials", "stages[1]") != 2 * rd.field(
            stages[0], "trials", "stages[0]"):
        rd.fail("the second stage does not run as many trials again as the first")
    design = rd.evidence("design", str)
    mt = rd.ev.get("multiple_testing")
    tests = 1
    if mt is not None:
        tests = rd.as_count(rd.field(mt, "tests", "evidence['multiple_testing']"), "tests")
        if mt.get("method") != "holm" or tests < 1:
            rd.fail(f"evidence['multiple_testing']={mt!r} is not a Holm correction over >= 1 tests")
    p1 = ps[0]
    if design.startswith("one stage"):
        if len(stages) != 1:
            rd.fail("a one-stage design with two stages")
        p_design = p1
    elif design.startswith("two stages"):
        band = alpha / (10 * tests) <= p1 < alpha
        if band != (len(stages) == 2):
            rd.fail(f"stage 1 p={fmt(p1)} {'lies' if band else 'does not lie'} in "
                    f"[alpha/{10 * tests:g}, alpha), yet {len(stages)} stage(s) ran")
        p_design = min(10 * p1, max(p1, ps[1])) if len(stages) == 2 else \
            (min(1.0, 10 * p1) if p1 < alpha else p1)
    else:
        rd.fail(f"evidence['design']={design!r} is neither design the probe runs")
    if rd.ev.get("p_design") is not None:
        p_agree(rd, "p_value (evidence p_design)", rd.as_number(rd.ev["p_design"], "p_design"),
                 p_design, "the design's p from its stages")
    if mt is None:
        p_agree(rd, "p_value", p, p_design, "the design's p-value from its stages")
    else:
        pu = rd.as_number(rd.ev.get("p_unadjusted"), "evidence['p_unadjusted']")
        p_agree(rd, "evidence p_unadjusted", pu, p_design, "the design's p from its stages")
        if not (p_design * (1 - P_REL) <= p <= min(1.0, tests * p_design) * (1 + P_REL)):
            rd.fail(f"metric p_value={fmt(p)} is not a Holm adjustment over {tests} tests of "
                    f"{fmt(p_design)} (between it and {tests} times it)")
    # 4. the per-trial errors, where the report keeps them whole (an audit's report.json
    # keeps the first 32 and says how many there were)
    errors = rd.evidence("errors", list)
    cut = (rd.ev.get("truncated") or {}).get("errors")
    if cut is not None:
        if cut != total or len(errors) > total:
            rd.fail(f"evidence['errors'] was cut from {cut!r} trials; the probe ran {total}")
    else:
        _errors_agree(rd, errors, total, n, bias, std, (pos, neg, zero), nonfinite + zero_ref)
    # 5. the verdict: fail with TP-B1 exactly when biased (the flag rule); warn when
    # trials were left out
    if not rd.m["biased"]:
        rd.verdict_is(("warn",) if nonfinite + zero_ref else ("pass",),
                      f"biased=False with {nonfinite + zero_ref} trials left out")


def _errors_agree(rd, errors, total, n, bias, std, signs, left_out):
    from scipy import stats
    vals = [rd.as_number(e, "evidence['errors'][...]") for e in errors]
    finite = [e for e in vals if math.isfinite(e)]
    if len(vals) != total or len(finite) != n or len(vals) - n != left_out:
        rd.fail(f"evidence['errors'] holds {len(vals)} trials, {len(finite)} finite; the metrics "
                f"say {total} run, {n} finite")
    mean = math.fsum(finite) / n
    sd = math.sqrt(math.fsum((e - mean) ** 2 for e in finite) / (n - 1))
    scale = max(abs(e) for e in finite)
    rd.agree("bias", bias, mean, "the mean of the per-trial errors", tiny=REL * scale)
    rd.agree("std", std, sd, "the spread of the per-trial errors", tiny=REL * scale)
    got = (sum(e > 0 for e in finite), sum(e < 0 for e in finite), sum(e == 0 for e in finite))
    if got != signs:
        rd.fail(f"positive/negative/zero trials {signs} are not the per-trial errors' {got}")
    nz = [e for e in finite if e != 0]
    want = float(stats.wilcoxon(nz).pvalue) if nz else 1.0
    p_agree(rd, "p_wilcoxon", rd.num("p_wilcoxon"), want, "the signed-rank test of the errors")

def _reveal(rd: Reader) -> None:
    """trainprobes.numerics.reveal: the mantissa bits are where the precision trace first
    leaves 1 (step 2 of its docstring), rounds_per_add follows from them."""
    from trainprobes.reference.formats import get_format

    bits = rd.count("accumulator_mantissa_bits")
    lower = rd.flag("accumulator_bits_lower_bound")
    per_add = rd.flag("rounds_per_add")
    out = rd.label("output_format")
    try:
        out_bits = get_format(out).mantissa_bits
    except Exception:
        rd.fail(f"metric output_format={out!r} is not a format")
    if per_add != ((not lower) and bits <= out_bits):
        rd.fail(f"rounds_per_add={per_add} beside {bits} mantissa bits "
                f"({'a lower bound' if lower else 'exact'}) and a {out} output ({out_bits} bits)")
    if lower and rd.m.get("rounding") != "unknown":
        rd.fail(f"rounding={rd.m.get('rounding')!r} beside a lower bound: the probe measures "
                "rounding only for a known precision")
    trace = rd.evidence("precision_trace", dict)
    try:
        steps = sorted((int(k), v) for k, v in trace.items())
    except (TypeError, ValueError):
        rd.fail("evidence['precision_trace'] is keyed by something other than step numbers")
    values = [rd.as_number(v, f"precision_trace[{s}]") for s, v in steps]
    if [s for s, _ in steps] != list(range(1, len(steps) + 1)):
        rd.fail("evidence['precision_trace'] skips a step")
    ones = next((i for i, v in enumerate(values) if v != 1.0), len(values))
    if lower:
        ok = ones >= len(values) - 1 and bits == ones and (ones == len(values) or
                                                            not math.isfinite(values[-1]))
    else:
        ok = ones == bits and ones == len(values) - 1 and math.isfinite(values[-1])
    if not ok:
        rd.fail(f"accumulator_mantissa_bits={bits} (lower bound: {lower}) is not where "
                f"evidence['precision_trace'] first leaves 1 ({len(values)} steps, "
                f"{ones} of them 1)")
    n, fan_in = rd.count("n"), rd.count("fan_in", optional=True)
    if fan_in is not None and fan_in > n:
        rd.fail(f"fan_in={fan_in} exceeds n={n}")
    tree = rd.ev.get("tree")
    if tree is not None and _leaf_count(tree) != n:
        rd.fail(f"metric n={n} is not the {_leaf_count(tree)} inputs of the order in "
                "evidence['tree']")
    if rd.r.verdict == "pass" and rd.r.codes:
        rd.fail(f"verdict 'pass' with codes {rd.r.codes}")


def _leaf_count(tree) -> int:
    """Inputs in a revealed order: a nested list whose leaves are input positions."""
    return sum(_leaf_count(t) for t in tree) if isinstance(tree, list) else 1


def _stall(rd: Reader) -> None:
    """trainprobes.numerics.stall: one row per (format, increment) in the evidence, each
    sum's relative error, and TP-B2 when any is over rel_tol."""
    rows_n, over, rel_tol = rd.count("rows"), rd.count("rows_over_tolerance"), rd.num("rel_tol")
    worst = rd.num("max_abs_relative_error")
    if over > rows_n:
        rd.fail(f"rows_over_tolerance={over} exceeds rows={rows_n}")
    rd.codes_agree("TP-B2", over > 0, f"rows_over_tolerance={over}")
    rd.verdict_is(("warn",) if over else ("pass",), f"rows_over_tolerance={over}")
    sums = [(k, rd.num(k)) for k in rd.m if k.startswith("sequential_sum[")]
    if len(sums) != rows_n:
        rd.fail(f"{len(sums)} sequential_sum[...] metrics for rows={rows_n}")
    rows = rd.evidence("rows", list)
    if (rd.ev.get("truncated") or {}).get("rows") is not None:
        return  # a long table was cut in report.json: the metrics are checked among themselves
    if len(rows) != rows_n:
        rd.fail(f"rows={rows_n} but evidence['rows'] holds {len(rows)}")
    errs = []
    for i, ((key, s), row) in enumerate(zip(sums, rows)):
        where = f"evidence['rows'][{i}]"
        seq, true = rd.field(row, "sequential_sum", where), rd.field(row, "true_sum", where)
        inc, n = rd.field(row, "increment", where), rd.field(row, "n", where)
        if not key.startswith(f"sequential_sum[{row.get('format')},") or not close(s, seq):
            rd.fail(f"metric {key}={fmt(s)} is not row {i}'s {row.get('format')} sum {fmt(seq)}")
        if not close(true, n * inc):
            rd.fail(f"{where}: true_sum={fmt(true)} is not n x increment")
        rel = rd.field(row, "relative_error", where)
        if not close(rel, (seq - true) / true if true else math.nan):
            rd.fail(f"{where}: relative_error={fmt(rel)} is not (sequential_sum - true_sum) / true_sum")
        errs.append(rel)
    finite = [abs(e) for e in errs if not math.isnan(e)]
    rd.agree("max_abs_relative_error", worst, max(finite) if finite else math.nan,
             "the largest |relative_error| of the rows")
    want = sum(not abs(e) <= rel_tol for e in errs)
    if over != want:
        rd.fail(f"rows_over_tolerance={over}, but {want} row(s) are off by more than "
                f"rel_tol={fmt(rel_tol)}")

def _gemm(rd: Reader) -> None:
    """trainprobes.numerics.gemm: error_stats (at alpha / 2: two ratios) over the groups'
    pseudo-values of the signed bias (evidence 'errors') and of the offset ('offset_errors'),
    SQNR and maximum error from the weighted sums the probe keeps, the growth fit from its
    points, stall_k and the promotion interval from their records, the verdict by judge()."""
    from scipy import stats
    from trainprobes.numerics.gemm import GEMMS, growth_exponent, is_within, judge
    from trainprobes.power import min_detectable_effect

    if rd.label("gemm") not in GEMMS:
        rd.fail(f"metric gemm={rd.m['gemm']!r} is not one of {list(GEMMS)}")
    preset, recipe = rd.label("preset"), rd.label("recipe")
    verdict = rd.label("gemm_verdict")
    # a what-if (a preset fed products it was not measured on) is named so, never silently
    said = rd.ev.get("combination")
    if not isinstance(said, str) or rd.m.get("what_if") is not (not said.endswith("was measured on these operands")):
        rd.fail(f"what_if={rd.m.get('what_if')!r} beside evidence['combination']={said!r}")
    from trainprobes.numerics.gemm import combination
    from trainprobes.reference.gemm import PRESETS
    from trainprobes.reference.recipes import RECIPES
    if preset in PRESETS and recipe in RECIPES:
        formats = rd.evidence("operand_formats", list)
        if bool(combination(PRESETS[preset], RECIPES[recipe], rd.m["gemm"], tuple(formats))) != rd.m["what_if"]:
            rd.fail(f"what_if={rd.m['what_if']!r} for preset {preset!r}, recipe {recipe!r} on "
                    f"{formats} operands: the preset's measured inputs say otherwise")
    n, S, K = rd.count("trials"), rd.count("samples"), rd.count("k")
    alpha, tol = rd.num("alpha"), rd.num("tolerance")
    if not 0 < alpha < 1:
        rd.fail(f"metric alpha={fmt(alpha)} is not a significance level in (0, 1)")
    rd.agree("confidence", rd.num("confidence"), 1 - alpha / 2, "1 - alpha/2 (two ratios judged)")
    shape = rd.evidence("shape", list)
    if len(shape) != 3 or shape[2] != K:
        rd.fail(f"metric k={K} is not the K of evidence['shape']={shape!r}")
    if not (n <= S <= shape[0] * shape[1]):
        rd.fail(f"samples={S} is not between trials={n} and the {shape[0] * shape[1]} outputs")
    design = rd.evidence("design", dict)
    for name, size in (("rows_drawn", shape[0]), ("columns_drawn", shape[1])):
        got = rd.count(name)
        if not 1 <= got <= min(size, S) or got != design.get(name):
            rd.fail(f"{name}={got} is not the design's {design.get(name)!r} (between 1 and "
                    f"min({size}, samples={S}))")
    # 1. each ratio's group pseudo-values: mean, spread, t-test, CI (at alpha / 2)
    cis = []
    for prefix, key in (("", "errors"), ("offset_", "offset_errors")):
        bias_name = "relative_bias" if not prefix else "relative_offset"
        bias, std = rd.num(bias_name), rd.num(prefix + "std")
        lo, hi, p = rd.num(prefix + "ci_low"), rd.num(prefix + "ci_high"), rd.num(prefix + "p_value")
        errors = [rd.as_number(e, f"evidence[{key!r}][...]") for e in rd.evidence(key, list)]
        finite = [e for e in errors if math.isfinite(e)]
        census = design.get("kind") == "every output" and S == shape[0] * shape[1]  # no even split
        if len(finite) != n or n < 3 or (S % len(errors) and not census):
            rd.fail(f"evidence[{key!r}] holds {len(errors)} groups, {len(finite)} finite; trials={n}, "
                    f"samples={S} (the groups split the samples evenly)")
        mean = math.fsum(finite) / n
        sd = math.sqrt(math.fsum((e - mean) ** 2 for e in finite) / (n - 1))
        scale = max(abs(e) for e in finite)
        rd.agree(bias_name, bias, mean, f"the mean of evidence[{key!r}]", tiny=REL * scale)
        rd.agree(prefix + "std", std, sd, f"the spread of evidence[{key!r}]", tiny=REL * scale)
        se = std / math.sqrt(n)
        half = 0.0 if std == 0 else float(stats.t.ppf(1 - alpha / 4, n - 1)) * se
        tiny = REL * (abs(bias) + half)
        how = f"{bias_name} -+ t(1 - alpha/4, trials - 1) {prefix}std / sqrt(trials)"
        rd.agree(prefix + "ci_low", lo, bias - half, how, tiny=tiny)
        rd.agree(prefix + "ci_high", hi, bias + half, how, tiny=tiny)
        p_agree(rd, prefix + "p_value", p, t_p(bias, se, n - 1), f"the t-test of evidence[{key!r}]")
        if not prefix:
            rd.agree("min_detectable_bias", rd.num("min_detectable_bias"),
                     min_detectable_effect(se, n - 1, alpha / 2), "the 80%-power effect of std / sqrt(trials)")
        cis.append((lo, hi))
    # 2. SQNR and the maximum error, from the weighted sums kept
    ssr, sse = rd.as_number(rd.ev.get("sum_sq_ref"), "evidence['sum_sq_ref']"), \
        rd.as_number(rd.ev.get("sum_sq_err"), "evidence['sum_sq_err']")
    wsum = rd.as_number(rd.ev.get("weight_sum"), "evidence['weight_sum']")
    mae = rd.as_number(rd.ev.get("max_abs_err"), "evidence['max_abs_err']")
    if ssr <= 0 or sse < 0 or mae < 0 or not wsum > 0:
        rd.fail("evidence sums of squares, weight sum or maximum error are negative")
    rd.agree("sqnr_db", rd.num("sqnr_db"), 10 * math.log10(ssr / sse) if sse else math.inf,
             "10 log10(sum_sq_ref / sum_sq_err)")
    rd.agree("max_relative_error", rd.num("max_relative_error"), mae / math.sqrt(ssr / wsum),
             "max_abs_err / rms of the exact outputs (sqrt(sum_sq_ref / weight_sum))")
    if (verdict == "exact") != (mae == 0):
        rd.fail(f"gemm_verdict={verdict!r} beside a largest error of {fmt(mae)}: exact means "
                "every sampled output equals fp64")
    if (mae == 0) != (sse == 0) or (mae == 0 and any(lo != 0 or hi != 0 for lo, hi in cis)):
        rd.fail("an exact GEMM (no error) with a non-zero error sum, bias or spread")
    # 3. the growth fit and its points
    growth = rd.evidence("growth", list)
    if not growth or not isinstance(growth[-1], dict) or growth[-1].get("k") != K:
        rd.fail(f"evidence['growth'] does not end at k={K}")
    rd.agree("growth_exponent", rd.num("growth_exponent"), growth_exponent(growth),
             "the log-log slope of evidence['growth']")
    # 4. stall_k: where half the outputs (by weight) had a fused add absorbed
    stall = rd.evidence("stall", dict)
    stalled = rd.as_count(rd.field(stall, "stalled_outputs", "evidence['stall']"), "stalled_outputs")
    share = rd.field(stall, "stalled_share", "evidence['stall']")
    sk = rd.num("stall_k")
    if stalled > S or not 0 <= share <= 1 or (share == 0) != (stalled == 0) \
            or (share < 0.5) != math.isinf(sk) or not (sk <= K or math.isinf(sk)) \
            or not close(sk, rd.field(stall, "stall_k", "evidence['stall']")):
        rd.fail(f"stall_k={fmt(sk)} beside {stalled} of {S} stalled outputs (a share {fmt(share)} "
                f"by weight) and k={K} (inf exactly when under half stalled; else the K by which half did)")
    # 5. the promotion interval: K unless biased, else the first candidate within tolerance
    need = rd.num("promote_every_needed")
    promo = rd.evidence("promotion", list)
    if "promotion_searched" in rd.m:  # reports before it lack the field
        searched = rd.m["promotion_searched"]
        ran = verdict == "biased" and not need == K  # a search gives a candidate below K or nan
        if searched is not ran or (promo and not searched):
            rd.fail(f"promotion_searched={searched!r} beside gemm_verdict={verdict!r}, "
                    f"promote_every_needed={fmt(need)} (k={K}) and {len(promo)} promotion "
                    "candidate(s): only a biased GEMM is searched, and a search that did not run "
                    "finds nothing (N_C stays k)")
    if verdict != "biased" or rd.m.get("biased") is not True:
        if need != K or promo:
            rd.fail(f"promote_every_needed={fmt(need)} beside a GEMM that is not biased: the probe "
                    f"writes k={K} and searches nothing")
    elif promo:
        for c in promo:
            within = all(is_within(rd.field(c, lo, "promotion"), rd.field(c, hi, "promotion"), tol)
                         for lo, hi in (("ci_low", "ci_high"), ("offset_ci_low", "offset_ci_high")))
            if within != c.get("within"):
                rd.fail(f"evidence['promotion'] entry {c!r} is not judged against tolerance={fmt(tol)}")
        hit = [c["promote_every"] for c in promo if c.get("within")]
        if not close(need, float(hit[0]) if hit else math.nan):
            rd.fail(f"promote_every_needed={fmt(need)} is not the first candidate within the "
                    f"tolerance ({hit[:1] or 'none'})")
    if verdict != judge(mae == 0, cis, tol):
        shown = ", ".join(f"[{fmt(lo)}, {fmt(hi)}]" for lo, hi in cis)
        rd.fail(f"gemm_verdict={verdict!r} beside the CIs {shown} (bias, offset) and tolerance="
                f"{fmt(tol)}: biased exactly when a CI excludes 0 and reaches past +-tolerance, "
                f"noise means the whole CI lies within it (else the probe cannot judge): "
                f"{judge(mae == 0, cis, tol)!r}")
    if (rd.m.get("biased") is True) != (verdict == "biased"):
        rd.fail(f"gemm_verdict={verdict!r} contradicts biased={rd.m.get('biased')}")
    rd.codes_agree("TP-B1", verdict == "biased", f"gemm_verdict is {verdict!r}")


# numerics.bias.error_stats: biased = p_value < alpha and |bias| >= min_effect. numerics.gemm
# is not in TESTS: its verdict reads the CI against the tolerance (a point estimate under it
# with a CI past it is biased), which _gemm checks with the probe's own is_biased / is_within.
TESTS = {"numerics.bias": Significance("p_value", "alpha", "bias", "min_effect")}
FLAG_LABELS = {"numerics.gemm": ("gemm_verdict", ("exact", "noise"), ("biased",))}
RULES = {"numerics.gemm": _gemm, "numerics.bias": _bias, "numerics.reveal": _reveal,
         "numerics.stall": _stall}
