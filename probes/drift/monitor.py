"""`DriftMonitor`: the drift statistics of `compare`, streamed step by step in constant memory.

Per step it keeps only sums (float64 running moments), fixed-size histograms of the log-ratio
and one small row of history; no token is stored. Sums per unit (sequence) make the
cluster-robust bias test of `compare` available at any time:
    sum_i (S_i - m n_i)^2 = sum S_i^2 - 2 m sum S_i n_i + m^2 sum n_i^2.
Quantiles in the summary come from the histograms (fine bins of 5e-5 nats for |x| < 0.05,
then 0.01 nats out to |x| < 20), so they are approximate; `compare` gives exact ones.
"""
from __future__ import annotations

import math
from collections import deque

import torch
from scipy import stats as sps
from trainprobes.drift import inputs, stats
from trainprobes.drift.compare import _check_options, _verdict
from trainprobes.errors import TrainprobesError

HISTORY_KEYS = ("n_tokens", "mean_log_ratio", "std_log_ratio", "k3_kl", "chi2_token",
                "frac_ratio_outside", "max_abs_log_ratio", "ess_token", "mean_abs_prob_diff",
                "max_abs_prob_diff")
FINE = (-0.05, 0.05, 2000)
COARSE = (-20.0, 20.0, 4000)


class DriftAlarm(TrainprobesError, RuntimeError):
    """A per-step metric crossed its threshold. `name` is the metric (the alarm's name)."""

    def __init__(self, name: str, value: float, threshold: float, step: int):
        self.name, self.value, self.threshold, self.step = name, value, threshold, step
        super().__init__(f"TP-D3 drift over threshold: {name} = {value:.4g} > {threshold:g} at step {step}")


_SUMS = ("n", "n_low", "s1", "s2", "se", "see", "k3", "rev", "n_out", "tail_sq", "adp", "units", "u_s",
         "u_s2", "u_sn", "u_n2", "v_s", "v_s2", "v_sn")


