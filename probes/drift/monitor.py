"""`DriftMonitor`: the drift statistics of `compare`, streamed step by step in constant memory.

Per step it keeps only sums (float64 running moments), fixed-size histograms of the log-ratio
and one small row of history; no token is stored. Sums per unit (sequence) make the
cluster-robust bias test of `compare` available at any time (stats.cluster_t_from_sums).
Quantiles in the summary come from the histograms (fine bins of 5e-5 nats for |x| < 0.05,
then 0.01 nats out to |x| < 20), so they are approximate; `compare` gives exact ones.
One `update` is one read of the step's tokens (trainprobes.drift.tokens.token_sums).
"""
from __future__ import annotations

import math
from collections import deque

import torch
from scipy import stats as sps
from trainprobes.drift.inputs import pair
from trainprobes.drift.stats import (
    QUANTILES,
    cluster_t_from_sums,
    nearest_rank,
    quantile_name,
    ratio_from_x,
    ratio_metrics,
)
from trainprobes.drift.tokens import Bins, Work, token_sums
from trainprobes.drift.verdict import check_options, judge
from trainprobes.errors import InvalidArgument, TrainprobesError
from trainprobes.validation import check_choice, check_int, check_number, check_type

HISTORY_KEYS = ("n_tokens", "mean_log_ratio", "std_log_ratio", "k3_kl", "chi2_token",
                "frac_ratio_outside", "max_abs_log_ratio", "ess_token", "mean_abs_prob_diff",
                "max_abs_prob_diff")
FINE = (-0.05, 0.05, 2000)
COARSE = (-20.0, 20.0, 4000)
# histograms of a = -x over the mirrored ranges, flipped into x order (histc semantics)
_FINE_A, _COARSE_A = Bins(-FINE[1], -FINE[0], FINE[2]), Bins(-COARSE[1], -COARSE[0], COARSE[2])


class DriftAlarm(TrainprobesError, RuntimeError):
    """A per-step metric crossed its threshold. `name` is the metric (the alarm's name)."""

    def __init__(self, name: str, value: float, threshold: float, step: int):
        self.name, self.value, self.threshold, self.step = name, value, threshold, step
        super().__init__(f"TP-D3 drift over threshold: {name} = {value:.4g} > {threshold:g} at step {step}")


_SUMS = ("n", "n_low", "n_below_fine", "s1", "s2", "se", "see", "k3", "rev", "n_out", "tail_sq", "adp", "units", "u_s",
         "u_s2", "u_sn", "u_n2", "v_s", "v_s2", "v_sn")


