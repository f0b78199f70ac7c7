"""The same trainer with the 2024 gradient-accumulation bug's normalisation: each rank
divides by its own token count (its rows hold 8 and 32 tokens), and FSDP2 averages."""
import torch.distributed as dist
from parallel import rows, setup  # noqa: F401 (the module's setup)
from train import call, loss_sum


def step(model, b, ctx):
    mine = rows(b, ctx)
    loss = loss_sum(call(model, mine), mine) / (mine["labels"] != -100).sum()
    loss.backward()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    return logged / ctx.world
