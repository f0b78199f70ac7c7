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
error is significant (p < 1e-3); else pass.
"""
from __future__ import annotations

from trainprobes.distributed.compare import bitwise_agreement, error_vs_reference, mismatch_report
from trainprobes.distributed.inputs import DTYPES, make_input, torch_dtype, wire_input
from trainprobes.distributed.launcher import launch
from trainprobes.distributed.worker import Case, cases_task
from trainprobes.result import Result

PROBE = "distributed.collective"
BIAS_P = 1e-3  # significance for TP-B1: one run of >= thousands of elements; rare by chance


def _inputs(case: Case, world: int) -> list:
    """Every rank's wire-cast input: what the emulator replays."""
    try:
        torch_dtype(case.dtype)
    except ValueError:  # a format torch cannot hold (tf32, fp6, ...): emulation only
        from trainprobes.reference.formats import get_format
        fmt = get_format(case.dtype)
        return [fmt.round(make_input(case.data, r, case.numel, case.seed)) for r in range(world)]
    # In the wire dtype itself: trainprobes.reference.collectives then takes the values as they are
    # (no rounding pass, which costs more than the reduction).
    return [wire_input(case.data, r, case.numel, case.seed, case.dtype) for r in range(world)]


def emulate(case: Case, world: int, algorithm: str, reference: bool = False,
            inputs: list | None = None) -> list:
    """Per-rank outputs of `case` under trainprobes.reference.collectives (float64; None: no output).

    algorithm="gloo" also replays gloo's reduce (its own segmenting) and AVG (sum, then
    divide). reference=True: the fp64 reduction of the same wire-cast inputs instead.
    inputs: the case's per-rank inputs if already built (they are rebuilt otherwise).
    """
    from trainprobes.reference import collectives as C
    xs = inputs if inputs is not None else _inputs(case, world)
    dt = "fp64" if reference else case.dtype
    if case.collective == "all_gather":
        return C.all_gather(xs, dtype=dt)
    kw = dict(op=case.op, dtype=dt)
    if reference:
        algorithm = "ring"
        if case.op == "avg":
            kw["avg"] = "divide"
    if case.collective == "reduce":
        return C.reduce(xs, root=case.root, algorithm=algorithm, **kw)
    if case.collective == "reduce_scatter":
        return C.reduce_scatter(xs, algorithm=algorithm, **kw)
    return C.all_reduce(xs, algorithm=algorithm, **kw)


def _scales(case: Case, xs: list, world: int) -> list | None:
    """Per-rank magnitude before cancellation, to measure errors in ulps of (see
    compare.error_vs_reference): max over ranks of |input|, / world for avg."""
    import torch
    if case.collective == "all_gather":
        return None  # no arithmetic: |ref| is the scale
    m = torch.stack([x.reshape(-1).to(torch.float32).to(torch.float64).abs() for x in xs]).amax(0)
    if case.op == "avg":
        m = m / world
    if case.collective == "reduce_scatter":
        return list(m.chunk(world))
    return [m] * world


def _target(case: Case, backend: str, world: int, algorithm: str) -> str:
    return (f"{case.collective}[{case.dtype},{case.op},{backend},alg={algorithm},w={world},"
            f"n={case.numel},{case.data},seed={case.seed}]")


def _ref_rows(reference: list, outputs: list):
    """Reference rows for the ranks that have outputs, matching bitwise_agreement's rows."""
    import torch
    return torch.stack([reference[r].reshape(-1) for r, t in enumerate(outputs)
                        if t is not None])


