"""probes/distributed/inputs.py: seeded per-rank inputs and the order-revealing pattern."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from trainprobes.distributed.inputs import DATA, make_input, reveal_input, torch_dtype, wire_input


@pytest.mark.parametrize("data", list(DATA))
def test_same_seed_same_bits_and_ranks_differ(data):
    a = make_input(data, 1, 512, seed=5)
    assert torch.equal(a, make_input(data, 1, 512, seed=5))
    if data != "ones":
        assert not torch.equal(a, make_input(data, 2, 512, seed=5))
        assert not torch.equal(a, make_input(data, 1, 512, seed=6))


def test_distributions_have_their_shape():
    pos = make_input("positive", 0, 10000, 0)
    assert bool((pos >= 0).all()) and float(pos.max()) < 1e-3
    assert bool((make_input("ones", 3, 7, 0) == 1).all())
    grad = make_input("gradient", 0, 100000, 0)
    normal = make_input("normal", 0, 100000, 0)
    kurt = lambda x: float(((x - x.mean()) ** 4).mean() / x.var() ** 2)  # noqa: E731
    assert kurt(grad) > 2 * kurt(normal)  # heavy tails (Student-t 3 dof)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_wire_input_is_the_cast_of_make_input(dtype):
    w = wire_input("normal", 2, 100, 9, dtype)
    assert w.dtype == torch_dtype(dtype)
    assert torch.equal(w, make_input("normal", 2, 100, 9).to(torch_dtype(dtype)))


@given(st.integers(2, 8), st.data())
def test_reveal_pattern(world, data):
    i = data.draw(st.integers(0, world - 2))
    j = data.draw(st.integers(i + 1, world - 1))
    rows = [reveal_input(r, 3, (i, j), "fp32", 2.0 ** 20, 2.0 ** -8) for r in range(world)]
    assert bool((rows[i] == 2.0 ** 20).all()) and bool((rows[j] == -(2.0 ** 20)).all())
    assert all(bool((rows[r] == 2.0 ** -8).all()) for r in range(world) if r not in (i, j))


def test_unknown_names_are_errors():
    with pytest.raises(ValueError, match="data='uniform'"):
        make_input("uniform", 0, 4, 0)
    with pytest.raises(ValueError, match="dtype='tf32'"):
        torch_dtype("tf32")
