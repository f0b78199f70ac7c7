"""The transforms.equivalence probe: does a parallel transform compute the single-device step?

    probe(step, transform, world=2, trials=16, seed=0, ...)  -> Result
    run_probes([Probe(...), ...], world=2, backend="gloo")   -> [Result], one set of ranks

1. Before any rank starts (prepare): the step is checked (trainprobes.transforms.step:
   deterministic model and batch factories, a scalar loss), the transform checks its
   options against the model and the batch (divisibility, a pipeline split that covers
   the model, a plan naming real modules), everything the ranks need must pickle, and the
   fp64 truth of every trial is computed here.
2. The ranks (trainprobes.distributed.launcher: reaped on crash, hang or silent death) run
   the transform's steps on the trials' batches (trainprobes.transforms.worker) and hand
   rank 0's gathered tensors back.
3. trainprobes.transforms.judge compares every parameter's gradient and the loss with the
   truth: exact / noise / biased / inconsistent / wrong, the metric `equivalent`, the scale
   with its CI, the worst parameter, and what a pass rules out.
"""
from __future__ import annotations

import contextlib
import math
import pickle
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from trainprobes.errors import InvalidArgument, InvalidType, TargetError, TrainprobesError
from trainprobes.result import Result
from trainprobes.transforms.base import Transform
from trainprobes.transforms.judge import (
    LOSS,
    Judgement,
    Observed,
    Statistics,
    declaration_hint,
    default_noise_tol,
    judge_statistics,
    lowest_precision,
    rounded,
    statistics,
    undeclared_format,
)
from trainprobes.transforms.step import (
    TrainingStep,
    Truth,
    check_step,
    check_truth,
    references,
    single_device,
)
from trainprobes.transforms.tolerances import compare_tolerances
from trainprobes.transforms.worker import DTYPES, RankCase, resolve_step
from trainprobes.validation import check_choice, check_int, check_number

PROBE = "transforms.equivalence"
CODES = {"biased": "TP-T1", "inconsistent": "TP-T2", "wrong": "TP-T3"}

__all__ = ["Probe", "probe", "run_probes", "prepare", "finish", "PROBE"]


@dataclass(frozen=True)
class Probe:
    """One probe: a step, a transform and how to judge it.

    step: a TrainingStep, or "pkg.mod:attr" naming one (or a factory of one).
    trials: seeded batches (each trial's seed is drawn from `seed` and recorded).
    alpha: false-positive rate of the whole verdict (Bonferroni over its tests).
    min_effect: smallest relative scale error / signed bias called biased.
    noise_tol: largest per-trial relative error called rounding noise (None: by dtype).
    replica_tol: largest relative disagreement between replicas (0: bit for bit).
    target: the Result's target (None: "<step>[<transform>]").
    expected: for a control, the Result verdict it is known to get ("pass" / "fail").
    tolerances: also record what a 5% loss tolerance, rtol 1e-5 on gradients and a
        bitwise loss comparison against the single-device step in its own dtype say.
    """

    step: object
    transform: Transform
    trials: int = 16
    seed: int = 0
    alpha: float = 0.01
    min_effect: float = 1e-6
    noise_tol: float | None = None
    replica_tol: float = 0.0
    target: str | None = None
    expected: str | None = None
    tolerances: bool = False

    def __post_init__(self):
        if not isinstance(self.transform, Transform):
            raise InvalidType(f"transform={self.transform!r} must be a trainprobes.transforms "
                              f"transform (DDP(), FSDP2(), TensorParallel(plan), Pipeline(), "
                              f"Accumulation(), Custom(fn))")
        check_int(self.trials, "trials", min=4, hint="seeded batches; 16 or more for a useful test")
        check_int(self.seed, "seed", min=0)
        check_number(self.alpha, "alpha", min=0, max=1, min_open=True, max_open=True, hint="e.g. 0.01")
        check_number(self.min_effect, "min_effect", min=0, hint="e.g. 1e-6")
        if self.noise_tol is not None:
            check_number(self.noise_tol, "noise_tol", min=0, min_open=True, hint="e.g. 1e-4")
        check_number(self.replica_tol, "replica_tol", min=0)
        if self.expected is not None:
            check_choice(self.expected, "expected", ("pass", "fail"))


class Prepared(NamedTuple):
    probe: Probe
    step: TrainingStep
    seeds: list
    dtype: str
    truth: Truth | None    # the fp64 single-device step
    base: Truth | None     # the single-device step in the model's own dtype


