"""Low-precision GEMM recipes as users configure them: how each operand is quantised.

A recipe turns an operand (rows, K), K the reduction axis, into a Quantized pair:
  values: float64, what the tensor core multiplies: element codes times their block scale
          (e8m0 powers of two and e4m3 block scales keep every product exact in float64);
  scale:  float64, (rows, 1) or (), applied to the output after accumulation (per-tensor
          and row-wise scales, NVFP4's fp32 tensor scale: the GEMM epilogue's alpha).
Recipes (each a named Recipe; RECIPES lists them):
  - per-tensor and row-wise dynamic amax, in the arithmetic torchao's Float8Linear
    (float8_utils.amax_to_scale, hp_tensor_and_scale_to_float8) and Transformer Engine's
    current scaling (recipe_common.cuh compute_scale_from_amax) run:
      1. amax of the tensor (per-tensor) or of each row along K (row-wise), clamped below at
         the recipe's amax_eps (torchao 1e-12; TE 0, where amax = 0 gives scale 1);
      2. scale = fp32(max_finite / amax) (448 for e4m3, 57344 for e5m2), fp32 max if that
         overflows; pow2 recipes round it down to a power of two as torchao does,
         exp2(floor(log2(scale))) in fp32;
      3. elements fp32(fp32(x) * scale), clamped to +-max_finite and rounded once to the
         element format (never x / (amax / max_finite) in float64, which lands a hair off
         exact ties and rounds them the other way: x = 2.859375 at amax 3.8125 is 336 in both
         real and this fp32 arithmetic, a tie between e4m3 320 and 352 that goes to 320 (even),
         while float64 gives 336.00000000000006, which rounds to 352);
      4. the epilogue multiplies by fp32(1 / scale) (torchao passes scale.reciprocal() to
         torch._scaled_mm; TE keeps scale_inv = 1 / scale).
    "fp8-tensor" (TE's HYBRID format, torchao's default tensorwise config) keeps e5m2 for
    gradients; "fp8-tensor-e4m3" uses e4m3 throughout. "fp8-rowwise-pow2" is torchao's
    "rowwise" recipe (Float8LinearConfig.from_recipe_name("rowwise"): e4m3 throughout,
    round_scales_to_power_of_2=True); "fp8-rowwise" the same row-wise scaling with fp32
    scales (a Float8LinearConfig with AXISWISE casts and round_scales_to_power_of_2=False).
  - MX (OCP Microscaling v1.0, section 6.3; torchao mx_formats FLOOR mode, the default):
    32-element blocks along K, scale 2^(floor(log2 amax) - emax_elem) in e8m0 (clamped to
    the fp32 normal range as torchao does), elements x / scale clamped and rounded to nearest.
    MXFP8 keeps e4m3 for gradients (Megatron-Bridge PR #638 moved them from e5m2).
  - NVFP4 (arXiv 2509.25149; torchao nvfp4_quantize): 16-element blocks, fp32 tensor scale
    s_t = amax / (448 * 6), e4m3 block scales fp32(fp32(amax_b / 6) / s_t), elements
    fp32(x * fp32(fp32(1 / s_t) / s_b)) clamped to +-6 and rounded to nearest e2m1.
    Options: 16x16 2-D blocks for weights, stochastic rounding of gradients, a 16-point
    random Hadamard transform along K of the weight-gradient GEMM's operands
    ("nvfp4-paper": all three, as the paper trains).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import get_format
from trainprobes.validation import check_choice

__all__ = ["Recipe", "Quantized", "RECIPES", "get_recipe", "quantize", "float8_scale",
           "float8_quantize", "mx_quantize", "nvfp4_quantize", "hadamard", "rotate"]

ROLES = ("activation", "weight", "grad")
E4M3_MAX, E2M1_MAX = 448.0, 6.0


@dataclass(frozen=True)
class Recipe:
    """How each operand of a training GEMM is quantised (module docstring)."""

    name: str
    scaling: str            # "none", "tensor", "row", "mx", "nvfp4"
    element: str | None     # element format of activations and weights
    grad_element: str | None
    block: int | None = None
    weight_2d: bool = False
    stochastic_grads: bool = False
    hadamard_wgrad: bool = False
    pow2_scales: bool = False   # tensor/row scales rounded down to a power of two (torchao)
    amax_eps: float = 0.0       # tensor/row amax clamped below at this (torchao: 1e-12)
    source: str = ""

    def element_for(self, role: str) -> str | None:
        return self.grad_element if role == "grad" else self.element


@dataclass(frozen=True)
class Quantized:
    """An operand as the tensor core sees it: values (block scales folded in) and the scale
    the epilogue applies."""

    values: torch.Tensor
    scale: torch.Tensor


_TE = ("Transformer Engine Float8CurrentScaling (per-tensor amax, fp32 scale), as torchao's "
       "default tensorwise Float8LinearConfig; HYBRID: e5m2 gradients")
# torchao.float8.float8_utils.EPS (0.18): the floor of an amax before 448 / amax
TORCHAO_AMAX_EPS = 1e-12
_AXISWISE = "torchao Float8Linear row-wise (AXISWISE) scaling along K, e4m3 throughout"
RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("exact", "none", None, None, source="no quantisation: the accumulator alone"),
    Recipe("bf16", "none", "bf16", "bf16", source="bf16 operands, no scales"),
    Recipe("fp8-tensor", "tensor", "fp8_e4m3fn", "fp8_e5m2", source=_TE),
    Recipe("fp8-tensor-e4m3", "tensor", "fp8_e4m3fn", "fp8_e4m3fn", source=_TE + " (e4m3 throughout)"),
    Recipe("fp8-rowwise", "row", "fp8_e4m3fn", "fp8_e4m3fn", amax_eps=TORCHAO_AMAX_EPS,
           source=_AXISWISE + ", fp32 scales (round_scales_to_power_of_2=False; torchao's "
                  "'rowwise' recipe rounds them to powers of two: fp8-rowwise-pow2)"),
    Recipe("fp8-rowwise-pow2", "row", "fp8_e4m3fn", "fp8_e4m3fn", pow2_scales=True,
           amax_eps=TORCHAO_AMAX_EPS,
           source=_AXISWISE + ", scales rounded down to powers of two: torchao's 'rowwise' "
                  "recipe (Float8LinearConfig.from_recipe_name('rowwise'), torchao 0.18)"),
    Recipe("mxfp8", "mx", "fp8_e4m3fn", "fp8_e4m3fn", 32,
           source="OCP MX v1.0; e4m3 gradients as Megatron-Bridge PR #638"),
    Recipe("mxfp8-e5m2-grads", "mx", "fp8_e4m3fn", "fp8_e5m2", 32, source="OCP MX v1.0"),
    Recipe("mxfp4", "mx", "fp4_e2m1fn", "fp4_e2m1fn", 32, source="OCP MX v1.0"),
    Recipe("nvfp4", "nvfp4", "fp4_e2m1fn", "fp4_e2m1fn", 16,
           source="NVFP4 (arXiv 2509.25149), 1-D 16-element blocks, round to nearest"),
    Recipe("nvfp4-paper", "nvfp4", "fp4_e2m1fn", "fp4_e2m1fn", 16, weight_2d=True,
           stochastic_grads=True, hadamard_wgrad=True,
           source="arXiv 2509.25149: 16x16 weight blocks, stochastic rounding of gradients, "
                  "16-point random Hadamard transforms on the weight-gradient inputs"),
)}


def get_recipe(name) -> Recipe:
    if isinstance(name, Recipe):
        return name
    return RECIPES[check_choice(name, "recipe", tuple(RECIPES), hint="a quantisation recipe")]


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _check_blocks(K: int, block: int, what: str) -> None:
    if K % block:
        raise InvalidArgument(f"{what}: K={K} is not a multiple of the block size {block}; pad K "
                              f"to {(K // block + 1) * block} or pick a recipe without blocks")


def float8_scale(amax: torch.Tensor, max_finite: float, *, eps: float = 0.0,
                 pow2: bool = False) -> torch.Tensor:
    """Steps 1-2 of the per-tensor / row-wise recipes (module docstring): the fp32 scale that
    multiplies the elements. amax: float64 (exact for bf16/fp32 tensors)."""
    amax = amax.to(torch.float64).clamp(min=eps)
    # max_finite / amax in float64 rounded to fp32 is the correctly rounded fp32 quotient
    # (53 >= 2 * 24 + 2 bits: double rounding of a division is innocuous), what both
    # torchao (float64, then .to(float32)) and TE (__fdiv_rn in fp32) compute
    s = (max_finite / amax).to(torch.float32)
    big = torch.tensor(torch.finfo(torch.float32).max, dtype=torch.float32)
    s = torch.where(torch.isinf(s), big, s)        # TE: an amax too small for fp32
    s = torch.where(amax == 0, torch.ones_like(s), s)  # TE with eps 0: an all-zero tensor
    if pow2:
        # torchao's _round_scale_down_to_power_of_2, the same fp32 ops: for a scale within
        # an ulp below a power of two, fp32 log2 rounds up to the integer and the scale
        # rounds up (TE's exponent mask would round down)
        s = torch.exp2(torch.floor(torch.log2(s)))
    return s


def float8_quantize(x: torch.Tensor, element: str, *, rowwise: bool, eps: float = 0.0,
                    pow2: bool = False, tensor_amax=None, mode: str = "nearest",
                    generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(element values as float64, fp32 scale as float64): the per-tensor (rowwise=False) or
    row-wise cast of x (rows, K), steps 1-3 of the module docstring. The epilogue multiplies
    by fp32(1 / scale) (Quantized.scale, from quantize). tensor_amax: the whole tensor's
    amax where x holds some of its rows."""
    fmt = get_format(element)
    x64 = x.to(torch.float64)
    if rowwise:
        amax = x64.abs().amax(-1, keepdim=True)
    elif tensor_amax is None:
        amax = x64.abs().amax()
    else:
        amax = torch.tensor(float(tensor_amax), dtype=torch.float64)
    s = float8_scale(amax, fmt.max_finite, eps=eps, pow2=pow2)
    data = (_f32(x) * s).clamp(-fmt.max_finite, fmt.max_finite)   # one fp32 multiply
    q = fmt.round(data.to(torch.float64), mode, saturate=True, generator=generator)
    return q, s.to(torch.float64)


