"""MoE routers perturb-checked on the run's own micro-batch every `every` steps.

    sentinel = Sentinel(findings="sentinel.jsonl")
    watch_routers(model, sentinel, every=50)   # routers found by class name, or routers=[...]

1. A forward hook on each router copies, at a checked step (sentinel.steps % every == 0,
   its first training-mode forward only), a sample of the hidden states the router sees:
   whole rows of a [B, T, D] input (as many as fit in `tokens`, at least one) drawn by the
   watch's own torch.Generator, or the first `tokens` of a
   flat [N, D] token list (HF MoE blocks flatten before the gate; the batch-major order
   is then the sequence order). The copy is new memory, never a view of the run's tensor.
2. At sentinel.step() (after the optimizer step: the router's weights are the new ones),
   trainprobes.causality.check runs the router on the sample with later positions
   perturbed, judging the routing DECISIONS (an integer or bool output: top-k ids, a
   dispatch mask of which tokens each expert takes), not the logits: an expert-choice
   router leaves every logit bit for bit where it was while its choices read the future.
3. The check runs under torch.no_grad(), in eval mode (each submodule's mode restored),
   inside keep_rng() (every global generator restored), with this watch's hooks silent and
   the router's buffers restored: the run's bits do not change (tests/test_watch_router.py).

A non-causal check is a finding (TP-C1, its step in the evidence), reported once per router;
later checks are counted. At close, one Result per router: fail (a non-causal check),
pass (every judged check causal), or cannot judge (nothing judged: never a pass).
"""
from __future__ import annotations

import contextlib

import torch
from trainprobes.causality import check
from trainprobes.errors import InvalidArgument, TargetError
from trainprobes.result import Result
from trainprobes.validation import check_int
from trainprobes.watch.rng import keep_rng

__all__ = ["watch_routers", "find_routers", "RouterWatch"]

PROBE = "causality.check"
_MOE_PARENT = ("moe", "sparse", "expert")


def find_routers(model: torch.nn.Module) -> dict:
    """{name: module} of modules whose class name holds "Router" or "Gate" inside a module
    whose class name holds MoE, Sparse or Expert (MixtralSparseMoeBlock.gate is a
    MixtralTopKRouter); the outermost such module only."""
    found = {}
    for name, parent in model.named_modules():
        if not any(w in type(parent).__name__.lower() for w in _MOE_PARENT):
            continue
        for child_name, m in parent.named_children():
            full = f"{name}.{child_name}" if name else child_name
            cls = type(m).__name__
            if ("Router" in cls or "Gate" in cls) and not any(full.startswith(f + ".") for f in found):
                found[full] = m
    return found


