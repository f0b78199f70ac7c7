"""probes/distributed/reveal.py: per-element order read back from crafted inputs."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from trainprobes.distributed.reveal import (
    canonical,
    crafted_values,
    order_from_counts,
    reveal_order,
    reveal_result,
)
from trainprobes.reference.gloo import gloo_order
from trainprobes.reference.schedules import RingSchedule

MiB = 1 << 20


def counts_of(order: torch.Tensor) -> torch.Tensor:
    """What a chain backend returns for every pair (module docstring, step 2)."""
    world = order.shape[0]
    pos = order.argsort(0)  # pos[rank, element]
    i, j = torch.triu_indices(world, world, offset=1)
    return (world - 1 - torch.maximum(pos[i], pos[j])).to(torch.uint8)


@given(st.integers(1, 9), st.integers(1, 40), st.integers(0, 2**31))
def test_any_chain_is_recovered_up_to_its_commuting_first_add(world, n, seed):
    g = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(world, generator=g) for _ in range(n)], 1)
    got, chain = order_from_counts(counts_of(order), world)
    assert bool(chain.all())
    assert torch.equal(got, canonical(order))


def test_counts_no_chain_explains_are_flagged():
    # An accumulator wider than the wire absorbs nothing: every pair leaves world-2 tinies.
    world = 4
    counts = torch.full((6, 3), world - 2, dtype=torch.uint8)
    _, chain = order_from_counts(counts, world)
    assert not bool(chain.any())


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("world", [2, 8, 64])
def test_crafted_values_absorb_the_tinies_and_keep_their_sums_exact(dtype, world):
    from trainprobes.distributed.inputs import torch_dtype
    big, tiny = crafted_values(world, dtype)
    t = torch_dtype(dtype)
    acc = torch.tensor(big, dtype=t)
    for _ in range(world - 1):  # tinies after big are absorbed, one add at a time
        acc = acc + torch.tensor(tiny, dtype=t)
    assert float(acc) == big
    s = torch.tensor(0.0, dtype=t)
    for _ in range(world - 1):
        s = s + torch.tensor(tiny, dtype=t)
    assert float(s) == (world - 1) * tiny


def test_crafted_values_that_overflow_are_refused():
    with pytest.raises(ValueError, match="overflows"):
        crafted_values(5000, "fp16")


@pytest.mark.parametrize("world, numel, dtype, collective", [
    (4, 100, "fp32", "all_reduce"),
    (4, 333, "bf16", "reduce"),
    (3, (7 * MiB + 12) // 4, "fp32", "all_reduce"),  # past the 2 * world segment minimum
])
def test_real_gloo_order_matches_the_model(world, numel, dtype, collective):
    res = reveal_result(world=world, numel=numel, dtype=dtype, collective=collective)
    assert res.metrics["order_match_fraction"] == 1.0, res.evidence["first_differences"]
    assert res.metrics["chain_fraction"] == 1.0 and res.verdict == "pass"
    assert res.metrics["runs"] == world * (world - 1) // 2


def test_the_revealed_order_is_not_nccls_ring():
    rev = reveal_order(world=4, numel=64, dtype="fp16")
    assert rev.is_chain and rev.agreement(gloo_order(4, 64, 2)) == 1.0
    assert rev.agreement(RingSchedule(4, 64).order_map()) < 0.5


@pytest.mark.parametrize("kw, match", [
    (dict(collective="all_gather"), "collective='all_gather'"),
    (dict(dtype="fp8_e4m3fn"), "dtype='fp8_e4m3fn'"),
    (dict(world=0), "world=0"),
    (dict(numel=0), "numel=0"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        reveal_order(**kw)
