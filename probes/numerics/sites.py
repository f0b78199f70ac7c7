"""Accumulation sites: the stall where it happens in real training, one probe each.

1. collective_site: an all-reduce of many ranks' same-signed gradients in a narrow wire
   format (trainprobes.reference.collectives) against the same reduction in fp64.
2. grad_accumulation_site: real torch autograd accumulating micro-batch gradients into a
   bf16 `.grad` (what `loss.backward()` does across micro-batches when the parameter is
   bf16), against the fp64 sum of the very same micro-batch gradients.
3. weight_update_site: a real `torch.optim.SGD` step on a bf16 parameter where lr * grad is
   below half an ulp of the weight: the update rounds away.
Each reports the mass lost (signed relative error, negative = too small) and fails with
TP-B2 when it exceeds `tol`.
"""
from __future__ import annotations

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.numerics.bias import signed_relative_error
from trainprobes.reference.formats import get_format
from trainprobes.result import Result
from trainprobes.validation import check_int, check_number, check_seed


def _verdict(lost: float, tol: float):
    bad = not (abs(lost) <= tol)  # NaN counts as bad
    return ("fail", ["TP-B2"]) if bad else ("pass", [])


def collective_site(*, world: int = 1024, numel: int = 256, dtype="bf16", grad: float = 1e-3,
                    spread: float = 0.1, algorithm: str = "ring", seed: int = 0, tol: float = 1e-2,
                    **all_reduce_kwargs) -> Result:
    """all_reduce(sum) of `world` ranks holding same-signed gradients ~ grad * (1 + spread * N(0,1))."""
    from trainprobes.reference.collectives import all_reduce

    fmt = get_format(dtype)
    check_int(world, "world", min=1, hint="the number of ranks")
    check_int(numel, "numel", min=1, hint="elements per rank")
    check_number(tol, "tol", min=0)
    g = torch.Generator().manual_seed(check_seed(seed))
    x = (grad * (1 + spread * torch.randn(world, numel, generator=g, dtype=torch.float64))).abs()
    x = fmt.round(x)
    ranks = list(x.unbind(0))
    low = all_reduce(ranks, dtype=fmt.name, algorithm=algorithm, **all_reduce_kwargs)[0]
    ref = all_reduce(ranks, dtype="fp64", algorithm=algorithm, **all_reduce_kwargs)[0]
    lost = signed_relative_error(low, ref)
    stall = fmt.stall_point(grad)
    verdict, codes = _verdict(lost, tol)
    msg = (f"{world} ranks x {grad:g} in {fmt.name} ({algorithm}): the sum is {abs(lost):.2%} too "
           f"{'small' if lost < 0 else 'large'} against fp64 (true ~{world * grad:g}; a running "
           f"{fmt.name} sum stalls at {stall:g} for increments of {grad:g})")
    return Result(probe="numerics.sites.collective", target=f"all_reduce[{fmt.name},{algorithm},w={world}]",
                  verdict=verdict, seed=seed, codes=codes, message=msg,
                  metrics={"relative_error": lost, "lost_mass": -lost, "world": world,
                           "stall_point": stall, "true_sum_mean": ref.mean().item(),
                           "low_sum_mean": low.mean().item(), "tol": tol},
                  evidence={"dtype": fmt.name, "algorithm": algorithm, "grad": grad, "spread": spread,
                            "numel": numel})


