"""Per-rank inputs from a seed: the launcher and every rank build the same bits.

Rank r's input depends only on (data, seed, rank, numel): its own generator, so a rank
never materialises the other ranks' data and the launcher can rebuild all of them to
predict the result.
"""
from __future__ import annotations

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import get_format
from trainprobes.validation import check_choice

DATA = {
    "normal": "standard normal values",
    "gradient": "heavy-tailed, gradient-like: Student-t (3 dof) times 1e-3",
    "positive": "same-signed small values: uniform in [0, 1e-3) (bias compounds)",
    "ones": "all ones: the stall pattern (a running sum of ones stalls at 2^(p))",
}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16,
          "bf16": torch.bfloat16}
_FP8 = {"fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def torch_dtype(name) -> torch.dtype:
    """The torch dtype a real backend moves for a format (any spelling get_format takes;
    fp8 where torch has it)."""
    fmt = get_format(name)
    if fmt.name in DTYPES:
        return DTYPES[fmt.name]
    if fmt.name in _FP8 and hasattr(torch, _FP8[fmt.name]):
        return getattr(torch, _FP8[fmt.name])
    raise InvalidArgument(f"dtype={name!r} is not a type a real collective moves; expected one "
                          f"of {list(DTYPES) + list(_FP8)}")


def _generator(seed: int, rank: int) -> torch.Generator:
    # One stream per (seed, rank); 1_000_003 is prime so nearby seeds and ranks never collide.
    return torch.Generator().manual_seed((seed * 1_000_003 + rank) % (1 << 63))


def make_input(data: str, rank: int, numel: int, seed: int) -> torch.Tensor:
    """Rank `rank`'s input as float64 values (cast to the wire dtype by the caller)."""
    check_choice(data, "data", tuple(DATA))
    if data == "ones":
        return torch.ones(numel, dtype=torch.float64)
    g = _generator(seed, rank)
    if data == "normal":
        return torch.randn(numel, generator=g, dtype=torch.float64)
    if data == "gradient":
        z = torch.randn(numel, generator=g, dtype=torch.float64)
        chi2 = torch.randn(3, numel, generator=g, dtype=torch.float64).square().sum(0)
        return 1e-3 * z / (chi2 / 3).sqrt()
    return 1e-3 * torch.rand(numel, generator=g, dtype=torch.float64)


def wire_input(data: str, rank: int, numel: int, seed: int, dtype: str) -> torch.Tensor:
    """make_input cast to the wire dtype with torch's own cast: what the rank sends."""
    x = make_input(data, rank, numel, seed)
    dt = torch_dtype(dtype)
    if dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return x.to(dt)
    return x.to(torch.float32).to(dt)  # fp8: via fp32, as training recipes cast


def reveal_input(rank: int, numel: int, pair: tuple[int, int], dtype: str,
                 big: float, tiny: float) -> torch.Tensor:
    """Order-revealing pattern (FPRev): +big at rank pair[0], -big at pair[1], tiny elsewhere.

    Every tiny added into a partial sum holding +-big before +big meets -big is absorbed;
    the others survive exactly, so each element's result / tiny counts the ranks added after
    the pair joined: one run per pair reveals the whole per-element order.
    """
    value = big if rank == pair[0] else -big if rank == pair[1] else tiny
    return torch.full((numel,), value, dtype=torch.float64).to(torch_dtype(dtype))
