"""A model's GEMMs: capture every nn.Linear's input and output gradient from one fp32 step,
and judge its three training GEMMs (numerics.gemm) under a recipe and an accumulator.
transformers' Conv1D (GPT-2's Linear with its weight stored transposed) counts as one; other
modules with a 2-D weight (not embeddings) are listed as not seen.

  1. hooks: a forward hook keeps each call's input x (flattened to tokens x in_features)
     and hooks that call's output tensor for its gradient dy (tokens x out_features), so a
     Linear called several times (shared weights) pairs each call's x with its own dy and
     its weight gradient, sum_calls dy^T x, is one GEMM over all the calls' tokens; calls
     whose output gets no gradient are dropped from both; the weight w is the Linear's own;
  2. one step in fp32: loss = the output's `loss` (HF models given labels), else loss_fn(out),
     else the mean square of the output; backward; then the model is put back as it was
     (kept_as_it_was: dtypes, values, gradients, buffers, training flags, random states);
  3. fprop (x . w, K = in), dgrad (dy . w^T, K = out), wgrad (dy^T . x^T, K = tokens) each
     judged by gemm_bias; the rows sorted by risk: biased first, then by the accumulator's
     own relative bias (evidence accumulator_bias).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from trainprobes.errors import CannotJudge, InvalidArgument, TargetError
from trainprobes.numerics.gemm import gemm_bias, linear_gemms
from trainprobes.numerics.gemm_defaults import DEFAULT_SAMPLES, DEFAULT_TOLERANCE, DEFAULT_TRIALS
from trainprobes.result import Result

ROOT = "(the model itself)"  # the name of a Linear that is the whole model ('' in named_modules)


@dataclass
class Captured:
    """One Linear's operands from the step."""

    name: str
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor | None  # None: no gradient reached it, its forward GEMM alone runs
    # the GEMMs the step runs: no weight gradient of a frozen weight (LoRA's base), no input
    # gradient of the calls whose input needs none (the batch itself): rows of dy that dgrad
    # multiplies (None: all)
    wgrad: bool = True
    dx_rows: torch.Tensor | None = None
    # a frozen weight's calls that no gradient reaches: rows of its forward GEMM alone
    x_forward: torch.Tensor | None = None


def _linear_shape(mod: torch.nn.Module):
    """(in_features, out_features, weight as (out, in)) of a module that is one GEMM of its
    input and weight, else None: nn.Linear, and transformers' Conv1D (GPT-2 and its kin:
    y = x W + b with W stored (in, out), pytorch_utils.Conv1D)."""
    if isinstance(mod, torch.nn.Linear):
        return mod.in_features, mod.out_features, mod.weight
    w = getattr(mod, "weight", None)
    if type(mod).__name__ == "Conv1D" and torch.is_tensor(w) and w.dim() == 2 \
            and tuple(w.shape) == (getattr(mod, "nx", None), getattr(mod, "nf", None)):
        return mod.nx, mod.nf, w.t()
    return None


def _unseen(model: torch.nn.Module, linears: list) -> list[dict]:
    """Modules outside `linears` that hold a 2-D weight (other than an embedding table, a
    lookup): likely GEMMs of their own (F.linear, matmul) the hooks cannot see; listed, so a
    table that covers part of a model says so."""
    seen = {n for n, _ in linears}
    return [{"layer": n or ROOT, "gemm": "all", "reason": f"a {type(m).__name__} with a 2-D weight, not an "
             "nn.Linear: its GEMMs (if any) are not seen"}
            for n, m in model.named_modules()
            if n not in seen and not isinstance(m, torch.nn.Embedding)
            and isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.dim() == 2]


