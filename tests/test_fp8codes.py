"""reference/fp8codes.py: fp8 codes give Format.round's bits (the cast in, the add table,
the decode out); scripts/fp8_cast_exhaustive.py checks torch's cast on every float32."""
import math

import pytest
import torch
from trainprobes.reference import fp8codes
from trainprobes.reference.formats import get_format

FP8 = list(fp8codes.TORCH_FP8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    eq = ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (a.isnan() & b.isnan())
    return bool(eq.all())


def test_torch_casts_float64_to_fp8_through_float32_so_encode_does_not():
    # the reason encode() casts only float32: 1.0625 is the midpoint of 1.0 and 1.125, and
    # 1.0625 + 2^-40 rounds to it in float32, then to even (1.0); once, it is 1.125
    x = torch.tensor([1.0625 + 2.0 ** -40], dtype=torch.float64)
    f = get_format("fp8_e4m3fn")
    assert x.to(torch.float8_e4m3fn).float().item() == 1.0
    assert fp8codes.decode(fp8codes.encode(x, f, False), f).item() == 1.125 == f.round(x).item()


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("source", [torch.float32, torch.float64])
def test_encode_is_format_round_at_every_midpoint_and_its_neighbours(name, saturate, source):
    f = get_format(name)
    v = fp8codes.decode(torch.arange(256, dtype=torch.int32).to(torch.uint8), f)
    v = v[torch.isfinite(v)].unique()  # sorted, -0 and +0 as one
    mid = (v[1:] + v[:-1]) / 2  # every tie, subnormal ones included
    top = torch.tensor([f.max_finite + f.ulp(torch.tensor(f.max_finite)).item() / 2])
    x = torch.cat([v, mid, top, -top]).to(source)
    up, down = (torch.nextafter(x, torch.tensor(s, dtype=source)) for s in (math.inf, -math.inf))
    wide = x.double()
    x = torch.cat([x, up, down, torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e30],
                                             dtype=source)])
    if source == torch.float64:  # neighbours float32 rounds onto the tie: double rounding
        x = torch.cat([x, wide * (1 + 2.0 ** -40), wide * (1 - 2.0 ** -40)])
    got = fp8codes.decode(fp8codes.encode(x, f, saturate), f)
    assert same(got, f.round(x.double(), saturate=saturate))


@pytest.mark.parametrize("name", FP8)
def test_random_values_over_the_whole_range_and_empty(name):
    f = get_format(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50_000, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 20, x.shape, generator=g).double())
    for t in (x, x.float()):
        assert same(fp8codes.decode(fp8codes.encode(t, f, False), f), f.round(t.double()))
    assert fp8codes.encode(torch.empty(0), f, False).shape == (0,)


@pytest.mark.parametrize("name", FP8)
def test_codes_round_trip_and_the_add_table_is_nccls_add(name):
    f = get_format(name)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = fp8codes.decode(codes, f)
    assert v.dtype == torch.float64
    back = fp8codes.decode(fp8codes.encode_exact(v, f), f)
    assert same(back, v)
    a, b = torch.meshgrid(codes, codes, indexing="ij")
    got = fp8codes.decode(fp8codes.add(a, b, f), f)
    want = f.round(get_format("fp16").round(v[:, None] + v[None, :]), saturate=True)
    assert got.shape == (256, 256) and same(got, want)
