"""The audit's gemm family: low-precision GEMM accumulators (trainprobes.numerics.gemm).

Controls (known verdicts, from the mechanism): the accumulator presets on one fixed GEMM of
mostly positive e4m3 operands (32 x 1024 and 32 x 1024, K = 1024, 256 sampled outputs), where
truncation loses the same sign in every product:
  h200-scaled-mm       14-bit significand, truncating, aligned terms: biased (about -4.5e-3)
  h200-scaled-mm-sum   the exact-sum reading of the same numbers: biased (about -6e-4)
  deepseek-v3          the same with fp32 promotion every 128: within a 1e-3 tolerance
  fp32                 round-to-nearest fp32 adds: noise within the default 1e-4
Stack (a finding about this machine): the accumulator of fp8 torch._scaled_mm revealed from
crafted inputs (numerics.reveal), narrower than fp32 a watch-out (TP-B3). Where the reveal
gives the exact width (a GPU's tensor cores: 13 bits on an H200), the same GEMM is judged
with that accumulator (fused width and rounding as revealed, 'terms' alignment as on the
H200 record: fp8's range cannot craft the alignment test); where e4m3's range only bounds
it from below (the CPU kernel: at least 17 bits) no model is built from a bound. The GPU
path is untested where this was written (no GPU): scripts/gpu-check.sh runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainprobes.audit.run import Check

# (rows, K) of each operand, samples, trials: ~0.1-0.5 s per control on one core
ROWS, K, SAMPLES, TRIALS = 32, 1024, 256, 16


@dataclass(frozen=True)
class GemmControl:
    preset: str
    expected: str      # "fail" (biased) or "pass" (noise or exact)
    why: str
    tolerance: float = 1e-4


CONTROLS = (
    GemmControl("h200-scaled-mm", "fail", "every product is truncated toward zero to the running "
                "sum's 14-bit grid: on same-signed data all the lost bits have one sign"),
    GemmControl("h200-scaled-mm-sum", "fail", "the running sum itself is truncated after every "
                "32-term group: always toward zero"),
    GemmControl("deepseek-v3", "pass", "fp32 promotion every 128 restarts the narrow sum before "
                "its grid coarsens: the bias stays within 1e-3", tolerance=1e-3),
    GemmControl("fp32", "pass", "round-to-nearest fp32 adds: no sign preferred"),
)


def operands(seed: int = 0):
    """The fixed GEMM every check judges: mostly positive e4m3 operands (mean 1)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ROWS, K, generator=g) + 1).to(torch.float8_e4m3fn).double() for _ in "ab"]


def _judge(acc, target: str, tolerance: float = 1e-4):
    from trainprobes.numerics.gemm import gemm_bias
    a, b = operands()
    return gemm_bias(a, b, preset=acc, samples=SAMPLES, trials=TRIALS, tolerance=tolerance,
                     promotion=False, target=target)


def _control(c: GemmControl) -> Check:
    def run():
        r = _judge(c.preset, f"gemm[{c.preset},K={K},mean 1]", c.tolerance)
        r.expected = c.expected
        r.evidence["known"] = c.why
        return r
    return Check("gemm", f"accumulator {c.preset} on same-signed e4m3 data (K={K})", run,
                 control=True)


def revealed_accumulator(reveal_result, name: str):
    """An Accumulator from a _scaled_mm reveal that gives the exact width, else None (a
    lower bound is no model: e4m3's range could not craft a smaller term)."""
    from trainprobes.numerics.gemm_reveal import fused_width
    from trainprobes.reference.gemm import Accumulator
    m = reveal_result.metrics
    if m.get("accumulator_bits_lower_bound") or m.get("rounding") not in ("toward_zero", "nearest"):
        return None
    return Accumulator(name, int(m["accumulator_mantissa_bits"]), fused_width(reveal_result, m["n"]),
                       m["rounding"], "terms", None, f"revealed on this machine: {reveal_result.message}")


def _stack(device: str) -> Check:
    def run():
        import torch
        from trainprobes.audit.families import accumulator_finding
        from trainprobes.numerics.reveal import reveal, scaled_mm_reduction
        label = f"torch._scaled_mm[fp8_e4m3fn,{device},out=fp32]"
        r = accumulator_finding(reveal(scaled_mm_reduction(out_dtype=torch.float32), n=32,
                                       dtype="fp8_e4m3fn", device=device, output_dtype="fp32",
                                       target=label))
        acc = revealed_accumulator(r, label)
        if acc is None:
            r.message += ("; a lower bound from e4m3's range, no accumulator model to judge the "
                          "GEMM with (wider than every narrow preset)")
            return r
        return [r, _judge(acc, f"gemm[{label},K={K},mean 1]")]
    return Check("gemm", f"reveal torch._scaled_mm on {device}, then judge with it", run)


def gemm_checks(*, seed: int = 0, quick: bool = False) -> list[Check]:
    """The presets' known verdicts (controls) and this machine's fp8 GEMM accumulator
    (stack: on the GPU where it has fp8 GEMMs, else the CPU kernel)."""
    import torch
    from trainprobes.audit.machine import cuda_missing as _cuda
    device = "cpu"
    if _cuda() is None and torch.cuda.get_device_capability(0) >= (8, 9):
        device = "cuda"
    checks = [_control(c) for c in CONTROLS]
    if hasattr(torch, "_scaled_mm"):
        checks.append(_stack(device))
    return checks