def capture_linears(model: torch.nn.Module, batch, loss_fn=None, skipped: list | None = None) -> list[Captured]:
    """Steps 1-2: every Linear's (x, w, dy) (nn.Linear and transformers' Conv1D, _linear_shape)
    from one fp32 forward and backward; a Linear not on the loss's path, and a module with a
    2-D weight that is not one, are appended to `skipped` as {layer, gemm, reason}."""
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgument(f"the model is a {type(model).__name__}, not a torch.nn.Module: its "
                              "Linears are found by their modules")
    if any(p.is_meta for p in model.parameters()):
        raise InvalidArgument("the model's weights are on the meta device (shapes without values): "
                              "materialise them (to_empty() and initialise, or load a checkpoint) first")
    linears = [(n, m) for n, m in model.named_modules() if _linear_shape(m) is not None]
    hooks = []
    if skipped is not None:
        skipped.extend(_unseen(model, linears))
    if not linears:
        raise InvalidArgument(f"the model ({type(model).__name__}) has no torch.nn.Linear: there "
                              "are no GEMMs to judge (modules of its own that call F.linear are not "
                              "seen; wrap them in nn.Linear)")
    calls: dict[str, list] = {n: [] for n, _ in linears}
    held = [0]  # bytes kept so far (each call's x and its dy in float64)
    backward = [False]  # set by _step once the loss's backward starts
    for name, mod in linears:
        def fwd(m, args, kwargs, out, name=name):
            x = args[0] if args else next((v for v in kwargs.values() if torch.is_tensor(v)), None)
            if not (torch.is_tensor(out) and torch.is_tensor(x)):
                return
            n_in, n_out, _ = _linear_shape(m)
            if backward[0] and not out.requires_grad:
                return
            where = _checkpoint_pass()  # a walk up the stack: only for calls kept
            if backward[0]:
                # a recompute: a reentrant checkpoint's calls get their gradient here (the
                # first pass ran without), a non-reentrant one's never do (the first pass's
                # outputs get it); x is referenced, copied once its gradient comes
                ref = x.detach()
                _hold(held, ref.element_size() * ref.numel(), name)
                call = _Call(None, None, x.requires_grad, recompute=where or "other", ref=ref)
            else:  # in torch's reentrant checkpoint, the first pass: its recompute is kept instead
                _hold(held, 8 * x.numel(), name)
                call = _Call(x.detach().reshape(-1, n_in).double(), None, x.requires_grad, recompute=where)
            calls[name].append(call)
            if out.requires_grad:
                def grad(g, call=call):
                    _hold(held, 8 * g.numel() + (8 * call.ref.numel() if call.ref is not None else 0), name)
                    if call.ref is not None:
                        call.x, call.ref = call.ref.reshape(-1, n_in).double(), None
                    call.dy = g.detach().reshape(-1, n_out).double()
                out.register_hook(grad)
        hooks.append(mod.register_forward_hook(fwd, with_kwargs=True))
    try:
        with kept_as_it_was(model):
            got = _step(model, batch, loss_fn, linears, calls, backward, skipped)
    finally:
        for h in hooks:
            h.remove()
    if not got:
        raise TargetError("no Linear received a gradient in the step: the loss does not depend on them")
    return got


@dataclass(eq=False)  # compared by identity (its tensors have no truth value)
class _Call:
    """One call of a Linear in the capture step."""

    x: torch.Tensor | None     # its input rows in float64 (a recompute's: once its gradient comes)
    dy: torch.Tensor | None    # its output's gradient, None unless one reached it
    x_grad: bool               # its input needs a gradient (its dgrad runs)
    # "first": the first pass of torch's reentrant checkpoint (without gradient); made in
    # the backward: "recompute" (torch's reentrant checkpoint), "other" (a non-reentrant
    # recompute, or another library's reentrant one); None: a plain forward call
    recompute: str | None = None
    ref: torch.Tensor | None = None  # a recompute's input until its gradient comes


def _checkpoint_pass() -> str | None:
    """'first' inside the first pass of torch's reentrant checkpoint (run without gradient),
    'recompute' inside its recompute, else None: read from the calling frames."""
    from torch.utils.checkpoint import CheckpointFunction
    first, again = CheckpointFunction.forward.__code__, CheckpointFunction.backward.__code__
    f = sys._getframe(2)
    while f is not None:
        if f.f_code is first:
            return "first"
        if f.f_code is again:
            return "recompute"
        f = f.f_back
    return None


def _unpaired_first_passes(calls: list) -> list:
    """The first-pass calls of torch's reentrant checkpoints that no recompute repeated (a
    segment whose output no gradient reaches is never recomputed): each recompute is paired
    with a first pass of the same input, bit for bit; those left ran once, without gradient."""
    firsts = [c for c in calls if c.recompute == "first"]
    for c in calls:
        if c.recompute == "recompute" and c.x is not None:
            twin = next((f for f in firsts if f.x.shape == c.x.shape and torch.equal(f.x, c.x)), None)
            if twin is not None:
                firsts.remove(twin)
    return firsts


def _hold(held: list, more: int, name: str) -> None:
    """Counted and checked before each copy: a large model's step holds every Linear's x and
    dy in float64 (estimated: a Llama-style 1B model, hidden 2048, MLP 8192, 16 layers, on 8
    x 2048 tokens: about 100 GiB); the last Linear's rows are joined once more at the end."""
    from trainprobes.budget import check_fits
    held[0] += more
    check_fits(held[0], f"the capture of every Linear's input and output gradient in float64 (up "
               f"to {name or ROOT!r})", fix="judge a smaller batch (fewer tokens)")


