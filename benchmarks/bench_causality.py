"""Causality probe benchmark: full certification against a per-cut loop, and evaluations to
the first flip of every leaky control.

1. Full certification at T=512 (every cut 0..T-2, decisions at positions <= c compared with
   the baseline) by the probe, as a user runs it (the near-tie search included, for targets
   that return decisions only), against the loop any user would write: one call per cut.
   Measured side by side in one run, interleaved (probe, loop, cuts only, ...; the order
   rotates), reported as the median over --repeats of each repeat's probe/loop ratio, with
   the probe's cuts alone (near_ties=0) beside it. The probe does strictly more
   (determinism and isolation checks, a control copy per packed call, the near-tie search)
   and chooses how many copies go into one call by measuring (trainprobes.causality.packing). Targets: a cheap
   router, the tiny MoE block, a single-head causal attention router and a tiny transformer
   block (torch.nn.TransformerEncoderLayer, causal mask): the last two cost T x T per copy,
   where one big packed call can fall out of cache.
2. Evaluations to the first flip for each leaky reference control (the default check and
   full certification), with the total and the share spent confirming.
Writes reports/causality-benchmark.md (a section per device).

    python benchmarks/bench_causality.py [--device cuda] [--repeats 5] [--seq-len 512] [--out FILE]
        [--targets router,moe,attention,transformer] [--no-first-flips] [--clock wall|cpu]
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from trainprobes.causality import check
from trainprobes.causality.suite import controls
from trainprobes.causality.target import differs
from trainprobes.reference.models.moe import TinyMoEBlock
from trainprobes.reference.routing import topk_softmax
from trainprobes.validation import parse_int


class AttentionRouter(torch.nn.Module):
    """One causal attention head feeding a top-2 router: x [B, T, D] -> (ids [B, T, 2],
    probs [B, T, E]). Its cost per copy is T x T x D, the scores [T, T] per copy."""

    def __init__(self, d: int = 64, n_experts: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.qkv = torch.nn.Parameter(torch.randn(d, 3 * d, generator=g) / math.sqrt(d))
        self.gate = torch.nn.Parameter(torch.randn(d, n_experts, generator=g) / math.sqrt(d))

    def forward(self, x):
        T = x.shape[1]
        q, k, v = (x @ self.qkv).chunk(3, -1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        h = x + att.masked_fill(future, float("-inf")).softmax(-1) @ v
        return topk_softmax(h @ self.gate, 2)


class TransformerBlock(torch.nn.Module):
    """torch's own encoder layer (d=64, 2 heads, ff 256, pre-norm) with a causal mask."""

    def __init__(self, d: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.TransformerEncoderLayer(d, 2, 4 * d, dropout=0.0, batch_first=True,
                                                      norm_first=True).eval()

    def forward(self, x):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device,
                                                                    dtype=x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


def plain_loop(fn, x, R, pick):
    """The baseline any user would write: one evaluation per cut, compared with the full run."""
    T = x.shape[1]
    pos = torch.arange(T, device=x.device)
    with torch.no_grad():
        y0 = pick(fn(x)).cpu()
        n_leaks = 0
        for c in range(T - 1):
            m = (pos > c).view(1, T, *([1] * (x.dim() - 2)))
            y = pick(fn(torch.where(m, R, x))).cpu()
            n_leaks += int((differs(y0, y, 0.0) & (torch.arange(T) <= c)).sum())
    return n_leaks


def lean_loop(fn, x, R, pick):
    """The same loop with the least work a user could do around each call (two slices joined,
    one torch.equal on the positions <= c): how much of the loop's time is its own overhead."""
    n_moved = 0
    with torch.no_grad():
        y0 = pick(fn(x)).cpu()
        for c in range(x.shape[1] - 1):
            y = pick(fn(torch.cat([x[:, :c + 1], R[:, c + 1:]], 1))).cpu()
            n_moved += not torch.equal(y[:, :c + 1], y0[:, :c + 1])
    return n_moved


def timed(f, clock=time.perf_counter):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = clock()
    out = f()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return clock() - t, out


# wall: what a user waits for; cpu: this process's CPU seconds, which other jobs on a shared
# machine do not add to (with OMP_NUM_THREADS=1 the probe and the loop run on one thread)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def certify(name, fn, x, pick, decision, repeats, clock=time.perf_counter):
    """Probe and loop interleaved, `repeats` times each, after one untimed call of the target
    (the process's first calls pay for thread pools and the allocator)."""
    R = torch.randn_like(x) if x.is_floating_point() else (x + 1) % 1000
    probe_t, loop_t, cuts_t, lean_t, results = [], [], [], [], []
    with torch.no_grad():
        fn(x)
    runs = {"probe": lambda: check(fn, x, cuts="all", decision=decision),
            "cuts": lambda: check(fn, x, cuts="all", decision=decision, near_ties=0),
            "loop": lambda: plain_loop(fn, x, R, pick), "lean": lambda: lean_loop(fn, x, R, pick)}
    order = ["probe", "loop", "cuts", "lean"]
    for k in range(repeats):  # interleaved, so machine load hits all alike; none always first
        for which in order[k % 4:] + order[:k % 4]:
            t, res = timed(runs[which], clock)
            {"probe": probe_t, "loop": loop_t, "cuts": cuts_t, "lean": lean_t}[which].append(t)
            if which == "probe":
                results.append(res)
    ratios = [p / lo for p, lo in zip(probe_t, loop_t)]
    cut_ratios = [c / lo for c, lo in zip(cuts_t, loop_t)]
    lean_ratios = [p / le for p, le in zip(probe_t, lean_t)]
    res = results[len(results) // 2]
    ties = res.evidence.get("near_tie_search") or {}
    m, packing = res.metrics, res.evidence["packing"] or {}
    sizes = packing.get("sizes") or []
    return {"name": name, "shape": "x".join(map(str, x.shape)),
            "probe_s": statistics.median(probe_t), "loop_s": statistics.median(loop_t),
            "cuts_s": statistics.median(cuts_t), "cut_ratio": statistics.median(cut_ratios),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "lean_s": statistics.median(lean_t), "lean_ratio": statistics.median(lean_ratios),
            "ties": (f"{ties['reached']} ties, {ties['evaluations']} calls" if ties.get("reached")
                     else ties.get("reason") or "- (scores or float decisions)"),
            "evals": m["n_evaluations"], "loop_evals": x.shape[1],
            "tokens": m["tokens_evaluated"], "loop_tokens": x.shape[0] * x.shape[1] ** 2,
            "copies": sorted({r.evidence["packing"]["copies_per_call"] for r in results
                              if r.evidence["packing"]}),
            "largest": max(sizes, default=0), "state": packing.get("state", "-"),
            "verdicts": sorted({r.verdict for r in results})}


def first_flips(T_default: int = 256, T_all: int = 128, seeds=(0, 1, 2)):
    """Every leaky control of the perturb view: evaluations to the first flip, seeds 0-2."""
    rows = []
    for ctl in controls():
        if ctl.causal_perturb:
            continue
        for cuts, T in ((None, T_default), ("all", T_all)):
            got = []
            for seed in seeds:
                g = torch.Generator().manual_seed(seed)
                x = torch.randn(4, T, 8 if ctl.kind == "router" else 64, generator=g)
                res = check(ctl.fn, x, cuts=cuts, decision=ctl.decision, scores=ctl.scores, seed=seed)
                got.append(res)
            m = [r.metrics for r in got]
            rows.append({"name": ctl.name.split(":")[1], "cuts": "all" if cuts else "default (8)",
                         "shape": f"4x{T}x{8 if ctl.kind == 'router' else 64}",
                         "first": [x["evaluations_to_first_flip"] for x in m],
                         "evals": [x["n_evaluations"] for x in m],
                         "confirm": [x["n_confirmations"] for x in m],
                         "isolated": sorted({str(x["batch_isolated"]) for x in m}),
                         "causal": sorted({str(x["causal"]) for x in m})})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq-len", type=parse_int("seq_len", min=2), default=512)
    ap.add_argument("--repeats", type=parse_int("repeats", min=1), default=5)
    ap.add_argument("--out", default="reports/causality-benchmark.md")
    ap.add_argument("--targets", default="router,moe,attention,transformer",
                    help="comma-separated: router, moe, attention, transformer")
    ap.add_argument("--no-first-flips", action="store_true", help="skip part 2")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall (default) or cpu: the process's CPU time, steadier on a shared "
                         "machine (CPU targets only)")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.device != "cpu":
        ap.error(f"--clock cpu times CPU work only: with --device {args.device} use --clock wall")
    names = ("router", "moe", "attention", "transformer")
    wanted = [n.strip() for n in args.targets.split(",") if n.strip()]
    if not wanted or any(n not in names for n in wanted):
        ap.error(f"--targets {args.targets!r}: pick from {', '.join(names)}")
    dev, T = torch.device(args.device), args.seq_len
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, T, 8, generator=g).to(dev)
    hidden = torch.randn(1, T, 64, generator=g).to(dev)
    targets = [
        ("topk_softmax router (k=2, E=8)", topk_softmax, logits, lambda o: o[0], 0),
        ("tiny MoE block (D=64, E=8, k=2), hidden out", TinyMoEBlock().to(dev), hidden,
         lambda o: o.hidden, "hidden"),
        ("single-head causal attention router (D=64, E=8, k=2)", AttentionRouter().to(dev), hidden,
         lambda o: o[0], 0),
        ("tiny transformer block (nn.TransformerEncoderLayer D=64, 2 heads), hidden out",
         TransformerBlock().to(dev), hidden, lambda o: o, None),
    ]
    rows = [certify(name, fn, x, pick, dec, args.repeats, CLOCKS[args.clock])
            for key, (name, fn, x, pick, dec) in zip(names, targets) if key in wanted]
    flips = [] if args.no_first_flips else first_flips()
    dev_name = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                f"CPU ({platform.processor() or platform.machine()}, "
                f"{torch.get_num_threads()} threads)")
    load = f"; load average {os.getloadavg()[0]:.1f} at the end" if hasattr(os, "getloadavg") else ""
    lines = [f"## {dev_name}, torch {torch.__version__}, T={T}, full certification "
             f"({T - 1} cuts), median of {args.repeats} interleaved repeats"
             + (", CPU time" if args.clock == "cpu" else ""), "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{load} (a shared "
             f"machine: absolute seconds move with the load, the ratio is taken side by side).", "",
             "| target | input | probe s | loop s | probe/loop | ratios (each repeat) | cuts only "
             "(near_ties=0) | lean loop (probe/lean) | near-tie search | probe evals | loop evals "
             "| probe tokens | loop tokens | copies per call | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        copies = "/".join(str(c) for c in r["copies"]) + f" (largest {r['largest']})"
        lines.append(f"| {r['name']} | {r['shape']} | {r['probe_s']:.3f} | {r['loop_s']:.3f} | "
                     f"**{r['ratio']:.2f}x** | {' '.join(f'{v:.2f}' for v in r['ratios'])} | "
                     f"{r['cuts_s']:.3f} s ({r['cut_ratio']:.2f}x) | {r['lean_s']:.3f} s "
                     f"({r['lean_ratio']:.2f}x) | {r['ties']} | "
                     f"{r['evals']} | {r['loop_evals']} | {r['tokens']} | {r['loop_tokens']} | "
                     f"{copies} | {'/'.join(r['verdicts'])} |")
    lines += ["", "Copies per call: what the probe settled on in each repeat (0: packing did not "
              "pay, one call per cut after the first); largest: the biggest call of the median "
              "repeat. The probe column is the check as a user runs it (cuts=\"all\", the near-tie "
              "search included where the target returns decisions only); cuts only: the same "
              "with near_ties=0, timed in the same rotation. Lean loop: the loop with the least "
              "work around each call (two slices joined, torch.equal on positions <= c), timed "
              "in the same rotation; probe/lean is the probe against it.", "",
              ]
    if flips:
        lines += ["### Evaluations to the first flip, leaky controls (seeds 0, 1, 2)", "",
                  "| control | cuts | input | evaluations to first flip | evaluations | of which "
                  "confirming | batch-isolated | causal |", "|---|---|---|---|---|---|---|---|"]
    for f in flips:
        lines.append(f"| {f['name']} | {f['cuts']} | {f['shape']} | {', '.join(map(str, f['first']))} | "
                     f"{', '.join(map(str, f['evals']))} | {', '.join(map(str, f['confirm']))} | "
                     f"{'/'.join(f['isolated'])} | {'/'.join(f['causal'])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = ("# Causality probe benchmark\n\nProduced by `python benchmarks/bench_causality.py` "
            "(see its docstring). The probe does strictly more than the loop (determinism and "
            "batch-isolation checks, a control copy per packed call) and must be no slower than "
            "the loop on every target.\n\n")
    old = out.read_text() if out.exists() else head
    # keep other devices' sections, replace this one
    sections = [s for s in old.split("\n## ")[1:] if not s.startswith(dev_name)]
    out.write_text(head + "".join("## " + s.rstrip("\n") + "\n\n" for s in sections) + text)
    return rows, flips


if __name__ == "__main__":
    main()