class DriftMonitor:
    """Stream train/inference log-prob pairs, one training step at a time.

    thresholds: {metric: max allowed |value| per step} over HISTORY_KEYS; crossing one raises
    DriftAlarm (on_alarm="raise") or records it in `alarms` (on_alarm="record").
    history: how many steps of per-step rows to keep (a deque; None keeps all).
    The other options are those of `compare` and feed the same verdict in `summary()`.
    """

    def __init__(self, *, thresholds: dict | None = None, on_alarm: str = "raise",
                 history: int | None = 100_000, alpha: float = 0.01, clip: float = 2.0,
                 clean_tol: float = 1e-3, noise_kl_max: float = 1e-3, tail_frac: float = 0.01,
                 tail_share_min: float = 0.5, kl_warn: float = 0.01, min_bias: float = 1e-5,
                 target: str = "train vs infer"):
        _check_options(alpha, clip, clean_tol, noise_kl_max, tail_frac, tail_share_min, kl_warn, None,
                       min_bias)
        thresholds = dict(thresholds or {})
        unknown = [k for k in thresholds if k not in HISTORY_KEYS]
        if unknown:
            raise ValueError(f"thresholds names {unknown!r}; per-step metrics are {HISTORY_KEYS}")
        if on_alarm not in ("raise", "record"):
            raise ValueError(f"on_alarm={on_alarm!r} must be 'raise' or 'record'")
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
        zero = torch.zeros(1)  # where histc puts an exact 0 (the masked-out tokens)
        self._zero_bin = tuple(int(torch.histc(zero, nb, -hi, -lo).flip(0).argmax())
                               for lo, hi, nb in (FINE, COARSE))

    def update(self, train_logprobs, infer_logprobs, mask=None) -> dict:
        """Add one step ([N] or [B, T], rows = sequences). Returns the step's row of history."""
        train, infer, m, unit = inputs.pair(train_logprobs, infer_logprobs, mask)
        # masked-out tokens become a = 0 (and |p diff| = 0): they add nothing to any sum, and
        # the zeros they put in the histograms are taken out again below. Work in a = log rho
        # = train - infer = -x, in place where possible: this runs every training step.
        a = train - infer
        n_pad = m.numel() - int(torch.count_nonzero(m))  # bool .sum() is ~10x slower
        if n_pad:
            pad = ~m
            a.masked_fill_(pad, 0.0)
        az = a
        a = a.reshape(-1)
        n = a.numel() - n_pad
        lo, hi = (-v.item() for v in reversed(torch.aminmax(a)))  # extremes of x = -a
        if n_pad and (lo == 0.0 or hi == 0.0):  # the padding zeros may be posing as extremes
            lo, hi = (-v.item() for v in reversed(torch.aminmax(a[m.reshape(-1)])))
        e = torch.expm1(a)
        row_s = -az.sum(1).double()  # row sums of x
        row_q = torch.bmm(az.unsqueeze(1), az.unsqueeze(2)).reshape(-1).double()  # row sums of x^2
        s1, s2 = row_s.sum().item(), row_q.sum().item()
        se_, see = e.sum().item(), torch.dot(e, e).item()
        k3, rev = stats.kl_sums(a, e, max(-lo, hi))
        del e
        log_c = math.log(self.clip)
        if max(-lo, hi) > log_c:
            outside = a.abs() > log_c
            n_out = int(outside.sum())
            tail_sq = (a[outside] ** 2).sum().item()
        else:
            n_out, tail_sq = 0, 0.0
        adp = infer.exp().sub_(train.exp()).abs_()
        if n_pad:
            adp.masked_fill_(pad, 0.0)
        adp_sum, adp_max = adp.sum().item(), adp.max().item()
        del adp
        # histograms of x = -a: histc of a over the mirrored range, flipped
        fine = torch.histc(a, FINE[2], -FINE[1], -FINE[0]).flip(0).double()
        if n_pad:
            fine[self._zero_bin[0]] -= n_pad
        if max(-lo, hi) < FINE[1]:  # all inside the fine range: coarse bins are sums of fine ones
            coarse = torch.zeros(COARSE[2], dtype=torch.float64)
            start = round((FINE[0] - COARSE[0]) / ((COARSE[1] - COARSE[0]) / COARSE[2]))
            per = int(round(FINE[2] / ((FINE[1] - FINE[0]) / ((COARSE[1] - COARSE[0]) / COARSE[2]))))
            coarse[start:start + FINE[2] // per] = fine.view(-1, per).sum(1)
        else:
            coarse = torch.histc(a, COARSE[2], -COARSE[1], -COARSE[0]).flip(0).double()
            if n_pad:
                coarse[self._zero_bin[1]] -= n_pad
        self.fine += fine
        self.coarse += coarse
        n_low = int((a > -COARSE[0]).sum()) if lo < COARSE[0] else 0  # histc drops out-of-range
        # per-unit sums for the cluster-robust tests
        k = inputs.row_counts(m).double()
        used = k > 0
        S, U, k = row_s[used], (row_s - row_q / 2)[used], k[used]
        upd = dict(n=n, n_low=n_low, s1=s1, s2=s2, se=se_, see=see, k3=k3, rev=rev, n_out=n_out, tail_sq=tail_sq,
                   adp=adp_sum, units=int(used.sum()), u_s=S.sum().item(), u_s2=(S * S).sum().item(),
                   u_sn=(S * k).sum().item(), u_n2=(k * k).sum().item(), v_s=U.sum().item(),
                   v_s2=(U * U).sum().item(), v_sn=(U * k).sum().item())
        for key, v in upd.items():
            self.sums[key] += v
        self.x_min, self.x_max = min(self.x_min, lo), max(self.x_max, hi)
        self.max_adp = max(self.max_adp, adp_max)
        mean = s1 / n
        row = {"step": self.steps, "n_tokens": n, "mean_log_ratio": mean,
               "std_log_ratio": math.sqrt(max(s2 / n - mean * mean, 0.0)),
               "k3_kl": max(k3 / n, 0.0), "chi2_token": (2 * se_ + see) / n,
               "frac_ratio_outside": n_out / n, "max_abs_log_ratio": max(-lo, hi),
               "ess_token": (n + se_) ** 2 / (n * (n + 2 * se_ + see)) if n + 2 * se_ + see > 0 else 0.0,
               "mean_abs_prob_diff": adp_sum / n, "max_abs_prob_diff": adp_max}
        self.history.append(row)
        self.steps += 1
        for name, limit in self.thresholds.items():
            if not abs(row[name]) <= limit:
                alarm = DriftAlarm(name, row[name], limit, row["step"])
                self.alarms.append(alarm)
                if self.on_alarm == "raise":
                    raise alarm
        return row

    def _cluster(self, s, s2, sn):
        """Cluster-robust mean, se, p from running unit sums (the formula of stats.cluster_t)."""
        G, N, n2 = self.sums["units"], self.sums["n"], self.sums["u_n2"]
        m = s / N
        ss = max(s2 - 2 * m * sn + m * m * n2, 0.0)
        se = math.sqrt(G / max(G - 1, 1) * ss) / N
        df = max(G - 1, 1)
        t = m / se if se > 0 else (0.0 if m == 0 else math.copysign(math.inf, m))
        p = float(2 * sps.t.sf(abs(t), df)) if G >= 2 else math.nan
        half = float(sps.t.ppf(1 - self.options["alpha"] / 2, df)) * se
        return m, se, t, p, half

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
        start_f = round((lo_f - lo_c) / width_c)  # coarse bin where the fine range starts
        before_f = cum_c[start_f - 1].item()
        cum_f = self.fine.cumsum(0) + before_f
        out = {}
        for q in stats.QUANTILES:
            r = n + 1 - stats._nearest_rank(q, n) - self.sums["n_low"]  # rank in ascending x
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
            out[f"ratio_p{stats._qname(q)}"] = math.exp(-v) if -v < 709 else math.inf
        return out

    def trend(self, metric: str = "k3_kl") -> dict:
        """Least-squares slope of a per-step metric over the kept history, with its p-value,
        and the mean of the first and last quarter of steps: is the mismatch growing?"""
        if metric not in HISTORY_KEYS:
            raise ValueError(f"metric={metric!r} is not a per-step metric; use one of {HISTORY_KEYS}")
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

    def summary(self):
        """A Result over every step so far, with the verdict rules of `compare`."""
        s, n = self.sums, self.sums["n"]
        if n == 0:
            raise ValueError("summary() before any update(): nothing to summarise")
        mean = s["s1"] / n
        m2 = max(s["s2"] / n - mean * mean, 0.0)
        m, se, t, p_mean, half = self._cluster(s["u_s"], s["u_s2"], s["u_sn"])
        _, _, _, p_excess, _ = self._cluster(s["v_s"], s["v_s2"], s["v_sn"])
        k2 = s["s2"] / n / 2
        metrics = {
            "n_tokens": int(n), "steps": self.steps, "n_units": int(s["units"]),
            "mean_log_ratio": m, "ci_low": m - half, "ci_high": m + half, "se_mean": se, "t_stat": t,
            "p_mean": p_mean, "p_excess": p_excess,
            "p_value": max(p_mean, p_excess) if k2 <= self.noise_kl_max else p_mean,
            "std_log_ratio": math.sqrt(m2), "max_abs_log_ratio": max(-self.x_min, self.x_max),
            "k1_kl": mean, "k2_kl": k2, "k3_kl": max(s["k3"] / n, 0.0), "k3_kl_reverse": s["rev"] / n,
            "chi2_token": (2 * s["se"] + s["see"]) / n, "mean_ratio": 1 + s["se"] / n,
            "min_ratio": math.exp(-self.x_max),
            "max_ratio": math.exp(-self.x_min) if -self.x_min < 709 else math.inf,
            "ess_token": (n + s["se"]) ** 2 / (n * (n + 2 * s["se"] + s["see"])),
            "frac_ratio_outside": s["n_out"] / n, "n_ratio_outside": int(s["n_out"]),
            "tail_share": s["tail_sq"] / s["s2"] if s["s2"] > 0 else 0.0,
            "mean_abs_prob_diff": s["adp"] / n, "max_abs_prob_diff": self.max_adp,
            "alpha": self.options["alpha"], "clip": self.clip, "noise_kl_max": self.noise_kl_max,
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
        result = _verdict(metrics, evidence, thresholds=None, probe="drift.monitor", target=self.target,
                          **self.options)
        if self.alarms:  # per-step alarms stay visible in the summary even when the total is calm
            first = self.alarms[0]
            if "TP-D3" not in result.codes:
                result.codes.append("TP-D3")
            if result.verdict == "pass":
                result.verdict = "warn"
            result.message += (f"; {len(self.alarms)} step alarm(s), first at step {first.step}: "
                               f"{first.name} = {first.value:.3g} > {first.threshold:g}")
        return result
