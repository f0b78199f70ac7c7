"""What every transform shares: the rank context, a step's output, how a batch is split
and how the pieces of a split batch are weighted.

A transform is a small frozen dataclass (its fields are its options, recorded in every
Result) with four methods:

    check(step, world, batch, model)  before any rank starts: refuse what cannot run
    setup(step, ctx)                  on each rank, once: build and wrap the model
    run(state, step, batch, ctx)      on each rank, per trial: one transformed step on the
                                      global batch -> StepOutput(loss, {name: full gradient})
    dtypes()                          the precisions it adds (a hook's wire dtype, ...)

Splitting a batch into P pieces (ranks x micro-batches) changes what "the loss" means. The
normalisation names it: piece i of the global batch gets the weight
    token-weighted  n_i / N       (n_i its loss units, N the batch's): the single-device
                                   token mean, whatever the split (transformers'
                                   num_items_in_batch)
    mean-of-means   1 / P          each piece's own mean, averaged (the classic recipe;
                                   equal to the above only when every n_i is equal)
    sum             1              the pieces' losses summed (right for sum losses)
so the transformed gradient is sum_i w_i grad(loss(piece i)).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.transforms.step import TrainingStep, count_tokens, is_scalar, rows, samples
from trainprobes.validation import check_choice, check_int

NORMALIZATIONS = ("token-weighted", "mean-of-means", "sum")

__all__ = ["NORMALIZATIONS", "RankContext", "StepOutput", "Transform", "piece_weights", "split"]


class RankContext(NamedTuple):
    """Where a transform runs: this rank, the world, the device, the backend."""

    rank: int
    world: int
    device: torch.device
    backend: str


class StepOutput(NamedTuple):
    """What one transformed step returns on one rank: the loss it would log (None where
    this rank has none, a non-last pipeline stage) and {name: full gradient} of the
    parameters it holds; missing: {name: dtype} of parameters it holds whose gradient the
    step left None (the loss did not reach them on this trial: an expert no token was routed
    to), which the probe reads as zero where the fp64 truth is exactly zero there and
    refuses elsewhere (trainprobes.transforms.local)."""

    loss: torch.Tensor | None
    grads: dict
    missing: dict = {}


def split(batch: dict, parts: int) -> list:
    """`parts` equal pieces of the samples of a batch, in order (scalars go whole to each)."""
    n = samples(batch)
    size = n // parts
    return [rows(batch, slice(i * size, (i + 1) * size)) for i in range(parts)]


def piece_weights(step: TrainingStep, batch: dict, pieces: list, normalization: str) -> list:
    """The weight of each piece's loss (module docstring)."""
    if normalization == "token-weighted":
        total = count_tokens(batch, step.tokens)
        return [count_tokens(p, step.tokens) / total for p in pieces]
    if normalization == "mean-of-means":
        return [1.0 / len(pieces)] * len(pieces)
    return [1.0] * len(pieces)


def check_split_loss(step: TrainingStep, batch: dict, pieces_of, axis: int, transform: str,
                     normalization: str) -> None:
    """Token-weighted promises the single-device loss whatever the split: sum_i (n_i / N)
    loss(piece_i) = loss(batch), true of a loss that is its piece's token mean. A loss that
    divides by a whole-batch value (num_items_in_batch, a 0-dim scalar kept whole in every
    piece) or none (a sum loss) is already its piece's share of the batch's: the pieces'
    losses add up to it, and weighting them again by n_i / N is a scale error of the
    built-in's own making, which the verdict would charge to the trainer. Checked before any
    rank starts, in fp64 on the batch's output cut as the batch is (pieces_of, along `axis`
    of the output); such a loss is refused, naming normalization=sum. An output that is not
    one tensor with that axis is not checked."""
    from trainprobes.transforms.step import _to_fp64, fp64_model
    if normalization != "token-weighted":
        return
    whole_batch = _to_fp64(batch)
    length = int(next(v.shape[axis] for v in whole_batch.values() if not is_scalar(v) and v.dim() > axis))
    with torch.no_grad():
        out = step.forward(fp64_model(step), whole_batch)
        if not isinstance(out, torch.Tensor) or out.dim() <= axis or out.shape[axis] != length:
            return
        key = "\0output"  # the output cut with the batch, under a key no batch uses
        pieces = pieces_of({**whole_batch, key: out})
        if len(pieces) < 2:
            return
        losses = [float(step.loss(p.pop(key), p)) for p in pieces]
        whole = float(step.loss(out, whole_batch))
    weighted = sum(w * x for w, x in zip(piece_weights(step, whole_batch, pieces, normalization), losses))
    added = sum(losses)

    def same(x: float) -> bool:
        return abs(x - whole) <= 1e-9 * abs(whole)
    if same(added) and not same(weighted):
        raise InvalidArgument(
            f"{transform}: the loss of a piece of the batch is already its share of the whole batch's "
            f"(it divides by a whole-batch value, such as num_items_in_batch kept whole in every "
            f"piece, or it is a sum): on trial 0's batch the {len(pieces)} pieces' losses add up to "
            f"the batch's {whole:.6g}, and weighted by their token shares (normalization="
            f"'token-weighted') they give {weighted:.6g}, a scale the built-in would add itself. "
            f"Add them as a trainer passing num_items_in_batch does: {transform}:normalization=sum")