def format_name(dtype: torch.dtype) -> str:
    """The format name of a floating dtype (bf16, fp8_e4m3fn, ...; one resolver for every
    face), its torch name where trainprobes does not model it (ranked least precise)."""
    from trainprobes.reference.formats import get_format
    try:
        return get_format(dtype).name
    except InvalidArgument:
        return str(dtype)


def _seeds(seed: int, trials: int) -> list:
    return torch.randint(0, 2**62, (trials,), generator=torch.Generator().manual_seed(int(seed))).tolist()


def prepare(p: Probe, world: int, *, truth: bool = True, device: str = "cpu") -> Prepared:
    """Step 1 of the module docstring (raises InvalidArgument / InvalidType / TargetError)."""
    step = resolve_step(p.step)
    seeds = _seeds(p.seed, p.trials)
    with _step_code(step):
        batch = check_step(step, seeds[0])
        model = step.model()
    p.transform.check(step, world, batch, model)
    own = {format_name(q.dtype) for q in model.parameters() if q.is_floating_point()}
    dtype = lowest_precision(tuple(own) + tuple(p.transform.dtypes()))
    for what, obj in (("step", p.step), ("transform", p.transform)):
        try:
            pickle.dumps(obj)
        except Exception as e:  # noqa: BLE001 - any pickling failure means the ranks cannot get it
            raise InvalidArgument(
                f"{what}={obj!r} cannot be sent to the ranks ({type(e).__name__}: {e}): use "
                f"module-level functions (or functools.partial of them), not lambdas or local "
                f"functions, for the model, batch, loss and custom step") from None
    with _step_code(step):
        ref, base = references(step, seeds, p.transform, device) if truth else (None, None)
        if ref is not None:
            check_truth(ref, step)
        else:
            check_truth_early(step, seeds, p.transform)
    return Prepared(p, step, seeds, dtype, ref, base)


@contextlib.contextmanager
def _step_code(step: TrainingStep):
    """The step's own model, batch, forward and loss raising on the single device: bad usage
    (exit 2), as when they raise on a rank (WorkerFailed), not an internal error."""
    try:
        yield
    except TrainprobesError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code, any error
        raise InvalidArgument(f"the step {step.name!r} raised on the single device before any rank "
                              f"started ({type(e).__name__}: {e}); the probe judges a step that "
                              f"runs: fix its model, batch, forward or loss") from e


def check_truth_early(step: TrainingStep, seeds: list, transform: Transform) -> None:
    """check_truth's refusals before any rank starts, without holding every trial's truth:
    trials one at a time until three have a non-zero gradient (the ranks check all)."""
    nonzero, zero = 0, 0
    w = transform.weight_dtype()
    for i in range(len(seeds)):
        ref = single_device(step, seeds[i:i + 1], param_dtype=w) if step.data is None else None
        if ref is None:  # a data iterable is read from its start: one pass over what is needed
            ref = single_device(step, seeds, param_dtype=w)
            check_truth(ref, step)
            return
        bad = [n for n, g in ref.grads.items() if not torch.isfinite(g).all()]
        if bad or not torch.isfinite(ref.loss).all():
            check_truth(ref, step)
        if any(bool((g != 0).any()) for g in ref.grads.values()):
            nonzero += 1
            if nonzero >= 3:
                return
        else:
            zero += 1
    raise InvalidArgument(f"the fp64 gradient of {step.name!r} is exactly zero on {zero} of "
                          f"{len(seeds)} trials: nothing to compare (does the loss depend on "
                          f"the parameters through the batch?)")


def base_device(backend: str) -> str:
    """Where the single-device base runs: the device the transform's ranks compute on."""
    return "cuda" if backend == "nccl" else "cpu"


def observed(out: dict, step: TrainingStep) -> Observed:
    """Rank 0's gathered tensors (trainprobes.transforms.worker.gather) by parameter and rank."""
    layout = [(n, tuple(q.shape)) for n, q in step.model().named_parameters() if q.requires_grad]
    mask, codes = out["mask"], out["codes"]
    grads, dtypes = {n: {} for n, _ in layout}, {}
    for r, flat in enumerate(out["flat"]):
        at = 0
        for i, (n, shape) in enumerate(layout):
            if not mask[r, i]:
                continue
            k = math.prod(shape)
            grads[n][r] = flat[:, at:at + k]
            at += k
            if n not in dtypes and codes[r, i] >= 0:
                dtypes[n] = DTYPES[int(codes[r, i])]
    losses = {r: out["loss"][r] for r in range(out["loss"].shape[0]) if out["has_loss"][r]}
    loss_codes = [int(c) for c in out["codes"][:, len(layout)] if c >= 0]
    dtypes[LOSS] = DTYPES[loss_codes[0]] if loss_codes else torch.float32
    return Observed(grads, dtypes, losses)


