"""No gather: the ranks compare the gradients they hold with the fp64 truth they compute
themselves; only the statistics the verdict needs travel.

Per case, each rank:
  1. runs the transform's steps (trainprobes.transforms.rank_case.run_trials checks what
     they return); after trial 0 the ranks agree which parameters each returned (a [world,
     P] mask): the lowest rank that returned a parameter owns it (its bits are the
     replicas' reference), and its holders take turns to judge it, trial t by holder
     t mod holders (`judges`);
  2. computes the fp64 truth and the single-device base of the trials it judges something
     in, and nothing else: where every rank holds every parameter (data parallelism,
     gathered shards) the truth's trials are spread over the ranks, once each, in parallel;
     a pipeline stage's rank judges its parameters on every trial (memory O(parameters x
     trials) at most per rank, whatever the world). They run on a thread beside the
     remaining steps (started after trial 0; on a GPU only the CPU truth does), so the
     time a rank waits in the steps' collectives pays for them;
  3. per trial, fingerprints what it returned and checks it for inf/NaN, one flat tensor per
     dtype (trainprobes.transforms.holdings), and keeps it; once the truth is in, sums, per
     trial and parameter it judges, the judge's statistics over its elements
     (trainprobes.transforms.judge.sums: <g, r>, |r|^2, |g|^2, |g - r|^2, signed error,
     |r|, the same against the base, |g - b|^2) and whether every value equals the truth
     rounded; per held parameter whether one is not finite, and a bit fingerprint; per
     trial the truth's and the base's loss (the judge of the first parameter);
  4. all-reduces those: SUM of the sums and losses, MIN/MAX of the flags, an all_gather of
     the fingerprints and losses ([world, T, P] integers, [world, T]); replicas whose
     fingerprints differ are measured by an element-wise MAX/MIN over their holders (the
     only O(parameters) traffic, and only when replicas disagree; the verdict is then
     inconsistent, and the statistics mix the replicas trial by trial).
Rank 0 returns the joined statistics (trainprobes.transforms.judge.Statistics as tensors).
Traffic per trial O(parameters' count), not O(world x elements) into one process.
"""
from __future__ import annotations

import math
import time

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.transforms.base import RankContext
from trainprobes.transforms.holdings import Flat, fingerprint, fingerprints, flatten, not_finite
from trainprobes.transforms.judge import rounded, sums, truth_terms
from trainprobes.transforms.rank_case import DTYPES, RankCase, _import_like_caller, resolve_step, run_trials
from trainprobes.transforms.step import run_single_device, single_device_inputs

__all__ = ["run_case_local", "fingerprint"]


