"""trainprobes.transforms.holdings: one trial's gradients as flat tensors per dtype."""
import pytest
import torch
from trainprobes.transforms.holdings import fingerprint, fingerprints, flatten, not_finite

NAMES = {"a": 0, "b": 1, "c": 2}


def grads(dtype):
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g).to(dtype), "b": torch.randn(7, generator=g).to(dtype),
            "c": torch.randn(2, 2, generator=g).to(dtype)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_fingerprints_of_the_flat_equal_each_parameters_own(dtype):
    g = grads(dtype)
    (f,) = flatten(g, NAMES)
    own = torch.stack([fingerprint(g[n].reshape(1, -1))[0] for n in f.names])
    assert torch.equal(fingerprints(f), own)
    one = dict(g, b=g["b"].clone())
    one["b"].view(torch.int8 if dtype.itemsize == 1 else {2: torch.int16, 4: torch.int32,
                                                         8: torch.int64}[dtype.itemsize])[3] += 1  # one bit
    (h,) = flatten(one, NAMES)
    assert (fingerprints(h) != fingerprints(f)).tolist() == [False, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_not_finite_names_the_parameter_that_holds_it(dtype, bad):
    g = grads(dtype)
    (f,) = flatten(g, NAMES)
    assert not not_finite(f).any()
    g["c"] = g["c"].clone()
    g["c"][1, 0] = bad
    (f,) = flatten(g, NAMES)
    assert not_finite(f).tolist() == [False, False, True]


def test_groups_by_dtype_in_layout_order_and_keeps_a_copy():
    g = grads(torch.float32)
    g["b"] = g["b"].to(torch.bfloat16)
    flats = flatten(g, NAMES)
    assert [(f.values.dtype, f.index, f.names, f.sizes) for f in flats] == [
        (torch.float32, [0, 2], ["a", "c"], [15, 4]), (torch.bfloat16, [1], ["b"], [7])]
    before = flats[0].values.clone()
    g["a"].add_(1.0)  # a gradient buffer the next step reuses
    assert torch.equal(flats[0].values, before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fingerprints_tell_a_sign_flip(dtype):
    # a replica that negates a gradient (or one element of it) differs from the owner in the
    # sign bits alone: 8-byte words times an even weight wrapped those bits away (2^63 w = 0
    # mod 2^64), so fp64's -g had g's fingerprint
    g = grads(dtype)
    (f,) = flatten(g, NAMES)
    neg = {n: -v for n, v in g.items()}
    (h,) = flatten(neg, NAMES)
    assert (fingerprints(h) != fingerprints(f)).all()
    for k in range(g["b"].numel()):
        one = dict(g, b=g["b"].clone())
        one["b"][k] = -one["b"][k]
        (h,) = flatten(one, NAMES)
        assert (fingerprints(h) != fingerprints(f)).tolist() == [False, True, False], k