def first_integer(output):
    """The routing decision in a router's output: the output if it is an integer or bool
    tensor, else the first such tensor of a tuple/list (logits and weights are floats)."""
    parts = output if isinstance(output, (tuple, list)) else (output,)
    for p in parts:
        if isinstance(p, torch.Tensor) and not p.is_floating_point() and not p.is_complex():
            return p
    kinds = [f"{type(p).__name__}{'(' + str(p.dtype) + ')' if isinstance(p, torch.Tensor) else ''}"
             for p in parts]
    raise TargetError(f"the router returned {', '.join(kinds)}: no integer or bool tensor to take "
                      "as its decisions (top-k ids, a dispatch mask); pass decision= (an index, "
                      "a name or a callable) picking which tokens each expert takes")


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """module.eval() for the block, each submodule's own mode restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


class RouterWatch:
    """See the module docstring. Made by watch_routers; stepped by its Sentinel."""

    def __init__(self, sentinel, routers: dict, *, every: int, tokens: int, decision, scores,
                 cuts, near_ties: int, seed: int):
        self.sentinel, self.routers = sentinel, routers
        self.every = check_int(every, "every", min=1, hint="steps between router checks")
        self.tokens = check_int(tokens, "tokens", min=2, hint="tokens per sample, e.g. 256")
        self.decision = decision if decision is not None else first_integer
        self.scores, self.cuts, self.near_ties = scores, cuts, near_ties
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._busy = False
        self._captured: dict = {}
        self.stats = {n: {"checks": 0, "causal": 0, "noncausal": 0, "unjudged": 0,
                          "first_noncausal_step": None, "reasons": []} for n in routers}
        self.handles = [m.register_forward_hook(self._hook_for(n), with_kwargs=True)
                        for n, m in routers.items()]

    def _hook_for(self, name: str):
        # a closure, not a bound method: the fp64 twin deep-copies the router, hooks included,
        # and a bound method would copy this watch with it
        def hook(module, args, kwargs, output):
            # training forwards only: an evaluation loop between steps is not the run's batch
            if (self._busy or not module.training or self.sentinel.steps % self.every
                    or name in self._captured):
                return
            try:
                self._captured[name] = self._sample(_first_tensor(args, kwargs))
            except Exception as e:
                self.sentinel._own_error(f"copying the input of router {name}", e)
        return hook

    def _sample(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        if x.dim() not in (2, 3):
            raise InvalidArgument(f"the router's input has shape {tuple(x.shape)}; expected "
                                  "hidden states [B, T, D] or a flat token list [N, D]")
        rows = max(1, min(x.shape[0], self.tokens // x.shape[1])) if x.dim() == 3 else 1
        size = rows * (x[0].numel() if x.dim() == 3 else min(len(x), self.tokens) * x.shape[1])
        if size * x.element_size() > self.sentinel.budget:
            raise InvalidArgument(f"a sample of {size} elements of {x.dtype} is over the "
                                  f"sentinel's budget={self.sentinel.budget} bytes: lower tokens")
        if x.dim() == 3:  # [B, T, D]: whole rows (causality needs the positions), own draws
            pick = torch.randperm(x.shape[0], generator=self._generator)[:rows]
            return x[pick.to(x.device)].clone()  # advanced indexing copies; clone says so
        return x[:self.tokens].clone()  # [N, D]: a flat token list, its first `tokens`

    def step(self, step: int) -> list[Result]:
        """Check what was captured during this step's forward; returns new findings."""
        captured, self._captured = self._captured, {}
        new = []
        for name, x in captured.items():
            try:
                r = self._check(name, x, step)
            except Exception as e:
                self.sentinel._own_error(f"checking router {name}", e)
                continue
            st = self.stats[name]
            st["checks"] += 1
            causal = r.metrics.get("causal")
            if causal is None:
                st["unjudged"] += 1
                st["reasons"] = (st["reasons"] + [r.message])[-5:]
            elif causal and r.verdict != "fail":
                st["causal"] += 1
            else:
                st["noncausal"] += 1
                if st["first_noncausal_step"] is None:
                    st["first_noncausal_step"] = step
                    new.append(r)
        return new

    def _check(self, name: str, x: torch.Tensor, step: int) -> Result:
        module = self.routers[name]
        buffers = [(b, b.clone()) for b in module.buffers()]
        self._busy = True
        try:
            with keep_rng(), torch.no_grad(), eval_mode(module):
                r = check(module, x, layout="flat" if x.dim() == 2 else "batched", cuts=self.cuts,
                          decision=self.decision, scores=self.scores, near_ties=self.near_ties,
                          max_batch_tokens=max(x.shape[:-1].numel(), self.sentinel.budget // (
                              x.shape[-1] * x.element_size())),  # perturbed copies in budget
                          seed=self.seed + step, target=f"watch:router[{name}]")
        finally:
            self._busy = False
            for b, saved in buffers:  # a router that counts or balances in forward
                if not torch.equal(b, saved):
                    b.copy_(saved)
        r.evidence.update({"router": name, "router_class": type(module).__name__, "step": step,
                           "sample_shape": list(x.shape), "sample_dtype": str(x.dtype),
                           "sampled": "the run's micro-batch of that step, checked after the "
                                      "optimizer step (the router's new weights), eval mode"})
        return r

    def close(self) -> list[Result]:
        for h in self.handles:
            h.remove()
        return [self._final(n) for n in self.routers]

    def _final(self, name: str) -> Result:
        st = self.stats[name]
        judged = st["causal"] + st["noncausal"]
        m = {"causal": (st["noncausal"] == 0) if judged else None, "checks": st["checks"],
             "causal_checks": st["causal"], "noncausal_checks": st["noncausal"],
             "unjudged_checks": st["unjudged"], "first_noncausal_step": st["first_noncausal_step"]}
        ev = {"every": self.every, "tokens": self.tokens, "steps": self.sentinel.steps,
              "unjudged_reasons": st["reasons"], "router_class": type(self.routers[name]).__name__}
        common = dict(probe=PROBE, target=f"watch:router[{name}]", seed=self.seed, metrics=m,
                      evidence=ev)
        if st["noncausal"]:
            return Result(**common, verdict="fail", codes=["TP-C1"],
                          message=f"router {name}: decisions read later tokens in {st['noncausal']} "
                          f"of {judged} judged checks, first at step {st['first_noncausal_step']}")
        if not judged:
            why = st["reasons"][-1] if st["reasons"] else "no forward of the router was sampled"
            return Result(**common, verdict="error", codes=["TP-E1"],
                          message=f"cannot judge router {name}: {st['checks']} checks in "
                          f"{self.sentinel.steps} steps, none judged ({why})")
        return Result(**common, verdict="pass", codes=[],
                      message=f"router {name}: decisions causal in all {judged} judged checks "
                      f"(every {self.every} steps, the run's own micro-batches)")

    def summary(self) -> dict:
        return {"sentinel/router_checks": sum(s["checks"] for s in self.stats.values()),
                "sentinel/router_noncausal": sum(s["noncausal"] for s in self.stats.values())}


