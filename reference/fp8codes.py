"""NCCL's fp8 arithmetic on one-byte codes: the exact input cast and a 65,536-entry add table.

The collectives hold fp8 values as their bit patterns (uint8), so a hop of the ring reads
and writes one byte per element and needs no conversion:
  - encode(): Format.round(x, "nearest") as codes. torch's own cast to fp8 rounds once
    from float32 (and saturates e4m3fn), but from float64 it goes through float32 first:
    two roundings (1.0625 + 2^-40 -> 1.0, not 1.125). So the cast is used on float32
    values inside +-max_finite only (where it is exact and nothing overflows); float64
    that float32 does not hold, and anything out of range, go through fastround's exact
    rounding first (the rounded value then casts exactly).
  - add(): NCCL adds two fp8 values in fp16 and casts back with __NV_SATFINITE
    (src/device/reduce_kernel.h). The result depends only on the two codes, so it is one
    lookup in a table of all 256 x 256 pairs, built once per format from the exact sum
    rounded by fastround (fp16 then fp8 rounding of an exact sum is innocuous,
    11 >= 2 * 4 + 2; tests/test_fp8codes.py checks the table against Format.round).
  - decode(): codes -> float64 values by a 256-entry table.
"""
from __future__ import annotations

import functools

import torch
from trainprobes.reference.fastround import round_nearest, rounder
from trainprobes.reference.formats import Format
from trainprobes.reference.scratch import Scratch, any_nonzero, float32_copy

# fp8 formats torch stores natively (the others have no torch dtype to cast with)
TORCH_FP8 = ("fp8_e4m3fn", "fp8_e5m2")


def _values(fmt: Format, device) -> torch.Tensor:
    """All 256 codes of fmt as float32 (exact), in code order."""
    return torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8) \
        .view(fmt.torch_dtype).to(torch.float32)


@functools.lru_cache(maxsize=None)
def _decode_table(fmt: Format, device: torch.device) -> torch.Tensor:
    return _values(fmt, device).to(torch.float64)


@functools.lru_cache(maxsize=None)
def add_table(fmt: Format, device: torch.device) -> torch.Tensor:
    """Codes of NCCL's fp8 add for every pair of codes a, b: table[(a << 8) | b]."""
    v = _values(fmt, device)
    exact = (v[:, None] + v[None, :]).reshape(-1)  # two fp8 values sum exactly in float32
    return encode_exact(rounder(fmt, torch.float32, saturate=True)(exact), fmt)


def encode_exact(values: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Codes of values that fmt holds exactly (and NaN, and inf where fmt has it)."""
    return values.to(fmt.torch_dtype).view(torch.uint8)


def encode(x: torch.Tensor, fmt: Format, saturate: bool,
           scratch: Scratch | None = None) -> torch.Tensor:
    """Format.round(x, "nearest", saturate=saturate) of a float32/float64 tensor, as codes
    (temporaries in `scratch` when given)."""
    s, exact = x, True
    if x.dtype != torch.float32:
        s, lost = float32_copy(x, Scratch() if scratch is None else scratch)
        exact = not any_nonzero(lost)  # NaN counts as lost
    if x.numel() and exact:  # s holds x exactly
        lo, hi = torch.aminmax(s)
        if -fmt.max_finite <= float(lo) and float(hi) <= fmt.max_finite:  # NaN fails too
            return encode_exact(s, fmt)  # one rounding, nothing to overflow
    return encode_exact(round_nearest(x, fmt, saturate=saturate), fmt)


def decode(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """float64 values of fp8 codes (any shape)."""
    table = _decode_table(fmt, codes.device)
    return table.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)


def add(a: torch.Tensor, b: torch.Tensor, fmt: Format) -> torch.Tensor:
    """NCCL's fp8 add of two code tensors of one shape (codes out)."""
    idx = a.to(torch.int32).bitwise_left_shift_(8).bitwise_or_(b)
    return add_table(fmt, a.device).index_select(0, idx.reshape(-1)).view(a.shape)