def mx_quantize(x: torch.Tensor, element: str, block: int = 32, *, mode: str = "nearest",
                generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(element values, e8m0 scales as float64 powers of two), blocks along the last axis.

    torchao FLOOR: the scale exponent is the fp32 exponent field of amax (so amax < 2^-126
    reads as -127) minus emax of the element format, clamped to [-127, 128]; the scale is
    then clamped to the smallest fp32 normal."""
    fmt = get_format(element)
    _check_blocks(x.shape[-1], block, "MX quantisation")
    xb = _f32(x).reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    field = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    emax_elem = math.floor(math.log2(fmt.max_finite))
    e = (field - emax_elem).clamp(-127, 128)
    code = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), e.to(torch.int32))  # the e8m0 value
    scale = code.to(torch.float32).clamp(min=2.0 ** -126)  # what torchao divides by
    data = (xb / scale).clamp(-fmt.max_finite, fmt.max_finite).to(torch.float64)
    q = fmt.round(data, mode, generator=generator)
    return q.reshape(x.shape), code.squeeze(-1)


def nvfp4_quantize(x: torch.Tensor, *, tensor_amax=None, mode: str = "nearest", generator=None,
                   tile_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e2m1 values, e4m3 block scales, fp32 tensor scale), 16-element blocks along the last
    axis (tile_rows=16: 16x16 tiles share one scale), in torchao's fp32 arithmetic."""
    fp4 = get_format("fp4_e2m1fn")
    rows, K = x.shape
    _check_blocks(K, 16, "NVFP4 quantisation")
    if rows % tile_rows:
        raise InvalidArgument(f"NVFP4 2-D blocks: {rows} rows is not a multiple of {tile_rows}")
    x32 = _f32(x)
    amax_t = x32.abs().amax() if tensor_amax is None else torch.as_tensor(tensor_amax, dtype=torch.float32)
    s_t = amax_t / torch.tensor(E4M3_MAX * E2M1_MAX, dtype=torch.float32)
    # an all-zero tensor: a unit scale quantises it to zeros (as the per-tensor recipes do),
    # where amax / 2688 = 0 would give 0/0 block scales
    s_t = torch.where(s_t > 0, s_t, torch.ones_like(s_t))
    tiles = x32.reshape(rows // tile_rows, tile_rows, K // 16, 16)
    amax_b = tiles.abs().amax(dim=(1, 3))                       # (rows/tile, K/16)
    s_b = ((amax_b / E2M1_MAX) / s_t).clamp(min=torch.finfo(torch.float8_e4m3fn).tiny,
                                            max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    recip = (torch.tensor(1.0, dtype=torch.float32) / s_t) / s_b
    data = (tiles * recip[:, None, :, None]).clamp(-E2M1_MAX, E2M1_MAX).reshape(rows, K)
    q = fp4.round(data.to(torch.float64), mode, generator=generator)
    s_b = s_b.repeat_interleave(tile_rows, 0).to(torch.float64)
    return q, s_b, s_t.to(torch.float64)


def hadamard(K: int, generator: torch.Generator, size: int = 16) -> torch.Tensor:
    """The blocks (K/16, 16, 16) of a block-diagonal random Hadamard transform along K:
    H_16 / 4 with rows of random signs per block. Orthogonal, so rotating both operands of
    a GEMM along K (rotate) leaves A B^T unchanged in real arithmetic."""
    _check_blocks(K, size, "the random Hadamard transform")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.randint(0, 2, (K // size, size, 1), generator=generator).to(torch.float64) * 2 - 1
    return signs * h / math.sqrt(size)


def rotate(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x (rows, K) times the block-diagonal transform whose blocks are `blocks`."""
    rows, K = x.shape
    n, size, _ = blocks.shape
    return torch.einsum("rbi,bij->rbj", x.reshape(rows, n, size), blocks).reshape(rows, K)


def quantize(x: torch.Tensor, recipe, role: str, *, generator: torch.Generator | None = None,
             tensor_amax: float | None = None) -> Quantized:
    """Operand x (rows, K) quantised as `recipe` quantises a `role` operand (module docstring).
    generator: for stochastic rounding (recipes that use it need one).
    tensor_amax: the amax of the whole tensor x was taken from (x may be some of its rows:
    per-tensor and NVFP4 scales depend on the whole tensor, everything else on the rows)."""
    recipe = get_recipe(recipe)
    check_choice(role, "role", ROLES)
    x = torch.as_tensor(x).to(torch.float64)
    if x.dim() != 2:
        raise InvalidArgument(f"operand has shape {tuple(x.shape)}; expected (rows, K)")
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        raise InvalidArgument(f"a {role} operand holds {int(bad.sum())} non-finite value(s) (first "
                              f"at {tuple(int(i) for i in torch.nonzero(bad)[0])}): an amax of them "
                              "scales nothing; find the overflow upstream")
    element = recipe.element_for(role)
    one = torch.ones((), dtype=torch.float64)
    mode = "nearest"
    if recipe.stochastic_grads and role == "grad":
        if generator is None:
            raise InvalidArgument(f"recipe {recipe.name!r} rounds gradients stochastically: pass a "
                                  "seeded generator")
        mode = "stochastic"
    if recipe.scaling == "none":
        vals = x if element is None else get_format(element).round(x, mode, generator=generator)
        return Quantized(vals, one)
    if recipe.scaling in ("tensor", "row"):
        q, s = float8_quantize(x, element, rowwise=recipe.scaling == "row", eps=recipe.amax_eps,
                               pow2=recipe.pow2_scales, tensor_amax=tensor_amax, mode=mode,
                               generator=generator)
        inverse = torch.ones((), dtype=torch.float32) / s.to(torch.float32)  # fp32 reciprocal
        return Quantized(q, inverse.to(torch.float64))
    if recipe.scaling == "mx":
        q, s = mx_quantize(x, element, recipe.block, mode=mode, generator=generator)
        return Quantized(q * s.repeat_interleave(recipe.block, -1), one)
    tile = 16 if recipe.weight_2d and role == "weight" else 1
    q, s_b, s_t = nvfp4_quantize(x, mode=mode, generator=generator, tile_rows=tile,
                                 tensor_amax=tensor_amax)
    return Quantized(q * s_b.repeat_interleave(16, -1), s_t)
