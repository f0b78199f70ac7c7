"""Measure the bias probe's error rates; write them to tests/data/ (read by tests).

  python scripts/bias_rates.py power [--seeds 200]
      each audit control (trainprobes.audit.suites.COLLECTIVES) at quick and full sizes over
      seeds 0..N-1: how often its known verdict comes out -> tests/data/bias_control_power.json
  python scripts/bias_rates.py false-positives [--seeds 200]
      the unbiased cases of `trainprobes bias` over seeds 0..N-1: how often one is called
      biased, with a 95% Clopper-Pearson interval -> tests/data/bias_false_positives.json

Each run is the probe exactly as the audit and the CLI call it (collective_bias).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from scipy import stats

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"

# Unbiased by mechanism, at the command's defaults (numel 256, 32 trials, alpha 0.01), except
# that world 64 stands for the default 1024 where it costs 15x (the case is world 64).
FALSE_POSITIVE_CASES = {
    "bf16 stochastic w=64": dict(dtype="bf16", world=64, rounding="stochastic"),
    "fp16 stochastic w=64": dict(dtype="fp16", world=64, rounding="stochastic"),
    "bf16 reduce_dtype=fp32 w=64": dict(dtype="bf16", world=64, reduce_dtype="fp32"),
    "fp32 w=64": dict(dtype="fp32", world=64),
    "bf16 tree w=16": dict(dtype="bf16", world=16, algorithm="tree"),
}


def _rate(hits: int, n: int) -> dict:
    ci = stats.binomtest(hits, n).proportion_ci(0.95, method="exact")
    return {"count": hits, "seeds": n, "rate": hits / n, "ci95": [ci.low, ci.high]}


def power(seeds: int) -> dict:
    from trainprobes.audit.suites import COLLECTIVES
    from trainprobes.numerics.bias import collective_bias
    out = {}
    for c in COLLECTIVES:
        name = f"{c.dtype} {c.algorithm} {c.op} w={c.world} {c.rounding}"
        for quick in (True, False):
            t0 = time.time()
            ok = sum(collective_bias(seed=s, **c.kwargs(quick)).verdict == c.expected
                     for s in range(seeds))
            row = {"expected": c.expected, **c.kwargs(quick), **_rate(ok, seeds),
                   "seconds_per_run": (time.time() - t0) / seeds}
            out[f"{name} {'quick' if quick else 'full'}"] = row
            print(name, "quick" if quick else "full", ok, "/", seeds, file=sys.stderr, flush=True)
    return out


def false_positives(seeds: int, cases) -> dict:
    from trainprobes.numerics.bias import collective_bias
    out = {}
    for name in cases:
        kw = FALSE_POSITIVE_CASES[name]
        t0 = time.time()
        rs = [collective_bias(seed=s, **kw) for s in range(seeds)]
        fp = sum(r.metrics["biased"] is True for r in rs)
        out[name] = {**kw, **_rate(fp, seeds), "alpha": 0.01,
                     "second_stage": sum(len(r.evidence["stages"]) == 2 for r in rs),
                     "stage1_below_alpha": sum(r.evidence["stages"][0]["p_value"] < 0.01 for r in rs),
                     "seconds_per_run": (time.time() - t0) / seeds}
        print(name, out[name], file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("power", "false-positives"))
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--cases", default=",".join(FALSE_POSITIVE_CASES))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.what == "power":
        doc, name = power(a.seeds), "bias_control_power.json"
    else:
        doc, name = false_positives(a.seeds, a.cases.split(",")), "bias_false_positives.json"
    path = Path(a.out) if a.out else DATA / name
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
