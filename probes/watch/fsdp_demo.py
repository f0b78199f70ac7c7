"""A small FSDP2 run with and without the sentinel: what the tests run on real gloo ranks.

fsdp_task(rank, world, reduce, steps, watch, ...) trains demo.model (an MLP with dropout,
so the run draws from torch's global generator every step) with fully_shard on every
Linear and on the root, on a 1-D CPU mesh, and returns plain data: the losses, the full
weights (gathered), the global generator's state, step times and the sentinel's Results as JSON.

reduce: "fp32" (torch's reduce-scatter in fp32), "bf16" (MixedPrecisionPolicy
reduce_dtype=bf16: gloo sums bf16 as a float add then a round to nearest), "force_sum"
(fp32, set_force_sum_reduction_for_comms: SUM, then FSDP divides), "divide_factor"
(set_gradient_divide_factor(3): PREMUL_SUM(1/3), carried out by a custom comm), "truncating" /
"rounding" (the controls of trainprobes.watch.hooks as the custom reduce-scatter).
"""
from __future__ import annotations

import torch

REDUCES = ("fp32", "bf16", "force_sum", "divide_factor", "truncating", "rounding")


def _premul_sum_base():
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    return ReduceScatter


class PremulSumReduceScatter(_premul_sum_base()):
    """A ReduceScatter that carries out PREMUL_SUM itself (inputs times the op's factor, then
    SUM), which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): what a user of
    set_gradient_divide_factor on gloo has to give FSDP."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist
        from torch.distributed import ReduceOp
        if getattr(op, "op", op) == ReduceOp.PREMUL_SUM:
            input_tensor, op = input_tensor * op.factor, ReduceOp.SUM
        dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op)


def _comm(reduce: str):
    from trainprobes.watch.hooks import RoundingReduceScatter, TruncatingReduceScatter
    if reduce == "divide_factor":
        return PremulSumReduceScatter
    return {"truncating": TruncatingReduceScatter, "rounding": RoundingReduceScatter}.get(reduce)


def fsdp_task(rank: int, world: int, reduce: str = "fp32", steps: int = 20, watch: bool = False,
              seed: int = 0, sentinel_kwargs: dict | None = None, width: int = 64,
              depth: int = 3, batch: int = 16, break_takes: dict | None = None,
              replace_at: int | None = None) -> dict:
    """break_takes: {rank: [i, ...]}: on that rank, the sentinel's i-th copy of a sample
    raises (a failure on one rank only). replace_at: before that step, every FSDP module's
    reduce-scatter is replaced (set_custom_reduce_scatter with the truncating comm) behind
    the sentinel's back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from trainprobes.watch import Sentinel, attach_fsdp2
    from trainprobes.watch.demo import model, regression_steps

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    net = model(width, depth, seed)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if reduce == "bf16" else None)
    for child in net.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    for m in net.modules():
        if reduce == "force_sum" and hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
        if reduce == "divide_factor" and hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(3.0)
    comm = _comm(reduce)
    sentinel = None
    if watch:
        sentinel = Sentinel(**(sentinel_kwargs or {}))
        attach_fsdp2(net, sentinel, reduce_scatter=comm() if comm else None)
        if break_takes and rank in break_takes:
            _break_takes(sentinel._fsdp, break_takes[rank])
    elif comm is not None:
        for m in net.modules():
            if hasattr(m, "set_custom_reduce_scatter") and m._get_fsdp_state()._fsdp_param_groups:
                m.set_custom_reduce_scatter(comm())
    def replace(i):  # a truncating comm set by hand mid-run, after attach
        if i == replace_at:
            from trainprobes.watch.hooks import TruncatingReduceScatter
            for m in net.modules():
                if hasattr(m, "set_custom_reduce_scatter") and m._get_fsdp_state()._fsdp_param_groups:
                    m.set_custom_reduce_scatter(TruncatingReduceScatter())

    losses, times, stopped_at = regression_steps(net, sentinel, steps=steps, batch=batch,
                                                 width=width, seed=seed, rank=rank, before=replace)
    results = [r.to_json() for r in sentinel.close()] if sentinel is not None else []
    weights = {k: v.full_tensor().detach().clone() for k, v in net.state_dict().items()}
    return {"losses": torch.stack(losses), "weights": weights, "rng": torch.random.get_rng_state(),
            "results": results, "stopped_at": stopped_at, "times": times,
            "own_errors": sentinel.error_count if sentinel else 0,
            "own_seconds": sentinel.own_seconds if sentinel else 0.0,
            "skipped": sentinel.summary().get("sentinel/skipped", 0) if sentinel else 0}


def _break_takes(watched, which: list) -> None:
    """The i-th copy of a sample raises, for each i in `which` (on this attach's record)."""
    take, count = watched.take, [0]

    def flaky(*args):
        count[0] += 1
        if count[0] - 1 in which:
            raise RuntimeError("a deliberately failed copy on one rank")
        return take(*args)
    watched.take = flaky


def fsdp_runs_task(rank: int, world: int, runs: list) -> list:
    """fsdp_task once per dict of keyword arguments in `runs`, in the same ranks."""
    return [fsdp_task(rank, world, **kw) for kw in runs]


