"""Cost of the GRPO drift monitor: TRL GRPOTrainer steps on the tiny Llama of
trainprobes.watch.grpo_demo, without and with the monitor, side by side in one run (each
repeat runs both, alternating which goes first, so machine load hits them alike).

Reported per configuration (completions x tokens per generation batch): the median GRPO step
time (TRL's own `step_time`, which includes generation and so the monitor's scoring) without
and with the monitor, their ratio, and the monitor's own seconds per step (its scoring forward
and its looks, timed inside it) as a share of the step. Target (issue 33): <= 1% at the
defaults (every 64, interval 4).
Usage: python benchmarks/bench_drift_trl.py [--steps 12] [--repeats 3] [--interval 10]
       [--max-sequences N] [--batches 16 64] [--every 1 20]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile

from trainprobes.watch.grpo import GRPODriftMonitor
from trainprobes.watch.grpo_demo import run


def _steps(trainer) -> list[float]:
    return [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]  # first: warm-up


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--max-sequences", type=int, default=None)
    p.add_argument("--every", type=int, nargs="+", default=[1, 20])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    a = p.parse_args(argv)
    logging.getLogger("trainprobes.watch").setLevel(logging.ERROR)
    print(f"{'completions x tokens':>20} {'every':>5} {'step s (off)':>12} {'step s (on)':>12} {'on/off':>7} "
          f"{'monitor s/step':>14} {'share':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for batch, every in ((b, e) for b in a.batches for e in a.every):
            off, on, own = [], [], []
            for r in range(a.repeats):
                for with_monitor in ((False, True) if r % 2 == 0 else (True, False)):
                    mon = (GRPODriftMonitor(interval=a.interval, max_sequences=a.max_sequences, every=every)
                           if with_monitor else None)
                    tr = run("clean", steps=a.steps, monitor=mon, output_dir=f"{tmp}/{batch}-{r}", batch=batch)
                    (on if with_monitor else off).extend(_steps(tr))
                    if with_monitor:
                        own.append(mon.own_seconds / max(mon.seen, 1))  # per GRPO step
            t_off, t_on, t_own = statistics.median(off), statistics.median(on), statistics.median(own)
            print(f"{f'{batch} x 6':>20} {every:>5} {t_off:>12.4f} {t_on:>12.4f} {t_on / t_off:>7.3f} {t_own:>14.4f} "
                  f"{t_own / t_off:>7.2%}")


if __name__ == "__main__":
    main()
