"""Reduction orders: each schedule against a direct, element-by-element statement of its order."""
import importlib.util

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from trainprobes.reference.formats import get_format
from trainprobes.reference.schedules import (
    ALGORITHMS,
    HalvingDoublingSchedule,
    HierarchicalSchedule,
    OrderSchedule,
    RingSchedule,
    SequentialSchedule,
    TreeSchedule,
    btree,
    get_schedule,
)

FP16 = get_format("fp16")


def fp16_add(a, b):
    return FP16.round(a + b)


def tracking_add(a, b):
    """Non-commutative, non-associative and exact for small ints: a*1000 + b writes the
    whole bracketing of a sum into one number's decimal digits."""
    return a * 1000 + b


def fp16_data(world, numel, seed=0):
    """Mixed magnitudes so that almost every change of association changes fp16 bits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, numel, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-6, 7, (world, numel), generator=g).double())
    return FP16.round(x)


def chunk_of(world, numel):
    return torch.cat([torch.full((len(c),), i) for i, c in
                      enumerate(torch.tensor_split(torch.arange(numel), world))]).long()


# ---------------------------------------------------------------- ring


@pytest.mark.parametrize("world,numel", [(2, 2), (3, 3), (4, 6), (5, 3), (3, 10), (8, 17)])
def test_ring_order_map_is_ncclc_order(world, numel):
    c = chunk_of(world, numel)
    om = RingSchedule(world, numel).order_map()
    for k in range(world):  # k-th rank added into chunk c is c + 1 + k (mod world)
        assert torch.equal(om[k], (c + 1 + k) % world)


@pytest.mark.parametrize("world,numel", [(2, 3), (3, 3), (4, 6), (5, 7), (4, 2)])
def test_ring_reduce_brackets_in_ring_order(world, numel):
    # x[r] = r + 1; chunk c must be ((x[c+1] + x[c+2]) + ...) + x[c]
    x = (torch.arange(world, dtype=torch.float64) + 1)[:, None].expand(world, numel)
    got = RingSchedule(world, numel).reduce(x.clone(), tracking_add)
    c = chunk_of(world, numel)
    for i in range(numel):
        want = 0.0
        for k in range(world):
            r = (int(c[i]) + 1 + k) % world
            want = (r + 1.0) if k == 0 else want * 1000 + (r + 1.0)
        assert got[i].item() == want, (i, got[i].item(), want)


@given(st.integers(1, 40), st.integers(0, 90), st.integers(0, 2**31 - 1))
def test_ring_equals_replay_of_its_order_map(world, numel, seed):
    x = fp16_data(world, numel, seed)
    ring = RingSchedule(world, numel)
    replay = OrderSchedule(world, numel, ring.order_map())
    assert torch.equal(ring.reduce(x, fp16_add), replay.reduce(x, fp16_add))


def test_ring_at_4096_ranks_matches_order_map():
    world, numel = 4096, 4100  # uneven chunks: 4 of 2 elements, 4092 of 1
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(world, numel, generator=g) * 64).half()  # native fp16 adds: exact, fast
    om = RingSchedule(world, numel).order_map()
    got = RingSchedule(world, numel).reduce(x, torch.add)
    assert torch.equal(got, OrderSchedule(world, numel, om).reduce(x, torch.add))


def test_ring_blocks_give_the_same_bits_as_one_block(monkeypatch):
    import trainprobes.reference.schedules as sched
    x = fp16_data(8, 70_001).half()  # chunks of 8750 > BLOCK // 8: two blocks per chunk
    blocked = RingSchedule(8, 70_001).reduce(x, torch.add)
    monkeypatch.setattr(sched, "BLOCK", 1 << 30)
    whole = RingSchedule(8, 70_001).reduce(x, torch.add)
    assert torch.equal(blocked, whole)


# ---------------------------------------------------------------- chains and order maps


@pytest.mark.parametrize("start", [0, 2])
def test_sequential_brackets_from_start(start):
    world = 4
    x = (torch.arange(world, dtype=torch.float64) + 1)[:, None].expand(world, 3).clone()
    got = SequentialSchedule(world, 3, start=start).reduce(x, tracking_add)
    digits = [(start + k) % world + 1 for k in range(world)]  # start=2: 3, 4, 1, 2
    want = float("".join(f"{d:03d}" for d in digits))
    assert torch.equal(got, torch.full((3,), want, dtype=torch.float64))


def test_order_map_replays_per_element_orders():
    world = 3
    order = torch.tensor([[2, 0], [0, 1], [1, 2]])  # element 0: 2,0,1; element 1: 0,1,2
    x = (torch.arange(world, dtype=torch.float64) + 1)[:, None].expand(world, 2).clone()
    got = OrderSchedule(world, 2, order).reduce(x, tracking_add)
    assert got.tolist() == [3001002.0, 1002003.0]


# ---------------------------------------------------------------- tree


def test_btree_is_nccl_illustration_for_14_ranks():
    # NCCL src/graph/trees.cc illustration: 0-8; 8: 4, 12; 4: 2, 6; 12: 10, 13; 10: 9, 11
    links = {r: btree(14, r) for r in range(14)}
    assert links[0] == (-1, -1, 8)
    assert links[8] == (0, 4, 12)
    assert links[4] == (8, 2, 6)
    assert links[12] == (8, 10, 13)
    assert links[10] == (12, 9, 11)
    assert links[13] == (12, -1, -1)
    assert links[6] == (4, 5, 7)


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 13, 14, 64, 100])
def test_tree_is_a_spanning_tree(world, mirror):
    t = TreeSchedule(world, 1, mirror=mirror)
    roots = (t.parent < 0).nonzero().flatten().tolist()
    assert len(roots) == 1
    for r in range(world):
        p = int(t.parent[r])
        if p >= 0:
            assert r in (int(t.child0[p]), int(t.child1[p]))
        for c in (int(t.child0[r]), int(t.child1[r])):
            if c >= 0:
                assert int(t.parent[c]) == r


def tree_by_recursion(t: TreeSchedule, x, add):
    def up(r):
        acc = x[r]
        for c in (int(t.child0[r]), int(t.child1[r])):
            if c >= 0:
                acc = add(acc, up(c))
        return acc
    root = int((t.parent < 0).nonzero()[0, 0])
    return up(root)


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 6, 7, 14, 33])
def test_tree_reduce_is_own_then_child0_then_child1(world, mirror):
    t = TreeSchedule(world, 64, mirror=mirror)
    x = fp16_data(world, 64, seed=world)
    assert torch.equal(t.reduce(x, fp16_add), tree_by_recursion(t, x, fp16_add))


# ---------------------------------------------------------------- halving-doubling


def halving_doubling_by_hand(x, add):
    W = x.shape[0]
    p = 1 << (W.bit_length() - 1)
    r = W - p
    ys = [add(x[2 * i], x[2 * i + 1]) for i in range(r)] + [x[i] for i in range(2 * r, W)]
    while len(ys) > 1:
        ys = [add(ys[2 * i], ys[2 * i + 1]) for i in range(len(ys) // 2)]
    return ys[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8, 12, 13])
def test_halving_doubling_matches_mpich_fold_then_pairs(world):
    x = fp16_data(world, 64, seed=world)
    got = HalvingDoublingSchedule(world, 64).reduce(x, fp16_add)
    assert torch.equal(got, halving_doubling_by_hand(x, fp16_add))


# ---------------------------------------------------------------- hierarchical


def test_hierarchical_brackets_by_hand():
    # 4 ranks, 2 per node, 2 elements. Element 0 is in shard 0: inside node g local ranks
    # 1 then 0; across nodes chunk 0 of the shard: node 1 then node 0.
    #   element 0 = (x3 + x2) + (x1 + x0); element 1 = (x2 + x3) + (x0 + x1)
    x = (torch.arange(4, dtype=torch.float64) + 1)[:, None].expand(4, 2).clone()
    got = HierarchicalSchedule(4, 2, ranks_per_node=2).reduce(x, tracking_add)
    assert got.tolist() == [4003 * 1000 + 2001.0, 3004 * 1000 + 1002.0]


@pytest.mark.parametrize("world,numel", [(4, 9), (6, 13), (8, 5)])
def test_hierarchical_degenerate_layouts_are_the_ring(world, numel):
    x = fp16_data(world, numel)
    ring = RingSchedule(world, numel).reduce(x, fp16_add)
    one_node = HierarchicalSchedule(world, numel, ranks_per_node=world).reduce(x, fp16_add)
    one_rank_nodes = HierarchicalSchedule(world, numel, ranks_per_node=1).reduce(x, fp16_add)
    assert torch.equal(one_node, ring) and torch.equal(one_rank_nodes, ring)


# ---------------------------------------------------------------- fp64: every order is a sum


@pytest.mark.parametrize("name,kw", [("ring", {}), ("tree", {}), ("halving_doubling", {}),
                                     ("sequential", {}), ("hierarchical", {"ranks_per_node": 3})])
@pytest.mark.parametrize("numel", [0, 1, 7, 100])
def test_every_schedule_sums_every_rank_once(name, kw, numel):
    world = 12
    x = (2.0 ** torch.arange(world, dtype=torch.float64))[:, None].expand(world, numel).clone()
    got = get_schedule(name, world, numel, **kw).reduce(x, torch.add)
    assert torch.equal(got, torch.full((numel,), 2.0 ** world - 1, dtype=torch.float64))


# ---------------------------------------------------------------- registry and bad input


def test_unknown_algorithm_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"algorithm='rign' must be one of .*'ring'.*did you mean 'ring'"):
        get_schedule("rign", 4, 8)


def test_option_for_another_algorithm_is_an_error():
    with pytest.raises(ValueError, match=r"ranks_per_node=2 does not apply to algorithm='ring'"):
        get_schedule("ring", 4, 8, ranks_per_node=2)


@pytest.mark.parametrize("rpn,msg", [(3, "does not divide world=8"), (None, "needs ranks_per_node"),
                                     (0, r"ranks_per_node=0 must be an int >= 1")])
def test_hierarchical_layout_errors(rpn, msg):
    with pytest.raises(ValueError, match=msg):
        HierarchicalSchedule(8, 4, ranks_per_node=rpn)


@pytest.mark.parametrize("order,msg", [
    (torch.tensor([[0, 0], [1, 0], [2, 2]]), r"order\[:, 1\] = \[0, 0, 2\] is not a permutation"),
    (torch.tensor([[0, 0], [1, 3], [2, 1]]), r"order\[:, 1\] = \[0, 3, 1\] is not a permutation"),
    (torch.zeros(2, 2, dtype=torch.long), r"order has shape \(2, 2\), expected \(3, 2\)"),
])
def test_bad_order_maps(order, msg):
    with pytest.raises(ValueError, match=msg):
        OrderSchedule(3, 2, order)


def test_an_order_map_of_floats_is_a_type_error():
    with pytest.raises(TypeError, match=r"order has dtype torch.float32, expected an integer tensor"):
        OrderSchedule(3, 2, torch.zeros(3, 2))


@pytest.mark.parametrize("world,numel", [(0, 4), (-1, 4), (2, -1), (2.0, 4)])
def test_bad_world_or_numel(world, numel):
    with pytest.raises(ValueError, match="world=|numel="):
        RingSchedule(world, numel)


def test_wrong_x_shape_is_named():
    with pytest.raises(ValueError, match=r"x has shape \(3, 4\), expected \(\.\.\., 4, 4\)"):
        RingSchedule(4, 4).reduce(torch.zeros(3, 4), torch.add)


def test_gloo_is_lazy_and_clear():
    if importlib.util.find_spec("trainprobes.reference.gloo") is None:
        with pytest.raises(ValueError, match="algorithm='gloo' is not available"):
            get_schedule("gloo", 4, 8, itemsize=2)
    else:
        s = get_schedule("gloo", 4, 8, itemsize=2)
        x = (2.0 ** torch.arange(4, dtype=torch.float64))[:, None].expand(4, 8).clone()
        assert torch.equal(s.reduce(x, torch.add), torch.full((8,), 15.0, dtype=torch.float64))
    assert "gloo" in ALGORITHMS
