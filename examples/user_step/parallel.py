"""The trainer's parallel step, unchanged: FSDP2 on every layer (setup, once per rank), each
rank's rows, the summed loss over the global num_items_in_batch (FSDP2 averages over ranks:
x world undoes it)."""
import torch.distributed as dist
from train import call, loss_sum


def setup(model, ctx):
    from torch.distributed.fsdp import fully_shard
    for layer in (model.tok, model.pos, model.mix, model.head):
        fully_shard(layer)
    fully_shard(model)  # in place: nothing to return


def rows(b, ctx):
    n = b["input_ids"].shape[0] // ctx.world
    return {k: v if v.dim() == 0 else v[ctx.rank * n:(ctx.rank + 1) * n] for k, v in b.items()}


def step(model, b, ctx):
    mine = rows(b, ctx)
    loss = loss_sum(call(model, mine), mine) / mine["num_items_in_batch"]
    (loss * ctx.world).backward()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    return logged  # the gradients stay where FSDP2 keeps them: the probe reads the DTensors
