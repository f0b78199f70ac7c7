"""No gather: every rank computes the fp64 truth itself and compares its own gradients;
only the statistics the verdict needs travel.

Per case, each rank:
  1. computes the fp64 truth and the single-device base of every trial itself (the proxy
     fits one process: memory O(parameters x trials) per rank, whatever the world);
  2. runs the transform's steps (trainprobes.transforms.worker checks what they return);
     after trial 0 the ranks agree which parameters each returned (a [world, P] mask) and the
     lowest rank that returned a parameter owns it;
  3. sums, per trial and owned parameter, the judge's statistics over its elements
     (trainprobes.transforms.judge.sums: <g, r>, |r|^2, |g|^2, |g - r|^2, signed error,
     |r|, the same against the base, |g - b|^2), and per held parameter whether every value
     equals the truth rounded, whether one is not finite, and a bit fingerprint;
  4. all-reduces those: SUM of the owners' sums, MIN/MAX of the flags, an all_gather of the
     fingerprints and losses ([world, T, P] integers, [world, T]); replicas whose
     fingerprints differ are measured by an element-wise MAX/MIN over their holders (the
     only O(parameters) traffic, and only when replicas disagree).
Rank 0 returns the joined statistics (trainprobes.transforms.judge.Statistics as tensors).
Traffic per trial O(parameters' count), not O(world x elements) into one process.
"""
from __future__ import annotations

import math

import torch
from trainprobes.transforms.base import RankContext
from trainprobes.transforms.judge import rounded, sums
from trainprobes.transforms.rank_case import DTYPES, RankCase, _import_like_caller, resolve_step, run_trials

__all__ = ["run_case_local", "fingerprint"]

