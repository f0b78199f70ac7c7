"""A user's data-parallel step, as the per-trial benchmark (bench_transforms.py) runs it by
hand and through the probe's --step path: DDP over the wide model, each rank's token sum
over the global token count (DDP's average undone). The ranks import it by name."""
import torch
import torch.distributed as dist
from trainprobes.reference.bugs import data


def setup(model, ctx):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model)


def step(model, batch, ctx):
    n = batch["input"].shape[0] // ctx.world
    mine = {k: v[ctx.rank * n:(ctx.rank + 1) * n] for k, v in batch.items()}
    count = data.tokens(mine).to(torch.float32).reshape(1)
    dist.all_reduce(count)
    loss = data.token_loss_sum(model(mine["input"]), mine) / count
    (loss * ctx.world).backward()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    return logged
