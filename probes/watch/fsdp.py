"""FSDP2 (torch.distributed.fsdp.fully_shard) through its own extension point,
FSDPModule.set_custom_reduce_scatter: the run's reduce-scatter (torch's default, or the
user's own) wrapped, a sampled share of reduce-scatters checked against an fp64 reduction of
the same inputs.

    attach_fsdp2(model, sentinel, reduce_scatter=None)

What the reduce-scatter sees (torch 2.13, fsdp/_fully_shard/_fsdp_collectives.py,
foreach_reduce): input_tensor, the unsharded gradients of one FSDP module (those that got one)
already cast to reduce_dtype (MixedPrecisionPolicy) and already divided by the
pre-divide factor, flat, as world_size chunks (chunk r goes to rank r); output_tensor, this
rank's chunk of the reduction, before the post-divide; op: AVG (fp32/bf16, the default),
SUM (set_force_sum_reduction_for_comms, or fp16: FSDP divides before and after itself), or
PREMUL_SUM(1/f) (set_gradient_divide_factor(f), f not the world size, which gives AVG; gloo
refuses it). So the comm's output is judged against what it was asked to compute, in fp64:
the sum of its inputs, times 1/world for AVG, times the factor for PREMUL_SUM. FSDP's own
divides outside the comm (a power of two before, a rounding divide after) and the cast to
reduce_dtype are not judged here.

For each reduce-scatter FSDP issues, on every rank in the same order (backward's order):
  1. the sentinel's own generator draws (Sentinel._choose, as for DDP's buckets) whether
     this one is sampled and where its window of n = window // world elements of a chunk
     starts;
  2. if sampled, every chunk's window of this rank's input (world * n elements) is copied
     to a new fp64 tensor before the comm runs (a custom comm may work in place);
  3. the comm runs, untouched, on FSDP's own buffers;
  4. this rank's output window is copied into its own slot of the same fp64 tensor (zeros
     in the other ranks' slots), with a last 'taken' flag (trainprobes.watch.collective);
  5. that tensor is all-reduced (sum) on the sentinel's own group, asynchronously. At the
     next sentinel.step() (or close()) it is waited on: every rank then holds the fp64 sum
     of every chunk's inputs and every rank's output window, the same numbers on every
     rank, and records one signed relative error over all world * n elements (or a skip,
     if some rank raised its flag). Every rank judges the same stream, so a finding stops
     every rank at the same step.

Refused at attach, naming what would not be watched: a model with no FSDPModule in it;
parameters that no fully_shard manages (their gradients are not reduced by FSDP), or none
trainable; HSDP (the all-reduce across replicas would go unwatched), replicate() (FSDP2's
data parallel: an all-reduce, no reduce-scatter) and a 1-rank shard group (FSDP copies the
gradients: no reduce-scatter runs); FSDP on a 2-D mesh beside tensor parallelism (each
data-parallel group would judge, and stop, alone); an all-reduce hook
already set (set_all_reduce_hook: the reduction it does would go unwatched); a module with
several parameter groups (torch refuses a custom reduce-scatter there); a custom
reduce-scatter already set (torch has no public getter for it: pass it as reduce_scatter=,
the sentinel wraps it), and a sentinel attached twice. Either set after attach is seen at
the next step() (_still_watched): the final Results then say 'cannot judge', naming it. Reading what is set goes through
FSDPModule._get_fsdp_state() (read only, to refuse; nothing of FSDP's is replaced).

The fp64 tensors live on the comm's device, and nothing in backward waits for the device
(the flag and the error are read at step()); tested on CPU with gloo only (torch 2.13),
not under NCCL.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import NamedTuple

import torch
from trainprobes.errors import InvalidArgument, InvalidType
from trainprobes.watch.collective import check_plan, flagged, own_group

ROOT = "<root>"


def _reduce_scatter_base():
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    return ReduceScatter


def _default_reduce_scatter():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    return DefaultReduceScatter


def op_scale(op, world: int) -> float | None:
    """What the reduce-scatter multiplies the sum of its inputs by, read from the op FSDP
    passes: SUM 1, AVG 1/world, PREMUL_SUM(f) f; None for an op that is not a sum."""
    from torch.distributed import ReduceOp
    kind = getattr(op, "op", op)
    if kind == ReduceOp.SUM:
        return 1.0
    if kind == ReduceOp.AVG:
        return 1.0 / world
    if kind == ReduceOp.PREMUL_SUM:
        factor = op.factor
        return float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    return None


def module_numel(module, world: int) -> int:
    """The module's reduce-scatter input when every trainable parameter has a gradient
    (dim 0 padded to a multiple of world, as foreach_reduce pads Shard(0)): its stream's
    size. A step's reduce-scatter can be smaller (FSDP reduces only the parameters that got
    a gradient), and that is the same stream, not a re-layout."""
    total = 0
    for pg in module._get_fsdp_state()._fsdp_param_groups:
        for fp in pg.fsdp_params:
            p = fp.sharded_param
            if not p.requires_grad:
                continue
            size = p.size()
            if fp.fsdp_placement.dim == 0 and len(size):
                total += -(-size[0] // world) * world * size[1:].numel()
            else:
                total += p.numel()
    return total


class _Sample(NamedTuple):
    """One sampled reduce-scatter, from its draw to its record."""

    key: str  # the stream: the FSDP module's name
    numel: int  # the stream's size (module_numel), the same whatever this step reduced
    step: int
    start: int  # the window in each chunk
    n: int
    world: int
    me: int  # this rank's index in the reduce-scatter's group
    scale: float  # op_scale
    buf: torch.Tensor  # inputs (world * n), outputs (world * n), the flag
    work: object = None  # the fp64 all-reduce in flight


class _Watched:
    """What attach_fsdp2 attached: the sentinel's record of it (Sentinel._fsdp)."""

    def __init__(self, name: str, modules: list, group, timeout: float):
        self.name = name
        self.modules = modules
        self.group = group
        self.timeout = timedelta(seconds=timeout)
        self.pending: list = []
        self.dtypes: set = set()
        self.ops: set = set()
        self.installed: list = []  # (name, FSDP module, the comm set on it)

    def take(self, input_tensor, world: int, start: int, n: int) -> torch.Tensor:
        """A new fp64 tensor of 2 * world * n + 1 zeros, every chunk's window of this rank's
        input first (never a view of FSDP's buffer: the reduction works on it in place)."""
        out = torch.zeros(2 * world * n + 1, dtype=torch.float64, device=input_tensor.device)
        out[:world * n].view(world, n).copy_(input_tensor.detach().reshape(world, -1)[:, start:start + n])
        return out

    def evidence(self) -> dict:
        # hook_calls (Sentinel._evidence) counts reduce-scatter calls here
        return {"reduce_scatter_configured": self.name, "fsdp_modules": list(self.modules),
                "reduce_dtypes_seen": sorted(self.dtypes), "reduce_ops_seen": sorted(self.ops)}


