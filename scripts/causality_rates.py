"""Measure the causality probe's error rates at its defaults; write tests/data/causality_rates.json.

  python scripts/causality_rates.py [--seeds 200]

For every reference router whose perturb verdict is causal by mechanism, probed with its
decision only (no scores: the near-tie search runs), over seeds 0..N-1 at the CLI's sizes
(4 x 256 logits over 8 experts, the default 8 cuts): how often it is called leaky (a false
positive) or left unsettled (warn), with 95% Clopper-Pearson intervals. And the power on the
sequence-mean router of issue 21 (top-2 of the logits minus 1e-3 x their sequence mean), as
a module (fp64 twin) and as a plain function (none), at the same sizes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from scipy import stats

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def _rate(hits: int, n: int) -> dict:
    ci = stats.binomtest(hits, n).proportion_ci(0.95, method="exact")
    return {"count": hits, "seeds": n, "rate": hits / n, "ci95": [ci.low, ci.high]}


class SeqMean(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x):
        lg = x @ self.w
        return (lg - 1e-3 * lg.mean(1, keepdim=True)).topk(2, -1).indices


def main(argv=None) -> int:
    from trainprobes.causality.check import check
    from trainprobes.reference import routing

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--out", default=str(DATA / "causality_rates.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = {"seeds": args.seeds, "shape": [4, 256, 8], "torch": torch.__version__,
           "false_positives": {}, "power": {}}
    for name, (causal, _) in routing.KNOWN_VERDICTS.items():
        if not causal:
            continue
        fn = getattr(routing, name)
        fails = warns = reached = 0
        for s in range(args.seeds):
            x = torch.randn(4, 256, 8, generator=torch.Generator().manual_seed(s))
            r = check(fn, x, seed=s, decision=0)
            fails += r.verdict == "fail"
            warns += r.verdict == "warn"
            reached += (r.metrics["n_near_ties"] or 0) > 0
        out["false_positives"][name] = {"fail": _rate(fails, args.seeds), "warn": _rate(warns, args.seeds),
                                        "near_ties_reached": reached}
        print(name, out["false_positives"][name]["fail"]["count"], "fail,", warns, "warn", file=sys.stderr)
    w = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) / 8
    fn_route = lambda x: ((x @ w) - 1e-3 * (x @ w).mean(1, keepdim=True)).topk(2, -1).indices  # noqa: E731
    for name, fn in (("sequence_mean module", SeqMean(w.clone())), ("sequence_mean function", fn_route)):
        found = blind = 0
        for s in range(args.seeds):
            x = torch.randn(4, 256, 64, generator=torch.Generator().manual_seed(s))
            found += check(fn, x, seed=s).verdict == "fail"
            blind += check(fn, x, seed=s, near_ties=0).verdict == "fail"
        out["power"][name] = {"fail": _rate(found, args.seeds), "without_search": _rate(blind, args.seeds)}
        print(name, found, "found;", blind, "without the search", file=sys.stderr)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
