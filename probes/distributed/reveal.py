"""Reveal a real backend's per-element reduction order from crafted inputs (FPRev-style).

    reveal_order(backend="gloo", world=4, numel=..., dtype="fp32") -> RevealedOrder
    reveal_result(...) -> Result: the revealed order against reference/gloo.py's model

1. For every pair i < j of ranks, one real run with +big at rank i, -big at rank j and
   tiny everywhere else (trainprobes.distributed.inputs.reveal_input). big is chosen so that
   big + (world - 1) * tiny rounds to big in the wire format (tiny < half an ulp of big).
2. In a chain (acc = acc + x[next rank], as gloo's and NCCL's rings do per element), the
   tinies added before the pair met are absorbed and those added after survive, so
       count(i, j) = result / tiny = world - 1 - max(pos(i), pos(j)).
3. So max_j count(i, j) = world - 1 - pos(i) for every rank but the first two (both give
   world - 2: the first add is commutative, a + b == b + a, so their order is not
   observable and is canonicalised to the smaller rank first).
4. The positions are checked against every pair's count; an element whose counts no chain
   explains (a tree, or an accumulator wider than the wire format that absorbs nothing) is
   reported as not a chain rather than forced into one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trainprobes.distributed.launcher import launch
from trainprobes.distributed.worker import reveal_task
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import get_format
from trainprobes.result import Result
from trainprobes.validation import check_choice, check_int

REVEAL_DTYPES = ("fp32", "fp16", "bf16", "fp64")
MAX_WORLD = 255  # counts travel as uint8


def crafted_values(world: int, dtype: str) -> tuple[float, float]:
    """(big, tiny): tiny = 2^-8 and big = tiny * 2^(m + bitlen(2 * world)), so that
    (world - 1) * tiny < ulp(big) / 2 (absorbed) and sums of tinies stay exact."""
    fmt = get_format(dtype)
    tiny = 2.0 ** -8
    big = tiny * 2.0 ** (fmt.mantissa_bits + (2 * world).bit_length())
    if big > fmt.max_finite:
        raise InvalidArgument(f"world={world!r} is too large to reveal in dtype={dtype!r} "
                         f"(the crafted value {big!r} overflows); reveal in 'fp32'")
    return big, tiny


def _pairs(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.triu_indices(world, world, offset=1)
    return idx[0], idx[1]


def canonical(order: torch.Tensor) -> torch.Tensor:
    """An order map with its first two rows sorted per element (they commute)."""
    order = order.clone()
    if order.shape[0] >= 2:
        order[:2] = order[:2].sort(0).values
    return order


def order_from_counts(counts: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order LongTensor[world, N] canonical, chain BoolTensor[N]) from pair counts [P, N]."""
    n = counts.shape[-1]
    if world == 1:
        return torch.zeros(1, n, dtype=torch.int64), torch.ones(n, dtype=torch.bool)
    I, J = _pairs(world)
    c = counts.to(torch.int64)
    best = torch.full((world, n), -1, dtype=torch.int64)
    best.scatter_reduce_(0, I[:, None].expand_as(c), c, "amax")
    best.scatter_reduce_(0, J[:, None].expand_as(c), c, "amax")
    pos = world - 1 - best  # step 3: the first two ranks both get position 1
    order = pos.argsort(dim=0, stable=True)  # ties (the first two) by rank: canonical
    rank_pos = torch.empty_like(order)
    rank_pos.scatter_(0, order, torch.arange(world)[:, None].expand(world, n).contiguous())
    predicted = world - 1 - torch.maximum(rank_pos[I], rank_pos[J])
    chain = (predicted == c).all(0)  # step 4
    return order, chain