@contextmanager
def kept_as_it_was(model: torch.nn.Module):
    """Run the fp32 capture step on the caller's model and leave it as it was: every
    parameter's dtype and values (model.float() converts a bf16 model for good), its gradient
    (the step's backward writes new ones; an existing .grad is put back, the same tensor), the
    buffers (a train-mode forward updates BatchNorm's running statistics in place), each
    module's training flag, and the CPU and CUDA random states (dropout draws from them)."""
    params = list(model.parameters())
    saved = [(p, p.data, p.grad) for p in params]
    buffers = [(m, n, b, b.clone()) for m in model.modules() for n, b in m._buffers.items()
               if b is not None]
    modes = [(m, m.training) for m in model.modules()]
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    for p in params:
        p.grad = None  # detached from model.float(), which would convert them in place
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        for p, data, grad in saved:
            p.data = data
            p.grad = grad
        for m, n, b, copy in buffers:
            with torch.no_grad():
                b.copy_(copy)
            m._buffers[n] = b
        for m, mode in modes:
            m.training = mode


def _fp32(batch):
    """The batch's floating tensors in fp32, as the model is for the step (a bf16 model's
    bf16 inputs would not multiply its fp32 weights); ids, masks and the caller's own
    tensors are left alone."""
    if torch.is_tensor(batch):
        return batch.float() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _fp32(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_fp32(v) for v in batch)
    return batch


def _step(model, batch, loss_fn, linears, calls, backward, skipped) -> list[Captured]:
    """Step 2 on the model (kept_as_it_was restores it) and the captured operands."""
    from trainprobes.errors import TrainprobesError
    model.float()
    batch = _fp32(batch)
    try:
        out = model(**batch) if isinstance(batch, dict) else model(batch)
    except TrainprobesError:
        raise
    except Exception as e:  # the user's model on the user's batch: bad input, not our bug
        raise TargetError(f"the model's forward on the batch raised {type(e).__name__}: {e}") from e
    loss = getattr(out, "loss", None)
    if loss is None:
        if loss_fn is not None:
            loss = loss_fn(out)
        else:
            t = getattr(out, "logits", out)
            t = t[0] if isinstance(t, (tuple, list)) and t else t
            if not torch.is_tensor(t):
                raise InvalidArgument(f"the model returned a {type(out).__name__}: the capture step needs a "
                                      f"loss from it (an output with .loss or .logits, a tensor, or a "
                                      f"tuple or list starting with one)")
            loss = t.float().pow(2).mean() if t.is_floating_point() else t
    if not torch.is_tensor(loss) or not loss.requires_grad:
        trained = [n or ROOT for n, m in linears if _linear_shape(m)[2].requires_grad]
        if trained:
            raise InvalidArgument(
                f"the step's loss needs no gradient, yet {len(trained)} Linear weight(s) are trainable "
                f"(e.g. {trained[:4]}): the forward ran under torch.no_grad, on detached inputs or in "
                f"a reentrant checkpoint of inputs without gradient, or its output is not "
                f"differentiable (an argmax, a comparison); judge the step as it trains")
    else:  # else every weight is frozen: the forward GEMMs alone run
        backward[0] = True
        loss.backward()
    got = []
    for name, mod in linears:
        shown = name or ROOT
        w = _linear_shape(mod)[2]
        frozen = not w.requires_grad
        done = [c for c in calls[name] if c.dy is not None]
        # calls no gradient reached (torch.no_grad, a detached input or output): the
        # forward's, and torch's reentrant recomputes (a non-reentrant recompute repeats a
        # forward call); where another library's recompute got a gradient, the forward's
        # calls without one are taken for its first pass, the same GEMMs
        for c in calls[name]:
            if c.dy is None and c.recompute == "recompute":
                c.x, c.ref = c.ref.reshape(-1, c.ref.shape[-1]).double(), None
        firsts = _unpaired_first_passes(calls[name])
        nograd = [] if any(c.recompute == "other" for c in done) else \
            [c for c in calls[name] if c.dy is None and (c.recompute in (None, "recompute") or c in firsts)]
        forward = nograd if frozen else []  # a frozen weight's forward GEMM still feeds the loss
        if nograd and not frozen and skipped is not None:
            skipped.append({"layer": shown, "gemm": "fprop" if done else "all", "reason":
                            f"{len(nograd)} call(s) that no gradient reaches (torch.no_grad, a "
                            f"detached input or output): not judged, and its trainable weight "
                            f"gets no gradient from them"})
        w64 = w.detach().double().contiguous()
        if not done and forward:  # its forward GEMM alone runs (judge_model skips the other two)
            got.append(Captured(shown, torch.cat([c.x for c in forward]), w64, None, False))
            calls[name].clear()
            continue
        if not done:
            if not calls[name] and skipped is not None:
                skipped.append({"layer": shown, "gemm": "all", "reason": "not called in this step"})
            continue
        dx_rows = torch.cat([torch.full((c.dy.shape[0],), c.x_grad) for c in done])
        got.append(Captured(shown, torch.cat([c.x for c in done]), w64, torch.cat([c.dy for c in done]),
                            not frozen, None if bool(dx_rows.all()) else dx_rows,
                            torch.cat([c.x for c in forward]) if forward else None))
        calls[name].clear()  # joined: the per-call copies go (one Linear held twice at most)
    return got


