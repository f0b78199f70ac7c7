"""trainprobes.reference.recipes: the MX and NVFP4 casts bit for bit against torchao's CPU
quantisers (skipped cleanly where torchao is absent), and what each recipe does to a GEMM."""
import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.recipes import (
    RECIPES,
    get_recipe,
    hadamard,
    mx_quantize,
    nvfp4_quantize,
    quantize,
    rotate,
)

N_VALUES = 131_072  # >= 100,000 values per cast


def _data(seed: int) -> torch.Tensor:
    """Rows of very different magnitudes (each block's scale differs), zero blocks, values past
    the element range after scaling, fp32 subnormals and exact ties of the element grid."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_VALUES // 256, 256, generator=g) * torch.exp(torch.randn(512, 1, generator=g) * 4)
    x[3, :32] = 0
    x[5, :64] = torch.randint(-8, 9, (64,), generator=g) * 0.25  # ties on the fp4/fp8 grids
    x[7] = x[7] * 1e-40  # fp32 subnormals: amax below 2^-126
    x[9, 5] = 3e38
    return x.float()


@pytest.fixture(scope="module")
def torchao_mx():
    pytest.importorskip("torchao", reason="torchao (the test extra) is not installed")
    from torchao.prototype.mx_formats import kernels, mx_tensor, nvfp4_tensor
    return mx_tensor, nvfp4_tensor, kernels


@pytest.mark.parametrize("element,attr", [("fp8_e4m3fn", "float8_e4m3fn"),
                                          ("fp8_e5m2", "float8_e5m2"),
                                          ("fp4_e2m1fn", "float4_e2m1fn_x2")])
def test_mx_cast_matches_torchao_bit_for_bit(torchao_mx, element, attr):
    mx_tensor, _, kernels = torchao_mx
    x = _data(1)
    scale, data = mx_tensor.to_mx(x, getattr(torch, attr), 32)
    if element.startswith("fp4"):
        data = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(data.view(torch.uint8))).reshape(x.shape)
    q, s = mx_quantize(x.double(), element, 32)
    assert q.numel() >= 100_000
    mism = (q != data.double()).sum().item()
    assert mism == 0, f"{mism} / {q.numel()} element codes differ from torchao"
    assert torch.equal(s, scale.to(torch.float32).double().reshape(s.shape))


def test_nvfp4_cast_matches_torchao_bit_for_bit(torchao_mx):
    _, nv, kernels = torchao_mx
    x = _data(2)
    scale, data = nv.nvfp4_quantize(x, 16, nv.per_tensor_amax_to_scale(x.abs().amax()))
    data = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(data)).reshape(x.shape)
    q, s_b, s_t = nvfp4_quantize(x.double())
    assert q.numel() >= 100_000
    assert (q != data.double()).sum().item() == 0
    assert torch.equal(s_b, scale.to(torch.float32).double().reshape(s_b.shape))
    assert s_t.item() == nv.per_tensor_amax_to_scale(x.abs().amax()).item()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_approximates_the_operand(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g, dtype=torch.float64)
    for role in ("activation", "weight", "grad"):
        q = quantize(x, name, role, generator=torch.Generator().manual_seed(1))
        back = q.values * q.scale
        rel = ((back - x).norm() / x.norm()).item()
        bound = {"exact": 0.0, "bf16": 0.005}.get(name, 0.2 if "fp4" in name else 0.07)
        assert rel <= bound, (name, role, rel)
        if name == "exact":
            assert torch.equal(back, x)


def test_grad_formats_differ_between_recipes():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    e5 = quantize(x, "fp8-tensor", "grad")
    e4 = quantize(x, "fp8-tensor-e4m3", "grad")
    # e5m2 has one mantissa bit less: larger quantisation error
    err = [((q.values * q.scale - x).norm() / x.norm()).item() for q in (e5, e4)]
    assert err[0] > 1.5 * err[1]


def test_2d_weight_blocks_share_one_scale_per_tile():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, s_b, _ = nvfp4_quantize(x, tile_rows=16)
    assert torch.equal(s_b[:16], s_b[:1].expand(16, -1)) and not torch.equal(s_b[0], s_b[16])


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = torch.full((64, 64), 1.3, dtype=torch.float64) + 0.01 * torch.randn(
        64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = quantize(x, "nvfp4-paper", "grad", generator=torch.Generator().manual_seed(5))
    b = quantize(x, "nvfp4-paper", "grad", generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.values, b.values)
    near = quantize(x, "nvfp4", "grad")
    bias_sr = ((a.values * a.scale - x).mean() / x.mean()).abs().item()
    bias_rn = ((near.values * near.scale - x).mean() / x.mean()).abs().item()
    assert bias_sr < bias_rn / 4


def test_hadamard_is_orthogonal_and_blockwise():
    blocks = hadamard(64, torch.Generator().manual_seed(0))
    R = rotate(torch.eye(64, dtype=torch.float64), blocks)
    assert torch.allclose(R @ R.t(), torch.eye(64, dtype=torch.float64), atol=1e-15)
    assert R[:16, 16:].abs().sum() == 0
    a, b = torch.randn(3, 64, dtype=torch.float64), torch.randn(5, 64, dtype=torch.float64)
    assert torch.allclose(rotate(a, blocks) @ rotate(b, blocks).t(), a @ b.t(), atol=1e-12)


def test_bad_input_is_named():
    with pytest.raises(InvalidArgument, match="mxfp8"):
        get_recipe("mxfp9")
    with pytest.raises(InvalidArgument, match="K=40 is not a multiple of the block size 32"):
        quantize(torch.ones(4, 40), "mxfp8", "activation")
    with pytest.raises(InvalidArgument, match="multiple of the block size 16"):
        quantize(torch.ones(4, 40), "nvfp4", "weight")
    x = torch.ones(4, 32)
    x[2, 1] = float("inf")
    with pytest.raises(InvalidArgument, match=r"non-finite.*\(2, 1\)"):
        quantize(x, "fp8-tensor", "activation")
    with pytest.raises(InvalidArgument, match="seeded generator"):
        quantize(torch.ones(16, 32), "nvfp4-paper", "grad")


def test_nvfp4_all_zero_operand_quantises_to_zeros():
    z = torch.zeros(16, 64, dtype=torch.float64)
    for rec in ("nvfp4", "nvfp4-paper"):
        for role in ("activation", "weight", "grad"):
            q = quantize(z, rec, role, generator=torch.Generator().manual_seed(0), tensor_amax=0.0)
            assert torch.isfinite(q.values).all() and torch.isfinite(q.scale).all()
            assert not q.values.any()
