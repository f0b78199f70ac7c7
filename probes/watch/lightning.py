"""Lightning through its own extension point, Callback.

    sentinel = Sentinel()
    trainer = L.Trainer(..., callbacks=[SentinelLightning(sentinel)])

on_train_start: `trainer.strategy.model` (the strategy's wrapped model) must be a
    DistributedDataParallel and the sentinel attaches to it with attach_ddp (hook, state:
    the comm hook to run, default allreduce_hook), or hold FSDP2 modules (ModelParallelStrategy,
    fully_shard in configure_model) and it attaches with attach_fsdp2 (reduce_scatter: the
    custom reduce-scatter to run, default torch's). Anything else is refused up front,
    naming what it is. Measured (Lightning 2.6.6, torch 2.13 CPU): DDPStrategy(ddp_comm_hook=...)
    registers the hook only on CUDA devices and drops it on CPU without a word; give the hook
    here instead, and the Result names the hook DDP actually ran. On CUDA, where Lightning
    registered it, attach_ddp refuses (DDP takes one hook) and says to pass it here.
on_train_start, routers / updates / gemms: watch_routers on the LightningModule
    (routers=True: found by class name), watch_updates on its one optimizer, watch_gemms on
    the LightningModule (gemms=True: its defaults, fp8-tensor on h200-scaled-mm, wgrad, every
    50 steps; or a dict of watch_gemms arguments); ddp=False: no DDP model needed.
on_train_batch_start (packing=True, the default): the batch Lightning hands over goes to
    watch_packing (trainprobes.watch.packing_watch): its packing convention is read, and the
    first batch and each batch whose convention is new is checked for packed-document
    isolation on_before_optimizer_step (after backward, before the update), calling the
    LightningModule with the batch's keys. packing=<an nn.Module>: that module's forward
    pre-hook reads the keyword arguments it receives instead (the HF model inside, when the
    module's forward does not take the batch's keys). A batch that is not a dict cannot be
    read: said once, and a final "cannot judge" Result (packing=False turns it off). A batch
    of more than `packing_max_documents` documents is not checked (cannot judge).
on_before_optimizer_step, updates: the update watch's fp64 replay, after the backward that
    Lightning runs inside optimizer.step(closure) (torch's step pre-hook comes before it).
on_train_batch_end: sentinel.step() when the batch ended with an optimizer step
    (trainer.global_step moved: a step is an optimizer step, as under the Trainer callback;
    micro-batches of accumulate_grad_batches share it); after a look its numbers go to the
    module's log_dict, so every logger the Trainer has gets them.
on_train_end: sentinel.close(); the Results in sentinel.results.
"""
from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_bool, check_int
from trainprobes.watch.ddp import attach_ddp
from trainprobes.watch.fsdp import attach_fsdp2


