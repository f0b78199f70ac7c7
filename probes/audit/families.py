"""Per-family finishing of probe Results for reports: plot specs drawn from the evidence,
and what a stack finding means on this machine.

The probes keep their evidence plain; these functions only read it and append
`evidence["plots"]` (see trainprobes.report.plots), tolerating a probe that left a field out.
"""
from __future__ import annotations

from trainprobes.display import format_number

# fp32's 23 mantissa bits: what kernels are expected to keep their partial sums in.
FP32_MANTISSA_BITS = 23


def accumulator_finding(r):
    """A revealed accumulator of this machine's kernel as a finding: narrower than fp32 is
    WARN (TP-B3, watch out): a sum of many small terms loses them once the partial sum is
    2^(bits+1) times larger (fp16 accumulation: 2048 ones sum to 2048, then stop)."""
    bits = r.metrics.get("accumulator_mantissa_bits")
    if isinstance(bits, int) and bits < FP32_MANTISSA_BITS \
            and not r.metrics.get("accumulator_bits_lower_bound"):
        r.verdict = "warn" if r.verdict == "pass" else r.verdict
        if "TP-B3" not in r.codes:
            r.codes.append("TP-B3")
        r.message = (f"watch out: partial sums keep {bits} mantissa bits, fewer than fp32's "
                     f"{FP32_MANTISSA_BITS}; long reductions lose small terms. " + r.message)
    return r


def distinct(a: float, b: float) -> tuple[str, str]:
    """a and b with the display's digits, or more where those would show two different
    numbers alike (4.09589 and 4.096 both read 4.096)."""
    fa, fb = format_number(a), format_number(b)
    for digits in range(5, 18):
        if fa != fb or a == b:
            break
        fa, fb = f"{a:.{digits}g}", f"{b:.{digits}g}"
    return fa, fb


def stall_plot(r) -> dict:
    """What the stall table shows: the fraction of the true sum each (format, increment)
    reaches after n adds, one bar per row. A format's stall is what its arithmetic does
    (round-to-nearest-even stops a sum of ones at 2^(p+1)), so a row that stalls where its
    format predicts is drawn as expected, not red; red is a row that differs from its
    format's prediction (this machine's arithmetic is not the format's). Every row is drawn,
    so a format that stalls like another (tf32 and fp16) is its own bar."""
    rows = r.evidence.get("rows", [])
    tol = r.metrics.get("rel_tol", 1e-2)
    n = rows[0]["n"] if rows else 0
    frac = [row["sequential_sum"] / row["true_sum"] if row["true_sum"] else float("nan")
            for row in rows]
    status = []
    for row, f in zip(rows, frac):
        stall_at = row.get("stall_at") or 0.0
        predicted = bool(stall_at) and stall_at < row["true_sum"] * (1 - tol)
        off = not abs(f - 1) <= tol
        # "exact" is a claim about bits: a sum within rel_tol that is not the true sum
        # (fp32 + 0.001: 4.09589 of 4.096) lost only rounding
        near = "exact" if row["sequential_sum"] == row["true_sum"] else "rounding"
        status.append("unexpected" if off != predicted else "expected" if off else near)
    return {"kind": "bars",
            "title": f"sum of {format_number(n)} adds in each format, as a fraction of the true sum",
            "labels": [f"{row['format']} + {format_number(row['increment'])}: "
                       + " of ".join(distinct(row["sequential_sum"], row["true_sum"]))
                       for row in rows],
            "values": frac, "status": status, "ref": [1.0],
            "xlabel": "sequential sum / true sum (1 = exact)"}


def _pos_cut(leak):
    if isinstance(leak, dict):
        return leak.get("position"), leak.get("cut")
    if isinstance(leak, (list, tuple)) and len(leak) >= 2:
        return leak[0], leak[1]
    return None, None