def fsdp_refusal_task(rank: int, world: int, cases: list) -> list:
    """What attach_fsdp2 says for each case ("" where it attaches)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trainprobes.watch import Sentinel, attach_fsdp2
    from trainprobes.watch.demo import model
    from trainprobes.watch.hooks import TruncatingReduceScatter

    out = []
    for case in cases:
        net = model(16, 1)
        mesh = init_device_mesh("cpu", (world,))
        try:
            if case == "plain":
                pass
            elif case == "hsdp":
                mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
                fully_shard(net, mesh=mesh2)
            elif case == "custom_set":
                fully_shard(net, mesh=mesh)
                net.set_custom_reduce_scatter(TruncatingReduceScatter())
            elif case == "all_reduce_hook":
                fully_shard(net, mesh=mesh)
                net.set_all_reduce_hook(lambda t: None)
            elif case == "partial":
                fully_shard(net[0], mesh=mesh)
            elif case == "twice":
                fully_shard(net, mesh=mesh)
                s = Sentinel()
                attach_fsdp2(net, s)
                net = model(16, 1)
                fully_shard(net, mesh=mesh)
                attach_fsdp2(net, s)
            elif case == "replicate":  # FSDP2's data parallel: an all-reduce, no reduce-scatter
                from torch.distributed._composable.replicate_with_fsdp import replicate
                replicate(net, mesh=mesh)
            elif case == "one_rank":  # a 1-rank shard group: FSDP copies, no reduce-scatter
                fully_shard(net, mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("r", "s"))["s"])
            elif case == "frozen":
                for p in net.parameters():
                    p.requires_grad_(False)
                fully_shard(net, mesh=mesh)
            elif case == "tp":  # FSDP beside tensor parallelism (tp of 1 rank): a 2-D mesh, not HSDP
                from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
                mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
                parallelize_module(net[0], mesh2["tp"], ColwiseParallel())
                fully_shard(net, mesh=mesh2["dp"])
            elif case == "ok":
                fully_shard(net, mesh=mesh)
            elif case == "grouped":  # one FSDP state over two modules, the root holding none
                fully_shard([net[0], net[3]], mesh=mesh)
                fully_shard(net, mesh=mesh)
            comms = attach_fsdp2(net, Sentinel()) if case != "twice" else {}
            out.append(",".join(comms) if case == "grouped" else "")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def lightning_fsdp_task(rank: int, world: int, reduce: str = "fp32", steps: int = 30,
                        sentinel_kwargs: dict | None = None) -> dict:
    """A small MLP trained by a Lightning Trainer under ModelParallelStrategy (fully_shard in
    configure_model, gloo, CPU) with SentinelLightning; its Results as JSON and the
    sentinel's numbers the logger received. reduce: "fp32" or a custom comm's name."""
    import tempfile

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from trainprobes.watch import Sentinel
    from trainprobes.watch.demo import model
    from trainprobes.watch.lightning import SentinelLightning

    torch.set_num_threads(1)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model(64, 2, 0)

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for child in self.net.children():
                if any(True for _ in child.parameters()):
                    fully_shard(child, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * 8 * world, 64, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=8)
    sentinel = Sentinel(**(sentinel_kwargs or {}))
    comm = _comm(reduce)
    with tempfile.TemporaryDirectory() as out:
        trainer = L.Trainer(
            accelerator="cpu", devices=world, max_steps=steps, logger=CSVLogger(out),
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                           process_group_backend="gloo"),
            log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[SentinelLightning(sentinel, packing=False, reduce_scatter=comm() if comm else None)])
        trainer.fit(Module(), loader)
        logged = trainer.logged_metrics
    return {"results": [r.to_json() for r in sentinel.results],
            "logged": {k: float(v) for k, v in logged.items() if k.startswith("sentinel/")}}


def lightning_fsdp_runs_task(rank: int, world: int, runs: list) -> list:
    return [lightning_fsdp_task(rank, world, **kw) for kw in runs]


def fsdp_branch_task(rank: int, world: int, reduce: str = "truncating", steps: int = 20) -> dict:
    """An FSDP module whose reduce-scatter changes size from step to step: the root holds a
    head and a Linear used on odd steps only (FSDP reduce-scatters only the parameters that
    have a gradient), beside one sharded Linear; every reduce-scatter sampled. Returns the
    final Results as JSON and the sentinel's relayout count."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trainprobes.watch import Sentinel, attach_fsdp2

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.odd, self.head = (torch.nn.Linear(16, 16), torch.nn.Linear(16, 16),
                                              torch.nn.Linear(16, 1))
            self.t = 0

        def forward(self, x):
            x = torch.relu(self.body(x))
            return self.head(x + self.odd(x) if self.t % 2 else x)

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    net = Branchy()
    fully_shard(net.body, mesh=mesh)
    fully_shard(net, mesh=mesh)
    comm = _comm(reduce)
    sentinel = Sentinel(sample=1.0, interval=5, max_per_step=4, window=1024)
    attach_fsdp2(net, sentinel, reduce_scatter=comm() if comm else None)
    data = torch.Generator().manual_seed(rank)
    for i in range(steps):
        net.t = i
        x = torch.randn(8, 16, generator=data)
        net(x).square().mean().backward()
        sentinel.step()
    return {"results": [r.to_json() for r in sentinel.close()], "relayouts": sentinel.relayouts}
