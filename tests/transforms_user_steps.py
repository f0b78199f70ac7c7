"""Users' own parallel steps, written as a trainer would (not a test file: the ranks import
it by name, from the folder the tests put on sys.path).

The single-device step is `step`: the demo's model (LayerNorm, Linear 4->8, GELU, Linear
8->4, Linear 4->2) on documents whose token counts differ between the two halves of the
batch (rank 0 holds 8 tokens, rank 1 32 at world 2), so a loss normalised by the local
instead of the global token count is a real bias.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from trainprobes.reference.bugs import data
from trainprobes.transforms import demo
from trainprobes.transforms.readout import Partition
from trainprobes.transforms.step import TrainingStep

LAYOUT = data.Layout((2, 2, 2, 2, 8, 8, 8, 8), (4.0, 4.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0), positions=8)
step = TrainingStep(model=demo.model, batch=functools.partial(data.documents, LAYOUT), loss=data.loss,
                    tokens=data.tokens, name="uneven")


def mine(batch, ctx):
    n = batch["input"].shape[0] // ctx.world
    return {k: v[ctx.rank * n:(ctx.rank + 1) * n] for k, v in batch.items()}


def global_tokens(piece):
    t = piece["mask"].sum().to(torch.float32).reshape(1)
    dist.all_reduce(t)
    return t


def logged(loss):
    out = loss.detach().clone()
    dist.all_reduce(out)
    return out


# -- FSDP2 (fully_shard on every child with parameters, then the root) --------------------
def fsdp_setup(model, ctx, reshard=True):
    from torch.distributed.fsdp import fully_shard
    for child in model:
        if any(True for _ in child.parameters()):
            fully_shard(child, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)  # in place: returns the same module


fsdp_setup_kept = functools.partial(fsdp_setup, reshard=False)


def fsdp_step(model, batch, ctx):
    """Global token normalisation; FSDP2 averages over ranks, so the loss is scaled back."""
    piece = mine(batch, ctx)
    loss = data.token_loss_sum(model(piece["input"]), piece) / global_tokens(piece)
    (loss * ctx.world).backward()
    return logged(loss)


def moving_fsdp_step(model, batch, ctx):
    """The trainer's whole step: forward, backward, an optimizer step (the weights move;
    the probe must put them back through the wrapper before the next trial)."""
    loss = fsdp_step(model, batch, ctx)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return loss


def fsdp_local_tokens(model, batch, ctx):
    """The bug: each rank divides by its own token count (Megatron-LM #7452's kind)."""
    piece = mine(batch, ctx)
    loss = data.token_loss_sum(model(piece["input"]), piece) / piece["mask"].sum()
    loss.backward()  # FSDP2's average over ranks: the mean of the ranks' means
    return logged(loss) / ctx.world


# -- FSDP1: FlatParameters (one per unit; the Linears their own units in the nested form) --
def fsdp1_setup(model, ctx, orig=False, nested=False):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    policy = ModuleWrapPolicy({torch.nn.Linear}) if nested else None
    return FullyShardedDataParallel(model, device_id=ctx.device, use_orig_params=orig,
                                    auto_wrap_policy=policy)


fsdp1_orig_nested_setup = functools.partial(fsdp1_setup, orig=True, nested=True)


# -- tensor parallel on DTensor -------------------------------------------------------------
def tp_setup(model, ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (ctx.world,))
    return parallelize_module(model, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})


def tp_step(model, batch, ctx):
    loss = data.loss(model(batch["input"]), batch)
    loss.backward()
    return loss.detach()


# -- DDP, buckets as gradient views ---------------------------------------------------------
def ddp_setup(model, ctx):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, gradient_as_bucket_view=True)


def ddp_bf16_setup(model, ctx):
    from trainprobes.transforms.data_parallel import bf16_allreduce_hook
    ddp = ddp_setup(model, ctx)
    ddp.register_comm_hook(None, bf16_allreduce_hook)
    return ddp


ddp_step = fsdp_step  # the same arithmetic: DDP averages over ranks too


# -- Megatron-style main_grad buffers -------------------------------------------------------
def main_grad_setup(model, ctx):
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)


def main_grad_step(model, batch, ctx):
    piece = mine(batch, ctx)
    loss = data.token_loss_sum(model(piece["input"]), piece) / global_tokens(piece)
    loss.backward()
    for p in model.parameters():
        p.main_grad.add_(p.grad)
        p.grad = None  # the optimizer reads main_grad
        dist.all_reduce(p.main_grad)
    return logged(loss)


# -- a row-parallel layer held as plain tensors, with a declared partition -----------------
class _Sum(torch.autograd.Function):
    """all_reduce forward; the backward is the identity (each rank's loss is the same)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _Copy(torch.autograd.Function):
    """Identity forward; all_reduce backward: each rank's input gradient covers only its
    span of the row-parallel layer (Megatron's `f`; without it the replicated layers before
    it get partial gradients, which the probe calls inconsistent)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class RowShard(torch.nn.Module):
    def __init__(self, full: torch.nn.Linear, rank: int, world: int):
        super().__init__()
        k = full.in_features // world
        self.span = (rank * k, (rank + 1) * k)
        self.weight = torch.nn.Parameter(full.weight.detach()[:, rank * k:(rank + 1) * k].clone())
        self.bias = torch.nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        part = _Copy.apply(x)[..., self.span[0]:self.span[1]] @ self.weight.T
        return _Sum.apply(part) + self.bias