def grad_accumulation_site(*, micro_batches: int = 1024, dtype="bf16", features: int = 16,
                           batch: int = 32, seed: int = 0, tol: float = 1e-2) -> Result:
    """Accumulate micro-batch gradients of a least-squares loss (divided by the number of
    micro-batches, as gradient accumulation does) into the `.grad` of a `dtype` parameter
    with real autograd; compare with the fp64 sum of the same per-micro-batch gradients
    (captured by a tensor hook before they are accumulated)."""
    fmt = get_format(dtype)
    if fmt.torch_dtype is None:
        raise InvalidArgument(f"dtype={dtype!r} has no torch dtype for autograd; use fp16, bf16 or fp32")
    check_int(micro_batches, "micro_batches", min=1)
    check_number(tol, "tol", min=0)
    g = torch.Generator().manual_seed(check_seed(seed))
    w_true = torch.randn(features, generator=g, dtype=torch.float64)
    xs = torch.randn(micro_batches, batch, features, generator=g, dtype=torch.float64)
    ys = (xs @ w_true).to(fmt.torch_dtype)
    xs = xs.to(fmt.torch_dtype)
    p = torch.nn.Parameter(torch.zeros(features, dtype=fmt.torch_dtype))
    seen = []
    # a leaf's tensor hook sees each micro-batch gradient before it is added into .grad
    handle = p.register_hook(lambda grad: seen.append(grad.detach().double()))
    try:
        for k in range(micro_batches):
            loss = ((xs[k] @ p - ys[k]) ** 2).mean() / micro_batches
            loss.backward()
    finally:
        handle.remove()
    acc = p.grad.double()
    ref = torch.stack(seen).sum(0)
    lost = signed_relative_error(acc, ref)
    worst = ((acc - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
    verdict, codes = _verdict(lost, tol)
    msg = (f"{micro_batches} micro-batches accumulated into a {fmt.name} .grad: "
           f"{abs(lost):.2%} too {'small' if lost < 0 else 'large'} against the fp64 sum of the "
           f"same micro-batch gradients (worst element {worst:.1%} off)")
    return Result(probe="numerics.sites.grad_accumulation",
                  target=f"grad_accumulation[{fmt.name},micro_batches={micro_batches}]",
                  verdict=verdict, seed=seed, codes=codes, message=msg,
                  metrics={"relative_error": lost, "lost_mass": -lost, "worst_element_error": worst,
                           "micro_batches": micro_batches, "tol": tol},
                  evidence={"dtype": fmt.name, "features": features, "batch": batch})


def weight_update_site(*, dtype="bf16", lr: float = 1e-4, steps: int = 100, numel: int = 4096,
                       grad_scale: float = 1.0, seed: int = 0, tol: float = 1e-2) -> Result:
    """`steps` real torch.optim.SGD steps on a `dtype` parameter (weights ~ N(0,1)) with a fixed
    gradient ~ grad_scale * N(0,1), against the same steps in fp64. Reports the fraction of
    element updates that left the weight unchanged, the fraction predicted by
    |lr * grad| <= ulp(w)/2, and the update mass lost over all steps."""
    fmt = get_format(dtype)
    if fmt.torch_dtype is None:
        raise InvalidArgument(f"dtype={dtype!r} has no torch dtype for torch.optim; use fp16, bf16 or fp32")
    check_int(steps, "steps", min=1)
    check_int(numel, "numel", min=1)
    check_number(lr, "lr", min=0, min_open=True)
    check_number(tol, "tol", min=0)
    g = torch.Generator().manual_seed(check_seed(seed))
    w0 = fmt.round(torch.randn(numel, generator=g, dtype=torch.float64))
    grad = fmt.round(grad_scale * torch.randn(numel, generator=g, dtype=torch.float64))
    p = torch.nn.Parameter(w0.to(fmt.torch_dtype))
    q = torch.nn.Parameter(w0.clone())
    opt_p, opt_q = torch.optim.SGD([p], lr=lr), torch.optim.SGD([q], lr=lr)
    unchanged = 0
    predicted = ((lr * grad).abs() <= fmt.ulp(w0) / 2) & (grad != 0)
    curve = []
    for _ in range(steps):
        before = p.detach().clone()
        p.grad, q.grad = grad.to(fmt.torch_dtype), grad.clone()
        opt_p.step()
        opt_q.step()
        unchanged += int(((p.detach() == before) & (grad != 0)).sum())
        moved_p = (p.detach().double() - w0).abs().sum().item()
        moved_q = (q.detach() - w0).abs().sum().item()
        curve.append(moved_p / moved_q if moved_q else 1.0)
    frac_lost = unchanged / (steps * max(int((grad != 0).sum()), 1))
    mass = signed_relative_error(p.detach().double() - w0, q.detach() - w0)
    verdict, codes = _verdict(mass, tol)
    msg = (f"SGD in {fmt.name}, lr={lr:g}: {frac_lost:.1%} of element updates rounded away "
           f"(predicted {predicted.double().mean().item():.1%} from |lr*grad| <= ulp(w)/2); after "
           f"{steps} steps the weights moved {abs(mass):.1%} {'less' if mass < 0 else 'more'} "
           "than in fp64")
    return Result(probe="numerics.sites.weight_update", target=f"sgd_step[{fmt.name},lr={lr:g}]",
                  verdict=verdict, seed=seed, codes=codes, message=msg,
                  metrics={"fraction_updates_lost": frac_lost,
                           "fraction_predicted_lost": predicted.double().mean().item(),
                           "update_relative_error": mass, "lost_mass": -mass, "steps": steps, "lr": lr,
                           "tol": tol},
                  evidence={"dtype": fmt.name, "moved_ratio_curve": curve, "numel": numel,
                            "grad_scale": grad_scale})


def all_sites(*, dtype="bf16", seed: int = 0) -> list[Result]:
    """The three sites with their defaults."""
    return [collective_site(dtype=dtype, seed=seed), grad_accumulation_site(dtype=dtype, seed=seed),
            weight_update_site(dtype=dtype, seed=seed)]
