"""The single-device definition of a training step, and its fp64 truth.

A user describes one step as three callables (a TrainingStep):

    model()            -> torch.nn.Module, the same initial weights on every call
    batch(generator)   -> {name: tensor}, every tensor with the sample axis first;
                          batch["input"] (input_key) is what the model is called on
    loss(output, batch) -> a scalar tensor: the loss of the WHOLE batch as one device
                          computes it (e.g. a token mean over batch["mask"])

and optionally tokens(batch) -> how many loss units a (piece of a) batch holds, which the
token-weighted normalisation of split batches uses (default: batch["mask"].sum() where the
batch has a "mask", else the number of samples).

The truth of a trial is that step in float64 on one process: the model's weights cast to
fp64 (after rounding them to the transform's parameter dtype where that is its contract,
FSDP2's param_dtype), the batch's floating tensors cast to fp64, one forward, one backward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

import torch
from trainprobes.errors import InvalidArgument, InvalidType

__all__ = ["TrainingStep", "Truth", "rows", "samples", "count_tokens", "check_step", "single_device"]


@dataclass(frozen=True)
class TrainingStep:
    """model(), batch(generator) or data(), loss(output, batch), and optionally
    tokens(batch) and call(model, batch)."""

    model: Callable
    batch: Callable | None = None
    loss: Callable | None = None
    tokens: Callable | None = None
    input_key: str = "input"
    name: str = "step"
    data: Callable | None = None
    call: Callable | None = None

    def __post_init__(self):
        for field in ("model", "loss"):
            if not callable(getattr(self, field)):
                raise InvalidType(f"{field}={getattr(self, field)!r} must be callable "
                                  f"(see trainprobes.transforms.TrainingStep)")
        if (self.batch is None) == (self.data is None):
            raise InvalidArgument("give batch(generator) -> batch, or data() -> an iterable of "
                                  "batches (your DataLoader), exactly one of them")
        for field in ("batch", "data", "tokens", "call"):
            v = getattr(self, field)
            if v is not None and not callable(v):
                raise InvalidType(f"{field}={v!r} must be None or callable (see "
                                  f"trainprobes.transforms.TrainingStep)")

    def forward(self, model, batch):
        """The model on a batch: call(model, batch) where given (several inputs: ids,
        position ids, masks, labels), else model(batch[input_key])."""
        if self.call is not None:
            return self.call(model, batch)
        return model(batch[self.input_key])

    def batches(self, seeds) -> list:
        """One batch per trial: batch(generator seeded by the trial's seed), or the next item
        of a fresh data() (every rank and the truth iterate their own copy, so it must
        yield the same batches on every call: no unseeded shuffle)."""
        if self.data is None:
            return [self.batch(torch.Generator().manual_seed(int(s))) for s in seeds]
        it = iter(self.data())
        out = []
        for _ in seeds:
            try:
                out.append(next(it))
            except StopIteration:
                raise InvalidArgument(f"data={self.data!r} ran dry after {len(out)} batch(es); "
                                      f"{len(seeds)} trials need {len(seeds)}: give a longer "
                                      f"iterable or fewer --trials") from None
        return out

    def count(self, batch) -> float:
        return count_tokens(batch, self.tokens)


class Truth(NamedTuple):
    """The fp64 single-device step over the trials: loss [trials], grads {name: [trials, *shape]}."""

    loss: torch.Tensor
    grads: dict


def is_scalar(v) -> bool:
    """A batch entry with no sample axis (num_items_in_batch, a token count): kept whole
    when a batch is split."""
    return not isinstance(v, torch.Tensor) or v.dim() == 0


def samples(batch: Mapping) -> int:
    """The number of samples: the first axis of the batch's tensors."""
    return next(v.shape[0] for v in batch.values() if not is_scalar(v))


def rows(batch: Mapping, index) -> dict:
    """The samples `index` (a slice or an index tensor) of every tensor of the batch;
    scalars as they are."""
    return {k: v if is_scalar(v) else v[index] for k, v in batch.items()}


def to_device(batch: Mapping, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def count_tokens(batch: Mapping, tokens: Callable | None = None) -> float:
    """Loss units in a (piece of a) batch: tokens(batch), else mask.sum(), else samples."""
    if tokens is not None:
        n = tokens(batch)
    elif "mask" in batch:
        n = batch["mask"].sum()
    else:
        n = samples(batch)
    return float(n.item() if isinstance(n, torch.Tensor) else n)


def _as_batch(b, name: str = "batch(generator)") -> dict:
    if not isinstance(b, Mapping) or not b:
        raise InvalidType(f"{name} returned {type(b).__name__}; it must return a "
                          f"non-empty dict of tensors, e.g. {{'input': x, 'target': y}}")
    bad = [k for k, v in b.items() if not isinstance(k, str)
           or not isinstance(v, (torch.Tensor, int, float)) or isinstance(v, bool)]
    if bad:
        raise InvalidType(f"{name} returned a dict whose entries {bad!r} are not str -> tensor "
                          f"or number; every entry is a tensor with the sample axis first, or a "
                          f"scalar (num_items_in_batch)")
    sizes = {k: v.shape[0] for k, v in b.items() if not is_scalar(v)}
    if not sizes:
        raise InvalidArgument(f"{name} returned only scalars {sorted(b)}: a batch needs a tensor "
                              f"with a sample axis")
    first = next(iter(sizes.values()))
    odd = {k: s for k, s in sizes.items() if s != first}
    if odd:
        raise InvalidArgument(f"{name} returned tensors with different sample counts "
                              f"{sizes!r}: every tensor needs the sample axis first, of one size "
                              f"(a whole-batch value such as num_items_in_batch is a 0-dim scalar)")
    return dict(b)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One shape, one dtype, the same bits (1-byte formats included: torch.equal has no fp8
    kernel on the CPU; a NaN equals itself, -0 differs from +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(bits), b.contiguous().view(bits)
    return torch.equal(a, b)


def _same_batch(a: dict, b: dict) -> bool:
    def same(x, y):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return same_bits(x, y)
        return type(x) is type(y) and x == y
    return set(a) == set(b) and all(same(a[k], b[k]) for k in a)


def _first_difference(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    """The first parameter or buffer (a fixed projection, positional table, running
    statistics) that differs between two calls of the factory."""
    for kind in ("parameter", "buffer"):
        found = _differs(dict(getattr(a, f"named_{kind}s")()), dict(getattr(b, f"named_{kind}s")()), kind)
        if found:
            return found
    return None


def _differs(pa: dict, pb: dict, kind: str) -> str | None:
    if list(pa) != list(pb):
        return f"{kind} names differ ({list(pa)[:4]}... vs {list(pb)[:4]}...)"
    for name, p in pa.items():
        q = pb[name]
        if p.shape != q.shape or p.dtype != q.dtype:
            return f"{name!r} is {tuple(p.shape)} {p.dtype} then {tuple(q.shape)} {q.dtype}"
        if not same_bits(p.detach(), q.detach()):
            return f"{kind} {name!r} holds different values"
    return None


def check_step(step: TrainingStep, seed: int) -> dict:
    """Refuse a step the probe cannot judge, before any rank starts; return trial 0's batch.

    1. model() twice: the same parameter and buffer names, shapes, dtypes and bits (ranks
       and the truth each build their own copy, so a factory that draws new weights or
       buffers breaks both);
    2. batch(generator) twice with one seed: a dict of tensors with a common sample axis
       and the same bits (every rank draws the batch from the trial's seed);
    3. the loss of that batch is a finite scalar that depends on the parameters, and a
       second forward gives the same loss (no dropout: the probe compares one function).
    """
    if not isinstance(step, TrainingStep):
        raise InvalidType(f"step={step!r} must be a trainprobes.transforms.TrainingStep")
    m1, m2 = step.model(), step.model()
    if not isinstance(m1, torch.nn.Module):
        raise InvalidType(f"model={step.model!r} returned {type(m1).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in m1.parameters()):
        raise InvalidArgument(f"model={step.model!r} returned a module with no trainable parameter")
    ids = {id(p) for p in m1.parameters()}
    shared = [n for n, p in m2.named_parameters() if id(p) in ids]
    if shared:  # the truth's in-place .double() would convert the rank's own model mid-run
        raise InvalidArgument(f"model={step.model!r} returned the same parameter objects on two calls "
                              f"(e.g. {shared[0]!r}): build a new model on every call (every rank, "
                              f"the fp64 truth and the base each convert and step their own copy)")
    diff = _first_difference(m1, m2)
    if diff:
        raise InvalidArgument(f"model={step.model!r} returned different initial weights on two calls "
                              f"({diff}): seed inside the factory (torch.manual_seed or a "
                              f"Generator) so every rank and the fp64 truth start from one model")
    what = "batch(generator)" if step.data is None else "data()"
    b1 = _as_batch(step.batches([seed])[0], what)
    b2 = _as_batch(step.batches([seed])[0], what)
    if step.call is None and step.input_key not in b1:
        raise InvalidArgument(f"{what} returned keys {sorted(b1)}; the model is called "
                              f"on batch[{step.input_key!r}] (input_key=; or give call(model, "
                              f"batch) for a model of several inputs)")
    if not _same_batch(b1, b2):
        if step.data is not None:
            raise InvalidArgument(f"data={step.data!r} yielded a different first batch on a second "
                                  f"call: every rank and the truth iterate their own copy, so it "
                                  f"must give the same batches each time (no unseeded shuffle)")
        raise InvalidArgument(f"batch={step.batch!r} returned different batches for one seed: draw "
                              f"every random number from the generator it is given")
    n = step.count(b1)
    if not (math.isfinite(n) and n > 0):
        raise InvalidArgument(f"the batch holds {n!r} loss units (tokens=/mask): need > 0")
    out = step.forward(m1, b1)
    loss = step.loss(out, b1)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.dim() != 0:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) \
            else type(loss).__name__
        raise InvalidArgument(f"loss={step.loss!r} returned {what}; it must return a scalar "
                              f"(0-dim) tensor: the loss of the whole batch (reduce with .mean() "
                              f"or a token mean)")
    if not loss.requires_grad:
        raise InvalidArgument(f"loss={step.loss!r} returned a tensor that does not depend on the "
                              f"model's parameters (requires_grad is False)")
    if not torch.isfinite(loss.detach().double()).all():
        raise InvalidArgument(f"loss={step.loss!r} is {loss.item()!r} on trial 0's batch")
    with torch.no_grad():
        again = step.loss(step.forward(m2, b1), b1)
    if not _same_value(loss.detach(), again.detach()):
        raise InvalidArgument(
            f"the step is not deterministic: one model and one batch gave the losses "
            f"{loss.item()!r} and {again.item()!r} (dropout or other randomness in train mode?). "
            f"The truth, the single device and every rank must compute one function: build the "
            f"model with dropout off (p=0, or model.eval() in the factory)")
    return b1


def _same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit on the CPU; elsewhere within 1e-3 relative (GPU kernels may reduce in
    another order on every call, dropout moves a loss by far more)."""
    if a.device.type == "cpu":
        return same_bits(a, b)
    a, b = a.double(), b.double()
    return bool(((a - b).abs() <= 1e-3 * a.abs()).all())


def _to_fp64(batch: Mapping) -> dict:
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in batch.items()}


def rounded_model(step: TrainingStep, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The factory's model, its floating weights rounded to param_dtype if given (kept in
    their own dtype)."""
    m = step.model()
    if param_dtype is not None:
        with torch.no_grad():
            for p in m.parameters():
                if p.is_floating_point():
                    p.copy_(p.to(param_dtype).to(p.dtype))
    return m


def fp64_model(step: TrainingStep, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The factory's model in float64, its weights first rounded to param_dtype if given."""
    return rounded_model(step, param_dtype).double()


def grads_of(model: torch.nn.Module, loss: torch.Tensor) -> dict:
    """{name: gradient} of every trainable parameter (zeros where the loss does not reach it)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: (torch.zeros_like(p) if g is None else g) for (n, p), g in zip(named, gs)}


def single_device(step: TrainingStep, seeds: list, *, fp64: bool = True,
                  param_dtype: torch.dtype | None = None, device: str = "cpu", pick=None) -> Truth:
    """The single-device step on every trial's batch: in float64 (the truth), or with
    fp64=False in the model's own dtype (what parity tests compare against); both with the
    weights rounded to param_dtype first where given (the base must compute with the
    weights the transform and the truth compute with, or the paired tests charge the
    weights' rounding to the transform). device: where it runs (the base runs on the
    transform's device: GPU and CPU kernels round differently, and that difference is not
    the transform's); the result is on the CPU. pick: the indices of the trials to run
    (None: all), in that order."""
    return run_single_device(step, single_device_inputs(step, seeds, fp64=fp64, param_dtype=param_dtype,
                                                        device=device, pick=pick))


class SingleDeviceInputs(NamedTuple):
    """The model and batches of single_device, built apart from its steps: the factory
    (which may seed torch's global generator) and a data iterable run on the caller's
    thread, and the steps may then run on another (trainprobes.transforms.local overlaps
    the truth with the transform's steps)."""

    model: torch.nn.Module
    batches: list


def single_device_inputs(step: TrainingStep, seeds: list, *, fp64: bool = True,
                         param_dtype: torch.dtype | None = None, device: str = "cpu",
                         pick=None) -> SingleDeviceInputs:
    model = (fp64_model(step, param_dtype) if fp64 else rounded_model(step, param_dtype)).to(device)
    if pick is None:
        batches = step.batches(seeds)
    elif step.data is None:  # drawn from each trial's seed: only the picked ones are made
        batches = step.batches([seeds[k] for k in pick])
    else:  # a data iterable is read from its start
        batches = step.batches(seeds)
        batches = [batches[k] for k in pick]
    return SingleDeviceInputs(model, [to_device(_to_fp64(b) if fp64 else b, device) for b in batches])


def run_single_device(step: TrainingStep, inputs: SingleDeviceInputs) -> Truth:
    """single_device's steps, one forward and backward per batch."""
    losses, grads = [], {}
    for b in inputs.batches:
        loss = step.loss(step.forward(inputs.model, b), b)
        for n, g in grads_of(inputs.model, loss).items():
            grads.setdefault(n, []).append(g.detach().cpu())
        losses.append(loss.detach().reshape(()).cpu())
    return Truth(torch.stack(losses), {n: torch.stack(v) for n, v in grads.items()})


def references(step: TrainingStep, seeds: list, transform, device: str = "cpu", pick=None) -> tuple:
    """(fp64 truth, single device in the model's dtype on `device`), both with the weights
    the transform computes with (trainprobes.transforms.base.Transform.weight_dtype), of the
    trials `pick` (None: all)."""
    w = transform.weight_dtype()
    return (single_device(step, seeds, param_dtype=w, pick=pick),
            single_device(step, seeds, fp64=False, param_dtype=w, device=device, pick=pick))


def check_truth(ref: Truth, step: TrainingStep) -> None:
    """A truth the probe can compare with: finite, and a gradient somewhere."""
    bad = [n for n, g in ref.grads.items() if not torch.isfinite(g).all()]
    if bad or not torch.isfinite(ref.loss).all():
        raise InvalidArgument(f"the fp64 single-device step of {step.name!r} is not finite "
                              f"({bad[:3] or 'the loss'}): the truth itself overflows or meets NaN")
    norms = torch.stack([g.reshape(g.shape[0], -1).pow(2).sum(1) for g in ref.grads.values()]).sum(0)
    zero = int((norms == 0).sum())
    if zero > len(norms) - 3:
        raise InvalidArgument(f"the fp64 gradient of {step.name!r} is exactly zero on {zero} of "
                              f"{len(norms)} trials: nothing to compare (does the loss depend on "
                              f"the parameters through the batch?)")
