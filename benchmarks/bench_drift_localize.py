"""Drift localisation benchmark: the cost of localising to a stage (trainprobes.drift.localize
with ops=False) and to the op (ops=True, minus the stage cost), each divided by the two
engines' plain forward passes on the same tokens, measured side by side: every repeat times
all three in turn (interleaved), so machine load hits them alike. Reported: the ratio of
median times and the spread of the per-repeat ratios, for wall time and for this process's
CPU time (time.process_time: on a shared, loaded machine the wall clock also counts the time
other processes held the cores; CPU time counts only this work, all threads summed).

The pair: a random HF Llama (no download), fp32 eager trainer against the same weights with
block 1's MLP in bf16 (so the op level runs). Targets (issue 19): to a stage <= 3x the two
plain forwards; to the op <= 2x more.
Usage: python benchmarks/bench_drift_localize.py [--hidden 256] [--layers 8] [--batch 8]
       [--length 128] [--repeats 5] [--threads 2] [--out PATH]
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from trainprobes.drift import faults
from trainprobes.drift.engines import Engine
from trainprobes.drift.localize import localize_layers
from trainprobes.validation import parse_int

TARGETS = {"stage": 3.0, "op": 2.0}


def _time(fn) -> tuple:
    """(wall seconds, CPU seconds of this process) of one call."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def pair(hidden: int, layers: int):
    from trainprobes.isolation.hf import tiny_model

    a = tiny_model("llama", "eager", hidden_size=hidden, intermediate_size=4 * hidden,
                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4)
    b = copy.deepcopy(a)
    faults.in_dtype(b.model.layers[1].mlp, torch.bfloat16)
    return Engine(a, name="trainer"), Engine(b, name="engine")


def measure(trainer, engine, ids, repeats: int) -> dict:
    def plain():
        with torch.no_grad():
            trainer.logits(ids)
            engine.logits(ids)
    calls = {"plain": plain,
             "stage": lambda: localize_layers(trainer, engine, ids, ops=False),
             "stage+op": lambda: localize_layers(trainer, engine, ids, ops=True)}
    for fn in calls.values():  # warm-up
        fn()
    times = {k: [] for k in calls}
    for _ in range(repeats):  # interleaved repeats
        for k, fn in calls.items():
            times[k].append(_time(fn))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=parse_int("hidden", min=8), default=256)
    p.add_argument("--layers", type=parse_int("layers", min=2), default=8)
    p.add_argument("--batch", type=parse_int("batch", min=2), default=8)
    p.add_argument("--length", type=parse_int("length", min=2), default=128)
    p.add_argument("--repeats", type=parse_int("repeats", min=1), default=5)
    p.add_argument("--threads", type=parse_int("threads", min=1), default=2)
    p.add_argument("--out", default="reports/drift-localize-benchmark.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    trainer, engine = pair(args.hidden, args.layers)
    ids = torch.randint(0, 128, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
    t = measure(trainer, engine, ids, args.repeats)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# Drift localisation benchmark", "",
        f"Llama hidden {args.hidden}, {args.layers} layers, tokens {args.batch} x {args.length}, "
        f"{args.threads} threads, {args.repeats} interleaved repeats, load average {load:.1f} (a shared "
        f"machine), {platform.processor() or platform.machine()}, torch {torch.__version__}.", "",
        "| what | clock | median s | / two plain forwards (medians) | (minima) | spread | target |",
        "|---|---|---|---|---|---|---|"]
    for clock, i in (("wall", 0), ("CPU", 1)):
        med = {k: statistics.median(x[i] for x in v) for k, v in t.items()}
        low = {k: min(x[i] for x in v) for k, v in t.items()}  # least disturbed by other work
        stage, stage_low = med["stage"] / med["plain"], low["stage"] / low["plain"]
        op = (med["stage+op"] - med["stage"]) / med["plain"]
        op_low = (low["stage+op"] - low["stage"]) / low["plain"]
        per = [(s[i] / q[i], (o[i] - s[i]) / q[i]) for q, s, o in zip(t["plain"], t["stage"], t["stage+op"])]
        n = args.layers
        lines += [
            f"| two plain forwards | {clock} | {med['plain']:.4f} | 1 | 1 | | |",
            f"| to a stage | {clock} | {med['stage']:.4f} | {stage:.2f}x | {stage_low:.2f}x | "
            f"{min(r[0] for r in per):.2f}-{max(r[0] for r in per):.2f} | <= {TARGETS['stage']:g}x |",
            f"| to the op (added) | {clock} | {med['stage+op'] - med['stage']:.4f} | {op:.2f}x | {op_low:.2f}x | "
            f"{min(r[1] for r in per):.2f}-{max(r[1] for r in per):.2f} | <= {TARGETS['op']:g}x |",
            f"| to the op (added), in one layer's two plain forwards | {clock} | | {op * n:.2f}x | "
            f"{op_low * n:.2f}x | {min(r[1] for r in per) * n:.2f}-{max(r[1] for r in per) * n:.2f} | "
            f"<= {TARGETS['op']:g}x (strict reading) |"]
    lines.append("")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