def run_case_local(case: RankCase, ctx: RankContext, replica_tol: float) -> dict | None:
    """Steps 1-4 of the module docstring; rank 0 returns the statistics as tensors."""
    import torch.distributed as dist
    _import_like_caller(case.sys_path)
    step = resolve_step(case.step)
    t = case.transform
    seeds = case.seeds
    T = len(seeds)
    layout = [(n, tuple(p.shape)) for n, p in step.model().named_parameters() if p.requires_grad]
    names = {n: i for i, (n, _) in enumerate(layout)}
    shapes = dict(layout)
    P = len(layout)
    mine, job = [], None
    base_ok = True
    truth_loss = torch.zeros(T, dtype=torch.float64)
    base_loss = torch.zeros(T, dtype=torch.float64)
    refused = torch.zeros(2, dtype=torch.float64)          # [truth not finite, trials whose truth is 0]
    G = torch.zeros(6, T, P, dtype=torch.float64)
    B = torch.zeros(6, T, P, dtype=torch.float64)
    added2 = torch.zeros(T, P, dtype=torch.float64)
    exact = torch.ones(P, dtype=torch.float64)
    nonfinite = torch.zeros(P + 1, dtype=torch.float64)
    prints = torch.zeros(T, P, dtype=torch.int64)
    nones = torch.zeros(T, P, dtype=torch.int64)            # held, gradient left None (read as 0)
    tol_grad = torch.zeros(1, dtype=torch.float64)
    losses, has_loss, loss_code, codes, seconds = [], None, -1, None, 0.0
    held, owner, kept = None, None, []
    state = t.setup(step, ctx)
    start, cpu = time.perf_counter(), time.process_time()
    for tr in run_trials(step, t, state, seeds, names, shapes, ctx, missing_held=True):
        trial, out, grads = tr.index, tr.out, tr.grads
        seconds += tr.seconds
        if trial == 0:
            none0 = torch.tensor([n in out.missing for n in names], dtype=torch.bool)
            masks = [torch.zeros(2 * P, dtype=torch.float32, device=ctx.device) for _ in range(ctx.world)]
            dist.all_gather(masks, torch.cat([tr.returned, none0]).float().to(ctx.device))
            masks = torch.stack([m.cpu() for m in masks]).bool()
            # the ranks that returned a parameter's gradient on trial 0 hold it; where none
            # did, those that hold it without one (an expert no token reached; a forgotten
            # gradient: judged as zero, refused below where the truth is not zero)
            real, none0 = masks[:, :P], masks[:, P:]
            held = torch.where(real.any(0)[None], real, none0)           # [world, P]
            owner = held.float().argmax(0)                                # lowest holder
            judge = judges(held, T)                                       # [T, P]
            mine = [k for k in range(T) if bool((judge[k] == ctx.rank).any())]
            if mine:  # the truth runs beside the steps (module docstring, step 2)
                job = _references_beside(step, seeds, t, ctx, mine)
            codes = None
        mine_held = held[ctx.rank]
        strays = [n for n in grads if not mine_held[names[n]]]
        if strays:  # a rank that left it None on trial 0 while another held it, not a holder
            raise InvalidArgument(f"the step ({t.label}) returned a gradient for {strays[:4]} on rank "
                                  f"{ctx.rank} on trial {trial} but not on trial 0, where rank(s) "
                                  f"{held[:, names[strays[0]]].nonzero().squeeze(-1).tolist()} "
                                  f"returned one: return it on every trial or never")
        if out.missing:  # judged as zeros; refused below where the truth is not exactly zero
            grads = dict(grads)
            for n, dtype in out.missing.items():
                if n in names and n not in grads and mine_held[names[n]]:
                    grads[n] = torch.zeros(shapes[n], dtype=dtype)
                    nones[trial, names[n]] = 1
        if codes is None:
            codes = torch.tensor([DTYPES.index(grads[n].dtype) if n in grads and grads[n].dtype in DTYPES
                                  else -1 for n in names])
            has_loss = out.loss is not None
        flats = flatten(grads, names)  # fresh copies: a buffer the next step reuses is kept as it was
        kept.append(flats)
        for f in flats:
            prints[trial, f.index] = fingerprints(f)
            nonfinite[f.index] = torch.maximum(nonfinite[f.index], not_finite(f).double())
        value = math.nan if out.loss is None else float(out.loss.detach().double().item())
        if out.loss is not None and not math.isfinite(value):
            nonfinite[P] = 1.0
        losses.append(value)
        if out.loss is not None and out.loss.dtype in DTYPES:
            loss_code = DTYPES.index(out.loss.dtype)
    t.teardown(state)
    if mine:
        truth, base = job.result()
        r = {n: dict(zip(mine, truth.grads[n].reshape(len(mine), -1))) for n in names}
        bg = {n: dict(zip(mine, base.grads[n].reshape(len(mine), -1).double())) for n in names}
        base_ok = all(bool(torch.isfinite(v).all()) for v in base.grads.values()) and \
            bool(torch.isfinite(base.loss).all())
        # a trial several ranks compute (a stage each holds part of the model) counts once:
        # where its loss is reported from
        refused += truth_refusals(truth, torch.tensor([int(judge[k, 0]) == ctx.rank for k in mine]))
        for k, tl, bl in zip(mine, truth.loss.tolist(), base.loss.tolist()):
            if int(judge[k, 0]) == ctx.rank:  # one rank reports each trial's loss truth
                truth_loss[k], base_loss[k] = tl, bl
        for k in mine:
            for f in kept[k]:
                js = [j for j, i in enumerate(f.index) if int(judge[k, i]) == ctx.rank]
                if js:
                    _judge_trial(f, js, k, r, bg if base_ok else None, G, B, added2, exact, tol_grad)

    # three collectives: the sums (SUM), the flags (MAX; a MIN as the MAX of 1 - flag), and
    # every rank's metadata and fingerprints (all_gather, the floats carried as their bits)
    summed = torch.cat([refused, G.reshape(-1), B.reshape(-1), added2.reshape(-1), tol_grad,
                        truth_loss, base_loss]).to(ctx.device)
    dist.all_reduce(summed)
    summed = summed.cpu()
    refused = summed[:2]
    check_truth_sums(refused, T, step)  # every rank refuses alike
    G, B, added2, tol_grad, truth_loss, base_loss = summed[2:].split([6 * T * P, 6 * T * P, T * P, 1, T, T])
    G, B, added2 = G.reshape(6, T, P), B.reshape(6, T, P), added2.reshape(T, P)
    flags = torch.cat([nonfinite, torch.tensor([float(not base_ok)], dtype=torch.float64), 1 - exact])
    flags = flags.to(ctx.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    flags = flags.cpu()
    nonfinite, base_ok, exact = flags[:P + 1], bool(flags[P + 1] == 0), 1 - flags[P + 2:]
    case_seconds = time.perf_counter() - start  # steps, truth, statistics: this rank's whole case
    case_cpu = time.process_time() - cpu        # the same, in CPU seconds of all its threads
    meta = torch.cat([torch.tensor([float(has_loss), seconds, float(loss_code)], dtype=torch.float64),
                      torch.tensor(losses, dtype=torch.float64), codes.double(),
                      torch.tensor([case_cpu, case_seconds], dtype=torch.float64)])
    packed = torch.cat([meta.view(torch.int64), prints.reshape(-1), nones.reshape(-1)]).to(ctx.device)
    every = [torch.empty_like(packed) for _ in range(ctx.world)]
    dist.all_gather(every, packed)
    every = torch.stack([e.cpu() for e in every])
    metas = every[:, :meta.numel()].contiguous().view(torch.float64)
    everyone = every[:, meta.numel():meta.numel() + T * P].reshape(ctx.world, T, P)  # [world, T, P]
    check_missing(every[:, meta.numel() + T * P:].reshape(ctx.world, T, P).bool(), G[5] != 0, held,
                  list(names), t.label)
    # the owner alone compares with the truth: its exactness holds for every holder only
    # where all holders' bits agree (a replica within replica_tol is not exact)
    same = (everyone == everyone[owner, :, torch.arange(P)].T[None]) | ~held[:, None, :]
    exact = exact * same.all(0).all(0).double()
    replicas = _replicas(everyone, held, owner, kept, names, ctx, replica_tol)
    if ctx.rank != 0:
        return None
    return {"G": G, "B": B if base_ok else torch.zeros(0), "added2": added2, "exact": exact,
            "nonfinite": nonfinite, "held": held, "has_loss": metas[:, 0].bool(),
            "seconds": metas[:, 1], "loss_codes": metas[:, 2].long(), "loss": metas[:, 3:3 + T],
            "codes": metas[:, 3 + T:-2].long(), "case_cpu_seconds": metas[:, -2],
            "case_seconds": metas[:, -1], "replicas": replicas,
            "tol_grad": tol_grad,
            "truth_loss": truth_loss, "base_loss": base_loss if base_ok else torch.zeros(0)}


def judges(held: torch.Tensor, T: int) -> torch.Tensor:
    """[T, P]: the rank that compares parameter p with the truth on trial t: its holders in
    turn (holders[t % len]), so a parameter every rank holds (data parallelism, gathered
    shards) spreads the truth's trials over the ranks, and one held by a single rank (a
    pipeline stage) is judged there on every trial."""
    out = torch.empty(T, held.shape[1], dtype=torch.long)
    for i in range(held.shape[1]):
        holders = held[:, i].nonzero().squeeze(-1)
        out[:, i] = holders[torch.arange(T) % len(holders)]
    return out


def truth_refusals(truth, counted: torch.Tensor) -> torch.Tensor:
    """[not finite (0/1), trials whose fp64 gradient is 0] of this rank's trials of the truth,
    the zeros among those `counted` ([len(trials)] bool) alone."""
    bad = any(not bool(torch.isfinite(g).all()) for g in truth.grads.values()) or \
        not bool(torch.isfinite(truth.loss).all())
    norms = torch.stack([g.reshape(g.shape[0], -1).pow(2).sum(1) for g in truth.grads.values()]).sum(0)
    return torch.tensor([float(bad), float(((norms == 0) & counted).sum())], dtype=torch.float64)


def check_truth_sums(refused: torch.Tensor, T: int, step) -> None:
    """trainprobes.transforms.step.check_truth's refusals, from the ranks' summed refusals."""
    from trainprobes.errors import InvalidArgument
    if refused[0] > 0:
        raise InvalidArgument(f"the fp64 single-device step of {step.name!r} is not finite: the truth "
                              f"itself overflows or meets NaN")
    zero = int(refused[1])
    if zero > T - 3:
        raise InvalidArgument(f"the fp64 gradient of {step.name!r} is exactly zero on {zero} of {T} "
                              f"trials: nothing to compare (does the loss depend on the parameters "
                              f"through the batch?)")


def _replicas(prints, held, owner, kept, names, ctx, replica_tol) -> torch.Tensor:
    """[K, 5] rows (parameter index, owner, other rank, max difference, owner's largest
    magnitude) of replicas that differ from the owner beyond replica_tol; the owner's values
    are broadcast only for parameters whose fingerprints differ."""
    import torch.distributed as dist
    rows = []
    for n, i in names.items():
        holders = [r for r in range(held.shape[0]) if held[r, i]]
        o = int(owner[i])
        if all(torch.equal(prints[r, :, i], prints[o, :, i]) for r in holders):
            continue
        mine = _kept(kept, n)
        size = torch.tensor([mine[0].numel() if mine else 0], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
        theirs = torch.stack(mine).double().to(ctx.device) if ctx.rank == o else \
            torch.empty(prints.shape[1], int(size.item()), dtype=torch.float64, device=ctx.device)
        dist.broadcast(theirs, o)
        d = torch.tensor([(torch.stack(mine).double().to(ctx.device) - theirs).abs().max().item()
                          if mine else 0.0], dtype=torch.float64, device=ctx.device)
        every = [torch.empty_like(d) for _ in range(ctx.world)]
        dist.all_gather(every, d)
        ref = theirs.abs().max().item() or 1.0
        for r in holders:
            if r != o and not float(every[r]) <= replica_tol * ref:
                rows.append([float(i), float(o), float(r), float(every[r]), ref])
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 5)


def _kept(trials: list, name: str) -> list:
    """`name`'s values on every trial, from the kept flats ([] where this rank returned none)."""
    out = []
    for flats in trials:
        for f in flats:
            if name in f.names:
                j = f.names.index(name)
                a = sum(f.sizes[:j])
                out.append(f.values[a:a + f.sizes[j]])
    return out


def _judge_trial(f: Flat, js: list, trial: int, r: dict, bg: dict | None, G, B, added2, exact,
                 tol_grad) -> None:
    """Step 3 for the parameters at positions js of f, which this rank judges on `trial`:
    each one's sums against the truth r (and the base bg, None where it is not usable) into
    G, B, added2, and whether every value is the truth rounded (exact) and within the
    tolerance checks' bounds of the base (tol_grad). Parameter by parameter: a whole-model
    temporary of every summand costs more in memory traffic than the loop."""
    starts = [0]
    for k in f.sizes:
        starts.append(starts[-1] + k)
    for j in js:
        i, n = f.index[j], f.names[j]
        x64 = f.values[starts[j]:starts[j + 1]].double()[None]
        rt = r[n][trial][None]
        terms = truth_terms(rt)
        G[:, trial, i] = sums(x64, rt, terms)[:, 0]
        if not torch.equal(x64, rounded(rt, f.values.dtype)):
            exact[i] = 0.0
        if bg is not None:
            bt = bg[n][trial][None]
            B[:, trial, i] = sums(bt, rt, terms)[:, 0]
            e = x64 - bt
            added2[trial, i] = (e ** 2).sum()
            if not tol_grad[0] and not _close(e, x64, bt):
                tol_grad[0] = 1.0


def _close(e: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.allclose(x, b, rtol=1e-5, atol=4e-5), e = x - b: every |e| <= atol settles it
    at the cost of one reduction (allclose's own temporaries cost as much as the rest of
    the trial's comparison); NaN and inf fall through to allclose."""
    if e.numel() == 0 or bool(e.abs().max() <= 4e-5):
        return True
    return torch.allclose(x, b, rtol=1e-5, atol=4e-5)


class _Beside:
    """A function run on a daemon thread; result() waits for it and raises what it raised."""

    def __init__(self, fn):
        import threading
        self._out, self._error = None, None

        def body():
            try:
                self._out = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                self._error = e
        self._thread = threading.Thread(target=body, daemon=True, name="trainprobes-truth")
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out


def _references_beside(step, seeds: list, t, ctx: RankContext, mine: list) -> _Beside:
    """The fp64 truth and the single-device base of the trials `mine`, computed on a thread
    beside the transform's steps (torch's kernels release the GIL, so it takes the time the
    rank would spend waiting in the steps' collectives). The models and batches are built
    here, on the rank's own thread: a factory may seed torch's global generator, which the
    user's step may draw from. On a GPU the base runs here, before the next step (its
    kernels would queue with the steps'), and only the CPU truth runs beside them."""
    w = t.weight_dtype()
    truth_in = single_device_inputs(step, seeds, param_dtype=w, pick=mine)
    base_in = single_device_inputs(step, seeds, fp64=False, param_dtype=w, device=ctx.device.type, pick=mine)
    if ctx.device.type != "cpu":
        base = run_single_device(step, base_in)
        return _Beside(lambda: (run_single_device(step, truth_in), base))
    return _Beside(lambda: (run_single_device(step, truth_in), run_single_device(step, base_in)))


def check_missing(nones: torch.Tensor, truth_nonzero: torch.Tensor, held: torch.Tensor, names: list,
                  label: str) -> None:
    """A held parameter whose gradient the step left None ([world, T, P] nones) was judged
    as zero; that stands only where the fp64 truth's gradient is exactly zero (the judge's
    sum |r| over it, [T, P]): elsewhere InvalidArgument naming the parameter, the ranks and
    the trial (every rank raises alike, from the same gathered flags)."""
    from trainprobes.errors import InvalidArgument
    bad = nones & truth_nonzero[None]                                     # [world, T, P]
    if not bool(bad.any()):
        return
    params = bad.any(0).any(0).nonzero().squeeze(-1).tolist()
    i = params[0]
    k = int(bad[:, :, i].any(0).nonzero()[0])
    without = bad[:, k, i].nonzero().squeeze(-1).tolist()
    holders = held[:, i].nonzero().squeeze(-1).tolist()
    others = [r for r in holders if not nones[r, k, i]]
    shown = [names[j] for j in params[:5]]
    if not others:
        raise InvalidArgument(
            f"the step ({label}) returned no gradient for {len(params)} parameter(s) on any rank, "
            f"e.g. {shown} (.grad None on rank(s) {without}, trial {k}), where the fp64 truth's "
            f"gradient is not zero: return every parameter's full gradient from the rank(s) that "
            f"hold it (a gradient left None is read as zero only where the truth is exactly zero)")
    raise InvalidArgument(
        f"the step ({label}) left {names[i]!r} without a gradient (.grad None) on rank(s) {without} "
        f"on trial {k}, while rank(s) {others} hold one, and the fp64 truth's gradient is not "
        f"zero there ({len(params)} parameter(s) so, e.g. {shown}): every replica must hold the "
        f"parameter's gradient (one left None is not updated, and the replicas part)")