def result_from_outputs(case: Case, outputs: list, *, backend: str, world: int,
                        algorithm: str | None = None) -> Result:
    """Result for real per-rank outputs of `case` (backend "gloo" or "nccl")."""
    algorithm = algorithm or ("gloo" if backend == "gloo" else "ring")
    xs = _inputs(case, world)
    predicted = emulate(case, world, algorithm, inputs=xs)
    reference = emulate(case, world, "ring", reference=True, inputs=xs)
    agree = bitwise_agreement(outputs, predicted, case.dtype)
    scales = _scales(case, xs, world)
    err = error_vs_reference([t for t in outputs if t is not None],
                             _ref_rows(reference, outputs), case.dtype,
                             scale=None if scales is None else _ref_rows(scales, outputs))
    metrics = {"bitwise_match_fraction": agree["bitwise_match_fraction"],
               "mismatched": agree["mismatched"], "compared": agree["compared"],
               **{k: err[k] for k in ("max_ulp_error", "mean_ulp_error", "bias", "bias_z",
                                      "bias_p", "bias_relative", "nonfinite")},
               "world": world, "numel": case.numel, "dtype": case.dtype, "op": case.op,
               "collective": case.collective, "backend": backend, "algorithm": algorithm}
    verdict, codes = "pass", []
    head = (f"{backend} {case.collective} {case.dtype} {case.op}, {world} ranks, "
            f"{case.numel} elements ({case.data})")
    frac = agree["bitwise_match_fraction"]
    if frac < 1.0:
        verdict, codes = "fail", ["TP-B4"]
        pred = (f"emulator (algorithm={algorithm!r}) misses {agree['mismatched']} of "
                f"{agree['compared']} elements ({100 * (1 - frac):.3g}%)")
    else:
        pred = f"emulator (algorithm={algorithm!r}) predicts every bit on every rank"
    if err["bias_p"] == err["bias_p"] and err["bias_p"] < BIAS_P:
        verdict = "warn" if verdict == "pass" else verdict
        codes.append("TP-B1")
    msg = (f"{head}: {pred}; vs fp64: max {err['max_ulp_error']:.3g} ulp, bias "
           f"{err['bias']:+.3g} ulp (p={err['bias_p']:.2g})")
    evidence = {"case": case.__dict__, "agreement": agree, "mismatch_report": mismatch_report(agree),
                "error": err, "reference": "fp64 reduction of the same wire-cast inputs"}
    return Result(probe=PROBE, target=_target(case, backend, world, algorithm), verdict=verdict,
                  metrics=metrics, evidence=evidence, seed=case.seed, codes=codes, message=msg)


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
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} must be an int >= 1")
    case = Case(collective, dtype, op, numel, data, seed, root).check(world, "emulated")
    xs = _inputs(case, world)
    out = emulate(case, world, algorithm, inputs=xs)
    reference = emulate(case, world, "ring", reference=True, inputs=xs)
    # Ranks holding identical bits share one tensor: compare each distinct output once.
    ranks = [r for r, t in enumerate(out) if t is not None]
    distinct = sorted({id(out[r]): r for r in ranks}.values())
    held = [out[r] if r in distinct else None for r in range(world)]
    scales = _scales(case, xs, world)
    err = error_vs_reference([out[r] for r in distinct], _ref_rows(reference, held), dtype,
                             scale=None if scales is None else _ref_rows(scales, held))
    metrics = {**{k: err[k] for k in ("max_ulp_error", "mean_ulp_error", "bias", "bias_z",
                                      "bias_p", "bias_relative", "nonfinite")},
               "world": world, "numel": numel, "dtype": dtype, "op": op,
               "collective": collective, "backend": "emulated", "algorithm": algorithm}
    verdict, codes = "pass", []
    if err["bias_p"] == err["bias_p"] and err["bias_p"] < BIAS_P:
        verdict, codes = "warn", ["TP-B1"]
    msg = (f"emulated {collective} {dtype} {op} (algorithm={algorithm!r}), {world} ranks, "
           f"{numel} elements ({data}): vs fp64: max {err['max_ulp_error']:.3g} ulp, bias "
           f"{err['bias']:+.3g} ulp (p={err['bias_p']:.2g}); bitwise match: not applicable "
           f"(no real backend ran)" + (f"; {note}" if note else ""))
    evidence = {"case": case.__dict__, "error": err, "note": note,
                "reference": "fp64 reduction of the same wire-cast inputs"}
    return Result(probe=PROBE, target=_target(case, "emulated", world, algorithm),
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
