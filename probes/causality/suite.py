"""The reference routers and MoE blocks as positive and negative controls: each is probed in
both modes and its verdict compared with the one known from its mechanism."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from trainprobes.causality.check import check
from trainprobes.reference import routing
from trainprobes.reference.models import moe
from trainprobes.result import Result


@dataclass(frozen=True)
class Control:
    name: str             # import path, used as the Result's target
    fn: Callable
    causal_perturb: bool  # known verdicts from the mechanism
    causal_truncate: bool
    kind: str             # "router": logits [B, T, E] in; "block": hidden [B, T, D] in
    decision: object = 0
    scores: object = 1


def controls() -> list[Control]:
    out = [Control(f"trainprobes.reference.routing:{name}", getattr(routing, name), p, t, "router")
           for name, (p, t) in routing.KNOWN_VERDICTS.items()]
    # the block's output hidden state is the decision: exact leak positions, noise under
    # truncation settled by the block's fp64 twin
    out += [Control("trainprobes.reference.models.moe:causal_block", moe.causal_block, True, True, "block",
                    decision="hidden", scores=None),
            Control("trainprobes.reference.models.moe:off_by_one_block", moe.off_by_one_block, False, False,
                    "block", decision="hidden", scores=None)]
    return out


def run_controls(*, seq_len: int = 256, batch: int = 4, n_experts: int = 8, d_model: int = 64,
                 seed: int = 0, cuts=None, modes=("perturb", "truncate"),
                 progress: Callable[[str], None] | None = None) -> list[tuple[Control, str, Result]]:
    """Probe every control in every mode: [(control, mode, result)]. Inputs are drawn from
    seed: router logits [batch, seq_len, n_experts], block inputs [batch, seq_len, d_model]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq_len, n_experts, generator=g)
    hidden = torch.randn(batch, seq_len, d_model, generator=g)
    rows = []
    for ctl in controls():
        for mode in modes:
            if progress is not None:
                progress(f"{ctl.name} [{mode}]")
            x = logits if ctl.kind == "router" else hidden
            res = check(ctl.fn, x, mode=mode, cuts=cuts, seed=seed, decision=ctl.decision,
                        scores=ctl.scores, target=ctl.name)
            rows.append((ctl, mode, res))
    return rows


def expected(ctl: Control, mode: str) -> bool:
    return ctl.causal_perturb if mode == "perturb" else ctl.causal_truncate