def _first_tensor(args, kwargs) -> torch.Tensor:
    for v in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    raise InvalidArgument("the router was called without a tensor argument: nothing to sample")


def watch_routers(model: torch.nn.Module | None, sentinel, *, routers=None, every: int = 50,
                  tokens: int = 256, decision=None, scores=None, cuts=None, near_ties: int = 0,
                  seed: int | None = None) -> RouterWatch:
    """Watch MoE routers through the sentinel (see the module docstring). routers: a dict
    {name: module}, a list of modules, or None (found in `model` by find_routers; none found
    is refused, never a silent half-watch). decision/scores: pickers as in causality.check
    (default: the first integer or bool tensor of the router's output). near_ties: the
    check's near-tie search (0: off; each point costs ~30 router calls)."""
    from trainprobes.watch.sentinel import Sentinel
    if not isinstance(sentinel, Sentinel):
        raise InvalidArgument(f"sentinel={sentinel!r} must be a trainprobes.watch.Sentinel")
    if routers is None:
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgument(f"model={type(model).__name__}: pass an nn.Module or routers=")
        routers = find_routers(model)
        if not routers:
            raise InvalidArgument(
                f"no router found in {type(model).__name__}: looked for modules whose class name "
                "holds 'Router' or 'Gate' inside a module whose class name holds MoE, Sparse or "
                "Expert; pass routers={name: module} (or a list of modules)")
    elif isinstance(routers, (list, tuple)):
        routers = {f"router{i}": m for i, m in enumerate(routers)}
    if not isinstance(routers, dict) or not routers or not all(
            isinstance(m, torch.nn.Module) for m in routers.values()):
        raise InvalidArgument(f"routers={routers!r}: expected a dict {{name: nn.Module}} or a "
                              "list of nn.Modules, not empty")
    near_ties = check_int(near_ties, "near_ties", min=0)
    w = RouterWatch(sentinel, routers, every=every, tokens=tokens, decision=decision,
                    scores=scores, cuts=cuts, near_ties=near_ties,
                    seed=sentinel.seed if seed is None else seed)
    sentinel.add_watch(w)
    return w
