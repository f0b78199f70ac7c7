"""trainprobes.reference.recipes: the MX and NVFP4 casts bit for bit against torchao's CPU
quantisers (skipped cleanly where torchao is absent), and what each recipe does to a GEMM."""
import pytest
import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import get_format
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


# --- per-tensor and row-wise FP8 against torchao.float8 (the casts Float8Linear runs) ------

# amaxes with few significand bits: 448 / amax is inexact in fp32, and x * scale lands on
# exact e4m3/e5m2 rounding ties often (bf16 x has 8 significant bits), where a cast that is
# not torchao's arithmetic rounds the other way
TIE_AMAXES = (3.8125, 2.5, 5.75, 0.6875, 13.0, 1.40625, 0.1171875, 96.0)


def _tie_prone(seed: int, rows: int = 2560, K: int = 256) -> torch.Tensor:
    """bf16 rows (rows x K = 655,360 values) whose row amaxes are TIE_AMAXES, the whole
    tensor's 3.8125: uniform values below each row's amax, one element at +-amax."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.tensor(TIE_AMAXES, dtype=torch.float32)[torch.arange(rows) % len(TIE_AMAXES)]
    amax = torch.where(torch.arange(rows) == 0, torch.tensor(3.8125), amax.clamp(max=3.8125))
    x = (torch.rand(rows, K, generator=g) * 2 - 1) * amax[:, None]
    x = x.to(torch.bfloat16).float().clamp(-amax[:, None], amax[:, None])
    at = torch.randint(0, K, (rows,), generator=g)
    x[torch.arange(rows), at] = amax * torch.where(torch.rand(rows, generator=g) < 0.5, 1.0, -1.0)
    x[1, :] = 0.0  # a row of zeros: amax clamped at torchao's eps
    x[0, 0], x[0, 1] = 2.859375, 3.8125  # the double-rounding case: exactly 336 in e4m3
    return x.to(torch.bfloat16)


@pytest.fixture(scope="module")
def torchao_float8():
    pytest.importorskip("torchao", reason="torchao (the test extra) is not installed")
    from torchao.float8 import config, float8_scaling_utils, float8_training_tensor
    return config, float8_scaling_utils, float8_training_tensor


def _torchao_cast(ao, x, dtype, *, rowwise: bool, pow2: bool):
    config, scaling, tensor = ao
    t = scaling.hp_tensor_to_float8_dynamic(
        x, dtype, tensor.LinearMMConfig(),
        scaling_granularity=config.ScalingGranularity.AXISWISE if rowwise else config.ScalingGranularity.TENSORWISE,
        axiswise_dim=-1 if rowwise else None, round_scales_to_power_of_2=pow2)
    # what torch._scaled_mm is given: the fp32 reciprocal of the scale (float8_ops.py)
    return t._data.float().double(), t._scale.reciprocal().double()


@pytest.mark.parametrize("recipe,role,rowwise", [("fp8-tensor", "activation", False),
                                                 ("fp8-tensor", "grad", False),
                                                 ("fp8-tensor-e4m3", "grad", False),
                                                 ("fp8-rowwise", "weight", True),
                                                 ("fp8-rowwise-pow2", "activation", True),
                                                 ("fp8-rowwise-pow2", "grad", True)])
def test_float8_cast_matches_torchao_bit_for_bit(torchao_float8, recipe, role, rowwise):
    rec = get_recipe(recipe)
    dtype = getattr(torch, "float8_" + rec.element_for(role).removeprefix("fp8_"))
    x = _tie_prone(3)
    data, inverse = _torchao_cast(torchao_float8, x, dtype, rowwise=rowwise, pow2=rec.pow2_scales)
    q = quantize(x.double(), rec, role)
    assert q.values.numel() >= 600_000
    differ = int((q.values != data).sum())
    assert differ == 0, f"{differ} / {q.values.numel()} element codes differ from torchao ({recipe}, {role})"
    assert torch.equal(q.scale, inverse.reshape(q.scale.shape))
    if not rowwise:  # the GEMM probe quantises sampled rows under the whole tensor's amax
        rows = torch.arange(7, x.shape[0], 97)
        part = quantize(x[rows].double(), rec, role, tensor_amax=x.float().abs().amax().item())
        assert torch.equal(part.values, data[rows]) and torch.equal(part.scale, inverse)
    if dtype == torch.float8_e4m3fn and not rec.pow2_scales:
        # the data is tie-prone: the old float64 arithmetic, x / (amax / 448) rounded once from
        # float64, differs from torchao on it (so this test can fail)
        x64 = x.double()
        amax = x64.abs().amax(-1, keepdim=True) if rowwise else x64.abs().amax()
        s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        old = get_format("fp8_e4m3fn").round(x64 / s, saturate=True)
        assert int((old != data).sum()) > 100


def test_double_rounding_case_rounds_once():
    # 2.859375 * fp32(448 / 3.8125) = 336 exactly, a tie between e4m3 320 and 352: even is 320;
    # float64 2.859375 / (3.8125 / 448) = 336.00000000000006 would round to 352
    x = torch.tensor([[2.859375, 3.8125]], dtype=torch.float64)
    for name in ("fp8-tensor", "fp8-tensor-e4m3", "fp8-rowwise"):
        assert quantize(x, name, "activation").values.tolist() == [[320.0, 448.0]]
    assert 2.859375 / (3.8125 / 448) == 336.00000000000006


def test_rowwise_recipes_follow_torchao_recipe_config(torchao_float8):
    # torchao's "rowwise" recipe (read from the installed library): AXISWISE e4m3 casts of
    # every operand and power-of-two scales; fp8-rowwise-pow2 is that recipe, fp8-rowwise not
    config = torchao_float8[0]
    cfg = config.Float8LinearConfig.from_recipe_name("rowwise")
    assert cfg.round_scales_to_power_of_2 is True
    for cc in (cfg.cast_config_input, cfg.cast_config_weight, cfg.cast_config_grad_output):
        assert cc.scaling_granularity is config.ScalingGranularity.AXISWISE
        assert cc.target_dtype == torch.float8_e4m3fn
    pow2, plain = get_recipe("fp8-rowwise-pow2"), get_recipe("fp8-rowwise")
    assert pow2.pow2_scales and not plain.pow2_scales
    assert {pow2.element, pow2.grad_element} == {"fp8_e4m3fn"}
    assert "'rowwise' recipe" in pow2.source and "round_scales_to_power_of_2=False" in plain.source
    # the default (tensorwise) config: e4m3 inputs and weights, e5m2 gradients (fp8-tensor)
    d = config.Float8LinearConfig()
    assert d.cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert get_recipe("fp8-tensor").grad_element == "fp8_e5m2"
    q = quantize(torch.tensor([[0.75, -3.0, 1.0]]), "fp8-rowwise-pow2", "weight")
    assert q.scale.item() == 2.0 ** -7  # 448 / 3 = 149.3 rounded down to 128


def test_float8_scale_edges():
    from trainprobes.reference.recipes import float8_scale
    f = lambda a, **kw: float8_scale(torch.tensor(a, dtype=torch.float64), 448.0, **kw).item()  # noqa: E731
    assert f(0.0) == 1.0                                # TE: an all-zero tensor keeps scale 1
    assert f(0.0, eps=1e-12) == float(torch.tensor(448e12, dtype=torch.float32))  # torchao's eps
    assert f(1e-45) == torch.finfo(torch.float32).max  # TE: a scale past fp32 -> fp32 max
    assert f(3.5, pow2=True) == 128.0 and f(7.0, pow2=True) == 64.0
    # torchao's pow2 rounding is fp32 exp2(floor(log2)): a scale just under 64 reads 64
    below = float(torch.nextafter(torch.tensor(64.0), torch.tensor(0.0)))
    amax = 448.0 / below
    assert float8_scale(torch.tensor(amax, dtype=torch.float64), 448.0).item() == below
    assert f(amax, pow2=True) == 64.0


def test_float8_scale_matches_torchao_amax_to_scale(torchao_float8):
    from torchao.float8.float8_utils import amax_to_scale
    from trainprobes.reference.recipes import TORCHAO_AMAX_EPS, float8_scale
    below = float(torch.nextafter(torch.tensor(64.0), torch.tensor(0.0)))
    amax = torch.tensor([0.0, 1e-13, 1e-12, 3.8125, 448.0 / below, 7.0, 1e-30, 3e38,
                         *TIE_AMAXES], dtype=torch.float32)
    amax = torch.cat([amax, torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 1e3])
    for dtype, top in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        for pow2 in (False, True):
            want = amax_to_scale(amax, dtype, round_scales_to_power_of_2=pow2)
            got = float8_scale(amax.double(), top, eps=TORCHAO_AMAX_EPS, pow2=pow2)
            assert torch.equal(got, want), (dtype, pow2)
