"""Sampled Linear calls' GEMMs judged under an FP8 recipe and an accumulator preset.

    sentinel = Sentinel(findings="sentinel.jsonl")
    watch_gemms(model, sentinel, every=50, recipe="fp8-tensor", preset="h200-scaled-mm")

What this step's wgrad dW = dY^T X (and, if asked, fprop X W^T or dgrad dY W) would lose if
the run's own operands went through `recipe` on a tensor core accumulating like `preset`:

1. At a checked step (sentinel.steps % every == 0) one Linear module, drawn by the watch's
   own torch.Generator, is sampled. A forward hook (its first training-mode forward of the
   step) copies up to `rows` token rows of the input X (rows drawn by the same generator, kept
   in order) and, for fprop/dgrad, the weight; it puts a pre-hook on the autograd node that
   made that call's output (Node.register_prehook: only the sampled call carries it, and an
   in-place op after the Linear still leaves it the gradient of the Linear's own output),
   which copies the same rows of dY. Copies are new memory (clone of an index), never views of the run's tensors.
   The rows kept fit the sentinel's budget: the copies plus the judge's float64 working set
   (about 64 bytes x samples x rows), so K = the number of rows judged.
2. At sentinel.step(), numerics.gemm.gemm_bias judges each GEMM under the recipe and preset
   against fp64 (under no_grad, every global generator restored), at the k-th checked step
   at level alpha 6/(pi^2 k^2) / len(gemms) (the sentinel's alpha, spent as its streams
   spend it, so a run is called biased falsely with chance at most alpha in all): biased (fail, TP-B1),
   noise or exact (pass), inconclusive (cannot judge). The first biased check of a module's
   GEMM is returned as a finding at once; later ones are counted.
3. At close, one Result per (module, gemm) that was checked: fail if any check was biased,
   pass if every check judged was noise or exact, cannot judge otherwise (never a pass).

Nothing of the run changes: the hooks return None, copies are new tensors, no global
generator is drawn (tests/test_watch_gemm.py: losses and weights bitwise equal).
"""
from __future__ import annotations

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.gemm import GEMMS, combination, gemm_bias
from trainprobes.reference.gemm import get_preset
from trainprobes.reference.recipes import get_recipe
from trainprobes.result import Result
from trainprobes.validation import check_choice, check_int
from trainprobes.watch.rng import keep_rng
from trainprobes.watch.stream import look_alpha

__all__ = ["watch_gemms", "GemmWatch", "gemm_options"]

PROBE = "numerics.gemm"
# float64 bytes per (sample, K) in gemm_bias's working set (its own check_fits estimate)
JUDGE_BYTES = 64
_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float64: "fp64"}


