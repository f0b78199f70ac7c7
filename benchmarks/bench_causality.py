"""Full causality certification at T=512: the probe against a plain loop of one call per cut.

Both do the same job (every cut 0..T-2, decisions at positions <= c compared with the
baseline), measured side by side in one run, interleaved, best of --repeats. The probe also
checks determinism and batch isolation and packs the cuts into batched calls (chunked to
--max-batch-tokens) with a control copy. Writes reports/causality-benchmark.md.

    python benchmarks/bench_causality.py [--device cuda] [--repeats 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
from trainprobes.causality import check
from trainprobes.causality.target import differs
from trainprobes.reference.models.moe import TinyMoEBlock
from trainprobes.reference.routing import topk_softmax


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


def timed(f):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = f()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def bench(name, fn, x, pick, decision, repeats, max_batch_tokens):
    R = torch.randn_like(x) if x.is_floating_point() else (x + 1) % 1000
    probe_t, loop_t = [], []
    res = None
    for _ in range(repeats):  # interleaved, so machine load hits both alike
        t, res = timed(lambda: check(fn, x, cuts="all", decision=decision,
                                     max_batch_tokens=max_batch_tokens))
        probe_t.append(t)
        t, _ = timed(lambda: plain_loop(fn, x, R, pick))
        loop_t.append(t)
    m = res.metrics
    return {"name": name, "shape": "x".join(map(str, x.shape)), "probe_s": min(probe_t),
            "loop_s": min(loop_t), "ratio": min(probe_t) / min(loop_t),
            "evals": m["n_evaluations"], "tokens": m["tokens_evaluated"],
            "loop_evals": x.shape[1], "loop_tokens": x.shape[0] * x.shape[1] ** 2,
            "verdict": res.verdict, "packed": m["packed"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch-tokens", type=int, default=65536)
    ap.add_argument("--out", default="reports/causality-benchmark.md")
    args = ap.parse_args(argv)
    dev, T = torch.device(args.device), args.seq_len
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, T, 8, generator=g).to(dev)
    hidden = torch.randn(1, T, 64, generator=g).to(dev)
    block = TinyMoEBlock().to(dev)
    rows = [
        bench("topk_softmax router (k=2, E=8)", topk_softmax, logits, lambda o: o[0], 0,
              args.repeats, args.max_batch_tokens),
        bench("tiny MoE block (D=64, E=8, k=2), hidden out", block, hidden, lambda o: o.hidden,
              "hidden", args.repeats, args.max_batch_tokens),
    ]
    dev_name = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                f"CPU ({platform.processor() or platform.machine()}, "
                f"{torch.get_num_threads()} threads)")
    load = f"; load average {os.getloadavg()[0]:.1f} at the end" if hasattr(os, "getloadavg") else ""
    lines = [f"## {dev_name}, torch {torch.__version__}, T={T}, full certification "
             f"({T - 1} cuts), best of {args.repeats}", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{load} (a shared "
             f"machine: absolute seconds move with the load, the ratio is taken side by side).", "",
             "| target | input | probe s | loop s | probe/loop | probe evals | loop evals | "
             "probe tokens | loop tokens | packed | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['shape']} | {r['probe_s']:.3f} | {r['loop_s']:.3f} | "
                     f"**{r['ratio']:.2f}x** | {r['evals']} | {r['loop_evals']} | {r['tokens']} | "
                     f"{r['loop_tokens']} | {r['packed']} | {r['verdict']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = ("# Causality probe benchmark\n\nProduced by `python benchmarks/bench_causality.py` "
            "(see its docstring). The probe does strictly more than the loop (determinism and "
            "batch-isolation checks, a control copy per packed call) and must stay within 1.1x "
            "of the loop's time on CPU.\n\n")
    old = out.read_text() if out.exists() else head
    # keep other devices' sections, replace this one
    sections = [s for s in old.split("\n## ")[1:] if not s.startswith(dev_name)]
    out.write_text(head + "".join("## " + s.rstrip("\n") + "\n\n" for s in sections) + text)
    return rows


if __name__ == "__main__":
    main()
