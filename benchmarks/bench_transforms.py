"""The transforms probe's cost per trial over the same step run by hand, side by side.
Writes reports/transforms-benchmark.md.

    python benchmarks/bench_transforms.py [--world 8] [--repeats 3] [--trials 8 72]

Per trial, timed on the ranks after setup (starting ranks, importing torch._dynamo and
wrapping the model are the same on both sides and are not per-trial work). Both sides launch
`world` gloo ranks (trainprobes.distributed.launcher) on the same seeded batches of the wide
model; the slowest rank's seconds over the trials:
  by hand  the step on every rank, every trial (a user's own DDP step,
           benchmarks/transforms_user_step.py, wrapped once; or a built-in transform's
           run), then on rank 0 one fp64 single-device step per trial (the truth any
           comparison needs), the other ranks waiting at a barrier;
  probe    trainprobes.transforms.run_probes, statistics summed on the ranks: every trial
           the weights restored through the wrapper and the gradients read back and
           fingerprinted, the fp64 truth and the single-device base of each trial once, on
           the rank that judges it (spread over the ranks under data parallelism), on a
           thread beside that rank's steps, the statistics and their all-reduce (the
           evidence's rank_case_seconds).
Repeats are interleaved (by hand, probe, ...); medians, at two trial counts (the per-trial
figure should not depend on them). Target: probe <= 1.1x by hand. Beside the wall time, the
CPU seconds of the same spans summed over the ranks (every thread of each rank): on a
machine shared with other users' load, the wall time of 8 ranks on 2 cores moves by tens of
percent from run to run, the CPU time much less.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # transforms_user_step, for the ranks

import torch  # noqa: E402
from trainprobes.distributed.launcher import launch  # noqa: E402
from trainprobes.reference.bugs import data  # noqa: E402
from trainprobes.transforms import DDP, FSDP2, Probe, TrainingStep, run_probes  # noqa: E402
from trainprobes.transforms.base import RankContext  # noqa: E402
from trainprobes.transforms.demo import step as demo  # noqa: E402
from trainprobes.transforms.equivalence import _seeds  # noqa: E402
from trainprobes.transforms.step import single_device  # noqa: E402
from trainprobes.transforms.user import UserStep  # noqa: E402

WIDE_LAYOUT = data.Layout(tuple([32, 24, 16, 8] * 4), tuple([1.0, 1.5, 2.0, 4.0] * 4), positions=32)


def wide_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(data.D, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, data.O))


WIDE = TrainingStep(model=wide_model, batch=functools.partial(data.documents, WIDE_LAYOUT), loss=data.loss,
                    tokens=data.tokens, name="wide")


def by_hand_task(rank, world, step, transform, seeds, base=False):
    """The step on every trial, and on rank 0 the fp64 truth of each (the same thread
    setting as the probe's ranks); base: rank 0 also runs the fp32 single-device step of
    each trial (the paired tests' base), the probe's design's floor."""
    import os

    import torch.distributed as dist
    from trainprobes.transforms.step import to_device
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    ctx = RankContext(rank, world, torch.device("cpu"), "gloo")
    if isinstance(transform, UserStep):  # the user's own setup once and step per trial, nothing else
        fn, setup, _ = transform.resolve()
        model = step.model()
        model = setup(model, ctx) or model

        def one(batch):
            fn(model, batch, ctx)
            model.zero_grad(set_to_none=True)
    else:
        state = transform.setup(step, ctx)

        def one(batch):
            transform.run(state, step, batch, ctx)
    start, cpu = time.perf_counter(), time.process_time()
    for batch in step.batches(seeds):
        one(to_device(batch, ctx.device))
    if rank == 0:
        single_device(step, seeds)
        if base:
            single_device(step, seeds, fp64=False)
    dist.barrier()
    return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}


def by_hand(step, transform, trials: int, world: int, base: bool = False) -> tuple:
    """(seconds, CPU seconds) of the trials on the ranks (after setup; the slowest rank's
    seconds: they end together; the CPU seconds summed over the ranks)."""
    outs = launch(by_hand_task, world, args=(step, transform, _seeds(0, trials), base), timeout=1800)
    return max(o["seconds"] for o in outs), sum(o["cpu"] for o in outs)


def probe(step, transform, trials: int, world: int) -> tuple:
    """(seconds, CPU seconds) of the trials on the ranks, the probe's way (run_probes: every
    rank's whole case after setup, its `rank_case_seconds`, the slowest rank; and its
    `rank_case_cpu_seconds`, summed)."""
    (r,) = run_probes([Probe(step, transform, trials=trials)], world=world, timeout=1800)
    assert r.metrics["transform_verdict"] in ("exact", "noise"), r.message
    return max(r.evidence["rank_case_seconds"]), sum(r.evidence["rank_case_cpu_seconds"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trials", type=int, nargs=2, default=[8, 72])
    ap.add_argument("--out", default="reports/transforms-benchmark.md")
    ap.add_argument("--only", choices=("user", "fsdp2"), help="one of the two steps")
    args = ap.parse_args(argv)
    few, many = args.trials
    user = UserStep("transforms_user_step", title="user DDP step")
    cases = [("wide", WIDE, user), ("wide", WIDE, FSDP2())]
    cases = [c for c in cases if args.only is None or (args.only == "user") == (c[2] is user)]
    torch.set_num_threads(1)
    load = os.getloadavg()
    launch(by_hand_task, 2, args=(demo, DDP(), [0]))  # start the forkserver outside the timings
    rows = []
    for name, step, transform in cases:
        runs = {(side, n): [] for side in ("hand", "probe") for n in (few, many)}
        runs["floor", many] = []
        for _ in range(args.repeats):
            for n in (few, many):
                runs["hand", n].append(by_hand(step, transform, n, args.world))
                if n == many:
                    runs["floor", n].append(by_hand(step, transform, n, args.world, base=True))
                runs["probe", n].append(probe(step, transform, n, args.world))

        def per_trial(side, n, k=0):
            return statistics.median(x[k] for x in runs[side, n]) / n
        h, p = per_trial("hand", many), per_trial("probe", many)
        hf, pf = per_trial("hand", few), per_trial("probe", few)
        hc, pc = per_trial("hand", many, 1), per_trial("probe", many, 1)
        fl, flc = per_trial("floor", many), per_trial("floor", many, 1)
        pairs = sorted(f"{b[0] / a[0]:.2f}" for a, b in zip(runs["hand", many], runs["probe", many]))
        rows.append((name, transform.label, h, p, p / h, fl / h, flc / hc, hf, pf, hc, pc, pc / hc, pairs))
        print(f"{name:5} {transform.label:15} per trial at {many}: by hand {h * 1e3:7.1f} ms  probe {p * 1e3:7.1f} ms  "
              f"ratio {p / h:.2f}x (by hand with the base {fl / h:.2f}x, CPU {flc / hc:.2f}x; at {few}: "
              f"{hf * 1e3:.0f} / {pf * 1e3:.0f} ms; CPU {hc * 1e3:.0f} / {pc * 1e3:.0f} ms, {pc / hc:.2f}x; "
              f"repeats {pairs})", flush=True)
    lines = ["# Transforms probe benchmark: cost per trial", "",
             f"Generated by `python benchmarks/bench_transforms.py --world {args.world} --repeats "
             f"{args.repeats} --trials {few} {many}{' --only ' + args.only if args.only else ''}` ({args.world} gloo ranks on 127.0.0.1, "
             f"{os.cpu_count()} cores, load average {load[0]:.1f} at the start and {os.getloadavg()[0]:.1f} at the "
             f"end; torch {torch.__version__}).", "",
             "Cost per trial: the slowest rank's seconds over the trials, timed on the ranks after "
             "setup, divided by the trials (at " + str(many) + ", and at " + str(few) + " beside it). By hand: the step on every "
             "rank, every trial, and one fp64 single-device step per trial on rank 0. Probe: "
             "`run_probes`, statistics summed on the ranks (weights restored and gradients read "
             "through the wrapper every trial; the fp64 truth and the fp32 single-device base of each "
             "trial once, on the rank that judges it, spread over the ranks, on a thread beside its "
             "steps; the statistics). Medians of interleaved repeats; target: probe <= 1.1x by hand. "
             "CPU: the same spans in CPU seconds summed over the ranks (all threads), per trial; "
             "the ratio of each interleaved pair (wall) beside it. By hand with the base: the same "
             "with rank 0 also running the fp32 single-device step of each trial after the truth, "
             "the least the paired tests need beyond the step and the truth (wall / CPU, over by hand).", "",
             f"| model | step | by hand per trial (ms) | probe per trial (ms) | probe / by hand | by hand with the base / by hand | at {few} trials: "
             f"by hand / probe (ms) | CPU by hand / probe (ms) | CPU probe / by hand | pairs (wall) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {n} | {t} | {h * 1e3:.1f} | {p * 1e3:.1f} | **{r:.2f}x** | {fw:.2f}x / {fc:.2f}x | {a * 1e3:.0f} / {b * 1e3:.0f} | "
              f"{c * 1e3:.0f} / {d * 1e3:.0f} | {e:.2f}x | {' '.join(f)} |"
              for n, t, h, p, r, fw, fc, a, b, c, d, e, f in rows]
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
