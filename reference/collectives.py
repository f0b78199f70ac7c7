"""Collectives over simulated ranks: the fp64 reference and the exact low-precision model.

    all_reduce(inputs, *, op="sum", dtype="fp64", accum_dtype=None, algorithm="ring", ...)
    reduce_scatter(...), all_gather(...), reduce(..., root=), broadcast(..., root=)

`inputs` is a list with one tensor per rank (or one tensor whose first dim is the world).
One code path for every format: at dtype="fp64" it IS the reference; at any other format it
rounds where a real backend rounds:
  1. each rank's input is rounded once to the wire format (one correct rounding from any
     input dtype; saturating only if asked),
  2. every add of the schedule (reference/schedules.py) is add(a, b) =
     wire(accum(a + b)): the exact sum rounded to `accum_dtype` (round to nearest), then to
     the wire format with `rounding`. NCCL's classic kernels keep the accumulator in the
     element type, so accum defaults to the wire format; for fp8 NCCL adds in fp16 and casts
     back with __NV_SATFINITE (src/device/reduce_kernel.h), so fp8 defaults to
     accum_dtype="fp16" and saturating adds: the "nccl_fp8" arithmetic.
  3. op="avg": avg="premul" (NCCL ncclAvg on floats = PreMulSum: every input times
     T(1/n) rounded to the wire format, then the sum) or avg="divide" (gloo: the sum, then
     / n rounded once to the wire format). avg=None picks "divide" for algorithm="gloo" and
     "premul" otherwise.
The exact sum of two values of a format up to fp32 is rounded by float64 innocuously
(53 >= 2*24 + 2), and fp32 arithmetic then one rounding is a correctly rounded fp16/bf16 add
(24 >= 2p + 2). So fp16/bf16/fp32 with rounding="nearest" run on torch's native dtypes (one
exact rounding of the inputs, then native adds). Everywhere else the bits are Format.round's,
computed faster where that is exact: NCCL's fp8 add (fp16 add, saturating cast) on fp8
values held in fp16, rounded in float32 by reference/fastround.py; stochastic rounding of
formats float32 holds on float32 values by reference/stochastic.py (integer bit arithmetic,
a few random bits per rounding, the same distribution); round-to-nearest of tf32, fp6, fp4
and the other fp8 set-ups on float64 by fastround; toward-zero rounding by Format.round.

Returns: a list of per-rank tensors holding the wire-format values as float64. Ranks that
receive identical bits (all_reduce, all_gather, broadcast) share ONE tensor object, so 16384
ranks cost one tensor of memory; do not modify it in place. reduce() returns None for
non-root ranks. NaN and Inf propagate as the wire type does (fp16 overflow -> inf, e4m3fn
overflow -> NaN, saturating fp8 adds -> +-448); `return_info=True` returns (outputs, info)
where `info` (CollectiveInfo) counts non-finite values in and out and records the seed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.reference import fp8codes
from trainprobes.reference.fastround import fits, round_nearest
from trainprobes.reference.formats import ROUNDING_MODES, Format, get_format
from trainprobes.reference.schedules import BLOCK, SequentialSchedule, get_schedule
from trainprobes.reference.scratch import Scratch
from trainprobes.reference.stochastic import (
    StochasticRounder,
    add_then_round,
    round_input,
    source,
    sr_storage,
    supported,
)
from trainprobes.validation import (
    check_bool,
    check_choice,
    check_int,
    check_seed,
    check_tensor,
    check_type,
)

OPS = ("sum", "avg", "max", "min")
AVG_MODES = ("premul", "divide")
_NATIVE = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16,
           "bf16": torch.bfloat16}
# Elements per block when rounding the inputs. Paths that allocate fresh temporaries (the
# float64 round-to-odd path makes ~10 per block) keep them small: at schedules.BLOCK (2^18,
# 2 MB each) fp64 -> bf16 went from 1.1x to 1.5x the reference on 8 x 16M. fp8 codes and
# stochastic rounding reuse Scratch buffers and take schedules.BLOCK (fp8 0.84x -> 0.62x).
# Fixed per path, so stochastic rounding draws its random numbers in one order everywhere.
STACK_BLOCK = 1 << 16
_GLOO_ITEMSIZE = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2}  # the types gloo reduces


@dataclass(frozen=True)
class CollectiveInfo:
    """What a collective did, for a probe to report: the arithmetic and non-finite counts.

    nan_inputs / inf_inputs: counted in the inputs as given; overflow_inputs: finite inputs
    that became inf/NaN when rounded to the wire format; nan_outputs / inf_outputs: in the
    reduced result (counted once, not per rank).
    """

    collective: str
    op: str
    dtype: str
    accum_dtype: str
    algorithm: str
    avg: str | None
    rounding: str
    saturate: bool
    arithmetic: str
    seed: int | None
    world: int
    numel: int
    nan_inputs: int
    inf_inputs: int
    overflow_inputs: int
    nan_outputs: int
    inf_outputs: int

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- input checking


def _as_world(inputs) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 0:
            raise InvalidArgument("inputs is a 0-d tensor; pass a list with one tensor per rank "
                                  "(or a tensor whose first dimension is the world)")
        inputs = list(inputs.unbind(0))
    check_type((list, tuple), inputs, "inputs", hint="a list with one tensor per rank")
    if len(inputs) == 0:
        raise InvalidArgument("inputs is empty: a collective needs at least one rank's tensor")
    out = []
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            try:
                t = torch.as_tensor(t)
            except Exception as e:
                raise InvalidType(f"inputs[{i}] has type {type(t).__name__}, expected a "
                                  f"torch.Tensor") from e
        check_tensor(t, f"inputs[{i}]", kind="real")
        if t.device.type == "meta":
            raise InvalidArgument(f"inputs[{i}] is on the meta device: it holds no values to "
                                  "reduce; pass tensors on cpu or cuda")
        out.append(t)
    for i, t in enumerate(out[1:], 1):
        check_tensor(t, f"inputs[{i}]", like=(out[0], "inputs[0]"))
    return out


# ---------------------------------------------------------------- the arithmetic


def _round_to_odd_fp32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 with round-to-odd: an inexact result gets an odd last bit.

    A later round-to-nearest-even to any format with p <= 22 bits is then ONE correct
    rounding of x (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved
    algorithms using rounding to odd", 2008), whereas fp64 -> fp32 -> narrow rounds twice.
    f = RNE(x); if inexact, the odd one of f's two neighbours around x is
    (bits(f) - [|f| > |x|]) | 1 in sign-magnitude bits.
    """
    f = x.to(torch.float32)
    back = f.to(torch.float64)
    inexact = back != x  # also True for NaN: |1 keeps a NaN a NaN
    past = (back.abs() > x.abs()).to(torch.int32)
    bits = f.view(torch.int32)
    return torch.where(inexact, (bits - past) | 1, bits).view(torch.float32)


