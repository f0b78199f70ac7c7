"""The adversarial review's steps (tests/test_transforms_user_review.py and
tests/test_transforms_readout.py): an MLP on token sequences with uneven tokens per half of
the batch, and the bugs the review found. Not a test file: the ranks import it by name.

Every data-parallel step here is one body (`_data_parallel`): this rank's rows, the token
sum over the global token count, a backward, then a reduction of each gradient that a bug
may change (the wire's dtype, one parameter taken from rank 0 alone, a count off by one)."""
import torch
import torch.distributed as dist
import torch.nn as nn
from trainprobes.transforms.step import TrainingStep

B, T, D, H = 8, 6, 4, 8


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))


def _batch(g, lengths, positions=T):
    x = torch.randn(B, positions, D, generator=g)
    y = torch.randn(B, positions, D, generator=g)
    mask = (torch.arange(positions)[None, :] < torch.tensor(lengths)[:, None]).float()
    return {"input": x, "target": y, "mask": mask, "num_items_in_batch": mask.sum()}


def batch(g):
    return _batch(g, [1, 2, 1, 2, 6, 6, 5, 6])


def batch_even(g):
    return _batch(g, [3, 4, 5, 6, 4, 3, 6, 5])


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


def logged(l):
    out = l.detach().clone().reshape(1)
    dist.all_reduce(out)
    return out


def _data_parallel(model, b, ctx, *, extra_tokens=0, reduce=None, scale=1.0):
    """This rank's rows, their token sum over the global count (plus `extra_tokens` per
    rank: an EOS counted), backward with the loss x `scale` (DDP averages over ranks: x
    world undoes it); reduce(name, grad) then reduces each gradient by hand where given.
    Returns the loss as the trainer logs it."""
    p = mine(b, ctx)
    n = p["mask"].sum().reshape(1) + extra_tokens
    dist.all_reduce(n)
    l = token_sum(model(p["input"]), p) / n
    (l * scale).backward()
    if reduce is not None:
        for name, q in model.named_parameters():
            reduce(name, q)
    return logged(l)


def _all_reduce(name, q, wire=None, bad=None):
    """q.grad summed over ranks on a `wire` dtype; `bad` (the bug) takes rank 0's alone x world."""
    w = q.grad if wire is None else q.grad.to(wire)
    if name == bad:
        dist.broadcast(w, 0)
        w.mul_(dist.get_world_size())
    else:
        dist.all_reduce(w)
    if w is not q.grad:
        q.grad.copy_(w.to(q.grad.dtype))


# ---------------- wrappers ---------------------------------------------------------------
def manual_setup(model, ctx):
    return None


def plain_ddp_setup(model, ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model)


def setup_raises_before_collective(model, ctx):
    """rank 1 fails before DDP's constructor; rank 0 enters DDP's parameter broadcast."""
    if ctx.rank == 1:
        raise RuntimeError("rank 1: CUDA-less node")
    return plain_ddp_setup(model, ctx)


# ---------------- steps under DDP (it averages: x world) ----------------------------------
def dp_step(model, b, ctx):
    return _data_parallel(model, b, ctx, scale=ctx.world)


def off_by_one_step(model, b, ctx):
    """each rank counts one token too many (an EOS counted): divides by N + world."""
    return _data_parallel(model, b, ctx, extra_tokens=1, scale=ctx.world)


def fp8_grads_step(model, b, ctx):
    """correct, but the gradients handed back in fp8 e4m3fn (a 1-byte dtype)."""
    l = dp_step(model, b, ctx)
    return {"loss": l, "grads": {n: q.grad.to(torch.float8_e4m3fn) for n, q in model.named_parameters()}}


def int8_grads_step(model, b, ctx):
    """the gradients handed back as int8 (truncated): never exact, never noise."""
    l = dp_step(model, b, ctx)
    return {"loss": l, "grads": {n: (q.grad * 64).to(torch.int8) for n, q in model.named_parameters()}}


def loss_vector_step(model, b, ctx):
    """a per-rank vector where one loss belongs."""
    l = dp_step(model, b, ctx)
    return torch.cat([l, l])


# ---------------- steps reducing by hand (manual_setup) ------------------------------------
def bug_on_bf16_wire(model, b, ctx, bad="norm.weight"):
    """a bf16 all-reduce (declared), but `bad`'s gradient is rank 0's shard alone x world."""
    return _data_parallel(model, b, ctx, reduce=lambda n, q: _all_reduce(n, q, torch.bfloat16, bad))


# ---------------- models ------------------------------------------------------------------
class Holder(nn.Module):
    """a single-device model that itself keeps its network under `module` (a user wrapper)"""

    def __init__(self):
        super().__init__()
        self.module = model()

    def forward(self, x):
        return self.module(x)


