"""GRPO on CPU with the drift monitor: one sampler/trainer mismatch at a time, each run with
the two lines a user adds (trainprobes.watch.grpo), and what the monitor called it.

    pip install trl==1.16.0        # beside trainprobes; CPU torch is enough
    python examples/grpo_drift.py [--steps 12] [--kinds clean,bf16,...]

A tiny random Llama with a word-level tokenizer built in memory (no download); 16
completions x 6 tokens per generation batch; one look per batch. See docs/drift_trl.md.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from trainprobes.watch.grpo import GRPODriftMonitor
from trainprobes.watch.grpo_demo import KINDS, run

CASES = {  # name: (sampler kind, trainer bf16, learning rate[, model])
    "clean": ("clean", False, 1e-5),
    "temperature_twice": ("temperature_twice", False, 1e-5),
    "bf16_sampler": ("bf16", False, 1e-5),
    "trainer_bf16_default": ("copy", True, 1e-5),  # GRPOConfig's bf16=True, an fp32 engine
    "top_p_renormalised": ("top_p_renormalised", False, 1e-5),
    "top_p_raw": ("top_p_raw", False, 1e-5),
    "stale_weights_4": ("stale", False, 3e-3),  # weights that move: a sync every 4 batches
    "moe_bf16_sampler": ("bf16", False, 1e-5, "qwen2_moe"),  # routing computed in bf16 too
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kinds", default=",".join(CASES), help=f"of {list(CASES)}")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.getLogger("trainprobes.watch").setLevel(logging.ERROR)  # the table says it
    assert set(c[0] for c in CASES.values()) <= set(KINDS)
    print(f"{'case':22} {'verdict':9} {'first biased':>12} {'mean nats/tok':>14} {'k3 KL':>9} "
          f"{'TRL IS share':>12} {'secs':>6}  message")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.kinds.split(","):
            kind, bf16, lr, *arch = CASES[name]
            mon = GRPODriftMonitor(every=1, interval=1, report=Path(tmp) / f"{name}.json")
            t0 = time.perf_counter()
            run(kind, steps=a.steps, monitor=mon, output_dir=str(Path(tmp) / name), batch=16, bf16=bf16,
                learning_rate=lr, seed=a.seed, arch=(arch or ["llama"])[0])
            final = mon.results[-1]
            m = final.metrics
            first = mon.found_at.get("run", mon.found_at.get("interval"))
            print(f"{name:22} {m['drift_verdict']:9} {first if first else '-':>12} "
                  f"{m['mean_log_ratio']:>+14.3g} {m['k3_kl']:>9.2g} {m['trl_is_changed_share']:>12.2%} "
                  f"{time.perf_counter() - t0:>6.1f}  {final.verdict}"
                  + ("; sampling differs from what the trainer scores" if m["sampling_differs"] else ""))


if __name__ == "__main__":
    main()
