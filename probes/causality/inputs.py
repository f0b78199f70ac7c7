"""What the probe feeds a target: the cuts, the replacement values, the perturbed copies."""
from __future__ import annotations

import torch
from trainprobes.errors import InvalidArgument
from trainprobes.validation import check_choice, check_int, check_type

MODES = ("perturb", "truncate")


def resolve_cuts(cuts, T: int, mode: str, generator: torch.Generator) -> list[int]:
    """None: a few evenly spaced cuts (8 in perturb mode, packed in one call; 4 in truncate
    mode, one call each), enough to catch global leaks. "all": 0..T-2 (full certification).
    An int n: n cuts sampled without replacement. A list: those positions."""
    last = T - 2  # a cut at T-1 has no future to perturb
    forms = "or an int (cuts to sample), a list of positions, or None"
    if cuts is None:
        n = min(8 if mode == "perturb" else 4, last + 1)
        return sorted({round((i + 1) * (last + 1) / (n + 1)) for i in range(n)} - {last + 1}) or [0]
    if isinstance(cuts, str):
        check_choice(cuts, "cuts", ("all",), hint=forms)
        return list(range(last + 1))
    if isinstance(cuts, bool) or not hasattr(cuts, "__iter__"):
        n = check_int(cuts, "cuts", min=1, hint="the number of cuts to sample; or 'all', or a list of positions")
        return sorted(torch.randperm(last + 1, generator=generator)[:min(n, last + 1)].tolist())
    hint = f"a cut c perturbs positions c+1..T-1, T={T}"
    out = sorted({check_int(c, f"cuts[{k}]", min=0, max=last, hint=hint) for k, c in enumerate(cuts)})
    if not out:
        raise InvalidArgument(f"cuts={cuts!r} is empty: give positions in [0, {last}], 'all', "
                              f"an int, or None")
    return out


def replacements(x: torch.Tensor, trials: int, vocab: int | None, g: torch.Generator) -> torch.Tensor:
    """[trials, *x.shape] values that differ from x everywhere: other token ids, or fresh
    Gaussian values with x's per-feature mean and std (never a permutation of x's own
    values, which would leave a sequence-wide sum unchanged)."""
    x = x.cpu()  # drawn on the CPU from the seeded generator: same seed, same values anywhere
    if not x.is_floating_point():
        V = vocab if vocab is not None else max(2, int(x.max()) + 1)
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= V):
            raise InvalidArgument(f"vocab={V!r} but inputs hold token ids in [{int(x.min())}, "
                                  f"{int(x.max())}]: pass the vocabulary size the ids come from")
        shift = torch.randint(1, V, (trials, *x.shape), generator=g)
        return (x[None] + shift) % V
    flat = x.double().reshape(-1, x.shape[-1]) if x.dim() > 2 else x.double().reshape(-1, 1)
    # two passes of sum: torch's mean/std over the outer axis take ~8 ms on 2 threads for a
    # [512, 64] input (0.01 ms on one), a tenth of a full certification of a cheap target
    mean = flat.sum(0) / flat.shape[0]
    std = ((flat - mean).square().sum(0) / (flat.shape[0] - 1)).sqrt().nan_to_num(1.0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    z = torch.randn((trials, *x.shape), generator=g, dtype=torch.float64)
    z = z * (std if x.dim() > 2 else std[0]) + (mean if x.dim() > 2 else mean[0])
    return z.to(x.dtype)


def as_batched(inputs, layout: str) -> torch.Tensor:
    """inputs as [B, T, ...]: token ids [B, T] (long) or floats [B, T, D]; layout="flat"
    takes one sequence [T] / [T, D] and adds the batch axis."""
    check_type(torch.Tensor, inputs, "inputs", hint="token ids [B, T] (long) or floats [B, T, D]")
    want = (1, 2) if layout == "flat" else (2, 3)
    ok_dim = inputs.dim() == (want[1] if inputs.is_floating_point() else want[0])
    if not ok_dim or inputs.is_complex():
        shapes = "[T] (long) or [T, D] (float)" if layout == "flat" else "[B, T] (long) or [B, T, D] (float)"
        raise InvalidArgument(f"inputs has dtype {inputs.dtype} and shape {tuple(inputs.shape)!r}, "
                              f"expected {shapes}" + ("; for one sequence without a batch axis pass "
                                                      "layout='flat'" if layout == "batched" else ""))
    x = inputs[None] if layout == "flat" else inputs
    if x.shape[1] < 2 or x.shape[0] < 1:
        raise InvalidArgument(f"inputs has shape {tuple(inputs.shape)!r}: need at least 1 "
                              f"sequence of at least 2 positions")
    return x.detach()


def spread_first(tasks: list, k: int) -> list:
    """tasks reordered so that the first k are spread evenly over all of them (the first
    packed call then holds early and late cuts alike, as the default cuts do), the rest in
    their order."""
    n = len(tasks)
    if not 0 < k < n:
        return tasks
    first = sorted({(2 * j + 1) * n // (2 * k) for j in range(k)})
    chosen = set(first)
    return [tasks[j] for j in first] + [t for j, t in enumerate(tasks) if j not in chosen]


class Perturbed:
    """Copies of x with every position after a cut replaced: `perturbed(c, i)` takes trial
    i's replacement values; `batch(part, head)` packs many into one call. Same length, same
    batch shape: capacity that depends on the number of tokens is left alone. Every call
    returns a fresh tensor (a target may keep its input, and the fp64 twin's answer is
    cached by the input's identity)."""

    def __init__(self, x: torch.Tensor, R: torch.Tensor):
        self.x, self.R = x, R.to(x.device)
        self.pos = torch.arange(x.shape[1], device=x.device)
        self.B, self.T = x.shape[:2]

    def __call__(self, c: int, i: int) -> torch.Tensor:
        # two slices joined: a third of the cost of a masked select over the whole input
        return torch.cat([self.x[:, :c + 1], self.R[i, :, c + 1:]], 1)

    def batch(self, part: list, head: list[torch.Tensor]) -> torch.Tensor:
        """[*head, x_c for (c, i) in part] along the batch axis, built in one pass: the
        copies are written by one masked select straight into the packed call's tensor."""
        x, n, rows = self.x, len(part), sum(h.shape[0] for h in head)
        out = torch.empty((rows + n * self.B, *x.shape[1:]), dtype=x.dtype, device=x.device)
        k = 0
        for h in head:
            out[k:k + h.shape[0]] = h
            k += h.shape[0]
        cuts = torch.tensor([c for c, _ in part], device=x.device)
        late = (self.pos[None, :] > cuts[:, None]).view(n, 1, self.T, *[1] * (x.dim() - 2))
        trials = {i for _, i in part}
        R = self.R[trials.pop()][None] if len(trials) == 1 else self.R[[i for _, i in part]]
        torch.where(late, R, x[None], out=out[rows:].view(n, *x.shape))
        return out