def finish(prep: Prepared, out: dict, *, world: int, backend: str) -> Result:
    """Step 3 of the module docstring: the Result of one probe, from gradients gathered to
    rank 0 (trainprobes.transforms.worker) or statistics summed on the ranks
    (trainprobes.transforms.local)."""
    p, t = prep.probe, prep.probe.transform
    noise_tol = p.noise_tol if p.noise_tol is not None else default_noise_tol(prep.dtype)
    if "G" in out:
        st, tolerances = local_statistics(out, prep)
    else:
        truth, base = (prep.truth, prep.base) if prep.truth is not None else references(
            prep.step, prep.seeds, t, base_device(backend))
        obs = observed(out, prep.step)
        st = statistics(truth, obs, base, p.replica_tol)
        tolerances = compare_tolerances(base, obs) if p.tolerances else None
    j: Judgement = judge_statistics(st, alpha=p.alpha, min_effect=p.min_effect, noise_tol=noise_tol,
                                    replica_tol=p.replica_tol)
    target = p.target or f"{prep.step.name}[{t.label},w={world}]"
    metrics = {**j.metrics, "transform": t.name, "world": world, "dtype": prep.dtype,
               "backend": backend}
    evidence = {**j.evidence, "transform": t.label, "transform_options": t.options,
                "step": prep.step.name, "trial_seeds": prep.seeds,
                "rank_step_seconds": out["seconds"].tolist(),
                **({"rank_case_seconds": out["case_seconds"].tolist(),
                    "rank_case_cpu_seconds": out["case_cpu_seconds"].tolist()} if "case_seconds" in out else {}),
                "statistics": "summed on the ranks" if "G" in out else "gathered to rank 0"}
    if p.tolerances:
        evidence["tolerances"] = tolerances
    message = j.message
    if not j.equivalent and j.kind != "inconsistent" and hasattr(t, "precisions"):
        # a user's step declares its formats itself: a correct bf16 step left undeclared is
        # judged as fp32, and fails; say which format explains the error (it still fails)
        found = undeclared_format(j.evidence["per_trial"]["added_error"], prep.dtype, t.dtypes())
        if found is not None and not _not_rounding(j, found):
            evidence["undeclared_format"] = found
            message += declaration_hint(found)
        narrow = undeclared_returned(out["codes"], prep.dtype, t.dtypes())
        if narrow:
            evidence["undeclared_returned_formats"] = narrow
            message += (f" The step returned values in {', '.join(narrow)}, narrower than the "
                        f"{prep.dtype} it is judged in: if that is its contract, declare it, "
                        f"precisions=(\"{narrow[0]}\",) (--precisions {narrow[0]}); until then the "
                        f"verdict stands.")
    return Result(probe=PROBE, target=target, verdict="pass" if j.equivalent else "fail",
                  metrics=metrics, evidence=evidence, seed=p.seed,
                  codes=[CODES[j.kind]] if j.kind in CODES else [], message=message,
                  expected=p.expected)


def undeclared_returned(codes: torch.Tensor, dtype: str, declared) -> list:
    """The floating formats of the gradients and losses the ranks returned (codes: indices
    into DTYPES, -1 another) that are narrower than `dtype` and not declared."""
    found = {format_name(DTYPES[c]) for c in codes.reshape(-1).tolist()
             if c >= 0 and DTYPES[c].is_floating_point}
    return sorted(f for f in found if f not in declared and f != dtype
                  and lowest_precision((dtype, f)) == f)


