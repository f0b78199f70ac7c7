"""A tiny Llama trained by transformers.Trainer under DDP on 2 gloo ranks with the sentinel on,
four times: the fp32 all-reduce (no finding), bf16_compress_hook's arithmetic (noise, with its
size), a hook that truncates to bf16 (biased, caught), and packed documents from
DataCollatorWithFlattening beside an all-ones attention mask (leaky, caught at step 0).

    python examples/watch_trainer_ddp.py [--steps 40]

The two lines a user adds are in trainprobes.watch.demo.trainer_task (docs/watch.md):
    sentinel = Sentinel()
    trainer.add_callback(SentinelCallback(sentinel, trainer, hook=my_hook))
"""
import argparse

from trainprobes.distributed.launcher import launch
from trainprobes.result import Result
from trainprobes.watch.demo import trainer_task

HOOKS = ("allreduce", "rounding_bf16", "truncating_bf16")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    for hook, packed in [(h, False) for h in HOOKS] + [("allreduce", True)]:
        out = launch(trainer_task, 2, args=(hook, a.steps, None, packed), timeout=600)
        final = {}
        for text in out[0]["results"]:  # the last Result per bucket: the final judgement
            r = Result.from_json(text)
            final[r.target] = r
        print(f"== {hook}" + (", packed documents beside an all-ones mask" if packed else ""))
        for r in final.values():
            print(f"  {r.verdict:5s} {r.target}: {r.message}")
        print(f"  Trainer.log got: {out[0]['logged'][-1]}")


if __name__ == "__main__":
    main()