_BIG = 2 ** 62


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """[T] int64: a weighted sum of the bits of each trial's values (any changed bit changes
    it, barring a 2^-62 collision); x [T, numel] in its own dtype."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    v = x.contiguous().view(bits).to(torch.int64)
    w = torch.arange(1, v.shape[1] + 1, dtype=torch.int64) * 2654435761 % (2 ** 31 - 1) + 1
    return (v * w).sum(1)  # int64 arithmetic wraps: still a function of every bit


def run_case_local(case: RankCase, ctx: RankContext, replica_tol: float) -> dict | None:
    """Steps 1-4 of the module docstring; rank 0 returns the statistics as tensors."""
    import torch.distributed as dist
    from trainprobes.transforms.step import references
    _import_like_caller(case.sys_path)
    step = resolve_step(case.step)
    t = case.transform
    seeds = case.seeds
    T = len(seeds)
    from trainprobes.transforms.step import check_truth
    truth, base = references(step, seeds, t, ctx.device.type)
    check_truth(truth, step)  # every rank refuses alike
    layout = [(n, tuple(p.shape)) for n, p in step.model().named_parameters() if p.requires_grad]
    names = {n: i for i, (n, _) in enumerate(layout)}
    shapes = dict(layout)
    P = len(layout)
    r = {n: truth.grads[n].reshape(T, -1) for n in names}
    bg = {n: base.grads[n].reshape(T, -1).double() for n in names}
    base_ok = all(bool(torch.isfinite(v).all()) for v in bg.values()) and bool(torch.isfinite(base.loss).all())
    G = torch.zeros(6, T, P, dtype=torch.float64)
    B = torch.zeros(6, T, P, dtype=torch.float64)
    added2 = torch.zeros(T, P, dtype=torch.float64)
    exact = torch.ones(P, dtype=torch.float64)
    nonfinite = torch.zeros(P + 1, dtype=torch.float64)
    prints = torch.zeros(T, P, dtype=torch.int64)
    tol_grad = torch.zeros(1, dtype=torch.float64)
    losses, has_loss, loss_code, codes, seconds = [], None, -1, None, 0.0
    held, owner, kept = None, None, {}
    state = t.setup(step, ctx)
    for tr in run_trials(step, t, state, seeds, names, shapes, ctx):
        trial, out, grads = tr.index, tr.out, tr.grads
        seconds += tr.seconds
        if trial == 0:
            masks = [torch.zeros(P, dtype=torch.float32, device=ctx.device) for _ in range(ctx.world)]
            dist.all_gather(masks, tr.returned.float().to(ctx.device))
            held = torch.stack([m.cpu() for m in masks]).bool()          # [world, P]
            owner = held.float().argmax(0)                                # lowest holder
            codes = torch.tensor([DTYPES.index(grads[n].dtype) if n in grads and grads[n].dtype in DTYPES
                                  else -1 for n in names])
            has_loss = out.loss is not None
        for n, i in names.items():
            if n not in grads:
                continue
            x = grads[n].detach().to("cpu").reshape(1, -1)
            prints[trial, i] = fingerprint(x)[0]
            x64 = x.double()
            if not bool(torch.isfinite(x64).all()):
                nonfinite[i] = 1.0
            kept.setdefault(n, []).append(x64[0])
            if int(owner[i]) != ctx.rank:
                continue
            rt = r[n][trial:trial + 1]
            G[:, trial, i] = sums(x64, rt)[:, 0]
            if not torch.equal(x64, rounded(rt, x.dtype)):
                exact[i] = 0.0
            if base_ok:
                bt = bg[n][trial:trial + 1]
                B[:, trial, i] = sums(bt, rt)[:, 0]
                added2[trial, i] = ((x64 - bt) ** 2).sum()
                if not torch.allclose(x64, bt, rtol=1e-5, atol=4e-5):
                    tol_grad[0] = 1.0
        value = math.nan if out.loss is None else float(out.loss.detach().double().item())
        if out.loss is not None and not math.isfinite(value):
            nonfinite[P] = 1.0
        losses.append(value)
        if out.loss is not None and out.loss.dtype in DTYPES:
            loss_code = DTYPES.index(out.loss.dtype)
    t.teardown(state)

    def reduce(x, op):
        y = x.to(ctx.device)
        dist.all_reduce(y, op=op)
        return y.cpu()
    G, B, added2, tol_grad = (reduce(x, dist.ReduceOp.SUM) for x in (G, B, added2, tol_grad))
    exact = reduce(exact, dist.ReduceOp.MIN)
    nonfinite = reduce(nonfinite, dist.ReduceOp.MAX)
    meta = torch.cat([torch.tensor([float(has_loss), seconds, float(loss_code)], dtype=torch.float64),
                      torch.tensor(losses, dtype=torch.float64), codes.double()]).to(ctx.device)
    metas = [torch.empty_like(meta) for _ in range(ctx.world)]
    dist.all_gather(metas, meta)
    metas = torch.stack([m.cpu() for m in metas])
    everyone = [torch.empty_like(prints).to(ctx.device) for _ in range(ctx.world)]
    dist.all_gather(everyone, prints.to(ctx.device))
    everyone = torch.stack([e.cpu() for e in everyone])                   # [world, T, P]
    replicas = _replicas(everyone, held, owner, kept, names, ctx, replica_tol)
    if ctx.rank != 0:
        return None
    return {"G": G, "B": B if base_ok else torch.zeros(0), "added2": added2, "exact": exact,
            "nonfinite": nonfinite, "held": held, "has_loss": metas[:, 0].bool(),
            "seconds": metas[:, 1], "loss_codes": metas[:, 2].long(), "loss": metas[:, 3:3 + T],
            "codes": metas[:, 3 + T:].long(), "replicas": replicas, "tol_grad": tol_grad,
            "truth_loss": truth.loss, "base_loss": base.loss.double() if base_ok else torch.zeros(0)}


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
        size = torch.tensor([kept[n][0].numel() if n in kept else 0], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
        theirs = torch.stack(kept[n]).to(ctx.device) if ctx.rank == o else \
            torch.empty(prints.shape[1], int(size.item()), dtype=torch.float64, device=ctx.device)
        dist.broadcast(theirs, o)
        d = torch.tensor([(torch.stack(kept[n]).to(ctx.device) - theirs).abs().max().item()
                          if n in kept else 0.0], dtype=torch.float64, device=ctx.device)
        every = [torch.empty_like(d) for _ in range(ctx.world)]
        dist.all_gather(every, d)
        ref = theirs.abs().max().item() or 1.0
        for r in holders:
            if r != o and not float(every[r]) <= replica_tol * ref:
                rows.append([float(i), float(o), float(r), float(every[r]), ref])
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 5)