class GemmWatch:
    """See the module docstring. Made by watch_gemms; stepped by its Sentinel."""

    def __init__(self, sentinel, modules: dict, *, every: int, recipe, preset, gemms: tuple,
                 rows: int, samples: int, trials: int, tolerance: float, what_if: bool, seed: int):
        self.sentinel, self.modules = sentinel, modules
        self.every, self.rows, self.samples, self.trials = every, rows, samples, trials
        # the objects (a custom Accumulator keeps its fields), their names for messages
        self.rec, self.acc, self.gemms = recipe, preset, gemms
        self.recipe, self.preset = recipe.name, preset.name
        self.tolerance, self.what_if, self.seed = tolerance, what_if, seed
        self._generator = torch.Generator().manual_seed(seed)
        self._names = list(modules)
        self._chosen = None  # (step, name) of the module sampled at that step
        self._looks = 0  # checked steps judged so far: the k of each check's level
        self._captured: dict = {}  # name -> {"x", "w", "dy", "idx"}
        self.stats = {(n, g): {"checks": 0, "biased": 0, "noise": 0, "exact": 0,
                               "inconclusive": 0, "first_biased_step": None, "worst": None,
                               "last": None}
                      for n in modules for g in gemms}
        self.handles = [m.register_forward_hook(self._hook_for(n)) for n, m in modules.items()]

    def _pick(self, step: int) -> str:
        if self._chosen is None or self._chosen[0] != step:
            i = int(torch.randint(len(self._names), (1,), generator=self._generator))
            self._chosen = (step, self._names[i])
        return self._chosen[1]

    def _hook_for(self, name: str):
        def hook(module, args, output):
            step = self.sentinel.steps
            # training forwards with autograd only (an eval loop, or checkpointing's no-grad
            # first pass, is not the call whose backward is the run's wgrad)
            if (step % self.every or not module.training or name in self._captured
                    or not isinstance(output, torch.Tensor) or not output.requires_grad
                    or self._pick(step) != name):
                return None
            try:
                self._capture(name, module, args[0], output)
            except Exception as e:
                self._captured.pop(name, None)
                self.sentinel._own_error(f"copying the operands of Linear {name}", e)
            return None
        return hook

    def _capture(self, name: str, module, x: torch.Tensor, output: torch.Tensor) -> None:
        x = x.detach().reshape(-1, module.in_features)
        T, out = x.shape[0], module.out_features
        need_w = any(g != "wgrad" for g in self.gemms)
        w_bytes = module.weight.numel() * module.weight.element_size() if need_w else 0
        per_row = JUDGE_BYTES * self.samples + (module.in_features + out) * x.element_size()
        k = min(T, self.rows, (self.sentinel.budget - w_bytes) // per_row)
        if k < 2:
            raise InvalidArgument(f"Linear {name}: the sentinel's budget={self.sentinel.budget} "
                                  f"bytes holds {max(k, 0)} row(s) of its operands and the judge's "
                                  f"working set ({per_row} bytes a row, weight {w_bytes}): raise "
                                  "budget or lower samples")
        idx = torch.randperm(T, generator=self._generator)[:k].sort().values.to(x.device)
        c = {"x": x[idx].clone(), "idx": idx, "tokens": T}  # indexing copies; clone says so
        if need_w:
            c["w"] = module.weight.detach().clone()
        self._captured[name] = c

        def grad_hook(grad_outputs):
            try:
                c["dy"] = grad_outputs[0].detach().reshape(-1, out)[c["idx"]].clone()
            except Exception as e:
                self.sentinel._own_error(f"copying the output gradient of Linear {name}", e)
            return None
        _producer(output).register_prehook(grad_hook)

    def _operands(self, c: dict, gemm: str):
        x, dy, w = c["x"], c.get("dy"), c.get("w")
        if gemm == "fprop":
            return x, w  # X (K=in) . W
        if dy is None:
            return None
        if gemm == "dgrad":
            return dy, w.t()  # dY (K=out) . W^T
        return dy.t(), x.t()  # wgrad: dY^T . X^T over the K token rows

    def step(self, step: int) -> list[Result]:
        captured, self._captured = self._captured, {}
        new = []
        if captured:
            self._looks += 1
        # each check's level: the sentinel's alpha spent over checked steps and gemms as the
        # streams spend it over looks (alpha 6/(pi^2 k^2) / gemms at the k-th): the chance that
        # a run whose GEMMs are not biased is ever called biased stays within alpha, however
        # many steps are checked (at alpha each, 1 in 100 checks would be a false finding)
        level = look_alpha(self.sentinel.streams.alpha, max(self._looks, 1), len(self.gemms))
        for name, c in captured.items():
            for gemm in self.gemms:
                ops = self._operands(c, gemm)
                if ops is None:
                    self.sentinel._own_error(f"judging {gemm} of Linear {name}", RuntimeError(
                        "no output gradient was seen (no backward of the sampled call)"))
                    continue
                try:
                    with keep_rng(), torch.no_grad():
                        r = gemm_bias(*ops, preset=self.acc, recipe=self.rec, gemm=gemm,
                                      samples=self.samples, trials=self.trials, seed=self.seed + step,
                                      alpha=level,
                                      tolerance=self.tolerance, promotion=False, what_if=self.what_if,
                                      target=f"watch:gemm[{name}].{gemm}")
                except Exception as e:
                    self.sentinel._own_error(f"judging {gemm} of Linear {name}", e)
                    continue
                r.evidence.update({"module": name, "step": step, "tokens_in_call": c["tokens"],
                                   "rows_judged": len(c["idx"]), "every": self.every,
                                   "look": self._looks, "run_alpha": self.sentinel.streams.alpha,
                                   "sampled": "one Linear call of the run at that step, its "
                                              "operands as they were; rows drawn by the watch"})
                if self._count(name, gemm, r, step):
                    new.append(r)
        return new

    def _count(self, name: str, gemm: str, r: Result, step: int) -> bool:
        st = self.stats[(name, gemm)]
        v = r.metrics["gemm_verdict"]
        st["checks"] += 1
        st[v] += 1
        st["last"] = r
        if v == "biased":
            if st["worst"] is None or abs(r.metrics["relative_bias"]) > abs(
                    st["worst"].metrics["relative_bias"]):
                st["worst"] = r
            if st["first_biased_step"] is None:
                st["first_biased_step"] = step
                return True
        return False

    def close(self) -> list[Result]:
        for h in self.handles:
            h.remove()
        out = [self._final(n, g) for (n, g), st in self.stats.items() if st["checks"]]
        if not out:
            out.append(Result(
                probe=PROBE, target="watch:gemm", verdict="error", codes=["TP-E1"], seed=self.seed,
                metrics={"biased": None, "checks": 0},
                evidence={"every": self.every, "steps": self.sentinel.steps,
                          "modules": self._names},
                message=f"cannot judge: no sampled Linear call was judged in "
                        f"{self.sentinel.steps} steps (every={self.every}; see the sentinel's "
                        "own errors)"))
        return out

    def _final(self, name: str, gemm: str) -> Result:
        st = self.stats[(name, gemm)]
        judged = st["biased"] + st["noise"] + st["exact"]
        shown = st["worst"] or st["last"]
        m = {k: st[k] for k in ("checks", "biased", "noise", "exact", "inconclusive",
                                "first_biased_step")}
        m.update({"biased": bool(st["biased"]) if judged else None, "recipe": self.recipe,
                  "preset": self.preset, "gemm": gemm,
                  "relative_bias": shown.metrics["relative_bias"],
                  "ci_low": shown.metrics["ci_low"], "ci_high": shown.metrics["ci_high"],
                  "k": shown.metrics["k"]})
        common = dict(probe=PROBE, target=f"watch:gemm[{name}].{gemm}", seed=self.seed,
                      metrics=m, evidence={"every": self.every, "shown_check": {
                          "step": shown.evidence["step"], "metrics": shown.metrics,
                          "message": shown.message}})
        head = f"Linear {name} {gemm} under {self.recipe} / {self.preset}: "
        if st["biased"]:
            return Result(**common, verdict="fail", codes=["TP-B1"],
                          message=head + f"biased in {st['biased']} of {st['checks']} checks, first "
                          f"at step {st['first_biased_step']}; the worst: {shown.message}")
        if not judged:
            return Result(**common, verdict="error", codes=["TP-E1"],
                          message=head + f"cannot judge: all {st['checks']} checks inconclusive; "
                          f"the last: {shown.message}")
        return Result(**common, verdict="pass", codes=[],
                      message=head + f"not biased in {judged} judged checks ({st['exact']} exact, "
                      f"{st['noise']} noise, {st['inconclusive']} inconclusive); the last: "
                      f"{shown.message}")

    def summary(self) -> dict:
        return {"sentinel/gemm_checks": sum(s["checks"] for s in self.stats.values()),
                "sentinel/gemm_findings": sum(s["first_biased_step"] is not None
                                              for s in self.stats.values())}


def _producer(output: torch.Tensor):
    """The autograd node that made the Linear's output, for a pre-hook that sees dY. Not a
    hook on the tensor: a 3-D output is a view of the [B*T, out] product, and an in-place op
    on that view (ReLU(inplace=True)) rebases it and drops its tensor hooks; the node that
    computed the product still receives dY. (register_full_backward_hook is no option: it
    makes an in-place op after the Linear raise, which would stop the run.)"""
    base = output._base
    if base is not None and base.grad_fn is not None and base.numel() == output.numel() \
            and output.is_contiguous():
        return base.grad_fn  # a reshape of the product: same elements, same order
    return output.grad_fn


def gemm_options(gemms) -> dict | None:
    """The callbacks' gemms= argument as watch_gemms keyword arguments: False -> None (not
    watched), True -> {} (watch_gemms' defaults: fp8-tensor on h200-scaled-mm, wgrad, every
    50 steps), a dict -> those arguments (recipe, preset, every, gemms, modules, ...)."""
    import inspect
    if gemms is False or gemms is None:
        return None
    if gemms is True:
        return {}
    if not isinstance(gemms, dict):
        raise InvalidArgument(f"gemms={gemms!r}: pass True (watch_gemms' defaults), False, or a "
                              "dict of watch_gemms arguments, e.g. {'recipe': 'fp8-rowwise', "
                              "'preset': 'h200-scaled-mm', 'every': 100}")
    allowed = [k for k in inspect.signature(watch_gemms).parameters if k not in ("model", "sentinel")]
    for k in gemms:
        if k not in allowed:
            raise InvalidArgument(f"gemms has the key {k!r}, not an argument of watch_gemms; "
                                  f"it takes {', '.join(allowed)}")
    return dict(gemms)


def find_linears(model: torch.nn.Module) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def watch_gemms(model, sentinel, *, every: int = 50, recipe: str = "fp8-tensor",
                preset: str = "h200-scaled-mm", gemms=("wgrad",), modules: dict | None = None,
                rows: int = 4096, samples: int = 256, trials: int = 16, tolerance: float | None = None,
                what_if: bool = False, seed: int | None = None) -> GemmWatch:
    """Judge a sampled Linear call's GEMMs every `every` steps (see the module docstring).
    modules: {name: nn.Linear} (default: every nn.Linear of the model). rows: the most token
    rows of a call kept (K of wgrad), further capped by the sentinel's budget. Refused up
    front: an unknown recipe, preset or gemm, every < 1, no Linear, and a recipe/preset pair
    no hardware runs on these operands (unless what_if=True)."""
    from trainprobes.numerics.gemm_defaults import DEFAULT_TOLERANCE
    from trainprobes.watch.sentinel import Sentinel
    if not isinstance(sentinel, Sentinel):
        raise InvalidArgument(f"sentinel={sentinel!r} must be a trainprobes.watch.Sentinel")
    every = check_int(every, "every", min=1, hint="steps between sampled GEMMs, e.g. 50")
    rows = check_int(rows, "rows", min=2, hint="token rows kept per call (K of wgrad), e.g. 4096")
    trials = check_int(trials, "trials", min=3, hint="groups of the CI, e.g. 16")
    samples = check_int(samples, "samples", min=trials, hint=f"at least trials={trials}")
    rec, acc = get_recipe(recipe), get_preset(preset)
    if isinstance(gemms, str):
        gemms = (gemms,)
    gemms = tuple(check_choice(g, "gemms", GEMMS) for g in gemms)
    if not gemms:
        raise InvalidArgument(f"gemms=() names no GEMM; pick from {', '.join(GEMMS)}")
    modules = find_linears(model) if modules is None else dict(modules)
    if not modules:
        raise InvalidArgument("the model has no torch.nn.Linear module to sample (or modules={} "
                              "was given): nothing to watch")
    for n, m in modules.items():
        if not isinstance(m, torch.nn.Linear):
            raise InvalidArgument(f"modules[{n!r}] is a {type(m).__name__}, not a torch.nn.Linear")
    held = {_FORMATS.get(p.dtype, str(p.dtype)) for m in modules.values() for p in m.parameters()}
    for g in gemms:
        for f in sorted(held):
            why = combination(acc, rec, g, (f, f) if rec.scaling == "none" else None)
            if why and not what_if:
                raise InvalidArgument(
                    f"recipe={rec.name!r} with preset={acc.name!r} on {g}: {why}; pick an fp8 "
                    "recipe (fp8-tensor, fp8-rowwise, ...) for an fp8 accumulator preset, or "
                    "preset='fp32', or what_if=True to judge it anyway, named as a what-if")
    w = GemmWatch(sentinel, modules, every=every, recipe=rec, preset=acc, gemms=gemms,
                  rows=rows, samples=samples, trials=trials,
                  tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
                  what_if=what_if, seed=sentinel.seed if seed is None else seed)
    sentinel.add_watch(w)
    return w