holder_step = TrainingStep(model=Holder, batch=batch, loss=loss, tokens=tokens, name="holder")


class Normed128(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, D))
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return self.net(self.norm(x))


normed128_step = TrainingStep(model=Normed128, batch=batch_even, loss=loss, tokens=tokens, name="normed128")

LT = 64  # off-by-one token count on long sequences (a bf16-sized scale error, in fp32)


def batch_long(g):
    return _batch(g, [LT] * B, LT)


long_step = TrainingStep(model=model, batch=batch_long, loss=loss, tokens=tokens, name="long")


# ---- a torchtitan-style pipeline split: each rank deletes the layers of the other stage,
# keeping the fully-qualified names of its own (torchtitan's pipeline_module_split does this)
def pp_setup(model, ctx):
    if ctx.rank == 0:
        model[2] = nn.Identity()
    else:
        model[0] = nn.Identity()


def pp_lost_setup(model, ctx):
    """the bug: both ranks delete layer 2 (no stage keeps it)."""
    model[2] = nn.Identity()
    if ctx.rank == 1:
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


# ---- an uneven plain shard: layer 0's 8 output rows split 5 / 3 (a valid tiling) ----------
CUTS = (0, 5, 8)


class _Join(torch.autograd.Function):
    """All ranks' pieces of the hidden layer joined (forward); this rank's slice of the
    gradient back (every rank computes the whole loss, so its gradient is the whole one)."""

    @staticmethod
    def forward(c, h, rank, cuts):
        sizes = [cuts[r + 1] - cuts[r] for r in range(len(cuts) - 1)]
        padded = torch.nn.functional.pad(h, (0, max(sizes) - h.shape[-1]))  # gloo gathers equal sizes
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous())
        c.span = (cuts[rank], cuts[rank + 1])
        return torch.cat([x[..., :n] for x, n in zip(parts, sizes)], -1)

    @staticmethod
    def backward(c, g):
        return g[..., c.span[0]:c.span[1]].contiguous(), None, None


class UnevenColShard(nn.Module):
    def __init__(self, full, rank, cuts=CUTS):
        super().__init__()
        self.rank, self.cuts = rank, cuts
        a, z = cuts[rank], cuts[rank + 1]
        self.weight = nn.Parameter(full.weight.detach()[a:z].clone())
        self.bias = nn.Parameter(full.bias.detach()[a:z].clone())

    def forward(self, x):
        return _Join.apply(x @ self.weight.T + self.bias, self.rank, self.cuts)


def uneven_setup(model, ctx):
    model[0] = UnevenColShard(model[0], ctx.rank)


def uneven_step(model, b, ctx):
    """every rank runs the whole batch; layer 2 is replicated; a shard's gradient is its
    slice of the whole gradient"""
    l = loss(model(b["input"]), b)
    l.backward()
    return l.detach()


# ---- a data iterable shorter than the trials -----------------------------------------------
def data_short():
    g = torch.Generator().manual_seed(0)
    return [batch_even(g) for _ in range(3)]


short_step = TrainingStep(model=model, data=data_short, loss=loss, tokens=tokens, name="short")


# ---- a language model whose head is tied to its embedding, in a 2-stage pipeline: stage 0
# keeps the embedding, stage 1 the head (Megatron keeps the tied weight on the first and
# last stages and all-reduces its gradient over them; the bug forgets that all-reduce)
V = 16


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.body = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.embed(ids))))


def tied_batch(g):
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    return {"input": ids[:, :-1], "labels": ids[:, 1:]}


def tied_loss(out, b):
    return nn.functional.cross_entropy(out.flatten(0, 1), b["labels"].flatten())


tied_step = TrainingStep(model=TiedLM, batch=tied_batch, loss=tied_loss, name="tied")


def tied_pp_setup(model, ctx):
    if ctx.rank == 0:
        model.head = None
    else:  # the last stage's own copy of the tied weight, under the head's name
        del model.embed
        model.head.weight = nn.Parameter(model.head.weight.detach().clone())


def _tied_pp(model, b, ctx, reduce_tied):
    if ctx.rank == 0:
        h = torch.tanh(model.body(model.embed(b["input"])))
        dist.send(h.detach().contiguous(), 1)
        g = torch.empty_like(h)
        dist.recv(g, 1)
        h.backward(g)
        tied, out = model.embed.weight, None
    else:
        h = torch.empty(b["input"].shape + (D,))
        dist.recv(h, 0)
        h.requires_grad_(True)
        out = tied_loss(model.head(h), b)
        out.backward()
        dist.send(h.grad.contiguous(), 0)
        tied, out = model.head.weight, out.detach()
    if reduce_tied:
        dist.all_reduce(tied.grad)
    return out


