"""A toy data-parallel MoE trainer with two "compute multiplier" switches.

    allreduce_dtype: "fp32" | "bf16"   the wire format of the gradient all-reduce (avg)
    router:          "token_choice" | "expert_choice"

Both switches save compute or bandwidth, and both can quietly hurt training: a bf16
all-reduce over 6 ranks pre-multiplies every gradient by bf16(1/6) = 0.16699 (+0.195%, as
NCCL's ncclAvg does: FIELD_NOTES, NCCL arithmetic) and rounds after every ring hop; expert
choice lets each expert pick its top tokens of the whole sequence, so a token's routing
depends on later tokens that inference never sees (flaxformer ExpertsChooseMaskedRouter).

The audit configs beside this file probe the trainer's pieces by import path, with stable
target names so the gate can compare variants: `baseline.toml` (fp32, token choice),
`bf16_allreduce.toml`, `expert_choice.toml`. Run from this folder:

    trainprobes audit --config baseline.toml --out reports/baseline
    trainprobes audit --config bf16_allreduce.toml --out reports/bf16 --report-only
    trainprobes gate --baseline reports/baseline/latest/report.json \
                     --candidate reports/bf16/latest/report.json
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from trainprobes.reference.collectives import all_reduce

HIDDEN, EXPERTS, WORLD = 16, 4, 6


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(HIDDEN, EXPERTS, generator=g, dtype=torch.float64) / HIDDEN ** 0.5
    experts = torch.randn(EXPERTS, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN ** 0.5
    return router, experts


# --- the two routers: hidden states [B, T, D] -> routing decisions ---------------------

def token_choice_router(h: torch.Tensor, router_weight: torch.Tensor | None = None):
    """Top-1 expert per token from that token's own scores: causal. Returns ids [B, T, 1]."""
    w = _weights()[0] if router_weight is None else router_weight
    return (h.to(w.dtype) @ w).softmax(-1).argmax(-1, keepdim=True)


def expert_choice_router(h: torch.Tensor, router_weight: torch.Tensor | None = None,
                         capacity_factor: float = 1.0):
    """Each expert takes its top-C tokens of the sequence, C = ceil(f*T/E): a 0/1 mask
    [B, T, E]. Whether token t is taken depends on the scores of tokens after t."""
    w = _weights()[0] if router_weight is None else router_weight
    probs = (h.to(w.dtype) @ w).softmax(-1)
    B, T, E = probs.shape
    cap = min(T, -(-int(capacity_factor * T) // E))
    chosen = probs.topk(cap, dim=1).indices
    return torch.zeros(B, T, E, dtype=torch.long).scatter_(1, chosen, 1)


ROUTERS = {"token_choice": token_choice_router, "expert_choice": expert_choice_router}


def gates(h: torch.Tensor, router: str, router_weight: torch.Tensor) -> torch.Tensor:
    """Per-token expert weights [B, T, E] from the chosen router's decision."""
    probs = (h @ router_weight).softmax(-1)
    decision = ROUTERS[router](h.detach(), router_weight.detach())
    if decision.shape[-1] == 1:
        decision = torch.zeros_like(probs, dtype=torch.long).scatter_(-1, decision, 1)
    return probs * decision


# --- the gradient all-reduce: per-rank flat gradients -> their average ----------------

def grad_allreduce(grads, dtype: str) -> torch.Tensor:
    """NCCL-style ring all-reduce, op avg, on the wire format `dtype` (emulated exactly)."""
    return all_reduce(list(grads), op="avg", dtype=dtype, algorithm="ring")[0]


def allreduce_fp64(grads):
    return grad_allreduce(grads, "fp64")


def allreduce_fp32(grads):
    return grad_allreduce(grads, "fp32")


def allreduce_bf16(grads):
    return grad_allreduce(grads, "bf16")


def gradient_shards(generator: torch.Generator, world: int = WORLD,
                    numel: int = 4096) -> list[torch.Tensor]:
    """Gradient-like per-rank inputs (the bias probe's make_inputs): a signal shared by all
    ranks plus per-rank noise, scale ~1e-3."""
    g = generator
    signal = torch.randn(numel, generator=g, dtype=torch.float64) * 1e-3
    return [signal + 3e-4 * torch.randn(numel, generator=g, dtype=torch.float64)
            for _ in range(world)]


# --- the trainer -------------------------------------------------------------------------

@dataclass
class TrainerConfig:
    allreduce_dtype: str = "fp32"
    router: str = "token_choice"
    world: int = WORLD
    steps: int = 20
    lr: float = 0.1
    batch: int = 2
    seq_len: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r}; expected one of {sorted(ROUTERS)}")
        if self.allreduce_dtype not in ("fp64", "fp32", "bf16", "fp16"):
            raise ValueError(f"allreduce_dtype={self.allreduce_dtype!r}; expected fp32 or bf16")


def train(cfg: TrainerConfig) -> list[float]:
    """Data-parallel steps on a regression task; returns the mean loss per step."""
    g = torch.Generator().manual_seed(cfg.seed)
    router_w, expert_w = (w.clone().requires_grad_(True) for w in _weights(cfg.seed))
    teacher = torch.randn(HIDDEN, generator=g, dtype=torch.float64)
    losses = []
    for _ in range(cfg.steps):
        grads, step_loss = [], 0.0
        for _rank in range(cfg.world):  # a loop over ranks, each with its own shard
            h = torch.randn(cfg.batch, cfg.seq_len, HIDDEN, generator=g, dtype=torch.float64)
            y = h @ teacher
            pred = (gates(h, cfg.router, router_w) * (h @ expert_w.T)).sum(-1)
            loss = ((pred - y) ** 2).mean()
            gr, ge = torch.autograd.grad(loss, (router_w, expert_w))
            grads.append(torch.cat([gr.reshape(-1), ge.reshape(-1)]))
            step_loss += loss.item() / cfg.world
        avg = grad_allreduce(grads, cfg.allreduce_dtype)
        with torch.no_grad():
            n = router_w.numel()
            router_w -= cfg.lr * avg[:n].reshape(router_w.shape)
            expert_w -= cfg.lr * avg[n:].reshape(expert_w.shape)
        losses.append(step_loss)
    return losses
