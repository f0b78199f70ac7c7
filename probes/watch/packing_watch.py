"""Packed-document isolation on the run's real batches, at the first batch and whenever the
batch's packing convention changes (trainprobes.watch.convention).

    sentinel = Sentinel(findings="sentinel.jsonl")
    watch = watch_packing(model, sentinel)   # a forward pre-hook on the (unwrapped) model
    ... the training step's forward and backward ...
    watch.check_pending()                    # a safe point: before optimizer.step()
    sentinel.step()                          # also checks what is pending

1. A forward pre-hook (torch's register_forward_pre_hook, with_kwargs=True) reads, on each
   training-mode call with autograd on, the Convention of the keyword arguments the model
   receives: the batch as the collator made it and the trainer passed it. Lightning's
   callback hands its batch to observe() instead. Eval-mode calls (an evaluation loop, the
   check's own) and calls under no_grad (generation in training mode) are skipped.
2. A convention not seen before is recorded with the step it first appeared at; if it is
   packed (restarting position ids, seq_idx, cu_seq_lens), the batch is copied (new
   tensors, never views; the copies pending together must fit the sentinel's budget) for
   a check.
3. The check runs at check_pending() (the callbacks call it after backward, before the
   optimizer step: a leak at step 0 is caught before the first update) or at sentinel.step():
   trainprobes.watch.packing.check_batch on the copy, with the model's own keys, under
   no_grad, in eval mode (dropout off; every submodule's mode restored), inside keep_rng(),
   on the model given (the unwrapped one: no DDP collective is issued).
4. The same convention is never checked twice; at most `max_checks` conventions are checked
   (each check is d + 2 forwards; a batch of more than `max_documents` documents is not
   checked: cannot judge, since the other ranks wait the check out); one past the bound is counted, warned about once, and
   named in a final "cannot judge" Result: never a silent pass.

A leak is the probe's Result (isolation.documents, fail, TP-I1) with the step and the
convention in its evidence, reported to the sentinel as it happens. A nondeterministic
forward (TP-C2: the same input, other outputs) is no isolation verdict: it is reported as
cannot judge (error, TP-E1), never as a leak. Errors of the watch are the sentinel's own:
logged, counted, never raised into the step.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.result import Result
from trainprobes.validation import check_int
from trainprobes.watch.convention import Convention, convention_of
from trainprobes.watch.packing import SKIP, check_batch

__all__ = ["watch_packing", "PackingWatch"]

log = logging.getLogger("trainprobes.watch")
PROBE = "isolation.documents"
# conventions remembered (not packed, or packed past max_checks): a bound on its memory
MAX_REMEMBERED = 1024


class PackingWatch:
    """See the module docstring. Made by watch_packing; stepped by its Sentinel."""

    def __init__(self, sentinel, model: torch.nn.Module, *, max_checks: int, hook: bool,
                 seed: int, max_documents: int = 64):
        self.sentinel, self.model, self.seed = sentinel, model, seed
        self.max_checks = check_int(max_checks, "max_checks", min=1,
                                    hint="distinct packed conventions checked, e.g. 8")
        self.max_documents = check_int(max_documents, "max_documents", min=2,
                                       hint="documents in a checked batch, e.g. 64")
        self.seen: dict[Convention, int] = {}      # convention -> the step it first appeared at
        self.checked: dict[Convention, str] = {}   # packed convention -> its verdict
        self.over: dict[Convention, int] = {}      # packed, past the bound: never checked
        self.unjudged: list[str] = []              # why a check could not judge (newest 20)
        self.not_read: str | None = None           # a batch that is not a dict: what it was
        self.batches = 0                           # training calls observed
        self.checks = 0
        self.leaks = 0
        self.seconds = {"convention": 0.0, "check": 0.0}  # wall time of its own work
        self._pending: list[tuple[int, Convention, dict]] = []
        self._busy = False
        # the module whose config names the attention implementation (a LightningModule
        # holds the HF model inside), found once: a walk over modules per batch costs
        self._configured = next((m for m in model.modules() if isinstance(
            getattr(getattr(m, "config", None), "_attn_implementation", None), str)), None)
        self.handle = (model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
                       if hook else None)

    # --- seeing batches -----------------------------------------------------------------

    def _pre_hook(self, module, args, kwargs):
        # a training batch is called with autograd on: generation in training mode (RL
        # trainers, under no_grad, a cache object beside it) is not one
        if self._busy or not module.training or not torch.is_grad_enabled():
            return None
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            kwargs = {"input_ids": args[0], **kwargs}  # its name as HF models have it
        elif len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
            kwargs = args[0]  # model(batch): the batch itself
        elif args:  # anything else positional: said unreadable, never taken for token ids
            kwargs = None
        self.observe(kwargs if kwargs is not None else args)
        return None

    def observe(self, batch) -> None:
        """Read the convention of a batch the model is about to receive (see the docstring)."""
        if self._busy:
            return
        t0 = time.perf_counter()
        try:
            self.batches += 1
            if not isinstance(batch, Mapping):
                if self.not_read is None:
                    self.not_read = (f"the batch is a {type(batch).__name__}, not a dict of "
                                     "keyword arguments: its packing convention cannot be read")
                    log.warning("trainprobes sentinel: %s (step %d)", self.not_read, self.sentinel.steps)
                return
            c = convention_of(batch, self._configured)
            if c in self.seen or c in self.over:
                return
            step = self.sentinel.steps
            if not c.packed:
                if len(self.seen) < MAX_REMEMBERED:
                    self.seen[c] = step
                if c.positions == "unread":  # packed or not is unknown: said, never a pass
                    kind = dict(c.keys).get("position_ids")
                    self.unjudged = (self.unjudged + [
                        f"step {step}: position_ids is {kind}, not a [B, L] tensor: whether "
                        "the batch is packed cannot be read"])[-20:]
                    log.warning("trainprobes sentinel: %s", self.unjudged[-1])
                    return
                log.info("trainprobes sentinel: step %d, a batch convention not packed, nothing "
                         "to check: %s", step, c.text)
                return
            if len(self.checked) + len(self._pending) >= self.max_checks:
                if not self.over:
                    log.warning("trainprobes sentinel: step %d, a packed batch convention past "
                                "max_checks=%d, not checked: %s", step, self.max_checks, c.text)
                if len(self.over) < MAX_REMEMBERED:
                    self.over[c] = step
                return
            self.seen[c] = step
            try:
                copy = self._copy(batch)
            except Exception as e:
                self._unjudged(c, f"step {step}: {type(e).__name__}: {e}")
                raise
            self._pending.append((step, c, copy))
        except Exception as e:
            self.sentinel._own_error("reading a batch's packing convention", e)
        finally:
            self.seconds["convention"] += time.perf_counter() - t0

    def _copy(self, batch: Mapping) -> dict:
        """New tensors (never views of the run's), within the sentinel's budget."""
        keep = {k: v for k, v in batch.items() if k not in SKIP or k == "input_ids"}
        shared = [f"{k} ({type(v).__name__})" for k, v in keep.items() if not isinstance(
            v, (torch.Tensor, int, float, bool, str, type(None)))]
        if shared:  # a cache object the check's forwards would update under the run
            raise InvalidArgument(f"batch key {shared[0]} is neither a tensor nor a plain value: "
                                  "the check would call the model with the run's own object")
        size = _nbytes(keep)
        held = sum(_nbytes(p[2]) for p in self._pending)  # copies waiting for their check
        if size + held > self.sentinel.budget:
            raise InvalidArgument(f"the batch's copy needs {size} bytes" + (
                f" beside {held} held for checks pending" if held else "") + ", over the "
                f"sentinel's budget={self.sentinel.budget}: raise budget to check it")
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in keep.items()}

    # --- checking -----------------------------------------------------------------------

    def step(self, step: int) -> list[Result]:
        """Check what is pending; returns the Results (the sentinel reports them)."""
        pending, self._pending = self._pending, []
        return [r for r in (self._check(*p) for p in pending) if r is not None]

    def check_pending(self) -> None:
        """Check what is pending now and report it (a safe point: after backward, before
        the optimizer step). SentinelFinding (stop_on_finding) leaves from here."""
        for r in self.step(self.sentinel.steps):
            self.sentinel.report(r)

    def _check(self, step: int, c: Convention, batch: dict) -> Result | None:
        t0 = time.perf_counter()
        self._busy = True
        try:
            r = check_batch(self.model, batch, seed=self.seed + step,
                            max_documents=self.max_documents)
        except Exception as e:
            self.sentinel._own_error(f"checking the packing of step {step}'s batch", e)
            self._unjudged(c, f"step {step}: {type(e).__name__}: {e}")
            return None
        finally:
            self._busy = False
            self.seconds["check"] += time.perf_counter() - t0
        self.checks += 1
        if r is None:  # document_starts said packed, so this is not expected: say so
            self._unjudged(c, f"step {step}: the batch's documents could not be read")
            return None
        r.evidence.update({"step": step, "convention": c.text, "convention_fields": c._asdict(),
                           "checked": "a copy of the batch the model received at that step, "
                                      "after its backward, before its optimizer step, eval mode"})
        if r.metrics.get("isolated") is None:  # nondeterministic: no isolation verdict
            self._unjudged(c, f"step {step}: {r.message}")
            return Result(probe=PROBE, target=r.target, verdict="error", codes=["TP-E1"],
                          seed=r.seed, metrics={"isolated": None, **{
                              k: v for k, v in r.metrics.items() if k != "isolated"}},
                          evidence={**r.evidence, "probe_codes": r.codes},
                          message=f"cannot judge packed-document isolation at step {step}: {r.message}")
        self.checked[c] = r.verdict
        if r.verdict == "fail":
            self.leaks += 1
            # the finding first, then where: the convention text is long
            r.message = f"{r.message} (step {step}, batch convention {c.text})"
        return r

    def _unjudged(self, c: Convention, why: str) -> None:
        self.checked[c] = "error"
        self.unjudged = (self.unjudged + [why])[-20:]

    def close(self) -> list[Result]:
        """Check what is still pending; one Result saying what could not be judged, if any."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        out = self.step(self.sentinel.steps)
        why = list(self.unjudged)
        if self.over:
            first = min(self.over.values())
            why.append(f"{len(self.over)} packed batch conventions past max_checks={self.max_checks} "
                       f"were not checked (first at step {first})")
        if self.not_read is not None:
            why.append(self.not_read)
        if self.batches == 0:
            why.append("no training forward of the model was seen (is it the module the "
                       "trainer calls?)")
        if why:
            out.append(Result(
                probe=PROBE, target="watch:packing", verdict="error", codes=["TP-E1"],
                seed=self.seed, metrics={"isolated": None, "n_leaks": None},
                evidence={**self._numbers(), "reasons": why,
                          "conventions_over_bound": [c.text for c in list(self.over)[:20]]},
                message="cannot judge the packing of every batch: " + "; ".join(why)))
        return out

    def _numbers(self) -> dict:
        return {"batches": self.batches, "conventions": len(self.seen), "checks": self.checks,
                "leaks": self.leaks, "over_bound": len(self.over), "max_checks": self.max_checks,
                "convention_seconds": self.seconds["convention"],
                "check_seconds": self.seconds["check"]}

    def summary(self) -> dict:
        return {"sentinel/packing_conventions": len(self.seen),
                "sentinel/packing_checks": self.checks, "sentinel/packing_leaks": self.leaks}


def _nbytes(batch: Mapping) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def watch_packing(model: torch.nn.Module, sentinel, *, max_checks: int = 8, hook: bool = True,
                  seed: int | None = None, max_documents: int = 64) -> PackingWatch:
    """Check packed-document isolation on the run's batches, once per packing convention
    (see the module docstring). model: the module that receives the batch's keys, unwrapped
    (not the DDP wrapper: the check must issue no collective). hook=False: no forward
    pre-hook; batches come through PackingWatch.observe (Lightning's callback).
    max_documents: a batch of more documents is not checked (cannot judge): a check is
    d + 2 forwards of the batch on one rank, which the other ranks wait out."""
    from trainprobes.watch.sentinel import Sentinel
    if not isinstance(sentinel, Sentinel):
        raise InvalidArgument(f"sentinel={sentinel!r} must be a trainprobes.watch.Sentinel")
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgument(f"model is a {type(model).__name__}, not a torch.nn.Module")
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel):
        raise InvalidArgument("model is a DistributedDataParallel: pass its .module (the check "
                              "calls the model outside the step and must issue no collective)")
    sharded = _sharded(model)
    if sharded:
        raise InvalidArgument(
            f"the model is sharded ({sharded}): its forward gathers parameters with a collective, "
            "and the check calls it on one rank only, when that rank's batch shows a new "
            "convention; the other ranks would not join and the run would hang. Pass "
            "packing=False, or check a batch by hand with trainprobes.watch.packing.check_batch "
            "on an unsharded copy")
    w = PackingWatch(sentinel, model, max_checks=max_checks, hook=hook,
                     seed=sentinel.seed if seed is None else seed, max_documents=max_documents)
    sentinel.add_watch(w)
    return w


def _sharded(model: torch.nn.Module) -> str | None:
    """What shards the model (FSDP1 / FSDP2 / DeepSpeed ZeRO-3), or None."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    for m in model.modules():
        if isinstance(m, (FSDPModule, FullyShardedDataParallel)):
            return f"{type(m).__name__} at {type(model).__name__}"
    if any(hasattr(p, "ds_status") for p in model.parameters()):  # ZeRO-3's partitioned params
        return "DeepSpeed ZeRO-3 partitioned parameters"
    return None
