"""Weight updates of sampled parameter elements against the same optimizer step in fp64.

    sentinel = Sentinel(findings="sentinel.jsonl")
    watch_updates(optimizer, sentinel)          # torch.optim's own step pre/post hooks

At a checked step (sentinel.steps % every == 0), through Optimizer.register_step_pre_hook
and register_step_post_hook:

1. before the step, for `elements` elements of each of `tensors` parameters (both drawn by
   the watch's own torch.Generator, the parameters afresh at every checked step, so each
   is checked alike over steps; default 8, None: every parameter), copies in fp64 of the parameter, its gradient and every optimizer
   state tensor shaped like it (exp_avg, exp_avg_sq, momentum_buffer, ...); scalar state
   (Adam's step) is copied as it is;
2. the same optimizer class, with the same group hyperparameters (lr as it is now), steps a
   shadow of those fp64 elements: `intended` = shadow after - before, the update the
   optimizer means, computed in fp64. Sound only for element-wise optimizers (ALLOWED):
   a norm or a factorisation over the whole tensor (LAMB, Adafactor) cannot be sliced;
3. after the real step, `realised` = parameter after - before (exact in fp64 for fp32,
   bf16 and fp16 values). Per step and parameter group: the signed relative error
   e = sum(sign(intended) (realised - intended)) / sum(|intended|) (e < 0: updates lost),
   streamed into the bias test the DDP sentinel uses (trainprobes.watch.stream: judged every
   `interval` steps, alpha spent over looks and groups), and the stalled share: elements
   whose intended update was not zero and whose parameter did not move at all.

A step given a closure (optimizer.step(closure), as Lightning calls it) runs its backward
after the pre-hook, so the gradients it uses do not exist there yet: such a step is not
checked (an error of the watch's own, saying so) unless the caller replays it after the
backward (prepared_by_caller=True and before_step(): SentinelLightning does this from
on_before_optimizer_step).

Gradient accumulation (on by default in a single-process run): a tensor hook on each parameter
(Tensor.register_hook, called with each backward's contribution before autograd adds it to
p.grad) sums the sampled elements' contributions in fp64 from p.grad's value at the step's
first contribution; p.grad's sampled elements after the last contribution (a post-accumulate
hook, so clipping or unscaling before the step is not counted) are compared with that sum
the same way (streams "accumulation.<group>"). bf16 sums of same-sign contributions stall once the sum's ulp
passes twice a contribution: 512 micro-batches of about 4.2 lose about 10%.

A bf16 parameter near 1 moves in steps of 2^-7; an update under half of that rounds to no
change (stalled, e = -1); fp32 rounds the update at 2^-24 relative, symmetric (noise).

Nothing of the run changes: copies are new tensors, the shadow optimizer owns its own
fp64 state, no RNG is drawn outside the watch's generator (tests/test_watch_updates.py).
"""
from __future__ import annotations

import logging

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.bias import signed_relative_error
from trainprobes.result import Result
from trainprobes.validation import check_bool, check_int
from trainprobes.watch.stream import Streams

__all__ = ["watch_updates", "UpdateWatch", "ALLOWED"]

log = logging.getLogger("trainprobes.watch")

PROBE = "numerics.bias"
POOLED = "all_groups"
# element-wise optimizers: each element's update depends on that element's gradient and state
ALLOWED = ("SGD", "Adam", "AdamW", "Adamax", "RMSprop", "Adagrad", "NAdam", "RAdam")
# the single-tensor, non-fused path for the shadow: same arithmetic, any dtype
# fp64 copies per sampled element at a checked step: before, gradient, shadow, up to three
# state tensors, the fp64 accumulation sum and its reading
FP64_COPIES = 8
_PLAIN = {"foreach": False, "fused": False, "capturable": False, "differentiable": False}