def _int64_to_odd_fp64(x: torch.Tensor) -> torch.Tensor:
    """int64 -> float64 with round-to-odd where float64 cannot hold the integer (|x| > 2^53),
    so that the wire rounding after it (any format of <= 51 bits, nearest or toward zero)
    is ONE correct rounding of x, as _round_to_odd_fp32 does for float64 -> float32."""
    f = x.to(torch.float64)
    top = f == 2.0 ** 63  # 2^63 - 1 and its neighbours round up out of int64's range
    d = x - f.clamp(max=2.0 ** 63 - 1024).to(torch.int64)  # exact: |d| <= 1024
    inexact = (d != 0) | top
    if not bool(inexact.any()):
        return f
    past = torch.where(x < 0, d > 0, d < 0) | top  # |f| > |x|
    bits = f.view(torch.int64)
    return torch.where(inexact, (bits - past.to(torch.int64)) | 1, bits).view(torch.float64)


def _fp64_to_narrow(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 -> fp16/bf16 in ONE rounding (torch's direct cast goes through fp32 twice)."""
    return _round_to_odd_fp32(x).to(dtype)


class _Arithmetic:
    """The wire format, accumulator and rounding of one collective call."""

    def __init__(self, dtype, accum_dtype, rounding, saturate, seed, device="cpu", fast=True):
        """fast=False: every rounding by Format.round (the definition; the fast paths of
        reference/fastround.py and reference/stochastic.py are checked against it)."""
        self.fast = fast
        self.wire: Format = get_format(dtype, "dtype")
        fp8 = self.wire.name.startswith("fp8")
        self.accum: Format = get_format(accum_dtype if accum_dtype is not None
                                        else ("fp16" if fp8 else self.wire), "accum_dtype")
        check_choice(rounding, "rounding", ROUNDING_MODES)
        if saturate is not None:
            check_bool(saturate, "saturate", hint="or None: the backend's choice")
        self.rounding = rounding
        # saturate=None: the backend's behaviour: NCCL's fp8 adds end in a satfinite cast;
        # input casts follow the type (e4m3fn overflow -> NaN).
        self.sat_inputs = bool(saturate)
        self.sat_adds = fp8 if saturate is None else saturate
        if rounding == "stochastic":
            if seed is None:
                raise InvalidArgument("rounding='stochastic' needs seed=<int>, got seed=None")
            seed = check_seed(seed)
            self.src = source(seed, device)
            self.gen = self.src.generator
        else:
            self.src = self.gen = None
        self.seed = seed
        self.scratch = Scratch()  # temporaries reused by every block of this call
        # Native torch arithmetic is exact where (a + b) in the native type is one correct
        # rounding: fp16/bf16 (via fp32 opmath), fp32 and fp64; an accumulator of fp32 or
        # wider for a 16-bit wire adds nothing (innocuous double rounding, 24 >= 2p + 2).
        wider = {"fp16": ("fp16", "fp32", "fp64"), "bf16": ("bf16", "fp32", "fp64"),
                 "fp32": ("fp32", "fp64"), "fp64": ("fp64",)}
        self.native = (_NATIVE.get(self.wire.name)
                       if rounding == "nearest" and not self.sat_inputs and not self.sat_adds
                       and self.accum.name in wider.get(self.wire.name, ()) else None)
        # NCCL's fp8 add (fp16 add, __NV_SATFINITE cast) on one-byte codes: an exact input
        # cast and a lookup in the table of every pair (reference/fp8codes.py). Checked
        # against Format.round on all 65,536 pairs of each type in the tests.
        self.codes = (self.wire.name in fp8codes.TORCH_FP8 and self.accum.name == "fp16"
                      and self.sat_adds and rounding == "nearest" and fast)
        # Stochastic rounding of formats float32 holds, on float32 values with integer bit
        # arithmetic and few random bits (reference/stochastic.py); the accumulator rounding,
        # if any, must be a float32 round-to-nearest too.
        self.sr = (StochasticRounder(self.wire, self.sat_adds)
                   if fast and rounding == "stochastic" and supported(self.wire)
                   and (self.accum is self.wire or fits(self.accum, torch.float32)) else None)
        self.sr_inputs = (StochasticRounder(self.wire, self.sat_inputs) if self.sr is not None
                          else None)
        self.work = (self.native or (torch.uint8 if self.codes
                                     else sr_storage(self.wire) if self.sr is not None
                                     else torch.float64))
        self.name = ("native_" + self.wire.name if self.native is not None
                     else "nccl_fp8" if fp8 and self.accum.name == "fp16" and self.sat_adds
                     else "emulated")

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """A flat input rounded once to the wire format, in the working dtype (a new tensor:
        stochastic rounding works in reused buffers)."""
        r = self._rounded(t)
        return r.to(self.work, copy=self.sr is not None)

    def values(self, t: torch.Tensor) -> torch.Tensor:
        """float64 values of a tensor in the working dtype (fp8 codes decoded)."""
        return fp8codes.decode(t, self.wire) if self.codes else t.to(torch.float64)

    def _rounded(self, t: torch.Tensor) -> torch.Tensor:
        """A flat input rounded once to the wire format, as fp8 codes or in a float dtype
        that holds the wire's values exactly (the working dtype, or wider: stack() narrows
        on the copy)."""
        if not t.is_floating_point():  # integers: float64, rounded to odd past 2^53
            t = _int64_to_odd_fp64(t) if t.dtype == torch.int64 and self.wire.name != "fp64" \
                else t.to(torch.float64)
        if self.native is not None:
            if t.dtype == self.native:
                return t
            if t.dtype == torch.float64 and self.native in (torch.float16, torch.bfloat16):
                return _fp64_to_narrow(t, self.native)
            return t.to(self.native)  # single rounding: fp32 -> 16-bit, any -> wider
        if self.codes:
            if t.dtype not in (torch.float64, torch.float32):  # fp16/bf16 widen exactly
                t = t.to(torch.float32)
            return fp8codes.encode(t, self.wire, self.sat_inputs, self.scratch)
        if self.sr is not None:
            return round_input(t, self.sr_inputs, self.src, self.scratch)
        t = t.to(torch.float64)
        if self.fast and self.rounding == "nearest" and fits(self.wire, t.dtype):
            return round_nearest(t, self.wire, saturate=self.sat_inputs)
        return self.wire.round(t, self.rounding, saturate=self.sat_inputs, generator=self.gen)

    def stack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """[world, numel] in the working dtype, each row rounded to the wire format.

        Rounded in blocks (a loop over ranks and blocks; each block is vectorised) so
        temporaries stay in cache: STACK_BLOCK elements, BLOCK where they are reused.
        """
        n = tensors[0].numel()
        step = BLOCK if self.codes or self.sr is not None else STACK_BLOCK
        x = torch.empty((len(tensors), n), dtype=self.work, device=tensors[0].device)
        for r, t in enumerate(tensors):
            t = t.reshape(-1)
            if t.dtype == self.native:  # already in the wire format
                x[r] = t
                continue
            for lo in range(0, n, step):
                x[r, lo:lo + step] = self._rounded(t[lo:lo + step])  # exact narrowing
        return x

    def _to_wire(self, s: torch.Tensor) -> torch.Tensor:
        """float64 sum -> accum (nearest) -> wire (self.rounding): Format.round's bits, by
        the fast roundings of reference/fastround.py where they apply."""
        if self.accum is not self.wire:
            s = (round_nearest(s, self.accum) if self.fast and fits(self.accum, s.dtype)
                 else self.accum.round(s, "nearest"))
        if self.fast and self.rounding == "nearest" and fits(self.wire, s.dtype):
            return round_nearest(s, self.wire, saturate=self.sat_adds)
        return self.wire.round(s, self.rounding, saturate=self.sat_adds, generator=self.gen)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return a + b
        if self.sr is not None:
            s = add_then_round(a, b, self.sr, None if self.accum is self.wire else self.accum,
                               self.src, self.scratch)
            return s.to(self.work, copy=True)  # s may live in the scratch buffers
        if self.codes:
            return fp8codes.add(a, b, self.wire)
        return self._to_wire(a + b)

    def scale(self, x: torch.Tensor, s: float) -> torch.Tensor:
        """x * s with s already a wire-format value: one rounding of the exact product."""
        if self.native is not None:
            return x * torch.tensor(s, dtype=self.native)
        q = self.wire.round(self.values(x) * s, self.rounding, saturate=self.sat_adds,
                            generator=self.gen)
        return self._to_work(q)

    def divide(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x / n rounded once to the wire format (gloo's AVG divides after the sum)."""
        q = self.values(x) / n
        return self._to_work(self.wire.round(q, self.rounding, saturate=self.sat_adds,
                                             generator=self.gen))

    def _to_work(self, q: torch.Tensor) -> torch.Tensor:
        """Wire-format values (float64) in the working dtype: exact."""
        return fp8codes.encode_exact(q, self.wire) if self.codes else q.to(self.work)


# ---------------------------------------------------------------- the collectives


def _reduce_world(collective, inputs, *, op, dtype, accum_dtype, algorithm, rounding, seed,
                  avg, ranks_per_node, saturate, order, schedule=None, count_overflow=False):
    """Validate, round, reduce. Returns (flat float64 result, info-maker, tensors); the
    info-maker counts overflowed inputs only with count_overflow (return_info)."""
    tensors = _as_world(inputs)
    check_choice(op, "op", OPS)
    if order is not None:
        if algorithm not in ("ring", "order"):  # "ring" is the default: order= overrides it
            raise InvalidArgument(f"order= replays an explicit order; it cannot be combined with "
                                  f"algorithm={algorithm!r} (use algorithm='order' or leave it)")
        algorithm = "order"
    if avg is not None:
        check_choice(avg, "avg", AVG_MODES)
        if op != "avg":
            raise InvalidArgument(f"avg={avg!r} only applies to op='avg', not op={op!r}")
    elif op == "avg":
        avg = "divide" if algorithm == "gloo" else "premul"
    arith = _Arithmetic(dtype, accum_dtype, rounding, saturate, seed, tensors[0].device)
    itemsize = None
    if algorithm == "gloo":
        if arith.wire.name not in _GLOO_ITEMSIZE:
            raise InvalidArgument(f"dtype={dtype!r} with algorithm='gloo': gloo reduces only "
                                  f"{list(_GLOO_ITEMSIZE)} (float8 gives \"Invalid scalar "
                                  f"type\"); use an NCCL-modelled algorithm")
        itemsize = _GLOO_ITEMSIZE[arith.wire.name]
    world, numel = len(tensors), tensors[0].numel()
    if schedule is None:
        schedule = get_schedule(algorithm, world, numel, ranks_per_node=ranks_per_node,
                                order=order, itemsize=itemsize)
    x = arith.stack(tensors)
    overflow = None
    if count_overflow:  # on the rounding used: stochastic rounding would draw anew
        finite_in = torch.stack([torch.isfinite(t.reshape(-1)) if t.is_floating_point()
                                 else torch.ones(numel, dtype=torch.bool, device=t.device)
                                 for t in tensors])
        finite_out = torch.isfinite(x if x.is_floating_point() else arith.values(x))
        overflow = int(torch.count_nonzero(finite_out.logical_not_().logical_and_(finite_in)))
    if op in ("max", "min"):  # on the values (fp8 codes do not sort as their values)
        x = arith.values(x)
        total = x.amax(0) if op == "max" else x.amin(0)  # exact; NaN propagates
    else:
        if op == "avg" and avg == "premul":
            s = float(arith.wire.round(torch.tensor(1.0 / world, dtype=torch.float64)))
            x = arith.scale(x, s)
        total = schedule.reduce(x, arith.add)
        if op == "avg" and avg == "divide":
            total = arith.divide(total, world)
        total = arith.values(total)  # once: max/min's total is values already

    def info() -> CollectiveInfo:
        given = [t for t in tensors if t.is_floating_point()]
        nan_in = sum(int(torch.count_nonzero(torch.isnan(t))) for t in given)
        inf_in = sum(int(torch.count_nonzero(torch.isinf(t))) for t in given)
        return CollectiveInfo(
            collective=collective, op=op, dtype=arith.wire.name, accum_dtype=arith.accum.name,
            algorithm=algorithm, avg=avg, rounding=rounding,
            saturate=arith.sat_adds, arithmetic=arith.name, seed=arith.seed, world=world,
            numel=numel, nan_inputs=nan_in, inf_inputs=inf_in, overflow_inputs=overflow,
            nan_outputs=int(torch.count_nonzero(torch.isnan(total))),
            inf_outputs=int(torch.count_nonzero(torch.isinf(total))))

    return total, info, tensors


def all_reduce(inputs, *, op="sum", dtype="fp64", accum_dtype=None, algorithm="ring",
               rounding="nearest", seed=None, avg=None, ranks_per_node=None, saturate=None,
               order=None, return_info=False):
    """Every rank gets the same reduction of all ranks' inputs (one shared tensor).

    op: "sum" | "avg" | "max" | "min". dtype: the wire format (trainprobes.reference.formats names).
    accum_dtype: precision of each add before the cast to the wire format (default: the
    wire format; fp16 for fp8, as NCCL). algorithm: see trainprobes.reference.schedules.ALGORITHMS;
    order=LongTensor[world, numel] replays an explicit order. rounding: "nearest" |
    "stochastic" (needs seed) | "toward_zero", applied at every wire rounding (the inputs,
    every add, the avg scaling). saturate: None = the backend's choice (NCCL fp8 adds
    saturate), True/False = clamp or not everywhere. avg: see the module docstring.
    ranks_per_node: for algorithm="hierarchical".
    """
    total, info, tensors = _reduce_world(
        "all_reduce", inputs, op=op, dtype=dtype, accum_dtype=accum_dtype,
        algorithm=algorithm, rounding=rounding, seed=seed, avg=avg,
        ranks_per_node=ranks_per_node, saturate=saturate, order=order,
        count_overflow=return_info)
    out = total.reshape(tensors[0].shape)
    outs = [out] * len(tensors)
    return (outs, info()) if return_info else outs


def reduce_scatter(inputs, *, op="sum", dtype="fp64", accum_dtype=None, algorithm="ring",
                   rounding="nearest", seed=None, avg=None, ranks_per_node=None,
                   saturate=None, order=None, return_info=False):
    """Rank r gets block r of the reduction (the first dim split into world equal blocks).

    Like torch.distributed.reduce_scatter_tensor, the first dim must be divisible by the
    world. With algorithm="ring" block r is NCCL's ring chunk r: ranks r+1, ..., r. Outputs
    are views of one reduced tensor. Arguments as all_reduce.
    """
    tensors = _as_world(inputs)
    world, shape = len(tensors), tuple(tensors[0].shape)
    if len(shape) == 0 or shape[0] % world:
        raise InvalidArgument(f"inputs[0] has shape {shape}; reduce_scatter needs a first dim "
                              f"divisible by the world ({world}), e.g. ({world * 4},)")
    total, info, _ = _reduce_world(
        "reduce_scatter", tensors, op=op, dtype=dtype, accum_dtype=accum_dtype,
        algorithm=algorithm, rounding=rounding, seed=seed, avg=avg,
        ranks_per_node=ranks_per_node, saturate=saturate, order=order,
        count_overflow=return_info)
    outs = list(total.reshape(shape).chunk(world, 0))
    return (outs, info()) if return_info else outs


def reduce(inputs, *, root=0, op="sum", dtype="fp64", accum_dtype=None, algorithm="ring",
           rounding="nearest", seed=None, avg=None, ranks_per_node=None, saturate=None,
           order=None, return_info=False):
    """The reduction at rank `root`; None for every other rank.

    algorithm="ring" is NCCL's ring reduce: one chain root+1, root+2, ..., root for every
    element (the chain ends at the root); algorithm="gloo" is gloo's reduce (its own
    segment layout, reference/gloo.py). Other algorithms use their all-reduce order.
    """
    tensors = _as_world(inputs)
    world = len(tensors)
    root = check_int(root, "root", min=0, max=world - 1, hint="a rank")
    schedule = None
    if algorithm == "ring" and order is None:
        schedule = SequentialSchedule(world, tensors[0].numel(), start=(root + 1) % world)
    elif algorithm == "gloo" and order is None:  # gloo/reduce.cc segments differently
        fmt = get_format(dtype)
        if fmt.name in _GLOO_ITEMSIZE:
            schedule = get_schedule("gloo", world, tensors[0].numel(),
                                    itemsize=_GLOO_ITEMSIZE[fmt.name], collective="reduce")
    total, info, _ = _reduce_world(
        "reduce", tensors, op=op, dtype=dtype, accum_dtype=accum_dtype, algorithm=algorithm,
        rounding=rounding, seed=seed, avg=avg, ranks_per_node=ranks_per_node,
        saturate=saturate, order=order, schedule=schedule, count_overflow=return_info)
    outs = [None] * world
    outs[root] = total.reshape(tensors[0].shape)
    return (outs, info()) if return_info else outs


def all_gather(inputs, *, dtype="fp64", rounding="nearest", seed=None, saturate=None):
    """Every rank gets all inputs, each rounded once to the wire format, concatenated on
    dim 0 (0-d inputs are stacked). No arithmetic, so no order. One shared tensor."""
    tensors = _as_world(inputs)
    arith = _Arithmetic(dtype, None, rounding, saturate, seed, tensors[0].device)
    rows = arith.values(arith.stack(tensors))
    shape = tensors[0].shape
    out = rows.reshape((len(tensors),) + tuple(shape))
    out = out if len(shape) == 0 else out.flatten(0, 1)
    return [out] * len(tensors)


def broadcast(inputs, *, root=0, dtype="fp64", rounding="nearest", seed=None, saturate=None):
    """Every rank gets rank `root`'s input rounded once to the wire format (shared)."""
    tensors = _as_world(inputs)
    root = check_int(root, "root", min=0, max=len(tensors) - 1, hint="a rank")
    arith = _Arithmetic(dtype, None, rounding, saturate, seed, tensors[0].device)
    out = arith.values(arith.stack([tensors[root]])[0]).reshape(tensors[root].shape)
    return [out] * len(tensors)
