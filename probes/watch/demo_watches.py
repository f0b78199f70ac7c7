"""Every watch at once on a small MoE language model under DDP: what the tests run on real
gloo ranks (trainprobes.distributed.launcher) to hold the promises of the router, update and
GEMM watches beside the bucket sentinel.

watches_task(rank, world, runs) runs train_moe once per dict of keyword arguments in `runs`
and returns plain data per run: losses, final weights, the states of python's, numpy's and
torch's global generators, and the sentinel's Results as JSON.
"""
from __future__ import annotations

import random

import torch
from torch import nn

D, E, VOCAB = 16, 4, 32


class SwitchableRouter(nn.Module):
    """Token choice (each token its top-1 expert) or expert choice (each expert its top-C
    tokens of the sequence) on the same logits: only the decisions differ."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, E, bias=False)
        self.expert_choice = False

    def forward(self, x):  # [B, T, D]
        logits = self.proj(x)
        if self.expert_choice:
            top = logits.topk(x.shape[1] // E, dim=1).indices  # [B, C, E]: tokens per expert
            return logits, torch.zeros_like(logits, dtype=torch.long).scatter_(1, top, 1)
        top = logits.topk(1, dim=-1).indices
        return logits, torch.zeros_like(logits, dtype=torch.long).scatter_(-1, top, 1)


class MoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = SwitchableRouter()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, x):
        logits, mask = self.router(x)
        w = logits.softmax(-1) * mask  # every expert runs: DDP sees a gradient for each
        return x + sum(w[..., e:e + 1] * self.experts[e](x) for e in range(E))


class MoeLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.drop = nn.Dropout(0.1)  # draws from torch's global generator every step
        self.moe = MoeBlock()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        return self.head(self.moe(self.drop(self.emb(ids))))


def _rng_states() -> dict:
    import numpy as np
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, gauss_py = random.getstate()
    return {"torch": torch.random.get_rng_state(), "numpy": torch.from_numpy(keys.astype("int64")),
            "numpy_rest": [kind, pos, has_gauss, gauss], "python": list(state),
            "python_rest": [version, gauss_py]}


def train_moe(rank: int, world: int, steps: int = 8, watch: bool = False, switch_at=None,
              seed: int = 0, gemm_kwargs: dict | None = None, sentinel_kwargs: dict | None = None,
              router_every: int = 2, dtype: str = "float32", lr: float = 1e-3) -> dict:
    """A MoE LM under DDP (gloo), AdamW; the batch drawn from numpy's global generator, its
    crop from python's, dropout from torch's, so a watch that drew from any of them would
    change the run. watch: the bucket sentinel (attach_ddp), watch_routers, watch_updates
    and watch_gemms all on. switch_at: the router turns expert-choice from that step.
    dtype: the weights' (and so the gradients' and the reduction's) format."""
    import numpy as np
    from torch.nn.parallel import DistributedDataParallel
    from trainprobes.watch import Sentinel, attach_ddp, watch_gemms, watch_routers, watch_updates

    torch.set_num_threads(1)
    torch.manual_seed(seed)  # the same initial weights on every rank
    net = MoeLM().to(getattr(torch, dtype))
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
    sentinel = None
    if watch:
        sentinel = Sentinel(**{"sample": 1.0, "interval": 2, "max_per_step": 4, "window": 4096,
                               "budget": 16 << 20, **(sentinel_kwargs or {})})
        attach_ddp(ddp, sentinel)
        watch_routers(net, sentinel, every=router_every)
        watch_updates(opt, sentinel)
        watch_gemms(net, sentinel, **{"every": 1, "recipe": "exact", "preset": "fp32",
                                      "gemms": ("fprop", "dgrad", "wgrad"), "samples": 64,
                                      **(gemm_kwargs or {})})
    np.random.seed(seed * 1000 + rank)
    random.seed(seed * 1000 + rank)
    torch.manual_seed(seed + 1 + rank)
    losses = []
    for i in range(steps):
        if switch_at is not None and i == switch_at:
            net.moe.router.expert_choice = True
        ids = torch.from_numpy(np.random.randint(0, VOCAB, (4, 24)))
        start = random.randrange(0, 8)
        ids = ids[:, start:start + 16]
        out = ddp(ids)
        loss = nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
        if sentinel is not None:
            sentinel.step()
    results = [r.to_json() for r in sentinel.close()] if sentinel is not None else []
    return {"losses": torch.stack(losses), "weights": {k: v.detach().clone() for k, v in
                                                       net.state_dict().items()},
            "rng": _rng_states(), "results": results,
            "own_errors": list(sentinel.errors) if sentinel is not None else []}


def watches_task(rank: int, world: int, runs: list) -> list:
    return [train_moe(rank, world, **kw) for kw in runs]
