"""The adversarial review's steps (tests/test_transforms_user_review.py): an MLP on token
sequences with uneven tokens per half of the batch, and the bugs the review found."""
import torch
import torch.distributed as dist
import torch.nn as nn
from trainprobes.transforms.readout import Partition
from trainprobes.transforms.step import TrainingStep

B, T, D, H = 8, 6, 4, 8


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))


def batch(g):
    x = torch.randn(B, T, D, generator=g)
    y = torch.randn(B, T, D, generator=g)
    lengths = torch.tensor([1, 2, 1, 2, 6, 6, 5, 6])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return {"input": x, "target": y, "mask": mask, "num_items_in_batch": mask.sum()}


def token_sum(out, b):
    return ((((out - b["target"]) ** 2).sum(-1)) * b["mask"]).sum()


def loss(out, b):
    return token_sum(out, b) / b["num_items_in_batch"]


def tokens(b):
    return b["mask"].sum()


step = TrainingStep(model=model, batch=batch, loss=loss, tokens=tokens, name="rv")


def mine(b, ctx):
    n = b["input"].shape[0] // ctx.world
    return {k: (v if v.dim() == 0 else v[ctx.rank * n:(ctx.rank + 1) * n]) for k, v in b.items()}


def gtokens(piece):
    t = piece["mask"].sum().reshape(1).clone()
    dist.all_reduce(t)
    return t


def logged(l):
    out = l.detach().clone().reshape(1)
    dist.all_reduce(out)
    return out


# ---------------- correct ----------------------------------------------------------------
def ddp_static_setup(model, ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, static_graph=True)


def ddp_bucket_setup(model, ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.0001)


def dp_step(model, b, ctx):
    """global token normalisation via a token all_reduce; DDP averages, so x world."""
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    (l * ctx.world).backward()
    return logged(l)


def nib_step(model, b, ctx):
    """transformers-style: divide by num_items_in_batch (global), x world for DDP's average."""
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / p["num_items_in_batch"]
    (l * ctx.world).backward()
    return logged(l)


def nosync_step(model, b, ctx):
    """2 micro-batches per rank, first under no_sync."""
    p = mine(b, ctx)
    n = p["input"].shape[0] // 2
    N = p["num_items_in_batch"]
    total = 0
    for i in range(2):
        mb = {k: (v if v.dim() == 0 else v[i * n:(i + 1) * n]) for k, v in p.items()}
        l = token_sum(model(mb["input"]), mb) / N
        if i == 0:
            with model.no_sync():
                (l * ctx.world).backward()
        else:
            (l * ctx.world).backward()
        total = total + l.detach()
    return logged(total)


def fsdp_mp_setup(model, ctx):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for i in (0, 2):
        fully_shard(model[i], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)


def tp_setup(model, ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (ctx.world,))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def tp_step(model, b, ctx):
    l = loss(model(b["input"]), b)
    l.backward()
    return l.detach()


class OrigMod(nn.Module):
    """like torch.compile's OptimizedModule: the model under `_orig_mod`."""
    def __init__(self, m):
        super().__init__()
        self._orig_mod = m

    def forward(self, x):
        return self._orig_mod(x)


def origmod_ddp_setup(model, ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(OrigMod(model))


# a single-device model that itself keeps its network under `module` (a user wrapper)
class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.module = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))

    def forward(self, x):
        return self.module(x)


holder_step = TrainingStep(model=Holder, batch=batch, loss=loss, tokens=tokens, name="holder")


def plain_ddp_setup(model, ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model)


# ---------------- buggy ------------------------------------------------------------------
def local_tokens_step(model, b, ctx):
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / p["mask"].sum()
    l.backward()
    return logged(l) / ctx.world


def twice_step(model, b, ctx):
    """DDP averages; the step divides by world again."""
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    l.backward()  # forgot x world: averaged twice
    return logged(l)


def manual_setup(model, ctx):
    return None


def dropped_step(model, b, ctx):
    """manual all_reduce; rank 1's gradient never contributes (rank 1 zeroes before)."""
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    l.backward()
    for q in model.parameters():
        if ctx.rank == 1:
            q.grad.zero_()
        dist.all_reduce(q.grad)
    return logged(l)


def bf16_wire_step(model, b, ctx):
    """correct, with the all-reduce in bf16."""
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    l.backward()
    for q in model.parameters():
        w = q.grad.to(torch.bfloat16)
        dist.all_reduce(w)
        q.grad.copy_(w.float())
    return logged(l)


def fp16_hook_setup(model, ctx):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    d = DDP(model)
    d.register_comm_hook(None, fp16_compress_hook)
    return d


def main_grad_setup(model, ctx):
    for q in model.parameters():
        q.main_grad = torch.zeros_like(q)


def main_grad_unreduced_step(model, b, ctx):
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    l.backward()
    for q in model.parameters():
        q.main_grad.add_(q.grad)
        q.grad = None
    return logged(l)


