"""reference/gloo.py: gloo's ring layout and order, from gloo's source (no processes here;
the real backend is checked in test_distributed_probe.py and test_distributed_reveal.py)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from trainprobes.reference.collectives import all_reduce, reduce
from trainprobes.reference.gloo import (
    MAX_SEGMENT_BYTES,
    GlooRingSchedule,
    gloo_layout,
    gloo_order,
    gloo_schedule,
)
from trainprobes.reference.schedules import OrderSchedule, RingSchedule, get_schedule

MiB = 1 << 20
worlds = st.integers(1, 12)
numels = st.integers(0, 5000)
itemsizes = st.sampled_from([2, 4, 8])


@given(worlds, numels, itemsizes, st.sampled_from(["all_reduce", "reduce"]))
def test_layout_obeys_gloo_invariants(world, numel, itemsize, collective):
    # gloo/allreduce.cc and reduce.cc: GLOO_ENFORCE_EQ(numSegments % size, 0),
    # GLOO_ENFORCE_GE(numSegments, 2 * size); segments cover the buffer and fit in 1 MiB.
    lay = gloo_layout(world, numel, itemsize, collective)
    assert lay.num_segments % world == 0 and lay.num_segments >= 2 * world
    assert lay.segment_elems * itemsize <= max(MAX_SEGMENT_BYTES, itemsize)
    assert lay.num_segments * lay.segment_elems >= numel
    c = lay.chunk_ids()
    assert c.shape == (numel,)
    if numel:
        assert int(c.min()) == 0 and int(c.max()) < world
        assert bool((c[1:] >= c[:-1]).all())  # chunks are contiguous runs


def test_layout_worked_by_hand():
    # 4 ranks, 10 fp32: T = 40 B, S = roundUp(max(ceil(40 / 1 MiB), 8), 4) = 8 segments of
    # roundUp(ceil(40 / 8), 4) = 8 B = 2 elements, 2 per rank: chunks of 4 elements.
    lay = gloo_layout(4, 10, 4)
    assert (lay.num_segments, lay.segment_elems, lay.chunk_elems) == (8, 2, 4)
    assert lay.chunk_ids().tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    # chunk c = ((x[c-1] + x[c-2]) + x[c-3]) + x[c]
    assert gloo_order(4, 10, 4)[:, 0].tolist() == [3, 2, 1, 0]
    assert gloo_order(4, 10, 4)[:, 9].tolist() == [1, 0, 3, 2]


def test_reduce_segments_differ_from_all_reduce_past_the_minimum():
    # 2 ranks, 5 MiB + 4 B of fp32: all_reduce uses S = roundUp(6, 2) = 6 segments of
    # ceil(T / 6); reduce caps segments at 1 MiB first: S = roundUp(6, 2) = 6 of 1 MiB, so
    # chunk 0 is 3 MiB under reduce and T / 2 under all_reduce.
    n = (5 * MiB + 4) // 4
    a, r = gloo_layout(2, n, 4, "all_reduce"), gloo_layout(2, n, 4, "reduce")
    assert r.chunk_elems * 4 == 3 * MiB
    assert a.chunk_elems != r.chunk_elems


@given(worlds, numels, itemsizes)
def test_order_map_is_the_ring_chain(world, numel, itemsize):
    order = gloo_order(world, numel, itemsize)
    assert order.shape == (world, numel)
    chunk = gloo_layout(world, numel, itemsize).chunk_ids()
    # every column a permutation; ends at the chunk's owner, starts at owner - 1
    assert bool((order.sort(0).values == torch.arange(world)[:, None]).all())
    if numel:
        assert torch.equal(order[-1], chunk)
        assert torch.equal(order[0], (chunk - 1) % world)
        if world > 1:  # each hop moves one rank down the ring
            assert bool(((order[1:] - order[:-1]) % world == world - 1).all())


@given(st.integers(1, 9), st.integers(1, 300), itemsizes, st.integers(0, 2**31))
def test_reduce_replays_its_order_map(world, numel, itemsize, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, numel, generator=g).to(torch.bfloat16)
    add = torch.add
    sched = gloo_schedule(world, numel, itemsize)
    replay = OrderSchedule(world, numel, sched.order_map())
    assert torch.equal(sched.reduce(x, add), replay.reduce(x, add))


def test_gloo_is_not_nccls_ring_from_four_ranks():
    # bf16 values whose sum depends on the association order.
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 4096, generator=g) * 100).to(torch.bfloat16)
    gl = gloo_schedule(4, 4096, 2).reduce(x, torch.add)
    ring = RingSchedule(4, 4096).reduce(x, torch.add)
    assert not torch.equal(gl, ring)
    # ... and for 3 ranks the two rings differ only in the commuting first add
    o3 = gloo_order(3, 6, 4)
    ring3 = torch.tensor([[1, 2, 0], [2, 0, 1], [0, 1, 2]])  # NCCL chunk c: c+1, c+2, c
    chunk = gloo_layout(3, 6, 4).chunk_ids()
    assert torch.equal(o3[2], ring3[chunk, 2])
    assert torch.equal(o3[:2].sort(0).values, ring3[chunk, :2].T.sort(0).values)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_collectives_algorithm_gloo_uses_this_order(dtype, op):
    g = torch.Generator().manual_seed(1)
    xs = list(torch.randn(5, 777, generator=g, dtype=torch.float64).unbind(0))
    item = {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]
    got = all_reduce(xs, dtype=dtype, op=op, algorithm="gloo")[0]
    want = all_reduce(xs, dtype=dtype, op=op, order=gloo_order(5, 777, item),
                      avg="divide" if op == "avg" else None)[0]
    assert torch.equal(got, want)
    red = reduce(xs, root=2, dtype=dtype, op=op, algorithm="gloo")[2]
    want = reduce(xs, root=2, dtype=dtype, op=op, order=gloo_order(5, 777, item, "reduce"),
                  avg="divide" if op == "avg" else None)[2]
    assert torch.equal(red, want)


def test_registry_passes_itemsize_and_collective():
    s = get_schedule("gloo", 4, 100, itemsize=2)
    assert isinstance(s, GlooRingSchedule) and s.itemsize == 2


@pytest.mark.parametrize("kw, match", [
    (dict(world=0, numel=4, itemsize=4), "world=0"),
    (dict(world=2, numel=-1, itemsize=4), "numel=-1"),
    (dict(world=2, numel=4, itemsize=0), "itemsize=0"),
    (dict(world=2, numel=4, itemsize=4, collective="gather"), "collective='gather'"),
])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        gloo_layout(**kw)


def test_reduce_checks_shape():
    with pytest.raises(ValueError, match=r"x has shape \(3, 5\), expected \(2, 5\)"):
        gloo_schedule(2, 5, 4).reduce(torch.zeros(3, 5), torch.add)
