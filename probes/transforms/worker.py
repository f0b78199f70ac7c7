"""What each rank runs: the transform's steps on every trial, gathered to rank 0 as plain
tensors (no pickled objects travel back: the launcher reads the results weights-only).

Launched locally by trainprobes.distributed.launcher (cases_task), or under torchrun by
trainprobes.transforms.torchrun (which owns the probe; this module only runs steps).

Per case, each rank:
  1. builds the transform (setup) once, then for every trial seed draws the global batch,
     runs one transformed step and checks what it returned: known parameter names, full
     shapes, and (after trial 0, all ranks together) every parameter returned by some rank;
  2. sends rank 0 what it returned: which parameters (a mask), their dtypes, its loss per
     trial and one flat float64 tensor [trials, elements] of its gradients.
"""
from __future__ import annotations

import math

import torch
from trainprobes.transforms.base import RankContext
from trainprobes.transforms.rank_case import (  # noqa: F401 (re-exported)
    DTYPES,
    RankCase,
    _import_like_caller,
    device_of,
    resolve_step,
    run_trials,
)

__all__ = ["RankCase", "cases_task", "run_case", "resolve_step"]

def run_case(case: RankCase, ctx: RankContext) -> dict | None:
    """Steps 1-2 of the module docstring; rank 0 returns the gathered outputs."""
    _import_like_caller(case.sys_path)
    step = resolve_step(case.step)
    t = case.transform
    layout = [(n, tuple(p.shape)) for n, p in step.model().named_parameters() if p.requires_grad]
    names = {n: i for i, (n, _) in enumerate(layout)}
    shapes = dict(layout)
    state = t.setup(step, ctx)
    kept, losses, mask, codes, seconds, loss_code, has_loss = None, [], None, None, 0.0, -1, False
    for tr in run_trials(step, t, state, case.seeds, names, shapes, ctx):
        out, grads = tr.out, tr.grads
        seconds += tr.seconds
        if tr.index == 0:
            mask, has_loss = tr.returned, out.loss is not None
            kept = {n: [] for n in names if n in grads}
            codes = torch.tensor([DTYPES.index(grads[n].dtype) if n in grads and grads[n].dtype in DTYPES
                                  else -1 for n in names])
        for n in kept:
            kept[n].append(grads[n].detach().to("cpu", torch.float64).reshape(-1))
        losses.append(math.nan if out.loss is None else float(out.loss.detach().double().item()))
        if out.loss is not None and out.loss.dtype in DTYPES:
            loss_code = DTYPES.index(out.loss.dtype)
    t.teardown(state)
    T = len(case.seeds)
    flat = torch.cat([torch.stack(v) for v in kept.values()], dim=1) if kept else torch.zeros(T, 0,
                                                                                             dtype=torch.float64)
    return gather(mask, torch.cat([codes, torch.tensor([loss_code])]), flat,
                  torch.tensor(losses, dtype=torch.float64), bool(has_loss), seconds,
                  [math.prod(s) for _, s in layout], ctx)


def gather(mask, codes, flat, losses, has_loss: bool, seconds: float, numels: list,
           ctx: RankContext) -> dict | None:
    """Every rank's outputs to rank 0, as tensors: one all_gather of the small metadata and
    the losses, then one send per rank of its flat gradients. codes: each parameter's
    gradient dtype (an index into DTYPES, -1 none), then the loss's."""
    import torch.distributed as dist
    P, T = mask.numel(), losses.numel()
    meta = torch.cat([mask.double(), codes.double(), torch.tensor([float(has_loss), seconds],
                                                                   dtype=torch.float64), losses])
    meta = meta.to(ctx.device)
    everyone = [torch.empty_like(meta) for _ in range(ctx.world)]
    dist.all_gather(everyone, meta)
    everyone = [m.cpu() for m in everyone]
    if ctx.rank != 0:
        if flat.shape[1]:
            dist.send(flat.to(ctx.device).contiguous(), 0)
        return None
    flats = [flat]
    for r in range(1, ctx.world):
        size = sum(n for n, m in zip(numels, everyone[r][:P].tolist()) if m)
        buf = torch.empty(T, size, dtype=torch.float64, device=ctx.device)
        if size:
            dist.recv(buf, r)
        flats.append(buf.cpu())
    return {"mask": torch.stack([m[:P] for m in everyone]).bool(),
            "codes": torch.stack([m[P:2 * P + 1] for m in everyone]).long(),
            "has_loss": torch.stack([m[2 * P + 1] for m in everyone]).bool(),
            "seconds": torch.stack([m[2 * P + 2] for m in everyone]),
            "loss": torch.stack([m[2 * P + 3:] for m in everyone]),
            "flat": flats}


def cases_task(rank: int, world: int, cases: list, backend: str) -> dict:
    """Launcher task: every case in order on this rank (one process group for all)."""
    ctx = RankContext(rank, world, device_of(backend, rank), backend)
    # the ranks share this machine's cores: torch's default (all of them, per rank) makes
    # their thread pools spin against each other (a toy DDP step took 0.6 s instead of 4 ms)
    if backend == "gloo":
        import os
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from trainprobes.transforms.local import run_case_local
    out = [run_case_local(c, ctx, c.replica_tol) if c.local else run_case(c, ctx) for c in cases]
    return {"cases": out if rank == 0 else []}