def main_grad_ok_step(model, b, ctx):
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    l.backward()
    for q in model.parameters():
        q.main_grad.add_(q.grad)
        q.grad = None
        dist.all_reduce(q.main_grad)
    return logged(l)


def small_param_wrong_shard_step(model, b, ctx):
    """correct except the last layer's bias: every rank uses rank 0's shard's gradient for it
    (broadcast instead of all_reduce) x world. Consistent across ranks, not systematic."""
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    l.backward()
    for n, q in model.named_parameters():
        if n == "2.bias":
            dist.broadcast(q.grad, 0)
            q.grad.mul_(ctx.world)
        else:
            dist.all_reduce(q.grad)
    return logged(l)


# plain TP shards: layer 0 colwise (rows of weight), hidden all-gathered
class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(c, x, world, rank):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        c.world, c.rank = world, rank
        return torch.cat(parts, -1)

    @staticmethod
    def backward(c, g):
        k = g.shape[-1] // c.world
        return g[..., c.rank * k:(c.rank + 1) * k].contiguous(), None, None


class ColShard(nn.Module):
    def __init__(self, full, rank, world, reverse=False):
        super().__init__()
        k = full.out_features // world
        self.rank, self.world, self.reverse = rank, world, reverse
        self.weight = nn.Parameter(full.weight.detach()[rank * k:(rank + 1) * k].clone())
        self.bias = nn.Parameter(full.bias.detach()[rank * k:(rank + 1) * k].clone())

    def forward(self, x):
        h = x @ self.weight.T + self.bias
        out = _Gather.apply(h, self.world, self.rank)
        if self.reverse:  # the bug: pieces joined in the wrong order
            k = out.shape[-1] // self.world
            out = torch.cat([out[..., r * k:(r + 1) * k] for r in reversed(range(self.world))], -1)
        return out


def col_setup(model, ctx):
    model[0] = ColShard(model[0], ctx.rank, ctx.world)


def col_reversed_setup(model, ctx):
    model[0] = ColShard(model[0], ctx.rank, ctx.world, reverse=True)


col_partitions = {"0.weight": Partition(0), "0.bias": Partition(0)}
col_wrongdim_partitions = {"0.weight": Partition(1), "0.bias": Partition(0)}


def batch_even(g):
    b = batch(g)
    lengths = torch.tensor([3, 4, 5, 6, 4, 3, 6, 5])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    b["mask"], b["num_items_in_batch"] = mask, mask.sum()
    return b


even_step = TrainingStep(model=model, batch=batch_even, loss=loss, tokens=tokens, name="even")


def wrong_bias_scaled_step(model, b, ctx):
    """correct, except the last layer's bias gradient is rank 0's shard's alone x world
    (consistent on all ranks; zero-mean error, ~100% of that parameter)."""
    return small_param_wrong_shard_step(model, b, ctx)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, D))
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return self.net(self.norm(x))


normed_step = TrainingStep(model=Normed, batch=batch_even, loss=loss, tokens=tokens, name="normed")


def norm_bias_rank0_step(model, b, ctx):
    """correct all-reduce of every gradient except norm.bias, which every rank takes from
    rank 0's shard alone (x world): consistent across ranks, zero-mean, ~100% wrong there."""
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    l.backward()
    for n, q in model.named_parameters():
        if n == "norm.bias":
            dist.broadcast(q.grad, 0)
            q.grad.mul_(ctx.world)
        else:
            dist.all_reduce(q.grad)
    return logged(l)


def norm_bias_rank0_bf16_step(model, b, ctx):
    """the same bug, on a bf16 wire (as the hint suggests the user's wire is)."""
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    l.backward()
    for n, q in model.named_parameters():
        w = q.grad.to(torch.bfloat16)
        if n == "norm.bias":
            dist.broadcast(w, 0)
            w.mul_(ctx.world)
        else:
            dist.all_reduce(w)
        q.grad.copy_(w.float())
    return logged(l)


class Normed128(Normed):
    def __init__(self):
        nn.Module.__init__(self)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, D))
        self.norm = nn.LayerNorm(D)


normed128_step = TrainingStep(model=Normed128, batch=batch_even, loss=loss, tokens=tokens, name="normed128")


def bug_on_bf16_wire(model, b, ctx, bad="norm.weight"):
    """a bf16 all-reduce (declared), but `bad`'s gradient is rank 0's shard alone x world."""
    p = mine(b, ctx)
    l = token_sum(model(p["input"]), p) / gtokens(p)
    l.backward()
    for n, q in model.named_parameters():
        w = q.grad.to(torch.bfloat16)
        if n == bad:
            dist.broadcast(w, 0)
            w.mul_(ctx.world)
        else:
            dist.all_reduce(w)
        q.grad.copy_(w.float())
    return logged(l)