def _make_comm(base):
    class WatchedReduceScatter(base):
        """FSDP2's ReduceScatter interface (allocate, __call__) around `inner`; see the module
        docstring for what a call does."""

        def __init__(self, inner, sentinel, key: str, watched: _Watched, numel: int):
            self.inner, self.sentinel, self.key, self.watched = inner, sentinel, key, watched
            self.numel = numel

        def allocate(self, size, *, dtype, device):
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, **kw):
            import torch.distributed as dist
            s, w = self.sentinel, self.watched
            s._hook_calls += 1
            t0 = time.perf_counter()
            sample = None
            try:
                world, me = group.size(), dist.get_rank(group)
                w.dtypes.add(str(input_tensor.dtype).replace("torch.", ""))
                w.ops.add(str(getattr(op, "op", op)).split(".")[-1].split(":")[0])
                chunk = output_tensor.numel()
                window = s._choose(chunk, max(1, s.window // world))
                scale = op_scale(op, world)
                if window is not None and scale is None:
                    s._own_error(f"reduce-scatter {self.key}", InvalidArgument(
                        f"op={op!r} is not a sum: nothing to compare in fp64"))
                elif window is not None:
                    start, n = window
                    buf = flagged(s, "sampling a reduce-scatter", 2 * world * n,
                                  lambda: w.take(input_tensor, world, start, n),
                                  device=input_tensor.device)
                    sample = _Sample(self.key, self.numel, s.steps, start, n, world, me, scale, buf)
            except Exception as e:
                s._own_error("choosing a reduce-scatter", e)
            s._add_time(time.perf_counter() - t0)
            # as FSDP called it (async_op only if FSDP passed it)
            work = self.inner(output_tensor=output_tensor, input_tensor=input_tensor,
                              group=group, op=op, **kw)
            if sample is None:
                return work
            t1 = time.perf_counter()
            start, n, world, me, buf = sample.start, sample.n, sample.world, sample.me, sample.buf
            try:
                if kw.get("async_op") and work is not None:  # the output is read below
                    work.wait()
                # copied even when flagged (then skipped anyway): reading the flag here would
                # wait for the device inside backward
                mine = buf[world * n + me * n: world * n + (me + 1) * n]
                mine.copy_(output_tensor.detach().reshape(-1)[start:start + n])
            except Exception as e:
                s._own_error("sampling a reduce-scatter's output", e)
                buf.zero_()
                buf[-1] = 1.0
            try:
                w.pending.append(sample._replace(work=dist.all_reduce(buf, group=w.group, async_op=True)))
            except Exception as e:
                s._own_error("reducing a sample", e)
            s._add_time(time.perf_counter() - t1)
            return work
    return WatchedReduceScatter


def _still_watched(sentinel, watched: _Watched) -> None:
    """Whether FSDP still runs the sentinel's comms with nothing after them (read only):
    set_custom_reduce_scatter (or set_all_reduce_hook) after attach would leave the rest of
    the run unwatched, and a pass on the steps before would be a pass on half the run. The
    first change seen makes the final Result 'cannot judge', naming it."""
    if sentinel.not_applicable is not None:
        return
    for name, m, comm in watched.installed:
        for pg in m._get_fsdp_state()._fsdp_param_groups:
            now = pg._reduce_scatter_comm
            what = (f"its reduce-scatter was replaced by {type(now).__name__}" if now is not comm
                    else "an all-reduce hook was set" if pg._all_reduce_hook is not None else None)
            if what is not None:
                sentinel.not_applicable = (
                    f"FSDP module {name!r}: {what} after attach_fsdp2, by step {sentinel.steps}; "
                    "the reductions since are not watched (attach after setting it, passing the "
                    "comm as reduce_scatter=)")
                sentinel._own_error("watching FSDP's reduce-scatter", RuntimeError(sentinel.not_applicable))
                return


def _flush(sentinel, watched: _Watched) -> None:
    """Wait for the samples' fp64 reductions and record them (at step() and close())."""
    t0 = time.perf_counter()
    try:
        _still_watched(sentinel, watched)
    except Exception as e:
        sentinel._own_error("reading FSDP's reduce-scatter", e)
    while watched.pending:
        x = watched.pending.pop(0)
        m = x.world * x.n
        try:
            x.work.wait(watched.timeout)
            if x.buf[-1].item() != 0:  # some rank sent its flag (or the flag is NaN)
                sentinel._record(x.key, x.numel, x.step, None, None, skipped=True)
            else:
                sentinel._record(x.key, x.numel, x.step, x.buf[m:2 * m], x.buf[:m].mul_(x.scale))
        except Exception as e:
            sentinel._own_error(f"checking reduce-scatter {x.key}", e)
    sentinel._add_time(time.perf_counter() - t0)


def _fsdp_modules(model) -> list:
    """(name, module) per FSDP state: fully_shard([a, b]) gives a and b one state and one
    reduce-scatter, named 'a+b' (set_custom_reduce_scatter on either sets it for both)."""
    from torch.distributed.fsdp import FSDPModule
    states: dict = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            states.setdefault(id(m._get_fsdp_state()), []).append((name, m))
    return [("+".join(n or ROOT for n, _ in group) if len(group) > 1 else group[0][0], group[0][1])
            for group in states.values()]


def _refuse_unwatched(model, modules) -> list:
    """The 1-D mesh's process group; refuses what the sentinel would leave unwatched."""
    from torch.distributed.tensor import DTensor
    unmanaged = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if unmanaged:
        raise InvalidArgument(
            f"{len(unmanaged)} trainable parameters are not managed by fully_shard (e.g. "
            f"{unmanaged[:3]}): FSDP does not reduce their gradients and the sentinel would not "
            "watch them; fully_shard the modules that hold them (or the root)")
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, HSDPMeshInfo
    for name, m in modules:
        # what FSDP will do with the gradients (torch 2.13 foreach_reduce): a DDPMeshInfo
        # all-reduces them, a 1-rank shard group copies them; neither calls the comm
        for pg in m._get_fsdp_state()._fsdp_param_groups:
            info = pg.mesh_info
            if isinstance(info, HSDPMeshInfo):
                raise InvalidArgument(
                    f"FSDP module {name or ROOT!r} is HSDP (a {info.mesh.ndim}-D mesh {tuple(info.mesh.shape)}): it "
                    "all-reduces each shard across replicas after the reduce-scatter, and that "
                    "all-reduce would go unwatched; attach_fsdp2 watches 1-D FSDP only")
            if isinstance(info, DDPMeshInfo):
                raise InvalidArgument(
                    f"module {name or ROOT!r} is replicated (replicate(), FSDP2's data parallel): "
                    "its gradients are all-reduced and no reduce-scatter runs, so attach_fsdp2 "
                    "would watch nothing; it watches fully_shard's reduce-scatter only")
            if info.shard_mesh_size < 2:
                raise InvalidArgument(
                    f"FSDP module {name or ROOT!r} is sharded over 1 rank: FSDP copies its "
                    "gradients and runs no reduce-scatter, so there is nothing to watch; shard "
                    "over 2 or more ranks")
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise InvalidArgument(
                f"parameter {name!r} is sharded on a {mesh.ndim}-D mesh {tuple(mesh.shape)} "
                f"(placements {p.placements}), FSDP beside another parallelism (e.g. tensor "
                "parallel): each data-parallel group would judge its own shards alone and could "
                "stop its ranks while the others wait for them; attach_fsdp2 watches FSDP on a "
                "1-D mesh only")
        group = mesh.get_group()
        groups.setdefault(tuple(_ranks(group)), group)
    if not groups:
        raise InvalidArgument("the model has no trainable parameter (every one has "
                              "requires_grad=False): FSDP reduces no gradient, nothing to watch")
    if len(groups) > 1:
        raise InvalidArgument(f"the parameters are sharded over {len(groups)} different groups of "
                              f"ranks {sorted(groups)}: attach_fsdp2 watches one")
    for name, m in modules:
        state = m._get_fsdp_state()
        if len(state._fsdp_param_groups) > 1:
            raise InvalidArgument(
                f"FSDP module {name or ROOT!r} has {len(state._fsdp_param_groups)} parameter "
                "groups (shard_placement_fn with several meshes): torch refuses a custom "
                "reduce-scatter there, so its reduction cannot be watched")
        for pg in state._fsdp_param_groups:
            if pg._all_reduce_hook is not None:
                raise InvalidArgument(
                    f"FSDP module {name or ROOT!r} has an all-reduce hook set "
                    f"({getattr(pg._all_reduce_hook, '__qualname__', pg._all_reduce_hook)!r}): the "
                    "reduction it does after the reduce-scatter would go unwatched; attach_fsdp2 "
                    "refuses rather than watch half")
    return next(iter(groups.values()))


def _ranks(group) -> list:
    import torch.distributed as dist
    return dist.get_process_group_ranks(group)


def attach_fsdp2(model, sentinel, reduce_scatter=None):
    """Watch the gradient reduce-scatters of a fully_shard'ed `model` (every FSDPModule in
    it) with `sentinel`. reduce_scatter: a custom FSDP2 ReduceScatter to run (wrapped, as
    model.set_custom_reduce_scatter(comm) would run it); default torch's own. Call it on
    every rank, once, after fully_shard and before the first backward. Returns the wrapped
    comms by module name."""
    import torch.distributed as dist
    from trainprobes.watch.sentinel import Sentinel

    if not isinstance(sentinel, Sentinel):
        raise InvalidType(f"sentinel={sentinel!r} must be a trainprobes.watch.Sentinel")
    if not isinstance(model, torch.nn.Module):
        raise InvalidType(f"model={type(model).__name__} must be a torch.nn.Module sharded with "
                          "torch.distributed.fsdp.fully_shard")
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgument("no process group (torch.distributed is not initialised): FSDP2's "
                              "reduce-scatter cannot run, nothing to watch; call "
                              "dist.init_process_group and fully_shard first")
    modules = [(n, m) for n, m in _fsdp_modules(model) if m._get_fsdp_state()._fsdp_param_groups]
    if not modules:
        raise InvalidType(
            f"model={type(model).__name__} is not fully_shard'ed (no FSDPModule with parameters "
            "in it): no FSDP2 reduce-scatter to watch; call fully_shard on it (for DDP, "
            "attach_ddp)")
    if sentinel._hook is not None or sentinel._fsdp is not None:
        raise InvalidArgument("this sentinel is already attached to a model; make one sentinel "
                              "per model")
    base, default = _reduce_scatter_base(), _default_reduce_scatter()
    if reduce_scatter is not None and not isinstance(reduce_scatter, base):
        raise InvalidType(f"reduce_scatter={reduce_scatter!r} must be an FSDP2 ReduceScatter "
                          "(torch.distributed.fsdp._fully_shard._fsdp_api: allocate and __call__)")
    for name, m in modules:
        for pg in m._get_fsdp_state()._fsdp_param_groups:
            comm = pg._reduce_scatter_comm
            if type(comm) is not default:
                raise InvalidArgument(
                    f"FSDP module {name or ROOT!r} already runs the reduce-scatter "
                    f"{type(comm).__name__} (set_custom_reduce_scatter, set_symm_mem or "
                    "set_allocate_memory_from_process_group) and torch 2.13 offers no public getter "
                    "to wrap it: attach before setting it, passing it as attach_fsdp2(model, "
                    "sentinel, reduce_scatter=comm)")
    group = _refuse_unwatched(model, modules)
    inner = reduce_scatter if reduce_scatter is not None else default()
    name = type(inner).__qualname__
    ranks = _ranks(group)
    own = own_group(ranks)
    check_plan(sentinel, name, own)
    watched = _Watched(name, [n or ROOT for n, _ in modules], own, sentinel.timeout)
    comm_type = _make_comm(base)
    comms = {}
    for mod_name, m in modules:  # a stream per FSDP module, keyed by its name in the model
        comms[mod_name or ROOT] = comm = comm_type(inner, sentinel, f"module:{mod_name or ROOT}",
                                                   watched, module_numel(m, len(ranks)))
        m.set_custom_reduce_scatter(comm)
        watched.installed.append((mod_name or ROOT, m, comm))
    sentinel._fsdp = watched
    sentinel._group = own
    sentinel._flushes.append(lambda: _flush(sentinel, watched))
    return comms