class DriftMonitor:
    """Stream train/inference log-prob pairs, one training step at a time.

    thresholds: {metric: max allowed |value| per step} over HISTORY_KEYS; crossing one raises
    DriftAlarm (on_alarm="raise") or records it in `alarms` (on_alarm="record").
    history: how many steps of per-step rows to keep (a deque; None keeps all).
    The other options are those of `compare` and feed the same verdict in `summary()`.
    Besides its sums the monitor keeps one block of work buffers, 13 bytes per token of its
    largest step (of at most tokens.BLOCK_ELEMENTS tokens), so steps do not pay page faults.
    """

    def __init__(self, *, thresholds: dict | None = None, on_alarm: str = "raise",
                 history: int | None = 100_000, alpha: float = 0.01, clip: float = 2.0,
                 clean_tol: float = 1e-3, noise_kl_max: float = 1e-3, tail_frac: float = 0.01,
                 tail_share_min: float = 0.5, kl_warn: float = 0.01, min_bias: float = 1e-5,
                 target: str = "train vs infer"):
        check_options(alpha=alpha, clip=clip, clean_tol=clean_tol, noise_kl_max=noise_kl_max,
                      tail_frac=tail_frac, tail_share_min=tail_share_min, kl_warn=kl_warn, min_bias=min_bias)
        thresholds = dict(check_type(dict, thresholds or {}, "thresholds", hint="a dict metric -> max |value|"))
        unknown = [k for k in thresholds if k not in HISTORY_KEYS]
        if unknown:
            raise InvalidArgument(f"thresholds names {unknown!r}; per-step metrics are {HISTORY_KEYS}")
        thresholds = {k: check_number(v, f"thresholds[{k!r}]", finite=False, hint="the max allowed |value|")
                      for k, v in thresholds.items()}
        check_choice(on_alarm, "on_alarm", ("raise", "record"))
        if history is not None:
            check_int(history, "history", min=1, hint="steps of history to keep, or None for all")
        self.thresholds, self.on_alarm, self.target = thresholds, on_alarm, target
        self.options = dict(alpha=alpha, clean_tol=clean_tol, tail_frac=tail_frac,
                            tail_share_min=tail_share_min, kl_warn=kl_warn)
        self.clip, self.noise_kl_max, self.min_bias = clip, noise_kl_max, min_bias
        self.history = deque(maxlen=history)
        self.alarms: list = []
        self.steps = 0
        self.sums = dict.fromkeys(_SUMS, 0.0)
        self.x_min, self.x_max, self.max_adp = math.inf, -math.inf, 0.0
        self.fine = torch.zeros(FINE[2], dtype=torch.float64)
        self.coarse = torch.zeros(COARSE[2], dtype=torch.float64)
        self._work = Work()  # one block of buffers, reused by every step

    def update(self, train_logprobs, infer_logprobs, mask=None, lengths=None) -> dict:
        """Add one step ([N] or [B, T], rows = sequences; a flat [N] with lengths= splits into
        sequences). Returns the step's row of history."""
        t = token_sums(pair(train_logprobs, infer_logprobs, mask, lengths), self.clip, bins=(_FINE_A, _COARSE_A),
                       work=self._work)
        fine, coarse = (h.counts.flip(0).double() for h in t.histograms)
        self.fine += fine
        self.coarse += coarse
        # per-unit sums for the cluster-robust tests: S_i = sum x, U_i = sum (x - x^2/2)
        used = t.row_n > 0
        S, k = t.row_sum[used], t.row_n[used].double()
        U = S - t.row_sq[used] / 2
        n = t.n
        # values below each range: a's above, since the histograms count a = -x
        upd = dict(n=n, n_low=t.histograms[1].above, n_below_fine=t.histograms[0].above, s1=t.s1, s2=t.s2, se=t.se, see=t.see, k3=t.k3, rev=t.rev,
                   n_out=t.n_out, tail_sq=t.tail_sq, adp=t.adp, units=int(used.sum()),
                   u_s=S.sum().item(), u_s2=(S * S).sum().item(), u_sn=(S * k).sum().item(),
                   u_n2=(k * k).sum().item(), v_s=U.sum().item(), v_s2=(U * U).sum().item(),
                   v_sn=(U * k).sum().item())
        for key, v in upd.items():
            self.sums[key] += v
        self.x_min, self.x_max = min(self.x_min, t.x_min), max(self.x_max, t.x_max)
        self.max_adp = max(self.max_adp, t.adp_max)
        mean = t.s1 / n
        ratios = ratio_metrics(n, t.se, t.see, t.x_min, t.x_max)
        row = {"step": self.steps, "n_tokens": n, "mean_log_ratio": mean,
               "std_log_ratio": math.sqrt(max(t.s2 / n - mean * mean, 0.0)),
               "k3_kl": max(t.k3 / n, 0.0), "chi2_token": ratios["chi2_token"],
               "frac_ratio_outside": t.n_out / n, "max_abs_log_ratio": max(-t.x_min, t.x_max),
               "ess_token": ratios["ess_token"], "mean_abs_prob_diff": t.adp / n,
               "max_abs_prob_diff": t.adp_max}
        self.history.append(row)
        self.steps += 1
        for name, limit in self.thresholds.items():
            if not abs(row[name]) <= limit:
                alarm = DriftAlarm(name, row[name], limit, row["step"])
                self.alarms.append(alarm)
                if self.on_alarm == "raise":
                    raise alarm
        return row

    def _cluster(self, prefix: str, alpha: float | None = None):
        """The cluster-robust test of the unit sums named prefix_s, prefix_s2, prefix_sn."""
        s = self.sums
        return cluster_t_from_sums(s[prefix + "_s"], s[prefix + "_s2"], s[prefix + "_sn"], s["u_n2"],
                                   int(s["units"]), s["n"], alpha or self.options["alpha"])

    def quantiles(self) -> dict:
        """Approximate ratio quantiles rho_pQ from the histograms (bin midpoints): the coarse
        histogram locates the rank, the fine one refines it when it falls inside |x| < 0.05;
        ranks beyond |x| = 20 report the recorded extreme."""
        n = int(self.sums["n"])
        if n == 0:
            return {}
        lo_c, hi_c, nb_c = COARSE
        lo_f, hi_f, nb_f = FINE
        width_c, width_f = (hi_c - lo_c) / nb_c, (hi_f - lo_f) / nb_f
        cum_c = self.coarse.cumsum(0)
        # ranks below the fine range as the fine histogram itself counted them: a value on the
        # range's edge can land in the coarse bin below it and in the fine range's first bin
        # (float32 binning), and the coarse count put every later rank one off
        before_f = self.sums["n_below_fine"] - self.sums["n_low"]
        cum_f = self.fine.cumsum(0) + before_f
        out = {}
        for q in QUANTILES:
            r = n + 1 - nearest_rank(q, n) - self.sums["n_low"]  # rank in ascending x
            if r <= 0:
                v = self.x_min
            elif r > cum_c[-1].item():
                v = self.x_max
            elif before_f < r <= cum_f[-1].item():
                b = int(torch.searchsorted(cum_f, torch.tensor(float(r), dtype=torch.float64)))
                v = lo_f + (b + 0.5) * width_f
            else:
                b = int(torch.searchsorted(cum_c, torch.tensor(float(r), dtype=torch.float64)))
                v = lo_c + (b + 0.5) * width_c
            v = min(max(v, self.x_min), self.x_max)
            out[f"ratio_p{quantile_name(q)}"] = ratio_from_x(v)
        return out

    def trend(self, metric: str = "k3_kl") -> dict:
        """Least-squares slope of a per-step metric over the kept history, with its p-value,
        and the mean of the first and last quarter of steps: is the mismatch growing?"""
        check_choice(metric, "metric", HISTORY_KEYS, hint="a per-step metric")
        ys = [r[metric] for r in self.history]
        k = len(ys)
        if k < 3:
            return {"metric": metric, "steps": k, "slope": math.nan, "p_value": math.nan,
                    "first": math.nan, "last": math.nan}
        res = sps.linregress(range(k), ys)
        q = max(1, k // 4)
        return {"metric": metric, "steps": k, "slope": float(res.slope),
                "p_value": float(res.pvalue) if math.isfinite(res.pvalue) else math.nan,
                "first": sum(ys[:q]) / q, "last": sum(ys[-q:]) / q}

    def summary(self, alpha: float | None = None):
        """A Result over every step so far, with the verdict rules of `compare`. alpha: the
        level of this one look (a caller that looks again and again spends its alpha over
        the looks); None: the monitor's own."""
        if alpha is not None:
            check_number(alpha, "alpha", min=0, max=1, min_open=True, max_open=True)
        options = self.options if alpha is None else {**self.options, "alpha": alpha}
        s, n = self.sums, self.sums["n"]
        if n == 0:
            raise InvalidArgument("summary() before any update(): nothing to summarise")
        mean = s["s1"] / n
        m2 = max(s["s2"] / n - mean * mean, 0.0)
        m, se, t, p_mean, half, _ = (v.item() for v in self._cluster("u", options["alpha"]))
        p_excess = self._cluster("v", options["alpha"]).p.item()
        k2 = s["s2"] / n / 2
        metrics = {
            "n_tokens": int(n), "steps": self.steps, "n_units": int(s["units"]),
            "mean_log_ratio": m, "ci_low": m - half, "ci_high": m + half, "se_mean": se, "t_stat": t,
            "p_mean": p_mean, "p_excess": p_excess,
            "p_value": max(p_mean, p_excess) if k2 <= self.noise_kl_max else p_mean,
            "std_log_ratio": math.sqrt(m2), "max_abs_log_ratio": max(-self.x_min, self.x_max),
            "k1_kl": mean, "k2_kl": k2, "k3_kl": max(s["k3"] / n, 0.0), "k3_kl_reverse": s["rev"] / n,
            **ratio_metrics(n, s["se"], s["see"], self.x_min, self.x_max),
            "frac_ratio_outside": s["n_out"] / n, "n_ratio_outside": int(s["n_out"]),
            "tail_share": s["tail_sq"] / s["s2"] if s["s2"] > 0 else 0.0,
            "mean_abs_prob_diff": s["adp"] / n, "max_abs_prob_diff": self.max_adp,
            "alpha": options["alpha"], "clip": self.clip, "noise_kl_max": self.noise_kl_max,
            "min_bias": self.min_bias,
            "alarms": len(self.alarms),
        }
        metrics.update(self.quantiles())
        trend = self.trend("k3_kl")
        metrics["k3_trend_slope"], metrics["k3_trend_p"] = trend["slope"], trend["p_value"]
        evidence = {"history": list(self.history), "trend": {k: self.trend(k) for k in
                                                             ("k3_kl", "mean_log_ratio", "frac_ratio_outside")},
                    "alarms": [{"name": a.name, "value": a.value, "threshold": a.threshold, "step": a.step}
                               for a in self.alarms],
                    "log_ratio_histogram": {"edges": [FINE[0], FINE[1]], "counts": self.fine.long().tolist()}}
        result = judge(metrics, evidence, thresholds=None, probe="drift.monitor", target=self.target,
                       **options)
        if self.alarms:  # per-step alarms stay visible in the summary even when the total is calm
            first = self.alarms[0]
            if "TP-D3" not in result.codes:
                result.codes.append("TP-D3")
            if result.verdict == "pass":
                result.verdict = "warn"
            result.message += (f"; {len(self.alarms)} step alarm(s), first at step {first.step}: "
                               f"{first.name} = {first.value:.3g} > {first.threshold:g}")
        return result