def check_divisible(batch: dict, world: int, parts: int, what: str) -> None:
    n = samples(batch)
    if n % (world * parts):
        raise InvalidArgument(
            f"the batch holds {n} samples, not divisible by world={world} x {what}={parts} "
            f"= {world * parts}: every rank and micro-batch needs an equal share (make "
            f"batch(generator) return a multiple of {world * parts} samples)")


class Transform:
    """Base of the transforms: options are the dataclass fields."""

    name: ClassVar[str] = "transform"

    @property
    def options(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = getattr(v, "__qualname__", None) or repr(v) if callable(v) else v
        return out

    @property
    def label(self) -> str:
        """name(option=value, ...) with the options that differ from their defaults."""
        changed = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.default is not dataclasses.MISSING and v == f.default:
                continue
            changed.append(f"{f.name}={_text(self.options[f.name])}")
        return f"{self.name}({','.join(changed)})" if changed else self.name

    def dtypes(self) -> tuple:
        """Precisions (format names) the transform adds to the model's own."""
        return ()

    def weight_dtype(self) -> torch.dtype | None:
        """The dtype the transform casts the weights to for compute, in place of the
        model's (the truth's weights are rounded to it first: that is its contract)."""
        return None

    def check(self, step: TrainingStep, world: int, batch: dict, model: torch.nn.Module) -> None:
        pass

    def setup(self, step: TrainingStep, ctx: RankContext):
        raise NotImplementedError

    def run(self, state, step: TrainingStep, batch: dict, ctx: RankContext) -> StepOutput:
        raise NotImplementedError

    def teardown(self, state) -> None:
        pass


def _text(v) -> str:
    """An option value as it is written on the command line (plan a:b;c:d, split a+b|c)."""
    if isinstance(v, dict):
        return ";".join(f"{k}:{x}" for k, x in v.items())
    if isinstance(v, (tuple, list)):
        return "|".join(_text(x) if isinstance(x, (tuple, list)) else str(x) for x in v) \
            if any(isinstance(x, (tuple, list)) for x in v) else "+".join(map(str, v))
    return str(v)


def check_normalization(value) -> str:
    return check_choice(value, "normalization", NORMALIZATIONS,
                        hint="how the losses of a split batch's pieces are combined")


def check_parts(value, name: str) -> int:
    return check_int(value, name, min=1)


def with_zeros(module: torch.nn.Module, grads: dict, ctx: RankContext, held=None) -> dict:
    """grads, plus a zero gradient for every trainable parameter of `module` (held: a
    predicate on the name, the parameters this rank holds) the loss did not reach: PyTorch
    leaves .grad None there, which is a zero gradient, as the truth's is (an unused
    parameter is not a parameter the transform forgot)."""
    out = dict(grads)
    for n, p in module.named_parameters():
        if p.requires_grad and n not in out and (held is None or held(n)):
            out[n] = torch.zeros(tuple(p.shape), dtype=p.dtype, device=ctx.device)
    return out


def step_loss(loss, label: str, ctx: RankContext) -> torch.Tensor | None:
    """The loss a step returned, as a 0-dim tensor (None where this rank logs none): one
    value, the whole batch's; a per-token or per-sample vector is refused by shape, not
    reshaped (its mean is a guess at the trainer's normalisation)."""
    if loss is None:
        return None
    if not isinstance(loss, (torch.Tensor, float, int)) or isinstance(loss, bool):
        raise InvalidArgument(f"the step ({label}) returned a loss of type {type(loss).__name__} on "
                              f"rank {ctx.rank}; return a scalar tensor (the whole batch's loss) "
                              f"or None")
    loss = torch.as_tensor(loss).detach()
    if loss.numel() != 1:
        raise InvalidArgument(f"the step ({label}) returned a loss of shape {tuple(loss.shape)} on "
                              f"rank {ctx.rank}; return one value, the loss of the whole batch as "
                              f"the trainer logs it (reduce a per-token or per-sample loss as "
                              f"the trainer does), or None on a rank that logs none")
    return loss.reshape(())


def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def reduce_loss(value: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """The loss summed over ranks (each rank's share already weighted)."""
    import torch.distributed as dist
    out = value.detach().clone().reshape(1)
    dist.all_reduce(out)
    return out.reshape(())
