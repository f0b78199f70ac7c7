"""Real fp8 GEMM outputs on crafted inputs, saved on a GPU and replayed on the CPU, so the
accumulator presets stay pinned to the hardware they were read from.

  1. crafted_cases(): small GEMMs (16 x K by K x 16, e4m3 operands built on the CPU from
     fixed seeds and constants, so any machine rebuilds them bit for bit): a big term beside
     small ones (alignment and precision), 0.75 of a spacing (rounding), negative small
     terms beside a big positive one (each aligned term cut toward zero, or toward -inf by
     a sign-fill shift: the H200 reveal used positive terms only, so this decides between
     h200-scaled-mm and h200-scaled-mm-signfill), a negative sum half a grid step past a
     power of two (the sum's own rounding: toward zero or toward -inf), a big value then
     ones (the narrow sum's stall, and a promotion interval if any), mostly positive random
     rows at K = 1024 and 4096 (the bias the presets predict), zero-mean random rows;
  2. record(run, ...): run(a, b) is the kernel (torch._scaled_mm with unit scales and fp32
     output, so the epilogue adds no rounding of its own to a 13- or 25-bit sum); the first
     ROWS_KEPT rows of each output are kept (a few KB in all);
  3. mismatches(doc, preset): the same cases through reference.gemm.matmul under a preset,
     compared bit for bit; scripts/gpu_check.py writes the document, tests/test_gemm_pin.py
     replays it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

ROWS_KEPT = 4
SCHEMA = 1


class Case(NamedTuple):
    name: str
    a: torch.Tensor   # (16, K) float32 holding e4m3 values
    b: torch.Tensor   # (K, 16) float32 holding e4m3 values


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def crafted_cases() -> list[Case]:
    """Step 1 of the module docstring: the inputs, the same bits on every machine."""
    cases = []
    # row s: 2^8 x 2^8 = 2^16, then 2^(16 - sh) x 1 with sh = 10 + s (2^6 .. 2^-9, all e4m3),
    # then -2^16 last: a row keeps the small term while sh <= the accumulator's bits
    a = torch.zeros(16, 64)
    a[:, 0], a[:, 63] = 2.0 ** 8, -(2.0 ** 8)
    a[:, 1] = torch.tensor([2.0 ** (6 - s) for s in range(16)])
    b = torch.zeros(64, 16)
    b[0], b[1], b[63] = 2.0 ** 8, 1.0, 2.0 ** 8
    cases.append(Case("big_small_cancel", _e4m3(a), _e4m3(b)))
    # 0.75 and 1.5 of the grid of 2^16 at 13 bits (2^3): truncation gives 0 or one spacing
    a = torch.zeros(16, 64)
    a[:, 0], a[:, 63] = 2.0 ** 8, -(2.0 ** 8)
    a[:, 1] = torch.tensor([0.75 * 2 ** k for k in range(16)]) / 2.0 ** 8  # times b = 2^8
    cases.append(Case("fractions_of_a_spacing", _e4m3(a), _e4m3(torch.full((64, 16), 2.0 ** 8))))
    # 2^16, then a negative small term, then -2^16 in the last group. The terms' grid is
    # 2^(16 - m): 8 at 13 bits, 2^-9 at 25; a negative term off it truncates toward zero
    # (the row reads that many grid steps, rounded toward zero) or floors (one step further
    # down). The kept rows (ROWS_KEPT) come first: -6 and -0.375 (off the 13-bit grid), and
    # -0.75 2^-10 and -0.75 2^-11 (off the 25-bit grid); then -0.75 2^(6 - s)
    small = [-6.0, -0.75 * 2.0 ** -10, -0.375, -0.75 * 2.0 ** -11] + [-0.75 * 2.0 ** (6 - s)
                                                                     for s in range(12)]
    a = torch.zeros(16, 64)
    a[:, 0], a[:, 63] = 2.0 ** 8, -(2.0 ** 8)
    a[:, 1] = torch.tensor(small) * 2.0 ** 6  # times b = 2^-6
    b = torch.zeros(64, 16)
    b[0], b[1], b[63] = 2.0 ** 8, 2.0 ** -6, 2.0 ** 8
    cases.append(Case("negative_small_term", _e4m3(a), _e4m3(b)))
    # -2^16, -2^16, -x in the first group, +2^16 +2^16 in the last: the sum -(2^17 + x) lies
    # on the grid 2^(17 - m) only if x does: its rounding toward zero or toward -inf (and
    # x's own cut) shows once the last group cancels the rest. x: 8 and 6 (13 bits),
    # 1.5 2^-9 and 1.5 2^-10 (25 bits) first, then 2^(3 - s)
    x = [8.0, 1.5 * 2.0 ** -9, 6.0, 1.5 * 2.0 ** -10] + [2.0 ** (3 - s) for s in range(12)]
    a = torch.zeros(16, 64)
    a[:, 0], a[:, 1] = -(2.0 ** 8), -(2.0 ** 8)
    a[:, 62], a[:, 63] = 2.0 ** 8, 2.0 ** 8
    a[:, 2] = -torch.tensor(x) * 8.0  # times b = 2^-3
    b = torch.zeros(64, 16)
    b[0], b[1], b[2], b[62], b[63] = 2.0 ** 8, 2.0 ** 8, 2.0 ** -3, 2.0 ** 8, 2.0 ** 8
    cases.append(Case("negative_carry", _e4m3(a), _e4m3(b)))
    # 2^12 x 2^8 = 2^20 first, then ones: a 13-bit truncating sum loses every one after it
    a = torch.ones(16, 1024)
    a[:, 0] = 2.0 ** 12
    b = torch.ones(1024, 16)
    b[0] = 2.0 ** 8
    cases.append(Case("big_then_ones", _e4m3(a), _e4m3(b)))
    for k, mean, seed in ((1024, 1.0, 1), (4096, 1.0, 2), (1024, 0.0, 3)):
        g = torch.Generator().manual_seed(seed)
        cases.append(Case(f"random_mean{mean:g}_k{k}", _e4m3(torch.randn(16, k, generator=g) + mean),
                          _e4m3(torch.randn(k, 16, generator=g) + mean)))
    return cases


def scaled_mm_runner(device: str) -> Callable:
    """run(a, b) = torch._scaled_mm on `device`: e4m3 operands (b column-major, as cuBLASLt
    wants it), unit scales, fp32 output, returned on the CPU as float64."""
    def run(a, b):
        fa = a.to(device=device, dtype=torch.float8_e4m3fn)
        fb = b.t().contiguous().to(device=device, dtype=torch.float8_e4m3fn).t()
        one = torch.ones((), dtype=torch.float32, device=device)
        return torch._scaled_mm(fa, fb, scale_a=one, scale_b=one, out_dtype=torch.float32).double().cpu()
    return run


def record(run: Callable, *, device_name: str, capability, torch_version: str) -> dict:
    """Step 2: the document saved under tests/data/."""
    return {"schema": SCHEMA, "device": device_name, "capability": list(capability),
            "torch": torch_version, "kernel": "torch._scaled_mm e4m3 x e4m3, unit scales, out fp32",
            "rows_kept": ROWS_KEPT,
            "cases": {c.name: run(c.a, c.b)[:ROWS_KEPT].tolist() for c in crafted_cases()}}


def mismatches(doc: dict, preset) -> list[str]:
    """Step 3: where the preset's emulation differs from the saved outputs (empty: bit for
    bit on every kept output)."""
    from trainprobes.reference.gemm import matmul
    out = []
    cases = {c.name: c for c in crafted_cases()}
    missing = sorted(set(cases) - set(doc.get("cases", {})))
    if missing:
        out.append(f"the document lacks cases {missing} (saved by an older gpu_check?)")
    for name, saved in doc.get("cases", {}).items():
        if name not in cases:
            out.append(f"case {name!r} is not one of crafted_cases(): {sorted(cases)}")
            continue
        c = cases[name]
        want = torch.tensor(saved, dtype=torch.float64)
        got = matmul(c.a[:ROWS_KEPT].double(), c.b.double(), preset)
        bad = (got != want).nonzero()
        if len(bad):
            i, j = (int(x) for x in bad[0])
            out.append(f"{name}: {len(bad)} of {want.numel()} outputs differ, the first at ({i}, {j}): "
                       f"hardware {want[i, j].item()!r}, emulated {got[i, j].item()!r}")
    return out
