"""transformers.Trainer through its own extension point, TrainerCallback.

    sentinel = Sentinel(findings="sentinel.jsonl")
    trainer.add_callback(SentinelCallback(sentinel, trainer))

on_train_begin: the Trainer has wrapped its model by then; `trainer.model_wrapped` (the
    Trainer's documented "most external model") must be a DistributedDataParallel, and the
    sentinel attaches to it with attach_ddp (hook, state: the comm hook to run, default
    allreduce_hook). A Trainer not under DDP is refused up front, naming what it is: the
    sentinel never half-watches in silence.
on_step_end: sentinel.step(); after a look, its numbers (Sentinel.summary) go to
    Trainer.log, so every logger the Trainer reports to gets them; with stop_on_finding a
    finding raises SentinelFinding out of trainer.train() after everything is written.
on_train_end: sentinel.close(); the final numbers logged, the Results in sentinel.results.
"""
from __future__ import annotations

from trainprobes.errors import InvalidArgument
from trainprobes.watch.ddp import attach_ddp
from transformers import TrainerCallback


class SentinelCallback(TrainerCallback):
    def __init__(self, sentinel, trainer, hook=None, state=None):
        from trainprobes.watch.sentinel import Sentinel
        if not isinstance(sentinel, Sentinel):
            raise InvalidArgument(f"sentinel={sentinel!r} must be a trainprobes.watch.Sentinel")
        if not hasattr(trainer, "model_wrapped") or not hasattr(trainer, "log"):
            raise InvalidArgument(f"trainer={type(trainer).__name__} must be a transformers.Trainer")
        self.sentinel, self.trainer, self.hook, self.state = sentinel, trainer, hook, state

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.nn.parallel import DistributedDataParallel
        model = self.trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            raise InvalidArgument(
                f"the Trainer's model is a {type(model).__name__}, not DistributedDataParallel: the "
                "sentinel watches DDP's gradient reduction and would watch nothing here (launch "
                "the Trainer on 2 or more ranks, e.g. torchrun, with DDP)")
        attach_ddp(model, self.sentinel, hook=self.hook, state=self.state)

    def on_step_end(self, args, state, control, **kwargs):
        looked = self.sentinel.streams.looks
        self.sentinel.step()  # SentinelFinding (stop_on_finding) leaves train() from here
        if self.sentinel.streams.looks != looked:
            self.trainer.log(self.sentinel.summary())

    def on_train_end(self, args, state, control, **kwargs):
        self.sentinel.close()
        self.trainer.log(self.sentinel.summary())
