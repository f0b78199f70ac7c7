"""The distributed.collective probe: run real collectives, predict them, compare.

    run_collectives(cases, backend="gloo", world=4, timeout=120.0) -> [Result per case]
    run_collective(backend="gloo", world=4, dtype="bf16", op="sum", ...) -> Result
    emulate_collective(world=4096, dtype="bf16", algorithm="ring", ...) -> Result

For each case the Result holds (metrics):
  bitwise_match_fraction  real vs the emulator's prediction (trainprobes.reference.collectives with
                          algorithm="gloo" for gloo, "ring" for nccl), over every rank;
  max_ulp_error, mean_ulp_error, bias, bias_z, bias_p, bias_relative
                          real vs the fp64 reference of the same wire-cast inputs (what the
                          collective's arithmetic adds, not the input cast).
Verdict: fail with TP-B4 when the emulator misses a bit; warn with TP-B1 when the signed
error is significant (p < 1e-3) and not negligible (at least 1e-6 of the values); else pass.
"""
from __future__ import annotations

from trainprobes.distributed.case import Case
from trainprobes.distributed.compare import error_vs_reference
from trainprobes.distributed.inputs import DTYPES
from trainprobes.distributed.launcher import launch
from trainprobes.distributed.predict import (
    PROBE,
    biased,
    case_inputs,
    emulate,
    ref_rows,
    result_from_outputs,
    scales,
    target,
)
from trainprobes.distributed.worker import cases_task
from trainprobes.result import Result
from trainprobes.validation import check_int

__all__ = ["run_collectives", "run_collective", "emulate_collective", "emulate",
           "result_from_outputs", "launch", "cases_task"]


def run_collectives(cases, *, backend: str = "gloo", world: int = 4, timeout: float = 120.0,
                    port: int | None = None, algorithm: str | None = None,
                    progress=None) -> list[Result]:
    """Run every case on one set of `world` real ranks; one Result per case.

    Every case is validated before any process starts. algorithm: the emulator's order
    (default "gloo" for gloo, "ring" for nccl).
    """
    cases = [c.check(world, backend) for c in cases]
    outs = launch(cases_task, world, backend=backend, timeout=timeout, port=port,
                  args=(cases, backend), progress=progress)
    return [result_from_outputs(c, [outs[r][k] for r in range(world)], backend=backend,
                                world=world, algorithm=algorithm) for k, c in enumerate(cases)]


def emulate_collective(*, world: int = 4, collective: str = "all_reduce", dtype: str = "bf16",
                       op: str = "sum", numel: int = 4096, data: str = "normal", seed: int = 0,
                       root: int = 0, algorithm: str = "ring", note: str = "") -> Result:
    """No processes: the emulated result (trainprobes.reference.collectives) against fp64.

    bitwise_match_fraction does not apply (nothing real ran) and is left out of metrics.
    """
    check_int(world, "world", min=1, hint="the number of ranks")
    case = Case(collective, dtype, op, numel, data, seed, root).check(world, "emulated")
    dtype = case.dtype
    xs = case_inputs(case, world)
    out = emulate(case, world, algorithm, inputs=xs)
    reference = emulate(case, world, "ring", reference=True, inputs=xs)
    # Ranks holding identical bits share one tensor: compare each distinct output once.
    ranks = [r for r, t in enumerate(out) if t is not None]
    distinct = sorted({id(out[r]): r for r in ranks}.values())
    held = [out[r] if r in distinct else None for r in range(world)]
    sc = scales(case, xs, world)
    err = error_vs_reference([out[r] for r in distinct], ref_rows(reference, held), dtype,
                             scale=None if sc is None else ref_rows(sc, held))
    metrics = {**{k: err[k] for k in ("max_ulp_error", "mean_ulp_error", "bias", "bias_z",
                                      "bias_p", "bias_relative", "nonfinite")},
               "world": world, "numel": numel, "dtype": dtype, "op": op,
               "collective": collective, "backend": "emulated", "algorithm": algorithm}
    verdict, codes = "pass", []
    flagged, floor_note = biased(err)
    if flagged:
        verdict, codes = "warn", ["TP-B1"]
    msg = (f"emulated {collective} {dtype} {op} (algorithm={algorithm!r}), {world} ranks, "
           f"{numel} elements ({data}): vs fp64: max {err['max_ulp_error']:.3g} ulp, bias "
           f"{err['bias']:+.3g} ulp (p={err['bias_p']:.2g}"
           + (f"; {floor_note})" if floor_note else ")") + "; bitwise match: not applicable "
           "(no real backend ran)" + (f"; {note}" if note else ""))
    evidence = {"case": case.__dict__, "error": err, "note": note,
                "reference": "fp64 reduction of the same wire-cast inputs"}
    return Result(probe=PROBE, target=target(case, "emulated", world, algorithm),
                  verdict=verdict, metrics=metrics, evidence=evidence, seed=seed, codes=codes,
                  message=msg)


def run_collective(*, backend: str = "gloo", world: int = 4, collective: str = "all_reduce",
                   dtype: str = "fp32", op: str = "sum", numel: int = 4096,
                   data: str = "normal", seed: int = 0, root: int = 0, timeout: float = 120.0,
                   port: int | None = None, algorithm: str | None = None,
                   progress=None) -> Result:
    """One case. backend="emulated" runs no process; gloo with an fp8 dtype (gloo cannot
    reduce float8) falls back to emulation, said so in the Result (verdict at least warn)."""
    if backend == "emulated":
        return emulate_collective(world=world, collective=collective, dtype=dtype, op=op,
                                  numel=numel, data=data, seed=seed, root=root,
                                  algorithm=algorithm or "ring")
    dtype = Case(dtype=dtype).dtype  # any spelling: "bfloat16" is bf16
    if backend == "gloo" and dtype not in DTYPES:
        note = (f"gloo has no float8 reduction ('Invalid scalar type'): dtype={dtype!r} "
                f"was emulated only, with NCCL's fp8 arithmetic (ring, fp16 adds, "
                f"saturating cast)")
        r = emulate_collective(world=world, collective=collective, dtype=dtype, op=op,
                               numel=numel, data=data, seed=seed, root=root,
                               algorithm=algorithm or "ring", note=note)
        r.verdict = "warn"
        return r
    case = Case(collective, dtype, op, numel, data, seed, root)
    return run_collectives([case], backend=backend, world=world, timeout=timeout, port=port,
                           algorithm=algorithm, progress=progress)[0]