def judge_model(model, batch, *, preset="h200-scaled-mm", recipe="fp8-tensor",
                samples=DEFAULT_SAMPLES, trials=DEFAULT_TRIALS, seed=0, alpha=0.01,
                tolerance=DEFAULT_TOLERANCE, loss_fn=None, what_if: bool = False,
                target: str = "model", progress=None) -> list[Result]:
    """Step 3: one Result per (Linear, GEMM), riskiest first (module docstring).
    The default is what an fp8 training step on Hopper runs: the fp8-tensor recipe (e4m3
    forward, e5m2 gradients, per-tensor scales) under the H200's accumulator; the fp32 step's
    operands under 'exact' are fp32 values, which no fp8 tensor core multiplies (refused
    unless what_if, numerics.gemm.gemm_bias).
    progress(done, total, name) is called before each GEMM."""
    results, skipped = [], []
    captured = list(capture_linears(model, batch, loss_fn, skipped))
    total, done = sum(1 if c.dy is None else 3 for c in captured), 0
    for c in captured:
        if c.dy is None:
            gemms = [("fprop", c.x, c.w)]
            skipped.extend({"layer": c.name, "gemm": g, "reason": "no gradient reaches it (a frozen "
                            "weight on an input without gradient): the step runs its forward GEMM "
                            "only"} for g in ("dgrad", "wgrad"))
        else:
            gemms = linear_gemms(c.x, c.w, c.dy)
            if c.x_forward is not None:  # the frozen weight's calls without gradient: fprop rows too
                gemms[0] = ("fprop", torch.cat([gemms[0][1], c.x_forward]), gemms[0][2])
        for gemm, a, b in gemms:
            if progress is not None:
                progress(done, total, f"{c.name}.{gemm}")
            done += 1
            if gemm == "wgrad" and not c.wgrad:
                skipped.append({"layer": c.name, "gemm": gemm, "reason": "a frozen weight (requires_grad "
                                "False): the step computes no weight gradient"})
                continue
            if gemm == "dgrad" and c.dx_rows is not None:
                if not bool(c.dx_rows.any()):
                    skipped.append({"layer": c.name, "gemm": gemm, "reason": "its input needs no "
                                    "gradient (the batch itself, or frozen upstream): no dgrad runs"})
                    continue
                a = a[c.dx_rows]  # the calls whose input gradient the step computes
            if not a.numel() or not b.numel():
                skipped.append({"layer": c.name, "gemm": gemm, "reason": "no rows (an empty batch)"})
                continue
            if not a.abs().sum() or not b.abs().sum():
                # an all-zero operand (a dead layer): nothing to judge, listed with the reason
                skipped.append({"layer": c.name, "gemm": gemm, "reason": "an all-zero operand"})
                continue
            try:
                r = gemm_bias(a, b, preset=preset, recipe=recipe, gemm=gemm, samples=samples,
                              trials=trials, seed=seed, alpha=alpha, tolerance=tolerance,
                              promotion=False, what_if=what_if, target=f"{target}:{c.name}.{gemm}")
            except InvalidArgument as e:
                raise type(e)(f"layer {c.name!r}: {e}") from None
            r.evidence["layer"] = c.name
            results.append(r)
    if not results:
        raise CannotJudge(f"no GEMM of the model could be judged: {skipped}")
    for r in results:
        r.evidence["skipped"] = skipped
    # riskiest first: biased, then by the accumulator's own share of the error (a recipe's
    # quantisation noise at these sample sizes would otherwise rank the rows at random)
    return sorted(results, key=lambda r: (not r.metrics["biased"],
                                          -abs(r.evidence["accumulator_bias"])))