def tied_pp_step(model, b, ctx):
    return _tied_pp(model, b, ctx, reduce_tied=True)


def tied_pp_unreduced(model, b, ctx):
    return _tied_pp(model, b, ctx, reduce_tied=False)


def twice_returned_step(model, b, ctx):
    """correct gradients, and one of them again under DDP's spelling, doubled (the two
    spellings collapsed into one name, the one kept depended on the dict's order)"""
    l = dp_step(model, b, ctx)
    grads = {"module.2.bias": model[2].bias.grad * 2}
    grads.update({n: q.grad for n, q in model.named_parameters()})
    return {"loss": l, "grads": grads}


def hanging_setup(model, ctx):
    """rank 1 never returns (a setup waiting on a device or a file that never comes); its pid
    written to $PIDS_DIR first, so a test can see whether it outlives its launcher"""
    import os
    import time
    folder = os.environ.get("PIDS_DIR")
    if folder:
        with open(os.path.join(folder, f"rank{ctx.rank}"), "w") as f:
            f.write(str(os.getpid()))
    if ctx.rank == 1:
        time.sleep(3600)


# -- a gradient left None: an expert without tokens on a trial, a replica that drops one ----
class TwoHeads(nn.Module):
    """The whole batch goes to one of two heads by the sign of its first feature's mean: the
    other head gets no tokens on that trial (its .grad stays None; the truth's gradient is 0)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(D, H)
        self.heads = nn.ModuleList([nn.Linear(H, D), nn.Linear(H, D)])

    def forward(self, x):
        return self.heads[int(x[..., 0].mean() > 0)](torch.tanh(self.body(x)))


def two_heads():
    torch.manual_seed(0)
    return TwoHeads()


two_heads_step = TrainingStep(model=two_heads, batch=batch, loss=loss, tokens=tokens, name="two_heads")


def replicated_step(model, b, ctx):
    """Every rank the whole batch (replicas identical, no communication)."""
    l = loss(model(b["input"]), b)
    l.backward()
    return l.detach()


_CALLS = [0]


def one_replica_drops_step(model, b, ctx):
    """rank 1 leaves the last bias without a gradient from its second step on; rank 0 keeps it."""
    l = replicated_step(model, b, ctx)
    _CALLS[0] += 1
    if ctx.rank == 1 and _CALLS[0] > 1:
        model[2].bias.grad = None
    return l


# ---------------- fp64: a replica whose gradient differs in its sign bits alone ------------
def model64():
    return model().double()


def batch64(g):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in batch(g).items()}


step64 = TrainingStep(model=model64, batch=batch64, loss=loss, tokens=tokens, name="rv64")
_calls = [0]


def negated_replica_step(model, b, ctx):
    """Correct (DDP), but rank 1 hands back -grad of 2.bias on the trials rank 0 judges (even
    ones at world 2): only the replicas' fingerprints can tell."""
    l = dp_step(model, b, ctx)
    trial, _calls[0] = _calls[0], _calls[0] + 1
    grads = {n: q.grad for n, q in model.named_parameters()}
    if ctx.rank == 1 and trial % 2 == 0:
        bias = next(n for n in grads if n.endswith("2.bias"))  # DDP names it module.2.bias
        grads[bias] = -grads[bias]
    return {"loss": l, "grads": grads}


# ---------------- trials whose every token is masked (the truth's gradient exactly 0) -------
def batch_sparse(g):
    b = batch(g)
    if float(torch.rand(1, generator=g)) < 0.5:
        b["mask"] = torch.zeros_like(b["mask"])
        b["num_items_in_batch"] = b["mask"].sum()
    return b


def loss_clamped(out, b):
    return token_sum(out, b) / b["num_items_in_batch"].clamp(min=1)


step_sparse = TrainingStep(model=model, batch=batch_sparse, loss=loss_clamped, tokens=tokens, name="sparse")


def staged_step(model, b, ctx):
    """Correct; rank 0 hands back layer 0's gradients, rank 1 layer 2's (a stage each), so
    every rank computes the truth of every trial."""
    p = mine(b, ctx)
    n = p["mask"].sum().reshape(1)
    dist.all_reduce(n)
    l = token_sum(model(p["input"]), p) / n.clamp(min=1)
    l.backward()
    for q in model.parameters():
        dist.all_reduce(q.grad)
    keep = "0." if ctx.rank == 0 else "2."
    return {"loss": logged(l), "grads": {k: q.grad for k, q in model.named_parameters() if k.startswith(keep)}}
