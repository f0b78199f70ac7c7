"""Predict a case's outputs and judge real ones: the launcher side of distributed.collective.

    emulate(case, world, algorithm) -> per-rank outputs under trainprobes.reference.collectives
    result_from_outputs(case, outputs, backend=, world=) -> Result (real vs emulator, fp64)

Used by trainprobes.distributed.probe (after launching ranks) and by the torchrun entry in
trainprobes.distributed.worker (rank 0 judges what it gathered); it imports neither.
"""
from __future__ import annotations

import hashlib

import torch
from trainprobes.distributed.case import Case
from trainprobes.distributed.compare import bitwise_agreement, error_vs_reference, mismatch_report
from trainprobes.distributed.inputs import DTYPES, make_input, wire_input
from trainprobes.reference import collectives as C
from trainprobes.reference.formats import get_format
from trainprobes.result import Result

PROBE = "distributed.collective"
BIAS_P = 1e-3  # significance for TP-B1: one run of >= thousands of elements; rare by chance
# ...and a size: a signed error below 1e-6 of the values (fp32 gloo on 4 ranks: ~1e-9, which
# thousands of elements make "significant") is one no training run can feel; the same floor
# as the transforms probe's default min_effect
MIN_RELATIVE_BIAS = 1e-6


def biased(err: dict) -> tuple[bool, str]:
    """TP-B1 or not, and a note when the bias is significant but below the floor."""
    p, rel = err["bias_p"], err["bias_relative"]
    if not (p == p and p < BIAS_P):
        return False, ""
    if rel == rel and abs(rel) < MIN_RELATIVE_BIAS:
        return False, f"significant but negligible: relative {rel:+.2g}, below {MIN_RELATIVE_BIAS:g}"
    return True, ""
_FP8 = ("fp8_e4m3fn", "fp8_e5m2")  # torch holds these: the ranks send them cast by torch


def case_inputs(case: Case, world: int) -> list:
    """Every rank's wire-cast input: what the emulator replays."""
    if case.dtype not in DTYPES and case.dtype not in _FP8:
        # a format torch cannot hold (tf32, fp6, ...): emulation only, rounded once
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
    xs = inputs if inputs is not None else case_inputs(case, world)
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


def scales(case: Case, xs: list, world: int) -> list | None:
    """Per-rank magnitude before cancellation, to measure errors in ulps of (see
    compare.error_vs_reference): max over ranks of |input|, / world for avg."""
    if case.collective == "all_gather":
        return None  # no arithmetic: |ref| is the scale
    m = torch.stack([x.reshape(-1).to(torch.float32).to(torch.float64).abs() for x in xs]).amax(0)
    if case.op == "avg":
        m = m / world
    if case.collective == "reduce_scatter":
        return list(m.chunk(world))
    return [m] * world


def target(case: Case, backend: str, world: int, algorithm: str) -> str:
    return (f"{case.collective}[{case.dtype},{case.op},{backend},alg={algorithm},w={world},"
            f"n={case.numel},{case.data},seed={case.seed}]")


def ref_rows(reference: list, outputs: list):
    """Reference rows for the ranks that have outputs, matching bitwise_agreement's rows."""
    return torch.stack([reference[r].reshape(-1) for r, t in enumerate(outputs)
                        if t is not None])


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


def distinct(outputs: list, reference: list) -> list:
    """outputs with None for every rank whose output and reference equal an earlier rank's.
    Ranks are matched by a digest of their bytes (then confirmed with torch.equal), so a
    world of distinct outputs (reduce_scatter at thousands of ranks) costs one pass, not W^2."""
    first, out = {}, []
    for r, t in enumerate(outputs):
        if t is None:
            out.append(None)
            continue
        k = first.setdefault((_digest(t), _digest(reference[r])), r)
        same = k != r and torch.equal(t, outputs[k]) and torch.equal(reference[r], reference[k])
        out.append(None if same else t)
    return out


def result_from_outputs(case: Case, outputs: list, *, backend: str, world: int,
                        algorithm: str | None = None) -> Result:
    """Result for real per-rank outputs of `case` (backend "gloo" or "nccl")."""
    algorithm = algorithm or ("gloo" if backend == "gloo" else "ring")
    xs = case_inputs(case, world)
    predicted = emulate(case, world, algorithm, inputs=xs)
    reference = emulate(case, world, "ring", reference=True, inputs=xs)
    agree = bitwise_agreement(outputs, predicted, case.dtype)
    sc = scales(case, xs, world)
    # ranks holding the same bits for the same truth (all_reduce) are one sample, not
    # `world`: counted per rank, 4 identical copies made a 0.016-ulp fp32 bias p=3e-6
    held = distinct(outputs, reference)
    err = error_vs_reference([t for t in held if t is not None],
                             ref_rows(reference, held), case.dtype,
                             scale=None if sc is None else ref_rows(sc, held))
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
    flagged, note = biased(err)
    if flagged:
        verdict = "warn" if verdict == "pass" else verdict
        codes.append("TP-B1")
    msg = (f"{head}: {pred}; vs fp64: max {err['max_ulp_error']:.3g} ulp, bias "
           f"{err['bias']:+.3g} ulp (p={err['bias_p']:.2g}" + (f"; {note})" if note else ")"))
    evidence = {"case": case.__dict__, "agreement": agree, "mismatch_report": mismatch_report(agree),
                "error": err, "reference": "fp64 reduction of the same wire-cast inputs"}
    return Result(probe=PROBE, target=target(case, backend, world, algorithm), verdict=verdict,
                  metrics=metrics, evidence=evidence, seed=case.seed, codes=codes, message=msg)
