"""gloo's ring reduction order on CPU, so anyone can predict gloo's bits without running it.

The contract with reference/collectives.py and reference/schedules.py:

    gloo_schedule(world, numel, itemsize) -> schedule with .reduce(x, add) and .order_map()

`x` is Tensor[world, numel] (one row per rank), `add(a, b)` the rounded add collectives.py
supplies; the schedule fixes only the association order. algorithm="gloo" in
trainprobes.reference.collectives imports this lazily; gloo's AVG is the sum, then a division by the
world (avg="divide"). Revealed from torch 2.13's ProcessGroupGloo with crafted inputs
(probes/distributed/reveal.py) and matching gloo's public source:

gloo/allreduce.cc, ring() (what ProcessGroupGloo's allreduce of a dense CPU tensor runs):
  1. T = numel * itemsize bytes; max segment = 1 MiB (AllreduceOptions::kMaxSegmentSize).
  2. S = roundUp(max(ceil(T / 1 MiB), 2 * world), world) segments, S / world per rank,
     segment bytes = roundUp(ceil(T / S), itemsize). The last segments may be short or
     empty: the layout is NOT torch.tensor_split(numel, world).
  3. chunk c = segments c*S/W .. (c+1)*S/W - 1. Rank r sends to r-1 and receives from r+1,
     so chunk c starts as rank c-1's input and is reduced by c-2, c-3, ..., ending at c:
         chunk c = ((x[c-1] + x[c-2]) + x[c-3]) + ... + x[c]      (ranks mod world)
     NCCL's ring runs the other way (x[c+1] + x[c+2] + ...): the two agree for world <= 3
     (the first two adds commute) and differ from world 4 on.
gloo/reduce.cc (ProcessGroupGloo's reduce): the same chain, but segments are
  roundUp(min(ceil(T / (2 * world)), 1 MiB), itemsize) bytes and
  S = roundUp(max(ceil(T / segment), 2 * world), world): pass collective="reduce".
gloo/math.h: sum is c[i] = a[i] + b[i] in the element type; at::Half / at::BFloat16 add
  through float and round to nearest even, so every hop is one correctly rounded add.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_choice, check_int

MAX_SEGMENT_BYTES = 1 << 20  # gloo/allreduce.h: AllreduceOptions::kMaxSegmentSize
COLLECTIVES = ("all_reduce", "reduce")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _check(world, numel, itemsize, collective, max_segment_bytes) -> None:
    check_int(world, "world", min=1, hint="the number of ranks")
    check_int(numel, "numel", min=0, hint="elements per rank")
    check_int(itemsize, "itemsize", min=1, hint="bytes per element")
    check_int(max_segment_bytes, "max_segment_bytes", min=1)
    check_choice(collective, "collective", COLLECTIVES,
                 hint="reduce_scatter and all_reduce of gloo share the all_reduce order")


@dataclass(frozen=True)
class GlooLayout:
    """gloo's segmentation of one buffer: S segments of `segment_elems`, S/world per chunk."""

    world: int
    numel: int
    itemsize: int
    collective: str
    num_segments: int
    segment_elems: int

    @property
    def segments_per_rank(self) -> int:
        return self.num_segments // self.world

    @property
    def chunk_elems(self) -> int:
        return self.segments_per_rank * self.segment_elems

    def chunk_ids(self) -> torch.Tensor:
        """LongTensor[numel]: the chunk (= the rank that finishes it) of every element."""
        return torch.arange(self.numel, dtype=torch.int64) // max(1, self.chunk_elems)


def gloo_layout(world: int, numel: int, itemsize: int, collective: str = "all_reduce",
                max_segment_bytes: int = MAX_SEGMENT_BYTES) -> GlooLayout:
    """The segments gloo cuts a buffer of numel * itemsize bytes into (module docstring)."""
    _check(world, numel, itemsize, collective, max_segment_bytes)
    total = numel * itemsize
    max_seg = itemsize * max(1, max_segment_bytes // itemsize)
    if collective == "all_reduce":
        segments = _round_up(max(_ceil_div(total, max_seg), 2 * world), world)
        seg_bytes = _round_up(_ceil_div(total, segments), itemsize)
    else:
        seg_bytes = _round_up(min(_ceil_div(total, 2 * world), max_seg), itemsize)
        segments = _round_up(max(_ceil_div(total, max(seg_bytes, 1)), 2 * world), world)
    return GlooLayout(world, numel, itemsize, collective, segments, seg_bytes // itemsize)


@dataclass(frozen=True)
class GlooRingSchedule:
    """gloo's ring order; chunk c = ((x[c-1] + x[c-2]) + ...) + x[c] (module docstring)."""

    name: ClassVar[str] = "gloo"
    world: int
    numel: int
    itemsize: int
    collective: str = "all_reduce"
    max_segment_bytes: int = field(default=MAX_SEGMENT_BYTES, repr=False)
    layout: GlooLayout = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "layout", gloo_layout(self.world, self.numel, self.itemsize,
                                                       self.collective, self.max_segment_bytes))

    def _rows(self, k: int) -> torch.Tensor:
        """Rank added at hop k into every element: (chunk - 1 - k) mod world."""
        return (self.layout.chunk_ids() - 1 - k) % self.world

    def order_map(self) -> torch.Tensor:
        """LongTensor[world, numel]: order[k, i] = the k-th rank added into element i."""
        chunk = self.layout.chunk_ids()
        k = torch.arange(self.world, dtype=torch.int64)[:, None]
        return (chunk[None, :] - 1 - k) % self.world

    def reduce(self, x: torch.Tensor, add) -> torch.Tensor:
        """x: Tensor[world, numel] -> Tensor[numel]; one vectorised gather per hop."""
        if x.dim() != 2 or tuple(x.shape) != (self.world, self.numel):
            raise InvalidArgument(f"x has shape {tuple(x.shape)}, expected ({self.world}, "
                                  f"{self.numel}) for {self!r}")
        if self.world == 1:
            return x[0].clone()
        # Chunks are contiguous runs of elements, so hop k reads one rank per chunk: a
        # loop over chunks of slices would be W^2 steps; one gather per hop is W steps.
        chunk = self.layout.chunk_ids().to(x.device)
        acc = x.gather(0, ((chunk - 1) % self.world)[None])[0]
        for k in range(1, self.world):
            acc = add(acc, x.gather(0, ((chunk - 1 - k) % self.world)[None])[0])
        return acc


def gloo_schedule(world: int, numel: int, itemsize: int,
                  collective: str = "all_reduce") -> GlooRingSchedule:
    """The schedule trainprobes.reference.collectives uses for algorithm="gloo" (module docstring)."""
    return GlooRingSchedule(world, numel, itemsize, collective)


def gloo_order(world: int, numel: int, itemsize: int,
               collective: str = "all_reduce") -> torch.Tensor:
    """LongTensor[world, numel] order map of gloo's ring, for algorithm="order" replays."""
    return GlooRingSchedule(world, numel, itemsize, collective).order_map()
