"""transformers.Trainer through its own extension point, TrainerCallback.

    sentinel = Sentinel(findings="sentinel.jsonl")
    trainer.add_callback(SentinelCallback(sentinel, trainer))

on_train_begin, first (packing=True): watch_packing on the Trainer's unwrapped model
    (trainprobes.watch.packing_watch): a forward pre-hook reads the packing convention of
    the batch the model receives (TrainerCallback events are not handed the batches); the
    first batch, and each batch whose convention is new, is checked for packed-document
    isolation on_pre_optimizer_step (after its backward, before the update), at most 8
    conventions, batches of at most `packing_max_documents` documents (a check is d + 2
    forwards). A leak is a finding (TP-I1) like any other; not packed: nothing to check.
    check_packing() checks, by hand, a batch a deep copy of the run's collator makes from
    the first `packing_examples` examples (python's, numpy's and torch's generators kept).
on_train_begin: the Trainer has wrapped its model by then; `trainer.model_wrapped` (the
    Trainer's documented "most external model") must be a DistributedDataParallel, and the
    sentinel attaches to it with attach_ddp (hook, state: the comm hook to run, default
    allreduce_hook). A Trainer not under DDP is refused up front, naming what it is: the
    sentinel never half-watches in silence.
on_train_begin, routers / updates / gemms: watch_routers on the Trainer's model
    (routers=True: found by class name; or a dict / list of modules), every `router_every`
    steps; watch_updates on the optimizer the Trainer hands its callbacks; watch_gemms on the
    Trainer's model (gemms=True: its defaults, every nn.Linear a candidate, one call's wgrad
    every 50 steps under fp8-tensor on h200-scaled-mm; or a dict of watch_gemms arguments,
    e.g. {"recipe": "fp8-rowwise", "every": 100}). ddp=False: no DDP model needed (a
    single-process run), only these and the packing check are watched.
on_step_end: sentinel.step(); after a look, its numbers (Sentinel.summary) go to
    Trainer.log, so every logger the Trainer reports to gets them (the Trainer's own log of
    that step still happens: Trainer.log clears control.should_log, restored here); with stop_on_finding a
    finding raises SentinelFinding out of trainer.train() after everything is written.
on_train_end: sentinel.close(); the final numbers logged, the Results in sentinel.results.
"""
from __future__ import annotations

import logging

from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_bool, check_int
from trainprobes.watch.ddp import attach_ddp
from transformers import TrainerCallback

log = logging.getLogger("trainprobes.watch")


class SentinelCallback(TrainerCallback):
    def __init__(self, sentinel, trainer, hook=None, state=None, packing: bool = True,
                 packing_examples: int = 4, ddp: bool = True, routers=None,
                 updates: bool = False, router_every: int = 50, gemms=False,
                 packing_max_documents: int = 64):
        from trainprobes.watch.gemm import gemm_options
        from trainprobes.watch.sentinel import Sentinel
        if not isinstance(sentinel, Sentinel):
            raise InvalidArgument(f"sentinel={sentinel!r} must be a trainprobes.watch.Sentinel")
        if not hasattr(trainer, "model_wrapped") or not hasattr(trainer, "log"):
            raise InvalidArgument(f"trainer={type(trainer).__name__} must be a transformers.Trainer")
        self.sentinel, self.trainer, self.hook, self.state = sentinel, trainer, hook, state
        self.packing = check_bool(packing, "packing")
        self.packing_examples = check_int(packing_examples, "packing_examples", min=1)
        self.packing_max_documents = check_int(packing_max_documents, "packing_max_documents", min=2)
        self.ddp, self.updates = check_bool(ddp, "ddp"), check_bool(updates, "updates")
        self.routers, self.router_every = routers, router_every
        self.gemms = gemm_options(gemms)  # None: not watched; else watch_gemms' arguments
        if not (self.ddp or self.packing or routers or self.updates or self.gemms is not None):
            raise InvalidArgument("ddp=False, packing=False, no routers, updates=False and "
                                  "gemms=False: the sentinel would watch nothing")

    def check_packing(self):
        """The packing check on a batch of the run's collator (see the module docstring);
        the Result (None: not packed) also goes to the sentinel. Its own errors are counted."""
        import copy

        from trainprobes.watch.packing import check_batch
        from trainprobes.watch.rng import keep_rng
        try:
            data = self.trainer.train_dataset
            n = min(self.packing_examples, len(data))
            with keep_rng():  # a collator that draws (MLM masking) from the global generators
                collate = copy.deepcopy(self.trainer.data_collator)  # ...or from its own
                batch = collate([data[i] for i in range(n)])
            device = next(self.trainer.model.parameters()).device
            batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
            r = check_batch(self.trainer.model, batch, seed=self.sentinel.seed)
        except Exception as e:
            self.sentinel._own_error("checking the packing of a batch", e)
            return None
        if r is None:
            log.info("trainprobes sentinel: the collator's batch is not packed; no packing check")
            return None
        self.sentinel.report(r)  # SentinelFinding (stop_on_finding) leaves train() from here
        return r

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.nn.parallel import DistributedDataParallel
        if self.packing:
            from trainprobes.watch.packing_watch import watch_packing
            self._packing = watch_packing(self.trainer.model, self.sentinel,
                                          max_documents=self.packing_max_documents)
        if self.routers:  # True: found by class name; else a dict or list of modules
            from trainprobes.watch.router import watch_routers
            watch_routers(self.trainer.model, self.sentinel, every=self.router_every,
                          routers=None if self.routers is True else self.routers)
        if self.updates:
            from trainprobes.watch.updates import watch_updates
            watch_updates(kwargs.get("optimizer") or self.trainer.optimizer, self.sentinel)
        if self.gemms is not None:
            from trainprobes.watch.gemm import watch_gemms
            watch_gemms(self.trainer.model, self.sentinel, **self.gemms)
        if not self.ddp:
            return
        model = self.trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            raise InvalidArgument(
                f"the Trainer's model is a {type(model).__name__}, not DistributedDataParallel: the "
                "sentinel watches DDP's gradient reduction and would watch nothing here (launch "
                "the Trainer on 2 or more ranks, e.g. torchrun, with DDP; or pass ddp=False to "
                "watch only routers, updates, gemms or packing)")
        attach_ddp(model, self.sentinel, hook=self.hook, state=self.state)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.packing and hasattr(self, "_packing"):
            self._packing.check_pending()  # SentinelFinding (stop_on_finding) leaves from here

    def on_step_end(self, args, state, control, **kwargs):
        looked = self.sentinel.streams.looks
        self.sentinel.step()  # SentinelFinding (stop_on_finding) leaves train() from here
        if self.sentinel.streams.looks != looked:
            # Trainer.log's on_log clears control.should_log (transformers 5.25
            # CallbackHandler.on_log): kept, or the Trainer's own loss log of this step is lost
            should_log = control.should_log
            self.trainer.log(self.sentinel.summary())
            control.should_log = should_log

    def on_train_end(self, args, state, control, **kwargs):
        self.sentinel.close()
        self.trainer.log(self.sentinel.summary())
