"""A small MLP trained by Lightning (DDPStrategy, gloo, CPU) on 2 ranks with the sentinel on:
the fp32 all-reduce (no finding), a hook that truncates to bf16 given to the sentinel (biased,
caught), and the same hook given to DDPStrategy(ddp_comm_hook=...) instead, which Lightning
2.6.6 drops on CPU without a word: the sentinel says DDP ran allreduce_hook, and the run is
clean.

    python examples/watch_lightning_ddp.py [--steps 30]

The line a user adds is in trainprobes.watch.demo.lightning_task (docs/watch.md):
    trainer = L.Trainer(..., callbacks=[SentinelLightning(Sentinel(), hook=my_hook)])
"""
import argparse

from trainprobes.distributed.launcher import launch
from trainprobes.result import Result
from trainprobes.watch.demo import lightning_task

RUNS = (("allreduce", "none", "fp32"), ("truncating_bf16", "none", "truncating hook, given to the sentinel"),
        ("none", "truncating_bf16", "truncating hook, given to DDPStrategy"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    for hook, strategy_hook, label in RUNS:
        out = launch(lightning_task, 2, args=(hook, a.steps, None, strategy_hook), timeout=600)
        final = {}
        for text in out[0]["results"]:  # the last Result per target: the final judgement
            r = Result.from_json(text)
            final[r.target] = r
        print(f"== {label}")
        for r in final.values():
            print(f"  {r.verdict:5s} {r.target}: {r.message}")
        print(f"  the logger got: {out[0]['logged']}")


if __name__ == "__main__":
    main()
