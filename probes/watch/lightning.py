"""Lightning through its own extension point, Callback.

    sentinel = Sentinel()
    trainer = L.Trainer(..., callbacks=[SentinelLightning(sentinel)])

on_train_start: `trainer.strategy.model` (the strategy's wrapped model) must be a
    DistributedDataParallel and the sentinel attaches to it with attach_ddp (hook, state:
    the comm hook to run, default allreduce_hook). Anything else is refused up front, naming
    what it is. Measured (Lightning 2.6.6, torch 2.13 CPU): DDPStrategy(ddp_comm_hook=...)
    registers the hook only on CUDA devices and drops it on CPU without a word; give the hook
    here instead, and the Result names the hook DDP actually ran. On CUDA, where Lightning
    registered it, attach_ddp refuses (DDP takes one hook) and says to pass it here.
on_train_start, routers / updates / gemms: watch_routers on the LightningModule
    (routers=True: found by class name), watch_updates on its one optimizer, watch_gemms on
    the LightningModule (gemms=True: its defaults, fp8-tensor on h200-scaled-mm, wgrad, every
    50 steps; or a dict of watch_gemms arguments); ddp=False: no DDP model needed.
on_train_batch_end: sentinel.step() (a step is a training batch); after a look its numbers go
    to the module's log_dict, so every logger the Trainer has gets them.
on_train_end: sentinel.close(); the Results in sentinel.results.
"""
from __future__ import annotations

from lightning.pytorch.callbacks import Callback
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_bool
from trainprobes.watch.ddp import attach_ddp


class SentinelLightning(Callback):
    def __init__(self, sentinel, hook=None, state=None, *, ddp: bool = True, routers=None,
                 updates: bool = False, router_every: int = 50, gemms=False):
        from trainprobes.watch.gemm import gemm_options
        from trainprobes.watch.sentinel import Sentinel
        if not isinstance(sentinel, Sentinel):
            raise InvalidArgument(f"sentinel={sentinel!r} must be a trainprobes.watch.Sentinel")
        self.sentinel, self.hook, self.state = sentinel, hook, state
        self.ddp, self.updates = check_bool(ddp, "ddp"), check_bool(updates, "updates")
        self.routers, self.router_every = routers, router_every
        self.gemms = gemm_options(gemms)  # None: not watched; else watch_gemms' arguments
        if not (self.ddp or routers or self.updates or self.gemms is not None):
            raise InvalidArgument("ddp=False, no routers, updates=False and gemms=False: the "
                                  "sentinel would watch nothing")

    def on_train_start(self, trainer, pl_module):
        from torch.nn.parallel import DistributedDataParallel
        if self.routers:
            from trainprobes.watch.router import watch_routers
            watch_routers(pl_module, self.sentinel, every=self.router_every,
                          routers=None if self.routers is True else self.routers)
        if self.updates:
            from trainprobes.watch.updates import watch_updates
            if len(trainer.optimizers) != 1:
                raise InvalidArgument(f"updates=True with {len(trainer.optimizers)} optimizers: "
                                      "the sentinel watches one; call watch_updates on each")
            watch_updates(trainer.optimizers[0], self.sentinel)
        if self.gemms is not None:
            from trainprobes.watch.gemm import watch_gemms
            watch_gemms(pl_module, self.sentinel, **self.gemms)
        if not self.ddp:
            return
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise InvalidArgument(
                f"the Lightning strategy {type(trainer.strategy).__name__} holds a "
                f"{type(model).__name__}, not DistributedDataParallel: the sentinel watches DDP's "
                "gradient reduction and would watch nothing here (use strategy='ddp' on 2 or more "
                "devices)")
        attach_ddp(model, self.sentinel, hook=self.hook, state=self.state)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        looked = self.sentinel.streams.looks
        self.sentinel.step()  # SentinelFinding (stop_on_finding) leaves fit() from here
        if self.sentinel.streams.looks != looked:
            pl_module.log_dict({k: float(v) for k, v in self.sentinel.summary().items()},
                               on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module):
        self.sentinel.close()