@dataclass
class RevealedOrder:
    """What a backend did, per element: a chain order where one explains every pair."""

    backend: str
    world: int
    numel: int
    dtype: str
    collective: str
    order: torch.Tensor  # [world, numel] canonical; meaningful where chain
    chain: torch.Tensor  # [numel] bool
    runs: int
    notes: list = field(default_factory=list)

    @property
    def is_chain(self) -> bool:
        return bool(self.chain.all())

    def agreement(self, model_order: torch.Tensor) -> float:
        """Fraction of elements whose revealed chain equals model_order (canonicalised)."""
        same = (canonical(model_order) == self.order).all(0) & self.chain
        return float(same.double().mean()) if self.numel else 1.0


def reveal_order(*, backend: str = "gloo", world: int = 4, numel: int = 1024,
                 dtype: str = "fp32", collective: str = "all_reduce", timeout: float = 120.0,
                 port: int | None = None, progress=None) -> RevealedOrder:
    """Run the crafted pairs on `world` real ranks and read each element's order back."""
    check_choice(collective, "collective", ("all_reduce", "reduce"),
                 hint="reduce_scatter is gloo's all_reduce")
    dtype = get_format(dtype).name
    check_choice(dtype, "dtype", REVEAL_DTYPES, hint="formats that carry the crafted values")
    check_int(world, "world", min=1, max=MAX_WORLD, hint="counts travel as uint8")
    check_int(numel, "numel", min=1, hint="elements per rank")
    big, tiny = crafted_values(world, dtype)
    outs = launch(reveal_task, world, backend=backend, timeout=timeout, port=port,
                  args=(numel, dtype, collective, big, tiny, backend), progress=progress)
    held = [o for o in outs if o is not None]
    notes = []
    if any(not torch.equal(o, held[0]) for o in held[1:]):
        notes.append("ranks disagree: the counts differ between ranks (rank 0's are used)")
    order, chain = order_from_counts(held[0], world)
    if not bool(chain.all()):
        notes.append(f"{int((~chain).sum())} of {numel} elements are not explained by any "
                     f"chain (a tree, or an accumulator wider than {dtype})")
    return RevealedOrder(backend, world, numel, dtype, collective, order, chain,
                         runs=world * (world - 1) // 2, notes=notes)


def reveal_result(*, backend: str = "gloo", world: int = 4, numel: int = 1024,
                  dtype: str = "fp32", collective: str = "all_reduce", timeout: float = 120.0,
                  port: int | None = None, progress=None) -> Result:
    """The revealed order against reference/gloo.py (gloo) as a Result (TP-B4 if it differs)."""
    from trainprobes.reference.gloo import gloo_order
    rev = reveal_order(backend=backend, world=world, numel=numel, dtype=dtype,
                       collective=collective, timeout=timeout, port=port, progress=progress)
    itemsize = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2}[rev.dtype]
    model = gloo_order(world, numel, itemsize, collective)
    frac = rev.agreement(model)
    bad = (~((canonical(model) == rev.order).all(0) & rev.chain)).nonzero().flatten()
    first = [{"index": int(i), "revealed": rev.order[:, i].tolist(),
              "model": canonical(model)[:, i].tolist(), "chain": bool(rev.chain[i])}
             for i in bad[:5]]
    verdict, codes = ("pass", []) if frac == 1.0 else ("fail", ["TP-B4"])
    msg = (f"{backend} {collective} {dtype}, {world} ranks, {numel} elements: revealed order "
           f"matches trainprobes.reference.gloo on {100 * frac:.4g}% of elements ({rev.runs} crafted runs)")
    if rev.notes:
        msg += "; " + "; ".join(rev.notes)
    return Result(probe="distributed.reveal", target=f"{collective}[{dtype},{backend},w={world},"
                  f"n={numel}]", verdict=verdict,
                  metrics={"order_match_fraction": frac, "chain_fraction":
                           float(rev.chain.double().mean()), "runs": rev.runs, "world": world,
                           "numel": numel},
                  evidence={"first_differences": first, "notes": rev.notes,
                            "model": "trainprobes.reference.gloo.gloo_order"},
                  codes=codes, message=msg)