def setup_raises_before_collective(model, ctx):
    """rank 1 fails before DDP's constructor; rank 0 enters DDP's parameter broadcast."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    if ctx.rank == 1:
        raise RuntimeError("rank 1: CUDA-less node")
    return DDP(model)


def setup_returns_tuple(model, ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP
    m = DDP(model)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def step_raises(model, b, ctx):
    raise ValueError("shape mismatch in my trainer")


def data_short():
    g = torch.Generator().manual_seed(0)
    return [batch_even(g) for _ in range(3)]


short_step = TrainingStep(model=model, data=data_short, loss=loss, tokens=tokens, name="short")


def unused_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
    m.extra = nn.Linear(D, D)  # never called
    return m


# ---- a torchtitan-style pipeline split: each rank deletes the layers of the other stage,
# keeping the fully-qualified names of its own (torchtitan pipeline_module_split does this)
def pp_setup(model, ctx):
    assert ctx.world == 2
    if ctx.rank == 0:
        model[2] = nn.Identity()
    else:
        model[0] = nn.Identity()


def pp_step(model, b, ctx):
    x = b["input"]
    if ctx.rank == 0:
        h = model[1](model[0](x))
        dist.send(h.detach().contiguous(), 1)
        g = torch.empty_like(h)
        dist.recv(g, 1)
        h.backward(g)
        return None
    h = torch.empty(x.shape[:-1] + (H,))
    dist.recv(h, 0)
    h.requires_grad_(True)
    l = loss(model[2](h), b)
    l.backward()
    dist.send(h.grad.contiguous(), 0)
    return l.detach()


# ---- off-by-one token count on long sequences (bf16-sized scale error, in fp32)
LT = 64


def batch_long(g):
    x = torch.randn(B, LT, D, generator=g)
    y = torch.randn(B, LT, D, generator=g)
    mask = torch.ones(B, LT)
    return {"input": x, "target": y, "mask": mask, "num_items_in_batch": mask.sum()}


long_step = TrainingStep(model=model, batch=batch_long, loss=loss, tokens=tokens, name="long")


def off_by_one_step(model, b, ctx):
    """each rank counts one token too many (an EOS counted): divides by N + world."""
    p = mine(b, ctx)
    n = p["mask"].sum().reshape(1) + 1
    dist.all_reduce(n)
    l = token_sum(model(p["input"]), p) / n
    (l * ctx.world).backward()
    return logged(l)


# ---- uneven plain shard: layer 0's 8 output rows split 5 / 3 (a valid tiling)
class UnevenColShard(ColShard):
    def __init__(self, full, rank, world):
        nn.Module.__init__(self)
        cuts = [0, 5, 8]
        self.rank, self.world, self.reverse = rank, world, False
        a, b_ = cuts[rank], cuts[rank + 1]
        self.weight = nn.Parameter(full.weight.detach()[a:b_].clone())
        self.bias = nn.Parameter(full.bias.detach()[a:b_].clone())

    def forward(self, x):
        h = x @ self.weight.T + self.bias
        sizes = [5, 3]
        parts = [torch.empty(h.shape[:-1] + (s,)) for s in sizes]
        dist.all_gather(parts, h.detach().contiguous())
        parts[self.rank] = h
        return torch.cat(parts, -1)


def uneven_setup(model, ctx):
    model[0] = UnevenColShard(model[0], ctx.rank, ctx.world)


def uneven_step(model, b, ctx):
    # every rank runs the whole batch; layer 2 is replicated; a shard's grad is exact locally
    l = loss(model(b["input"]), b)
    l.backward()
    return l.detach()


def odd_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, 3))


def batch_odd(g):
    b = batch_even(g)
    b["target"] = b["target"][..., :3]
    return b


odd_step = TrainingStep(model=odd_model, batch=batch_odd, loss=loss, tokens=tokens, name="odd")


def fsdp_plain_setup(model, ctx):
    from torch.distributed.fsdp import fully_shard
    for i in (0, 2):
        fully_shard(model[i])
    fully_shard(model)


def fp8_grads_step(model, b, ctx):
    l = dp_step(model, b, ctx)
    return {"loss": l, "grads": {n: q.grad.to(torch.float8_e4m3fn) for n, q in model.named_parameters()}}


def loss_vector_step(model, b, ctx):
    l = dp_step(model, b, ctx)
    return torch.cat([l, l])


def fsdp_bf16_reduce_setup(model, ctx):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for i in (0, 2):
        fully_shard(model[i], mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def fsdp_opt_setup(model, ctx):
    fsdp_plain_setup(model, ctx)
    model._opt = torch.optim.SGD(model.parameters(), lr=0.5)


def tp_opt_setup(model, ctx):
    m = tp_setup(model, ctx)
    m._opt = torch.optim.SGD(m.parameters(), lr=0.5)
    return m


def opt_nib_step(model, b, ctx):
    """the trainer's whole step: forward, backward, optimizer.step (weights move)."""
    l = nib_step(model, b, ctx)
    model._opt.step()
    return l


def opt_tp_step(model, b, ctx):
    l = tp_step(model, b, ctx)
    model._opt.step()
    return l


unused_step = TrainingStep(model=unused_model, batch=batch, loss=loss, tokens=tokens, name="unused")


def ddp_unused_setup(model, ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, find_unused_parameters=True)