def leak_map(leaks, seq_len: int, bins: int = 64, counts=None) -> dict | None:
    """Heatmap spec: how many leaks at (decision position, cut), binned to at most bins^2.

    counts: the probe's complete [[cut, position, n], ...] (trainprobes.causality evidence
    "leak_map"); leaks: individual leak records, used when counts are absent.
    """
    if counts:
        pairs = [(int(p), int(c), int(n)) for c, p, n in counts]
    else:
        pairs = [_pos_cut(leak) for leak in leaks or []]
        pairs = [(int(p), int(c), 1) for p, c in pairs if p is not None and c is not None]
    if not pairs or seq_len < 1:
        return None
    width = max(1, -(-seq_len // bins))
    n = -(-seq_len // width)
    m = [[0] * n for _ in range(n)]
    for p, c, k in pairs:
        if 0 <= p < seq_len and 0 <= c < seq_len:
            m[p // width][c // width] += k
    unit = "" if width == 1 else f" (bins of {width})"
    return {"kind": "heatmap", "title": f"leaks: decision position x cut{unit}", "matrix": m,
            "xlabel": f"cut (future changed after it){unit}", "ylabel": f"decision position{unit}",
            "clabel": "leaks (decisions that changed)"}


def causality_result(r, seq_len: int):
    """Leak map (position x cut) and flip rate by position, where the probe found flips."""
    ev = r.evidence
    plots = []
    spec = leak_map(ev.get("leaks"), seq_len, counts=ev.get("leak_map"))
    if spec:
        plots.append(spec)
    rate = ev.get("flip_rate_by_position")
    if spec and rate:
        plots.append({"kind": "line", "title": "flip rate by decision position",
                      "x": list(range(len(rate))),
                      "series": {r.target: ["nan" if v is None else v for v in rate]},
                      "xlabel": "position", "ylabel": "fraction of compared decisions flipped"})
    if plots:
        ev.setdefault("plots", []).extend(plots)
    return r


def histogram_spec(values, title: str, xlabel: str, bins: int = 24) -> dict | None:
    """Histogram spec of finite values (torch.histogram: no Python loop over elements)."""
    import torch
    v = torch.tensor([float(x) for x in values if isinstance(x, (int, float))],
                     dtype=torch.float64)
    v = v[torch.isfinite(v)]
    if v.numel() < 2:
        return None
    lo, hi = v.min().item(), v.max().item()
    if lo == hi:
        lo, hi = lo - 0.5 * (abs(lo) or 1.0), hi + 0.5 * (abs(hi) or 1.0)
    counts, edges = torch.histogram(v, bins=bins, range=(lo, hi))
    return {"kind": "hist", "title": title, "edges": edges.tolist(), "counts": counts.tolist(),
            "xlabel": xlabel, "ylabel": "trials"}


def bias_result(r):
    """Histogram of the per-trial signed relative errors (trainprobes.numerics.bias evidence),
    with zero and the estimated bias marked: a bias is the whole histogram off zero."""
    spec = histogram_spec(r.evidence.get("errors", []), "signed relative error per trial",
                          "signed relative error (< 0: too small)")
    bias = r.metrics.get("bias")
    if spec and isinstance(bias, (int, float)) and not isinstance(bias, bool):
        spec["marks"] = {"zero": 0.0, f"bias {format_number(bias, digits=3)}": bias}
    if spec:
        r.evidence.setdefault("plots", []).append(spec)
    return r


def drift_result(r):
    """Log-ratio histogram and bias by token probability (trainprobes.drift.compare evidence)."""
    plots = drift_plots(r)
    if plots:
        r.evidence.setdefault("plots", []).extend(plots)
    return r


def drift_plots(r) -> list[dict]:
    """The log-ratio histogram, every token drawn (the tails past the binned bulk as bars of
    their own, labelled "N beyond"), and the mean log-ratio by inference probability with
    its 99% confidence interval (normal, per token)."""
    import math
    ev, plots = r.evidence, []
    h = ev.get("log_ratio_histogram")
    if isinstance(h, dict) and h.get("edges") and h.get("counts"):
        plots.append({"kind": "hist", "title": "log-ratio x = log p_infer - log p_train per token",
                      "edges": h["edges"], "counts": h["counts"],
                      "xlabel": "log p_infer - log p_train (nats)",
                      "ylabel": "tokens", "logy": True, "below": h.get("below", 0),
                      "above": h.get("above", 0), "x_min": h.get("x_min"),
                      "x_max": h.get("x_max"), "xunit": " nats"})
    rows = [b for b in ev.get("by_probability", []) if b.get("n", 0) >= 2]
    if rows:
        half = [2.576 * b["std_log_ratio"] / math.sqrt(b["n"]) for b in rows]  # 99% normal
        plots.append({"kind": "ci", "title": "bias by inference probability of the token (99% CI)",
                      "labels": [f"p in ({b['p_low']:.2g}, {b['p_high']:.2g}], n={b['n']}"
                                 for b in rows],
                      "estimate": [b["mean_log_ratio"] for b in rows],
                      "low": [b["mean_log_ratio"] - d for b, d in zip(rows, half)],
                      "high": [b["mean_log_ratio"] + d for b, d in zip(rows, half)],
                      "xlabel": "mean log-ratio", "unit": "nats/token"})
    return plots