def local_statistics(out: dict, prep: Prepared) -> tuple:
    """(Statistics, tolerance flags) from the ranks' summed statistics."""
    layout = [(n, tuple(q.shape)) for n, q in prep.step.model().named_parameters() if q.requires_grad]
    names = [n for n, _ in layout]
    held = out["held"]
    losses = {r: out["loss"][r] for r in range(held.shape[0]) if out["has_loss"][r]}
    loss = losses[min(losses)] if losses else None
    codes = [int(c) for c in out["loss_codes"] if c >= 0]
    loss_dtype = DTYPES[codes[0]] if codes else torch.float32
    exact = bool(out["exact"].min() > 0)
    if loss is not None and not torch.equal(loss, rounded(out["truth_loss"], loss_dtype)):
        exact = False
    nonfinite = [n for i, n in enumerate(names) if out["nonfinite"][i] > 0]
    if out["nonfinite"][len(names)] > 0:
        nonfinite.append(LOSS)
    reps = [{"parameter": names[int(i)], "ranks": [int(a), int(b)], "max_difference": d,
             "relative": d / ref} for i, a, b, d, ref in out["replicas"].tolist()]
    ranks = sorted(losses)
    for r in ranks[1:]:
        d = (losses[ranks[0]] - losses[r]).abs().max().item()
        ref = losses[ranks[0]].abs().max().item() or 1.0
        if not d <= prep.probe.replica_tol * ref:
            reps.append({"parameter": LOSS, "ranks": [ranks[0], r], "max_difference": d, "relative": d / ref})
    has_base = out["B"].numel() > 0
    base_loss = out["base_loss"] if has_base else None
    st = Statistics(names, [math.prod(s) for _, s in layout],
                    {n: [r for r in range(held.shape[0]) if held[r, i]] for i, n in enumerate(names)},
                    out["G"], out["B"] if has_base else None, out["added2"] if has_base else None,
                    exact, nonfinite, sorted(reps, key=lambda x: -x["relative"]), loss,
                    out["truth_loss"], base_loss)
    tol = {"grad_rtol_1e-5": bool(out["tol_grad"][0] > 0), "loss_rtol_5pct": None, "loss_bitwise": None}
    if loss is not None and has_base:
        tol["loss_rtol_5pct"] = bool(((loss - base_loss).abs() > 0.05 * base_loss.abs()).any())
        tol["loss_bitwise"] = not torch.equal(loss.to(torch.float32), base_loss.float())
    return st, tol


_RAISED = (InvalidArgument, InvalidType, TargetError)


def _rank_error(e) -> TrainprobesError | None:
    """A rank that refused its inputs (InvalidArgument ...) is a bad input, not a crash."""
    last = e.traceback.strip().splitlines()[-1] if e.traceback.strip() else ""
    for cls in _RAISED:
        prefix = f"{cls.__module__}.{cls.__name__}: "
        if last.startswith(prefix):
            return cls(f"{last[len(prefix):]} (raised on rank {e.rank})")
    return None


def _not_rounding(j, found: dict) -> bool:
    """An error of rounding size that rounding does not explain: a biased verdict whose scale
    leaves a residual under half the added error (one factor, the same in every parameter:
    a normalisation, not a narrow format, whose rounding scatters), or a loss that is off (a
    reduction's format does not touch the loss)."""
    if j.tests.get("loss", {}).get("significant"):
        return True
    return j.kind == "biased" and j.metrics["mean_residual"] < 0.5 * found["median_added_error"]


def run_probes(probes: list, *, world: int = 2, backend: str = "gloo", timeout: float = 600.0,
               port: int | None = None, progress: Callable | None = None, gather: bool = False) -> list:
    """Every probe on one set of `world` ranks; one Result each, in order. The ranks
    compute the fp64 truth of the trials they judge and sum their own statistics
    (trainprobes.transforms.local);
    gather=True sends every rank's gradients to rank 0 instead (memory O(world x
    parameters) there; kept to check that both give one verdict)."""
    from trainprobes.distributed.launcher import WorkerFailed, launch
    from trainprobes.transforms.worker import cases_task
    world = check_int(world, "world", min=1, hint="the number of ranks")
    backend = check_choice(backend, "backend", ("gloo", "nccl"))
    if not probes:
        raise InvalidArgument("probes=[] holds nothing to run")
    prepared = []
    for i, p in enumerate(probes):
        if not isinstance(p, Probe):
            raise InvalidType(f"probes[{i}]={p!r} must be a trainprobes.transforms.Probe")
        if progress:
            progress(f"checking {p.target or p.transform.label}" + ("" if not gather else
                                                                     " and computing its fp64 truth"))
        prepared.append(prepare(p, world, truth=gather, device=base_device(backend)))
    import sys
    cases = [RankCase(pr.probe.step, pr.probe.transform, pr.seeds, tuple(sys.path), not gather,
                      pr.probe.replica_tol) for pr in prepared]
    try:
        outs = launch(cases_task, world, backend=backend, timeout=timeout, args=(cases, backend),
                      port=port, progress=progress)
    except WorkerFailed as e:
        refused = _rank_error(e)
        if refused is not None:
            raise refused from e
        raise
    return [finish(pr, out, world=world, backend=backend) for pr, out in zip(prepared, outs[0]["cases"])]


def probe(step, transform: Transform, *, world: int = 2, backend: str = "gloo", timeout: float = 600.0,
          progress: Callable | None = None, **options) -> Result:
    """One probe (Probe's fields as keyword options) on `world` fresh ranks."""
    return run_probes([Probe(step, transform, **options)], world=world, backend=backend,
                      timeout=timeout, progress=progress)[0]
