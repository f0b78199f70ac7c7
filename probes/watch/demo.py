"""A small DDP run with and without the sentinel: what the tests, the benchmark and the docs
run on real gloo ranks (trainprobes.distributed.launcher).

train_task(rank, world, hook, steps, watch, seed, sentinel_kwargs) trains an MLP with dropout
(so the run draws from torch's global generator every step) under DDP with `hook` (a name in
HOOKS) and returns plain data: the losses, the final weights, the global generator's state,
step times, and the sentinel's Results as JSON (when watch is true).
"""
from __future__ import annotations

import time

import torch

HOOKS = ("none", "allreduce", "rounding_bf16", "truncating_bf16", "bf16_compress_hook", "powerSGD")


def hook_by_name(name: str):
    """The comm hook a name in HOOKS stands for (None: DDP's built-in reduction)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook
    from trainprobes.watch.hooks import rounding_bf16_hook, truncating_bf16_hook
    return {"none": None, "allreduce": default_hooks.allreduce_hook,
            "rounding_bf16": rounding_bf16_hook, "truncating_bf16": truncating_bf16_hook,
            "bf16_compress_hook": default_hooks.bf16_compress_hook,
            "powerSGD": powerSGD_hook}[name]


def state_by_name(name: str, group=None):
    """The state the hook a name in HOOKS is registered with: PowerSGD's (rank 1, error
    feedback, compressing from step 2) or the process group (None: as torch reads it)."""
    if name == "powerSGD":
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
        return PowerSGDState(process_group=group, matrix_approximation_rank=1,
                             start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
    return group


def model(width: int = 256, depth: int = 3, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank, as a real run has
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Dropout(0.1)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def train_task(rank: int, world: int, hook: str = "none", steps: int = 20, watch: bool = False,
               seed: int = 0, sentinel_kwargs: dict | None = None, width: int = 256,
               depth: int = 3, batch: int = 32, bucket_cap_mb: float = 0.25,
               break_sentinel: bool = False, break_takes: dict | None = None,
               group_ranks: list | None = None) -> dict:
    """break_sentinel: every check of the sentinel raises (its errors must stay its own).
    break_takes: {rank: [i, ...]}: on that rank, the sentinel's i-th copy of a sample raises
    (a failure on one rank only). group_ranks: DDP (and the hook) run on a subgroup of
    these ranks (every rank calls this; ranks outside it return at once)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from trainprobes.watch import Sentinel, attach_ddp

    torch.set_num_threads(1)
    group = None
    if group_ranks is not None:
        group = dist.new_group(group_ranks)
        if rank not in group_ranks:
            return {}
    net = model(width, depth, seed)
    ddp = DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb, process_group=group)
    sentinel = None
    # hook "none" (attach_ddp's default hook) is given no state, as a user calls it
    state = state_by_name(hook, group) if hook != "none" else None
    if watch:
        sentinel = (_Broken if break_sentinel else Sentinel)(**(sentinel_kwargs or {}))
        if break_takes and rank in break_takes:
            _break_takes(sentinel, break_takes[rank])
        attach_ddp(ddp, sentinel, hook=hook_by_name(hook), state=state)
    elif hook != "none":
        ddp.register_comm_hook(state, hook_by_name(hook))
    losses, times, stopped_at = regression_steps(ddp, sentinel, steps=steps, batch=batch,
                                                 width=width, seed=seed, rank=rank)
    results = [r.to_json() for r in sentinel.close()] if sentinel is not None else []
    return {"losses": torch.stack(losses), "weights": {k: v.detach().clone() for k, v in
                                                       net.state_dict().items()},
            "rng": torch.random.get_rng_state(), "times": times, "results": results,
            "stopped_at": stopped_at, "own_errors": sentinel.error_count if sentinel else 0,
            "skipped": sentinel.summary().get("sentinel/skipped", 0) if sentinel else 0,
            "sentinel_group": dist.get_process_group_ranks(sentinel._group)
            if getattr(sentinel, "_group", None) is not None else []}


def regression_steps(net, sentinel, *, steps: int, batch: int, width: int, seed: int, rank: int,
                     before=None) -> tuple:
    """`steps` SGD steps of `net` (DDP- or FSDP2-wrapped) on a regression of the first 8
    inputs' sum, this rank's data from its own generator; sentinel.step() after each step
    (None: no sentinel); before(i) runs before step i. (losses, step times, the step count
    at which a SentinelFinding stopped the run, or None)."""
    from trainprobes.watch.sentinel import SentinelFinding
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = torch.Generator().manual_seed(seed * 1000 + rank)
    torch.manual_seed(seed + 1)  # dropout's stream, alike with and without the sentinel
    losses, times, stopped_at = [], [], None
    for i in range(steps):
        if before is not None:
            before(i)
        x = torch.randn(batch, width, generator=data)
        y = x[:, :8].sum(1, keepdim=True)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
        if sentinel is not None:
            try:
                sentinel.step()
            except SentinelFinding:
                stopped_at = i + 1
                break
        times.append(time.perf_counter() - t0)
    return losses, times, stopped_at


def runs_task(rank: int, world: int, runs: list) -> list:
    """train_task once per dict of keyword arguments in `runs`, one after another in the same
    ranks (a launch costs seconds; the runs share nothing but the default process group)."""
    return [train_task(rank, world, **kw) for kw in runs]


