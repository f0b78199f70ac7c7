"""Reduction orders: which rank's contribution is added to which partial sum, and when.

The contract (used by reference/collectives.py and by reference/gloo.py):

    schedule = get_schedule(name, world, numel, **kw)
    total = schedule.reduce(x, add)     # x: Tensor[world, numel] -> Tensor[numel]

`add(a, b)` is the rounded add of the arithmetic being modelled (collectives supplies it:
a native fp16/bf16 add, or an exact add followed by `Format.round`). It must return a new
tensor and never modify its arguments; a schedule calls it once per hop on whole vectors
(vectorised over elements and chunks), never per element. Float addition is commutative
(a + b and b + a round to the same value), so only the association order matters, and
that is what a schedule fixes. Every schedule has `name`, `world`, `numel`; the chain
schedules (ring, sequential, order) also have `order_map() -> LongTensor[world, numel]`,
order[k, i] = the k-th rank added into element i, which `OrderSchedule` replays.

Algorithms (name -> class):
  "ring"        NCCL ring: chunk c (torch.tensor_split of the tensor into `world` chunks)
                is ((x[c+1] + x[c+2]) + ...) + x[c], ranks modulo world (NCCL
                src/device/all_reduce.h: the rank at ring position p reduces chunk p-j at
                step j and finishes chunk p).
  "tree"        NCCL's binary tree (src/graph/trees.cc, ncclGetBtree): root 0, one rank
                per node; each rank adds its own input, then child0's subtree, then
                child1's. `mirror=True` gives the second tree of NCCL's double binary tree
                (mirrored for even world, shifted by one for odd). NCCL splits data over
                both trees by channel and chains ranks inside a node; neither is modelled.
  "halving_doubling"  recursive halving reduce-scatter + recursive doubling all-gather
                (Rabenseifner; MPICH allreduce_intra_reduce_scatter_allgather): with
                p = the largest power of two <= world and r = world - p, ranks 2i and 2i+1
                (i < r) first combine, then the p survivors pair at distance 1, 2, 4, ...
                so each element is a balanced pairwise sum. gloo's halving-doubling uses
                "binary blocks" for non-powers of two instead; that variant is not modelled.
  "hierarchical"  ring reduce-scatter inside each node of `ranks_per_node` consecutive
                ranks, ring all-reduce of each shard across nodes, all-gather inside.
  "sequential"  ((x[s] + x[s+1]) + ...) in rank order from `start` (default 0), wrapping.
  "order"       an explicit per-element order map, e.g. one revealed from a real backend.
  "gloo"        gloo's ring, from reference/gloo.py (`gloo_schedule(world, numel,
                itemsize=...)`), imported lazily.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_bool, check_choice, check_int, check_tensor

ALGORITHMS = ("ring", "tree", "halving_doubling", "hierarchical", "sequential", "order", "gloo")


def _check_world_numel(world, numel) -> tuple[int, int]:
    return (check_int(world, "world", min=1, hint="the number of ranks"),
            check_int(numel, "numel", min=0, hint="elements per rank"))


def _check_x(schedule, x: torch.Tensor) -> None:
    check_tensor(x, "x")
    if x.dim() < 2 or tuple(x.shape[-2:]) != (schedule.world, schedule.numel):
        raise InvalidArgument(f"x has shape {tuple(x.shape)}, expected (..., {schedule.world}, "
                              f"{schedule.numel}) for {schedule!r}")


@dataclass(frozen=True)
class _Schedule:
    """world ranks of numel elements each, checked once; the orders below subclass it."""

    name: ClassVar[str]
    world: int
    numel: int

    def __post_init__(self):
        world, numel = _check_world_numel(self.world, self.numel)
        object.__setattr__(self, "world", world)  # frozen: normalised once, here
        object.__setattr__(self, "numel", numel)


# Elements per vectorised step. Orders depend on an element's chunk, never on its position
# inside the chunk, so long vectors are reduced block by block: temporaries stay in cache
# and no hop allocates a full-size tensor. 2^18 (1 MB of float32): stochastic rounding runs
# ~25 torch ops per add, whose fixed cost (~2 us each) 2^16 did not amortise (1.7x the fp64
# reference at 2^16, 1.2x at 2^18, no gain past it; benchmarks/bench_collectives.py).
# Fixed (not tuned per machine) so that stochastic rounding consumes its generator in the
# same order everywhere: same seed, same bits.
BLOCK = 1 << 18


def _blocked(x: torch.Tensor, fn, rows: int) -> torch.Tensor:
    """fn over blocks of the last dim of x [..., rows, n] -> [..., n], for orders that do
    not depend on the element's position."""
    n = x.shape[-1]
    step = max(256, BLOCK // max(1, rows))
    if n <= step:
        return fn(x)
    out = None
    for lo in range(0, n, step):
        part = fn(x[..., lo:lo + step])
        if out is None:
            out = part.new_empty(part.shape[:-1] + (n,))
        out[..., lo:lo + step] = part
    return out


def ring_reduce(x: torch.Tensor, add) -> torch.Tensor:
    """NCCL ring order over the last two dims of x [..., W, n] -> [..., n].

    Chunk c (tensor_split of n into W) starts with x[c+1] and ends with x[c]. Step j reads,
    for every chunk c at once, row (c + j) mod W: a wrapped diagonal of the (rank, chunk)
    grid, taken as two strided views with torch.diagonal, so no index tensor is built and
    the work is O(W * n) in W vectorised steps (per block of positions within the chunks).
    tensor_split gives the first n % W chunks one extra element, so the grid is done in
    two parts of equal chunk size.
    """
    W, n = x.shape[-2], x.shape[-1]
    if W == 1:
        return x[..., 0, :].clone()
    size, rem = divmod(n, W)
    out = x.new_empty(x.shape[:-2] + (n,))
    batch = max(1, x[..., 0, 0].numel()) if n else 1
    for c0, k, s, lo in ((0, rem, size + 1, 0), (rem, W - rem, size, rem * (size + 1))):
        if not k or not s:
            continue
        grid = x[..., lo:lo + k * s].unflatten(-1, (k, s))  # [..., W rank, k chunk, s]
        dest = out[..., lo:lo + k * s].unflatten(-1, (k, s))  # [..., k, s]
        step = max(1, BLOCK // (batch * k))
        for b0 in range(0, s, step):
            g = grid[..., b0:b0 + step]
            acc = None
            for j in range(1, W + 1):
                d = (c0 + j) % W  # chunk c0 + t reads rank (t + d) mod W
                views = [torch.diagonal(g, offset=-d, dim1=-3, dim2=-2)]  # ranks d.., chunks 0..
                if d and k > W - d:  # wrapped part: ranks 0.., chunks W-d..
                    views.append(torch.diagonal(g, offset=W - d, dim1=-3, dim2=-2))
                # [..., k, step] contiguous: the adds then run on plain dense blocks
                b = torch.cat([v.movedim(-1, -2) for v in views], -2) if len(views) > 1 \
                    else views[0].movedim(-1, -2)
                acc = b if acc is None else add(acc, b)
            dest[..., b0:b0 + step] = acc
    return out


def _chunk_ids(world: int, numel: int) -> torch.Tensor:
    """Chunk index of every element under torch.tensor_split(numel, world)."""
    size, rem = divmod(numel, world)
    sizes = torch.full((world,), size, dtype=torch.int64)
    sizes[:rem] += 1
    return torch.repeat_interleave(torch.arange(world), sizes)


@dataclass(frozen=True)
class RingSchedule(_Schedule):
    """NCCL ring all-reduce order; see the module docstring."""

    name: ClassVar[str] = "ring"

    def reduce(self, x: torch.Tensor, add) -> torch.Tensor:
        _check_x(self, x)
        return ring_reduce(x, add)

    def order_map(self) -> torch.Tensor:
        c = _chunk_ids(self.world, self.numel)
        k = torch.arange(1, self.world + 1)[:, None]
        return (c[None, :] + k) % self.world


@dataclass(frozen=True)
class SequentialSchedule(_Schedule):
    """((x[s] + x[s+1]) + ...) + x[s-1]: one chain, the same for every element.

    start=0 is rank order; NCCL's ring reduce to `root` is start=root+1 (the chain ends at
    the root).
    """

    name: ClassVar[str] = "sequential"
    start: int = 0

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "start", check_int(self.start, "start", min=0,
                                                    max=self.world - 1, hint="a rank"))

    def reduce(self, x: torch.Tensor, add) -> torch.Tensor:
        _check_x(self, x)
        return _blocked(x, lambda xb: self._chain(xb, add), self.world)

    def _chain(self, x: torch.Tensor, add) -> torch.Tensor:
        acc = x[..., self.start, :].clone()
        for k in range(1, self.world):
            acc = add(acc, x[..., (self.start + k) % self.world, :])
        return acc

    def order_map(self) -> torch.Tensor:
        ranks = (torch.arange(self.world) + self.start) % self.world
        return ranks[:, None].expand(self.world, self.numel).clone()


@dataclass(frozen=True)
class OrderSchedule(_Schedule):
    """Replay an explicit order: order[k, i] is the k-th rank added into element i.

    order may also be 1-D [world]: the same chain for every element.
    """

    name: ClassVar[str] = "order"
    order: torch.Tensor = field(repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        world, numel = self.world, self.numel
        order = check_tensor(torch.as_tensor(self.order), "order", kind="integer",
                             hint="of ranks").to(torch.int64)
        if order.dim() == 1:
            order = order[:, None].expand(order.shape[0], numel)
        if tuple(order.shape) != (world, numel):
            raise InvalidArgument(f"order has shape {tuple(order.shape)}, expected ({world}, "
                                  f"{numel}) (order[k, i] = k-th rank added into element i) or "
                                  f"({world},)")
        if numel:
            # a permutation of 0..world-1 in every column: in range, and every rank seen
            inside = (order >= 0) & (order < world)
            seen = torch.zeros(world, numel, dtype=torch.bool)
            seen.scatter_(0, torch.where(inside, order, torch.zeros_like(order)), inside)
            bad = ~seen.all(0) | ~inside.all(0)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise InvalidArgument(f"order[:, {i}] = {order[:, i].tolist()[:16]!r} is not a "
                                      f"permutation of ranks 0..{world - 1}: every rank must be "
                                      f"added exactly once into every element")
        object.__setattr__(self, "order", order)

    def reduce(self, x: torch.Tensor, add) -> torch.Tensor:
        _check_x(self, x)
        if x.dim() != 2:
            raise InvalidArgument(f"x has shape {tuple(x.shape)}; OrderSchedule takes (world, "
                                  f"numel)")
        order = self.order.to(x.device)
        acc = x.gather(0, order[0:1])[0]
        for k in range(1, self.world):
            acc = add(acc, x.gather(0, order[k:k + 1])[0])
        return acc

    def order_map(self) -> torch.Tensor:
        return self.order.clone()


def btree(world: int, rank: int) -> tuple[int, int, int]:
    """(parent, child0, child1) of `rank` in NCCL's ncclGetBtree tree; -1 where none.

    Root 0 has a single child (as child1). Otherwise, with b the lowest set bit of rank:
    parent = (rank ^ b) | 2b, or rank ^ b if that is out of range; child0 = rank - b/2;
    child1 = rank + b/2, halving the offset until it is in range (e.g. 14 ranks: 12 -> 13).
    """
    bit = 1
    while bit < world and not bit & rank:
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1) if world > 1 else -1
    up = (rank ^ bit) | (bit << 1)
    if up >= world:
        up = rank ^ bit
    low = bit >> 1
    if low == 0:
        return up, -1, -1
    down1 = rank + low
    while down1 >= world and low:
        low >>= 1
        down1 = rank + low if low else -1
    return up, rank - (bit >> 1), down1


@dataclass(frozen=True)
class TreeSchedule(_Schedule):
    """NCCL binary tree (ncclGetBtree); see the module docstring."""

    name: ClassVar[str] = "tree"
    mirror: bool = False
    # LongTensor[world] each: a rank's parent and children, -1 where none (from mirror)
    parent: torch.Tensor = field(init=False, repr=False, compare=False)
    child0: torch.Tensor = field(init=False, repr=False, compare=False)
    child1: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        check_bool(self.mirror, "mirror", hint="the second tree of NCCL's double binary tree")
        for name, links in zip(("parent", "child0", "child1"), self._links()):
            object.__setattr__(self, name, links)

    def _links(self):
        W = self.world
        if not self.mirror or W == 1:
            rel = [btree(W, r) for r in range(W)]
            to_rank = from_rank = lambda r: r  # noqa: E731
        elif W % 2 == 0:  # ncclGetDtree: mirror for an even world
            to_rank = lambda r: W - 1 - r  # noqa: E731
            from_rank = to_rank
            rel = [btree(W, from_rank(r)) for r in range(W)]
        else:  # shift by one for an odd world
            to_rank = lambda r: (r + 1) % W  # noqa: E731
            rel = [btree(W, (r - 1) % W) for r in range(W)]
        mapped = [tuple(to_rank(v) if v >= 0 else -1 for v in links) for links in rel]
        return tuple(torch.tensor(col, dtype=torch.int64) for col in zip(*mapped))

    def heights(self) -> torch.Tensor:
        """Height of every rank's subtree (leaves 0); children finish before parents."""
        parent = self.parent.tolist()
        depth = [0] * self.world
        for r in range(self.world):
            p, d = parent[r], 0
            while p >= 0:
                p, d = parent[p], d + 1
            depth[r] = d
        h = [0] * self.world
        for r in sorted(range(self.world), key=lambda r: -depth[r]):  # deepest first
            if parent[r] >= 0:
                h[parent[r]] = max(h[parent[r]], h[r] + 1)
        return torch.tensor(h, dtype=torch.int64)

    def reduce(self, x: torch.Tensor, add) -> torch.Tensor:
        _check_x(self, x)
        # Steps bottom-up: all ranks of one subtree height add child0, then child1.
        h = self.heights()
        steps = []
        for level in range(1, int(h.max()) + 1):
            nodes = (h == level).nonzero().flatten()
            for kids in (self.child0[nodes], self.child1[nodes]):
                has = kids >= 0
                if bool(has.any()):
                    steps.append((nodes[has], kids[has]))
        root = int((self.parent < 0).nonzero()[0, 0])
        return _blocked(x, lambda xb: self._up(xb, add, steps, root), self.world)

    @staticmethod
    def _up(x: torch.Tensor, add, steps, root: int) -> torch.Tensor:
        acc = x.clone()
        for n, c in steps:
            n, c = n.to(x.device), c.to(x.device)
            acc[..., n, :] = add(acc[..., n, :], acc[..., c, :])
        return acc[..., root, :]


@dataclass(frozen=True)
class HalvingDoublingSchedule(_Schedule):
    """Recursive halving/doubling (MPICH's non-power-of-two fold); see the module docstring."""

    name: ClassVar[str] = "halving_doubling"

    def reduce(self, x: torch.Tensor, add) -> torch.Tensor:
        _check_x(self, x)
        return _blocked(x, lambda xb: self._pairwise(xb, add), self.world)

    def _pairwise(self, x: torch.Tensor, add) -> torch.Tensor:
        W = self.world
        p = 1 << (W.bit_length() - 1)
        r = W - p
        # 1. ranks 2i, 2i+1 (i < r) fold into one survivor; ranks >= 2r survive as they are.
        if r:
            folded = add(x[..., 0:2 * r:2, :], x[..., 1:2 * r:2, :])
            y = torch.cat([folded, x[..., 2 * r:, :]], -2)
        else:
            y = x
        # 2. survivors pair at distance 1, then 2, 4, ...: a balanced pairwise sum.
        while y.shape[-2] > 1:
            y = add(y[..., 0::2, :], y[..., 1::2, :])
        return y[..., 0, :].clone() if y is x else y[..., 0, :]


@dataclass(frozen=True)
class HierarchicalSchedule(_Schedule):
    """Ring reduce-scatter inside nodes, ring all-reduce of each shard across nodes.

    Node g holds ranks g*L .. g*L+L-1 (L = ranks_per_node). Element i falls in shard s of
    tensor_split(numel, L); inside node g it is reduced in ring order over the node's
    local ranks (shard s accumulates local ranks s+1, ..., s); across the M = world/L
    nodes shard s is itself split into M chunks and reduced in ring order over nodes.
    """

    name: ClassVar[str] = "hierarchical"
    ranks_per_node: int | None = None

    def __post_init__(self):
        super().__post_init__()
        world, L = self.world, self.ranks_per_node
        if L is None:
            raise InvalidArgument("algorithm='hierarchical' needs ranks_per_node=<int> "
                                  "(e.g. 8 for 8 GPUs per node)")
        L = check_int(L, "ranks_per_node", min=1, hint="ranks in one node")
        if world % L:
            divisors = [d for d in range(1, min(world, 64) + 1) if world % d == 0]
            raise InvalidArgument(f"ranks_per_node={L!r} does not divide world={world}: a "
                                  f"hierarchical layout needs whole nodes; divisors of {world}: "
                                  f"{divisors}")
        object.__setattr__(self, "ranks_per_node", L)

    def reduce(self, x: torch.Tensor, add) -> torch.Tensor:
        _check_x(self, x)
        L = self.ranks_per_node
        M = self.world // L
        n = self.numel
        # 1. inside each node: ring over the node's L ranks, shards = tensor_split(n, L).
        nodes = ring_reduce(x.unflatten(-2, (M, L)), add)  # [..., M, n]
        if M == 1:
            return nodes[..., 0, :]
        # 2. across nodes, shard by shard (equal-size shards batched together).
        size, rem = divmod(n, L)
        outs = []
        for lo, k, s in ((0, rem, size + 1), (rem * (size + 1), L - rem, size)):
            if k and s:
                part = nodes[..., lo:lo + k * s].unflatten(-1, (k, s)).movedim(-2, -3)
                outs.append(ring_reduce(part, add).flatten(-2))  # [..., k, M, s] -> [..., k*s]
        if not outs:
            return nodes[..., 0, :0]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


_CLASSES = {
    "ring": (RingSchedule, ()),
    "tree": (TreeSchedule, ("mirror",)),
    "halving_doubling": (HalvingDoublingSchedule, ()),
    "hierarchical": (HierarchicalSchedule, ("ranks_per_node",)),
    "sequential": (SequentialSchedule, ("start",)),
    "order": (OrderSchedule, ("order",)),
}


def _gloo(world: int, numel: int, itemsize: int | None = None, collective: str | None = None):
    try:
        from trainprobes.reference.gloo import gloo_schedule
    except ImportError as e:
        raise InvalidArgument(f"algorithm='gloo' is not available: trainprobes.reference.gloo could not be "
                         f"imported ({e}); use one of {[a for a in ALGORITHMS if a != 'gloo']}"
                         ) from e
    if itemsize is None:
        raise InvalidArgument("algorithm='gloo' needs itemsize=<bytes per element> (gloo's "
                         "segments are at most 1 MiB, so its order depends on it)")
    if collective is None:
        return gloo_schedule(world, numel, itemsize=itemsize)
    return gloo_schedule(world, numel, itemsize=itemsize, collective=collective)


def get_schedule(name: str, world: int, numel: int, **kw):
    """The schedule `name` for `world` ranks of `numel` elements each.

    Keyword options, by algorithm: tree: mirror; hierarchical: ranks_per_node (required);
    sequential: start; order: order (required); gloo: itemsize (required) and collective
    ("all_reduce" or "reduce": gloo segments a reduce differently). An option set
    (not None) for an algorithm that does not take it is an error, so nothing is silently
    ignored.
    """
    check_choice(name, "algorithm", ALGORITHMS)
    allowed = ("itemsize", "collective") if name == "gloo" else _CLASSES[name][1]
    given = {k: v for k, v in kw.items() if v is not None}
    extra = sorted(set(given) - set(allowed))
    if extra:
        raise InvalidArgument(f"{extra[0]}={given[extra[0]]!r} does not apply to algorithm={name!r}"
                         f" (it takes {list(allowed) or 'no options'})")
    _check_world_numel(world, numel)
    if name == "gloo":
        return _gloo(world, numel, **given)
    if name == "order" and "order" not in given:
        raise InvalidArgument("algorithm='order' needs order=<LongTensor[world, numel]>")
    return _CLASSES[name][0](world, numel, **given)