def plain_setup(model, ctx):
    model[3] = RowShard(model[3], ctx.rank, ctx.world)


def plain_step(model, batch, ctx):
    loss = data.loss(model(batch["input"]), batch)
    loss.backward()
    return loss.detach()


def waiting_step(model, batch, ctx):
    """A step that says it runs (a file $TRAINPROBES_TEST_MARK.<rank> holding its pid) and
    then takes its time: the interrupt tests stop a launcher while its ranks are inside it."""
    import os
    import time
    mark = os.environ.get("TRAINPROBES_TEST_MARK")
    if mark:
        with open(f"{mark}.{ctx.rank}", "w", encoding="utf-8") as f:
            f.write(str(os.getpid()))
    time.sleep(0.5)
    return plain_step(model, batch, ctx)


plain_partitions = {"3.weight": Partition(dim=1)}
# a declaration whose pieces do not make the parameter: two [4, 4] pieces along dim 0 are [8, 4], not [4, 8]
bad_partitions = {"3.weight": Partition(dim=0)}


# -- bad inputs -----------------------------------------------------------------------------
def raising_setup(model, ctx):
    if ctx.rank == 1:
        raise RuntimeError("no such device mesh")
    return model


class Renamed(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


def renaming_setup(model, ctx):
    return Renamed(model)


def forgetful_step(model, batch, ctx):
    """Never reduces nor keeps the last layer's gradient."""
    loss = fsdp_step(model, batch, ctx)
    for p in model[4].parameters():
        p.grad = None
    return loss


# -- a language model as trainers feed it: several inputs, a dict batch with a scalar
# num_items_in_batch, batches from a DataLoader over a small dataset file -----------------
V, T, H = 11, 6, 8


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.tok_embeddings = torch.nn.Embedding(V, H)
        self.pos_embeddings = torch.nn.Embedding(T, H)
        self.mixer = torch.nn.Linear(H, H)
        self.lm_head = torch.nn.Linear(H, V)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, input_ids, position_ids, attention_mask):
        h = self.tok_embeddings(input_ids) + self.pos_embeddings(position_ids)
        h = torch.tanh(self.mixer(h)) * attention_mask.unsqueeze(-1).to(h.dtype)
        return self.lm_head(h)


def write_dataset(path, rows=64):
    """Token rows with lengths 2 (first half of each batch of 8) and 6 (second half)."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, V, (rows, T), generator=g)
    lengths = torch.tensor([2 if (i % 8) < 4 else 6 for i in range(rows)])
    torch.save({"ids": ids, "lengths": lengths}, path)


class TokenFile(torch.utils.data.Dataset):
    def __init__(self, path):
        d = torch.load(path, weights_only=True)
        self.ids, self.lengths = d["ids"], d["lengths"]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        mask = (torch.arange(T) < n).long()
        labels = torch.where(mask.bool(), torch.roll(self.ids[i], -1), torch.tensor(-100))
        return {"input_ids": self.ids[i], "position_ids": torch.arange(T), "attention_mask": mask,
                "labels": labels}


def collate(items):
    batch = torch.utils.data.default_collate(items)
    batch["num_items_in_batch"] = (batch["labels"] != -100).sum()  # a 0-dim scalar
    return batch


def loader(path, batch_size=8):
    return torch.utils.data.DataLoader(TokenFile(path), batch_size=batch_size, shuffle=False,
                                       collate_fn=collate)


def lm_call(model, batch):
    return model(batch["input_ids"], position_ids=batch["position_ids"],
                 attention_mask=batch["attention_mask"])


def lm_loss_sum(logits, batch):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), batch["labels"].reshape(-1),
                                             ignore_index=-100, reduction="sum")


def lm_loss(logits, batch):
    return lm_loss_sum(logits, batch) / batch["num_items_in_batch"]


def lm_tokens(batch):
    return (batch["labels"] != -100).sum()


def lm_step(path) -> TrainingStep:
    return TrainingStep(model=TinyLM, data=functools.partial(loader, path), loss=lm_loss,
                        tokens=lm_tokens, call=lm_call, name="tinylm")


def lm_ddp_step(model, batch, ctx):
    """num_items_in_batch counts the global batch: each rank's sum over it, DDP's average undone."""
    piece = mine_rows(batch, ctx)
    loss = lm_loss_sum(lm_call(model, piece), piece) / piece["num_items_in_batch"]
    (loss * ctx.world).backward()
    return logged(loss)


def lm_ddp_local_mean(model, batch, ctx):
    """The bug: each rank's own token mean (the 2024 gradient-accumulation normalisation)."""
    piece = mine_rows(batch, ctx)
    loss = lm_loss_sum(lm_call(model, piece), piece) / lm_tokens(piece)
    loss.backward()
    return logged(loss) / ctx.world


def mine_rows(batch, ctx):
    from trainprobes.transforms.step import rows
    n = batch["input_ids"].shape[0] // ctx.world
    return rows(batch, slice(ctx.rank * n, (ctx.rank + 1) * n))