def refusal_task(rank: int, world: int, hooks: list) -> list:
    """What DDP says when the sentinel attaches each hook: "" where it is accepted."""
    from torch.nn.parallel import DistributedDataParallel
    from trainprobes.watch import Sentinel, attach_ddp
    out = []
    for hook in hooks:
        ddp = DistributedDataParallel(model(16, 1))
        try:
            attach_ddp(ddp, Sentinel(), hook=hook_by_name(hook))
            out.append("")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def _broken(*args, **kwargs):
    raise RuntimeError("a deliberately broken check")


def _break_takes(sentinel, which: list) -> None:
    """The sentinel's i-th copy of a sample raises, for each i in `which` (on this instance)."""
    take, count = sentinel._take, [0]

    def flaky(*args):
        count[0] += 1
        if count[0] - 1 in which:
            raise RuntimeError("a deliberately failed copy on one rank")
        return take(*args)
    sentinel._take = flaky


def plan_task(rank: int, world: int, kwargs_by_rank: list) -> str:
    """attach_ddp with each rank's own Sentinel arguments: what it raises ("" if nothing)."""
    from torch.nn.parallel import DistributedDataParallel
    from trainprobes.watch import Sentinel, attach_ddp
    try:
        attach_ddp(DistributedDataParallel(model(16, 1)), Sentinel(**kwargs_by_rank[rank]))
        return ""
    except Exception as e:
        return f"{type(e).__name__}: {e}"


class _Broken:
    """A Sentinel whose every check raises (the tests' witness that such errors stay its own)."""

    def __new__(cls, **kwargs):
        from trainprobes.watch import Sentinel
        s = Sentinel(**kwargs)
        s._record = _broken  # on the instance: this one sentinel, nothing else
        return s


def _flattening_with_ones_mask():
    """DataCollatorWithFlattening, then the all-ones 2-D attention_mask many trainers add."""
    from transformers import DataCollatorWithFlattening
    flatten = DataCollatorWithFlattening(return_tensors="pt")

    def collate(features):
        b = flatten(features)
        b["attention_mask"] = torch.ones_like(b["input_ids"])
        return b
    return collate


def trainer_task(rank: int, world: int, hook: str = "allreduce", steps: int = 40,
                 sentinel_kwargs: dict | None = None, packed: bool = False) -> dict:
    """A tiny Llama trained by transformers.Trainer under DDP (gloo, CPU) with the sentinel on;
    returns its Results as JSON and what reached Trainer.log. packed: documents of 3 to 12
    tokens flattened into rows beside an all-ones mask (the collator trap)."""
    import tempfile

    from trainprobes.watch import Sentinel, SentinelCallback
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    net = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    if packed:
        lengths = torch.randint(3, 13, (256,), generator=g).tolist()
        data = [{"input_ids": torch.randint(0, 128, (n,), generator=g).tolist()} for n in lengths]
    else:
        ids = torch.randint(0, 128, (256, 32), generator=g)
        data = [{"input_ids": x, "labels": x} for x in ids]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=4,
                                 max_steps=steps, logging_steps=10, report_to=[], save_strategy="no",
                                 ddp_backend="gloo", seed=0, disable_tqdm=True, learning_rate=1e-3)
        trainer = Trainer(model=net, args=args, train_dataset=data,
                          data_collator=_flattening_with_ones_mask() if packed else None)
        # the two lines a user adds (docs/watch.md)
        sentinel = Sentinel(**(sentinel_kwargs or {}))
        trainer.add_callback(SentinelCallback(sentinel, trainer, hook=hook_by_name(hook)))
        trainer.train()
    logged = [{k: v for k, v in h.items() if k.startswith("sentinel/")}
              for h in trainer.state.log_history if "sentinel/step" in h]
    return {"results": [r.to_json() for r in sentinel.results], "logged": logged}


def lightning_task(rank: int, world: int, hook: str = "none", steps: int = 30,
                   sentinel_kwargs: dict | None = None, strategy_hook: str = "none") -> dict:
    """A small MLP trained by a Lightning Trainer (DDPStrategy, gloo, CPU) with the sentinel
    on; returns its Results as JSON and the sentinel's numbers the logger received.
    strategy_hook: given to DDPStrategy(ddp_comm_hook=...) instead (Lightning 2.6.6 drops it
    on CPU: the sentinel's Result names the hook DDP ran)."""
    import tempfile

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy
    from trainprobes.watch import Sentinel
    from trainprobes.watch.lightning import SentinelLightning

    torch.set_num_threads(1)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model(64, 2, 0)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * 8 * world, 64, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :1])
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    sentinel = Sentinel(**(sentinel_kwargs or {}))
    with tempfile.TemporaryDirectory() as out:
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(
            process_group_backend="gloo", ddp_comm_hook=hook_by_name(strategy_hook)), max_steps=steps, logger=CSVLogger(out), log_every_n_steps=1,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[SentinelLightning(sentinel, hook=hook_by_name(hook), packing=False)])
        trainer.fit(Module(), loader)
        logged = trainer.logged_metrics
    return {"results": [r.to_json() for r in sentinel.results],
            "logged": {k: float(v) for k, v in logged.items() if k.startswith("sentinel/")}}