class SentinelLightning(Callback):
    def __init__(self, sentinel, hook=None, state=None, *, ddp: bool = True, routers=None,
                 updates: bool = False, router_every: int = 50, packing=True,
                 reduce_scatter=None, gemms=False, packing_max_documents: int = 64):
        from trainprobes.watch.gemm import gemm_options
        from trainprobes.watch.sentinel import Sentinel
        if not isinstance(sentinel, Sentinel):
            raise InvalidArgument(f"sentinel={sentinel!r} must be a trainprobes.watch.Sentinel")
        self.sentinel, self.hook, self.state = sentinel, hook, state
        self.reduce_scatter = reduce_scatter
        self.ddp, self.updates = check_bool(ddp, "ddp"), check_bool(updates, "updates")
        self.routers, self.router_every = routers, router_every
        if not (isinstance(packing, torch.nn.Module) or isinstance(packing, bool)):
            raise InvalidArgument(f"packing={packing!r}: True (the batch Lightning hands over, "
                                  "the LightningModule called with its keys), False, or the "
                                  "nn.Module that receives the batch's keys")
        self.packing, self._packing, self._updates = packing, None, None
        self._stepped_at = None  # trainer.global_step when the sentinel last stepped
        self.packing_max_documents = check_int(packing_max_documents, "packing_max_documents", min=2)
        self.gemms = gemm_options(gemms)  # None: not watched; else watch_gemms' arguments
        if not (self.ddp or routers or self.updates or self.gemms is not None
                or packing is not False):
            raise InvalidArgument("ddp=False, packing=False, no routers, updates=False and "
                                  "gemms=False: the sentinel would watch nothing")

    def on_train_start(self, trainer, pl_module):
        from torch.nn.parallel import DistributedDataParallel
        self._stepped_at = trainer.global_step  # a resumed fit starts past 0
        if self.packing is not False:
            from trainprobes.watch.packing_watch import watch_packing
            own = self.packing is True
            self._packing = watch_packing(pl_module if own else self.packing, self.sentinel, hook=not own,
                                          max_documents=self.packing_max_documents)
        if self.routers:
            from trainprobes.watch.router import watch_routers
            watch_routers(pl_module, self.sentinel, every=self.router_every,
                          routers=None if self.routers is True else self.routers)
        if self.updates:
            from trainprobes.watch.updates import watch_updates
            if len(trainer.optimizers) != 1:
                raise InvalidArgument(f"updates=True with {len(trainer.optimizers)} optimizers: "
                                      "the sentinel watches one; call watch_updates on each")
            # Lightning runs forward and backward in the closure it passes to optimizer.step,
            # after torch's step pre-hooks: the replay is made in on_before_optimizer_step
            self._updates = watch_updates(trainer.optimizers[0], self.sentinel)
            self._updates.prepared_by_caller = True
        if self.gemms is not None:
            from trainprobes.watch.gemm import watch_gemms
            watch_gemms(pl_module, self.sentinel, **self.gemms)
        if not self.ddp:
            return
        from torch.distributed.fsdp import FSDPModule
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            if self.reduce_scatter is not None:
                raise InvalidArgument("reduce_scatter= is FSDP2's; the model runs under DDP: pass "
                                      "a comm hook as hook= instead")
            attach_ddp(model, self.sentinel, hook=self.hook, state=self.state)
        elif any(isinstance(m, FSDPModule) for m in model.modules()):
            if self.hook is not None or self.state is not None:
                raise InvalidArgument("hook= and state= are DDP's; the model is sharded with FSDP2 "
                                      "(fully_shard): pass a ReduceScatter as reduce_scatter= instead")
            attach_fsdp2(model, self.sentinel, reduce_scatter=self.reduce_scatter)
        else:
            raise InvalidArgument(
                f"the Lightning strategy {type(trainer.strategy).__name__} holds a "
                f"{type(model).__name__}, neither DistributedDataParallel nor sharded with FSDP2's "
                "fully_shard: the sentinel watches their gradient reduction and would watch "
                "nothing here (use strategy='ddp' on 2 or more devices, or ModelParallelStrategy "
                "with fully_shard in configure_model)")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.packing is True and self._packing is not None:
            self._packing.observe(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # after the backward (and any unscaling), before the step's update: the gradients it uses
        if self._updates is not None:
            self._updates.before_step()
        if self._packing is not None:
            self._packing.check_pending()  # SentinelFinding (stop_on_finding) leaves from here

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # the sentinel's step is the optimizer's (as under the Trainer callback): a batch that
        # only accumulated (accumulate_grad_batches) made no step, and global_step says so
        if trainer.global_step == self._stepped_at:
            return
        self._stepped_at = trainer.global_step
        looked = self.sentinel.streams.looks
        self.sentinel.step()  # SentinelFinding (stop_on_finding) leaves fit() from here
        if self.sentinel.streams.looks != looked:
            pl_module.log_dict({k: float(v) for k, v in self.sentinel.summary().items()},
                               on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module):
        self.sentinel.close()