class UpdateWatch:
    """See the module docstring. Made by watch_updates; stepped by its Sentinel."""

    def __init__(self, sentinel, optimizer, *, every: int, elements: int, seed: int,
                 accumulation: bool = False, tensors: int | None = None):
        self.sentinel, self.optimizer = sentinel, optimizer
        self.every = check_int(every, "every", min=1, hint="steps between checked updates")
        self.elements = check_int(elements, "elements", min=1, hint="per parameter, e.g. 256")
        self.tensors = None if tensors is None else check_int(
            tensors, "tensors", min=1, hint="parameters checked per step, e.g. 8, or None: all")
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        st = sentinel.streams
        self.streams = Streams(alpha=st.alpha, min_effect=st.min_effect, keep=st.keep)
        self._pending: list = []
        # True: the caller calls before_step() after the backward (the step takes a closure)
        self.prepared_by_caller = False
        self.checked_steps = 0
        self.stalled = {}  # group key -> [stalled elements, elements with an update]
        self.dtypes = {}
        self.handles = [optimizer.register_step_pre_hook(self._pre_hook()),
                        optimizer.register_step_post_hook(self._post_hook())]
        # gradient accumulation: per parameter, the sampled elements' contributions summed
        # in fp64 as backward hands them over, compared with p.grad before the step
        self._acc: dict = {}  # id(param) -> [cycle, idx, fp64 sum, contributions]
        self.accumulation = accumulation
        self.contributions = 0
        if accumulation:
            for gi, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    if p.requires_grad:
                        self.handles += [p.register_hook(self._grad_hook(p)),
                                         p.register_post_accumulate_grad_hook(self._summed_hook())]

    def _pre_hook(self):
        def hook(optimizer, args, kwargs):
            if self.sentinel.steps % self.every:
                return
            if kwargs.get("grad_scale") is not None:  # a fused step unscales inside itself
                self._acc.clear()
                self._pending = []
                self.sentinel._own_error("checking the update", InvalidArgument(
                    "the step was given grad_scale (a fused optimizer under GradScaler): p.grad "
                    "is still scaled, its update cannot be replayed; step not checked"))
                return
            if self.prepared_by_caller:
                return
            # torch passes the step's own args, the optimizer first: step(closure) is args[1]
            if kwargs.get("closure", args[1] if len(args) > 1 else None) is not None:
                # step(closure) makes the gradients inside the step, after this hook: a replay
                # here would use the previous step's (Lightning does this; its callback calls
                # before_step() from on_before_optimizer_step, after the backward, instead)
                self._acc.clear()
                self._pending = []
                self.sentinel._own_error("checking the update", InvalidArgument(
                    "the step was given a closure: its backward runs after the step's pre-hook, "
                    "so the gradients the step uses cannot be read there; step not checked (set "
                    "prepared_by_caller=True and call before_step() after the backward)"))
                return
            self.before_step()
        return hook

    def before_step(self) -> None:
        """Copy the sampled elements and replay the step in fp64 from the gradients as they are
        now: from the step pre-hook, or, where the backward runs inside step(closure), from
        the caller once the backward is done (SentinelLightning's on_before_optimizer_step)."""
        if self.sentinel.steps % self.every:
            return
        if self._acc:
            try:
                self._accumulated()
            except Exception as e:
                self.sentinel._own_error("reading the accumulated gradients", e)
        try:
            self._pending = self._intended()
        except Exception as e:
            self._pending = []
            self.sentinel._own_error("computing the fp64 update", e)

    def _grad_hook(self, p):
        # a closure over the parameter: called with each backward's gradient before autograd
        # adds it to p.grad (so the contribution itself is seen, not the running sum)
        def hook(grad):
            step = self.sentinel.steps
            if step % self.every:
                return None
            try:
                a = self._acc.get(id(p))
                if a is None or a[0] != step:  # the first contribution of this step
                    n = p.numel()
                    idx = torch.randint(n, (min(n, self.elements),), generator=self._generator)
                    idx = idx.to(p.device)
                    start = (p.grad.detach().reshape(-1)[idx].to(torch.float64) if p.grad is not None
                             else torch.zeros(len(idx), dtype=torch.float64, device=p.device))
                    a = self._acc[id(p)] = [step, idx, start, 0, None]
                a[2] += grad.detach().reshape(-1)[a[1]].to(torch.float64)
                a[3] += 1
            except Exception as e:
                self._acc.pop(id(p), None)
                self.sentinel._own_error("summing a gradient contribution in fp64", e)
            return None
        return hook

    def _summed_hook(self):
        # after autograd added a contribution: p.grad's sampled elements as they stand then,
        # so gradient clipping or unscaling between backward and the step is not counted
        def hook(p):
            a = self._acc.get(id(p))
            if a is None or a[0] != self.sentinel.steps or p.grad is None:
                return
            try:
                a[4] = p.grad.detach().reshape(-1)[a[1]].to(torch.float64)
            except Exception as e:
                self._acc.pop(id(p), None)
                self.sentinel._own_error("reading an accumulated gradient", e)
        return hook

    def _accumulated(self) -> None:
        """Before the step: each parameter's accumulated p.grad against its fp64 sum."""
        step, by_key = self.sentinel.steps, {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                a = self._acc.pop(id(p), None)
                if a is None or a[0] != step or a[4] is None:
                    continue
                self.contributions = max(self.contributions, a[3])
                realised = a[4]
                r, i = by_key.get(f"accumulation.group{gi}", ([], []))
                by_key[f"accumulation.group{gi}"] = (r + [realised.cpu()], i + [a[2].cpu()])
        if by_key:
            self._add_all(by_key, step, "accumulation." + POOLED)

    def _post_hook(self):
        def hook(optimizer, args, kwargs):
            pending, self._pending = self._pending, []
            try:
                self._realised(pending)
            except Exception as e:
                self.sentinel._own_error("reading the realised update", e)
        return hook

    def _intended(self) -> list:
        """[(group key, param, idx, before, intended)] for the sampled elements. The sampled
        elements of a group's parameters whose scalar state agrees (Adam's step) are stepped
        as one fp64 tensor: the optimizers in ALLOWED are element-wise, so the arithmetic per
        element is the same, at one shadow step per group instead of one per parameter."""
        params = [(gi, p) for gi, group in enumerate(self.optimizer.param_groups)
                  for p in group["params"] if p.grad is not None]
        if not params:
            return []
        if self.tensors is not None and len(params) > self.tensors:
            # the cost is per parameter tensor (its copies, its share of the shadow step), not
            # per element: a fixed number a step keeps it bounded on a model of many tensors
            pick = torch.randperm(len(params), generator=self._generator)[:self.tensors]
            params = [params[i] for i in pick.sort().values.tolist()]
        sizes = [min(p.numel(), self.elements) for _, p in params]
        # one draw for every parameter's indices (uniform, with replacement, as randint)
        u = torch.rand(sum(sizes), generator=self._generator, dtype=torch.float64)
        parts: dict = {}  # (group, scalar state) -> [(param, idx, before, grad, state)]
        start = 0
        for (gi, p), k in zip(params, sizes):
            n = p.numel()
            idx = (u[start:start + k] * n).long().clamp_(max=n - 1).to(p.device)
            start += k
            before = p.detach().reshape(-1)[idx].to(torch.float64)  # indexing copies
            grad = p.grad.detach().reshape(-1)[idx].to(torch.float64)
            state = {key: _slice_state(key, v, n, idx)
                     for key, v in self.optimizer.state.get(p, {}).items()}
            # stepped together only with the same state keys and the same scalars: SGD has no
            # scalar state, so a parameter without a momentum_buffer yet (its first gradient
            # came late) would otherwise share a shadow with one that has a buffer
            scalars = tuple(sorted((key, _scalar(v)) for key, v in state.items()
                                   if not _per_element(key, v, k)))
            kinds = tuple(sorted(state))
            parts.setdefault((gi, kinds, scalars), []).append((p, idx, before, grad, state))
            self.dtypes.setdefault(f"group{gi}", set()).add(str(p.dtype).replace("torch.", ""))
        groups, taken = [], []
        for (gi, _, _), items in parts.items():
            s = torch.cat([it[2] for it in items])
            s.grad = torch.cat([it[3] for it in items])
            first = items[0][4]
            state = {key: torch.cat([it[4][key] for it in items])
                     if _per_element(key, v, len(items[0][1])) else v for key, v in first.items()}
            group = self.optimizer.param_groups[gi]
            hyper = {key: v for key, v in group.items() if key != "params"}
            hyper.update({key: v for key, v in _PLAIN.items() if key in hyper})
            groups.append(({"params": [s], **hyper}, s, state))
            taken.append((f"group{gi}", items, s))
        shadow = type(self.optimizer)([g for g, _, _ in groups])
        for _, s, state in groups:
            if state:
                shadow.state[s] = state
        before_all = {id(s): s.detach().clone() for _, s, _ in groups}
        shadow.step()
        out = []
        for key, items, s in taken:
            intended = s.detach() - before_all[id(s)]
            at = 0
            for p, idx, before, _, _ in items:
                out.append((key, p, idx, before, intended[at:at + len(idx)]))
                at += len(idx)
        return out

    def _realised(self, pending: list) -> None:
        if not pending:
            return
        self.checked_steps += 1
        step = self.sentinel.steps
        by_key: dict = {}
        for key, p, idx, before, intended in pending:
            realised = p.detach().reshape(-1)[idx].to(torch.float64) - before
            r, i = by_key.get(key, ([], []))
            by_key[key] = (r + [realised.cpu()], i + [intended.cpu()])
        self._add_all(by_key, step, POOLED)

    def _add_all(self, by_key: dict, step: int, pooled: str) -> None:
        allr, alli = [], []
        for key, (r, i) in by_key.items():
            r, i = torch.cat(r), torch.cat(i)
            allr.append(r)
            alli.append(i)
            self._add(key, step, r, i)
        self._add(pooled, step, torch.cat(allr), torch.cat(alli))

    def _add(self, key: str, step: int, realised, intended) -> None:
        moving = intended != 0
        if not key.startswith("accumulation."):
            c = self.stalled.setdefault(key, [0, 0])
            c[0] += int((moving & (realised == 0)).sum())
            c[1] += int(moving.sum())
        zero = not bool(moving.any())
        err = float("nan") if zero else signed_relative_error(realised, intended)
        self.streams.stream(key, realised.numel()).add(step, err, zero_reference=zero)

    def step(self, step: int) -> list[Result]:
        if (step + 1) % self.sentinel.interval:
            return []
        new = []
        for j in self.streams.look(step + 1):
            if j.biased and self.streams.streams[j.key].found_at == step + 1:
                new.append(self._result(j))
        return new

    def _result(self, j) -> Result:
        s = self.streams.streams[j.key]
        stalled, moving = self.stalled.get(j.key, [0, 0])
        share = stalled / moving if moving else None
        group = j.key.removeprefix("accumulation.")
        acc = j.key.startswith("accumulation.")
        dtypes = sorted(set().union(*self.dtypes.values())) if group == POOLED else sorted(
            self.dtypes.get(group, ()))
        ev = {"errors": list(s.errors), "sample_steps": list(s.steps), "every": self.every,
              "elements_per_param": self.elements, "tensors_per_step": self.tensors,
              "param_dtypes": dtypes,
              "optimizer": type(self.optimizer).__name__, "look": j.look, "alpha_look": j.alpha,
              "found_at_step": s.found_at, "found": s.found, "biased_at_this_look": j.now,
              "reference": "the same optimizer class and hyperparameters stepping fp64 copies "
                           "of the sampled elements, their gradients and state"}
        target = f"watch:updates[{type(self.optimizer).__name__}].{j.key}"
        base = {"stalled_share": share, "stalled_elements": stalled, "updated_elements": moving,
                "zero_reference_trials": s.zero_reference, "nonfinite_trials": s.nonfinite}
        if j.stats is None:
            return Result(probe=PROBE, target=target, verdict="error", seed=self.seed,
                          metrics={"biased": None, "trials": len(s.errors), **base}, evidence=ev,
                          codes=["TP-E1"], message=f"cannot judge {j.key}'s updates: {j.reason}")
        st = j.stats
        what = (f"accumulated gradients (up to {self.contributions} micro-batches)" if acc
                else "realised weight updates")
        stall = ("" if acc or share is None else
                 f"; {share:.1%} of sampled updates stalled (no change at all)")
        head = (f"{j.key} ({', '.join(dtypes)}): {what} off by {st['bias']:+.3g} relative to "
                f"fp64 over {st['trials']} checked steps, p={st['p_value']:.2g}{stall}")
        if acc:
            ev["contributions"] = self.contributions
        if st["biased"]:
            f = s.found  # the direction is the finding's, not the latest samples'
            gone = "" if j.now is not False else (
                f"; no longer seen in the latest samples (found at look {f['look']}: "
                f"{f['bias']:+.3g} over {f['trials']} checked steps, p={f['p_value']:.2g} at "
                f"level {f['alpha']:.2g})")
            return Result(probe=PROBE, target=target, verdict="fail", codes=["TP-B1"],
                          metrics={**st, **base}, evidence=ev, seed=self.seed,
                          message=head + f": biased since step {s.found_at}, "
                          + ("gradients" if acc else "updates") + " "
                          + ("lost" if f["bias"] < 0 else "inflated") + " on average" + gone)
        return Result(probe=PROBE, target=target, verdict="pass", codes=[], metrics={**st, **base},
                      evidence=ev, seed=self.seed, message=head + ": noise, no bias of at least "
                      f"{self.streams.min_effect:.3g}")

    def close(self) -> list[Result]:
        for h in self.handles:
            h.remove()
        if not self.streams.streams:
            return [Result(probe=PROBE, target=f"watch:updates[{type(self.optimizer).__name__}]",
                           verdict="error", seed=self.seed, codes=["TP-E1"],
                           metrics={"biased": None, "trials": 0},
                           evidence={"steps": self.sentinel.steps, "every": self.every},
                           message=f"cannot judge the weight updates: no optimizer step checked in "
                           f"{self.sentinel.steps} steps")]
        return [self._result(j) for j in self.streams.look(self.sentinel.steps, full=True)]

    def summary(self) -> dict:
        stalled, moving = self.stalled.get(POOLED, [0, 0])
        return {"sentinel/update_checks": self.checked_steps,
                "sentinel/update_stalled_share": stalled / moving if moving else 0.0,
                "sentinel/update_findings": sum(s.found_at is not None
                                                for s in self.streams.streams.values())}


def _world() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _per_element(key: str, v, k: int) -> bool:
    """A sliced state entry with one value per sampled element (not Adam's step)."""
    return torch.is_tensor(v) and key != "step" and v.dim() == 1 and v.numel() == k


def _scalar(v):
    """A scalar state entry as a hashable value (a 1-element tensor, a number, None)."""
    return v.item() if torch.is_tensor(v) else v


def _slice_state(key: str, v, n: int, idx):
    """An optimizer state entry for the shadow: a per-element tensor (exp_avg, ...) sliced to
    fp64, a scalar (Adam's step) copied as it is."""
    if not torch.is_tensor(v):
        return v
    if key != "step" and v.numel() == n:
        return v.detach().reshape(-1)[idx].to(torch.float64)
    if v.numel() == 1:
        return v.detach().clone()
    raise InvalidArgument(f"optimizer state {key!r} has {v.numel()} elements for a parameter of "
                          f"{n}: not element-wise, its update cannot be replayed on a sample")


def watch_updates(optimizer, sentinel, *, every: int = 1, elements: int = 256, tensors: int | None = 8,
                  accumulation: bool | None = None, seed: int | None = None) -> UpdateWatch:
    """Check the weight updates of `elements` sampled elements per parameter against fp64
    every `every` steps (see the module docstring). tensors: how many parameters a checked
    step samples (drawn afresh each time; None: all of them). Refused up front: an optimizer that is
    not a torch.optim.Optimizer, or one not in ALLOWED (its update cannot be sliced).
    accumulation: None (on in a single-process run, off on several ranks, where DDP and
    FSDP replace p.grad with the reduced mean), True (refused on several ranks), False."""
    from trainprobes.watch.sentinel import Sentinel
    if not isinstance(sentinel, Sentinel):
        raise InvalidArgument(f"sentinel={sentinel!r} must be a trainprobes.watch.Sentinel")
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise InvalidArgument(f"optimizer is a {type(optimizer).__name__}, not a "
                              "torch.optim.Optimizer: its step hooks are what the watch uses")
    if type(inner).__name__ not in ALLOWED or type(inner).__module__.split(".")[:2] != ["torch", "optim"]:
        raise InvalidArgument(
            f"optimizer {type(inner).__module__}.{type(inner).__name__}: the fp64 replay slices "
            f"the optimizer's state element by element, sound only for torch.optim's element-wise "
            f"optimizers ({', '.join(ALLOWED)}); a norm or factorisation over a whole tensor "
            "cannot be replayed on a sample")
    elements = check_int(elements, "elements", min=1, hint="per parameter, e.g. 256")
    sampled = sum(min(p.numel(), elements) for g in inner.param_groups for p in g["params"])
    if sampled * 8 * FP64_COPIES > sentinel.budget:
        raise InvalidArgument(
            f"elements={elements} per parameter samples {sampled} elements, "
            f"{FP64_COPIES} fp64 copies each ({sampled * 8 * FP64_COPIES} bytes) at a checked "
            f"step: over the sentinel's budget={sentinel.budget}; lower elements or raise budget")
    ranks = _world()
    if accumulation is None:
        accumulation = ranks == 1
        if not accumulation:
            # said, not silent: on several ranks only the updates are watched
            log.warning("trainprobes sentinel: %d ranks, gradient accumulation not watched (DDP "
                        "and FSDP replace p.grad with the reduced mean); weight updates are",
                        ranks)
    elif check_bool(accumulation, "accumulation") and ranks > 1:
        raise InvalidArgument(
            f"accumulation=True on {ranks} ranks: a parameter's hook sees this rank's "
            "contribution, but DDP and FSDP replace p.grad with the reduced mean, so the fp64 "
            "sum would not be what p.grad should hold; pass accumulation=False (the weight "
            "updates are still watched)")
    w = UpdateWatch(sentinel, inner, every=every, elements=elements, tensors=tensors,
                    seed=sentinel.seed if seed is None else seed, accumulation=accumulation)
    sentinel.add_watch(w)
    return w
