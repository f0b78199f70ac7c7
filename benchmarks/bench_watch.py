"""What the sentinel costs a live run: step time with and without it, side by side in one run.

    python benchmarks/bench_watch.py [--steps 150] [--world 2]
    python benchmarks/bench_watch.py --rates 40 [--rate-steps 60]

On `world` gloo ranks (127.0.0.1), each rank builds the same tiny Llama three times under
DDP: without the sentinel (DDP's built-in all-reduce), with it at the defaults, and with it
checking every bucket (sample=1, up to 8 a step). Steps of the three alternate in a rotating
order, so the machine's load falls on all of them alike; the cost is the ratio of mean step
times (a mean, not a median: the sentinel's work falls on the sampled steps only). Then the
two ways to get an fp64 reference of a window are timed: an fp64 all_reduce of the rank's
copy (what the sentinel does) and an all_gather of the fp32 window (summed locally in fp64).

What the cost scales with: per sampled bucket, one copy of min(bucket, window) elements to
fp64 and one fp64 all_reduce of it (twice the bytes of the fp32 reduction of that window),
plus an O(window) comparison when the hook's future completes; the expected number of
checked buckets per step is sample * min(buckets, max_per_step), whatever the model's size.
Every `interval` steps the look runs the bias test on each bucket's kept errors (at most
`keep` floats each) and on all buckets' together.

--memory: the sentinel's real peak memory per rank: the peak resident set (ru_maxrss) of
fresh ranks training one Linear(4096, 2048) (its weight one bucket of 2^23 elements) with
the sentinel checking every bucket at several `window`s, less the same run without it.

--watches: the router, update and GEMM watches at their defaults (routers every 50 steps, 256
tokens; updates every step, 256 elements per parameter; one Linear call's wgrad every 50
steps under fp8-tensor / h200-scaled-mm), each alone and all together (with the bucket
sentinel), and the Trainer callback's defaults (the bucket sentinel and the packing watch's
forward pre-hook, reading every batch), against no sentinel, under DDP on `world` gloo ranks,
steps interleaved as above. --family llama: the Llama's rows alone.
The update and GEMM watches run on the tiny Llama; the router watch on a tiny Mixtral of the
same sizes (the Llama has no router: Mixtral is Llama's attention with MoE blocks, 4 experts,
top-2). The steps are cut into blocks of `--block` steps (a multiple of the watches' 50, so
each block holds its share of checked steps); per block, the ratio of mean step times; the
figure is the median over blocks, beside the smallest and largest.

--rates: over many seeds, how often the fp32 all-reduce and bf16 round-to-nearest (noise)
are called biased (the run-wide false-positive rate, <= alpha by construction), and the step
at which a truncating hook stops the run (stop_on_finding).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from trainprobes.distributed.launcher import launch  # noqa: E402

CONFIGS = {"without": None, "defaults": {}, "every bucket": {"sample": 1.0, "max_per_step": 8,
                                                                  "budget": 24 << 20}}


def _llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg)


def bench_rank(rank: int, world: int, steps: int, seq: int, batch: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from trainprobes.watch import Sentinel, attach_ddp
    from trainprobes.watch.sentinel import POOLED

    torch.set_num_threads(1)
    runs = {}
    for name, kw in CONFIGS.items():
        ddp = DistributedDataParallel(_llama(0))
        sentinel = None
        if kw is not None:
            sentinel = Sentinel(**kw)
            attach_ddp(ddp, sentinel)
        runs[name] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3), sentinel)
    g = torch.Generator().manual_seed(rank)
    times = {n: [] for n in runs}
    names = list(runs)
    for i in range(steps):
        ids = torch.randint(0, 1024, (batch, seq), generator=g)
        order = names[i % 3:] + names[:i % 3]
        for n in order:
            ddp, opt, sentinel = runs[n]
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            if sentinel is not None:
                sentinel.step()
            times[n].append(time.perf_counter() - t0)
    info = {}
    for n, (ddp, _, sentinel) in runs.items():
        if sentinel is not None:
            res = sentinel.close()
            streams = {k: s for k, s in sentinel.streams.streams.items() if k != POOLED}
            info[n] = {"samples": sum(s.samples for s in streams.values()),
                       "buckets": len(streams), "hook_calls": sentinel._hook_calls,
                       "own_errors": sentinel.error_count, "own_seconds": sentinel.own_seconds,
                       "look_seconds": sentinel.look_seconds, "verdicts": sorted({r.verdict for r in res}),
                       "bucket_numel": sorted(s.numel for s in streams.values())}
    # the reference's two ways, on a window of the default size
    n = 1 << 16
    x = torch.randn(n, generator=g)
    ways = {}
    for way in ("fp64 all_reduce", "fp32 all_gather", "fp32 all_reduce (the run's own)"):
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            if way == "fp64 all_reduce":
                dist.all_reduce(x.to(torch.float64, copy=True))
            elif way == "fp32 all_gather":
                out = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(out, x)
                torch.stack(out).to(torch.float64).sum(0)
            else:
                dist.all_reduce(x.clone())
            ts.append(time.perf_counter() - t0)
        ways[way] = statistics.median(ts)
    return {"times": times, "info": info, "ways": ways,
            "params": sum(p.numel() for p in runs["without"][0].parameters())}


def _mixtral(seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=128)
    return MixtralForCausalLM(cfg)


# model -> config -> the watches on (each at its defaults); "ddp" is attach_ddp's bucket sentinel
WATCHES = {"llama": {"without": (), "updates": ("updates",), "gemms": ("gemms",),
                     # SentinelCallback's defaults: the bucket sentinel and the packing watch's
                     # forward pre-hook on the model inside DDP, reading every batch
                     "trainer": ("ddp", "packing"),
                     "all": ("ddp", "updates", "gemms")},
           "mixtral": {"without": (), "routers": ("routers",),
                       "all": ("ddp", "routers", "updates", "gemms")}}


def watches_rank(rank: int, world: int, blocks: int, block: int, seq: int, batch: int,
                 families: tuple = tuple(WATCHES)) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    from trainprobes.watch import Sentinel, attach_ddp, watch_gemms, watch_routers, watch_updates
    from trainprobes.watch.packing_watch import watch_packing

    torch.set_num_threads(1)
    out = {}
    for family, configs in WATCHES.items():
        if family not in families:
            continue
        runs, hook_s = {}, {n: 0.0 for n in configs}
        for name, on in configs.items():
            net = (_llama if family == "llama" else _mixtral)(0)
            ddp = DistributedDataParallel(net)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
            sentinel = Sentinel() if on else None
            if "ddp" in on:
                attach_ddp(ddp, sentinel)
            if "routers" in on:
                watch_routers(net, sentinel)
            if "updates" in on:  # its hooks bracketed by two of ours: its own time
                _bracket(opt, lambda: watch_updates(opt, sentinel), hook_s, name)
            if "gemms" in on:
                watch_gemms(net, sentinel)
            if "packing" in on:
                watch_packing(net, sentinel)
            runs[name] = (ddp, opt, sentinel)
        g = torch.Generator().manual_seed(rank)
        times = {n: [] for n in runs}
        step_s = {n: 0.0 for n in runs}  # in sentinel.step(): the router and GEMM judges
        names = list(runs)
        # the mask a causal-LM collator gives (padded rows): what the packing watch reads
        mask = torch.ones(batch, seq, dtype=torch.long)
        for i in range(blocks * block):
            ids = torch.randint(0, 1024, (batch, seq), generator=g)
            k = i % len(names)
            for n in names[k:] + names[:k]:
                ddp, opt, sentinel = runs[n]
                t0 = time.perf_counter()
                opt.zero_grad()
                ddp(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
                opt.step()
                if sentinel is not None:
                    t1 = time.perf_counter()
                    sentinel.step()
                    step_s[n] += time.perf_counter() - t1
                times[n].append(time.perf_counter() - t0)
        info = {}
        for n, (_, _, sentinel) in runs.items():
            if sentinel is not None:
                res = sentinel.close()
                # the packing watch's pre-hook (its checks run in sentinel.step(), counted there)
                packing = sum(w.seconds["convention"] for w in sentinel.watches if hasattr(w, "seen"))
                info[n] = {"own_errors": sentinel.error_count, "errors": sentinel.errors[-3:],
                           "ddp_seconds": sentinel.own_seconds,  # the bucket sentinel's hook
                           "packing_seconds": packing,
                           "verdicts": sorted({f"{r.target.split('[')[0]}:{r.verdict}" for r in res}),
                           "summary": {k: v for k, v in sentinel.summary().items()
                                       if k.endswith(("_checks", "samples"))}}
        out[family] = {"times": times, "step_seconds": step_s, "hook_seconds": hook_s, "info": info,
                       "params": sum(p.numel() for p in runs["without"][0].parameters())}
    return out


def _bracket(opt, attach, seconds: dict, name: str) -> None:
    """attach() registers the update watch's step pre/post hooks; ours, registered before and
    after it, run just before and after each of them (torch runs step hooks in the order
    registered), so seconds[name] adds up the time spent in the watch's hooks."""
    t = [0.0]

    def start(*_):
        t[0] = time.perf_counter()

    def stop(*_):
        seconds[name] += time.perf_counter() - t[0]
    opt.register_step_pre_hook(start)
    opt.register_step_post_hook(start)
    attach()
    opt.register_step_pre_hook(stop)
    opt.register_step_post_hook(stop)


def watches(a) -> None:
    import os
    if a.steps % a.block:
        raise SystemExit(f"--steps {a.steps} must be a multiple of --block {a.block}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank, in the ranks too
    blocks = a.steps // a.block
    families = tuple(a.family) if a.family else tuple(WATCHES)
    out = launch(watches_rank, a.world, args=(blocks, a.block, a.seq, a.batch, families),
                 timeout=3600)
    print(f"DDP on {a.world} gloo ranks, batch {a.batch}x{a.seq} per rank, {a.steps} steps per "
          f"config in {blocks} blocks of {a.block}, interleaved (a shared machine: read ratios)")
    for family in families:
        r0 = out[0][family]
        # a step ends when its slowest rank does
        t = {n: [max(o[family]["times"][n][i] for o in out) for i in range(a.steps)]
             for n in WATCHES[family]}
        print(f"{family} ({r0['params']:,} parameters)")
        print(f"  {'config':10s} {'mean step ms':>12s} {'vs without: median of blocks':>29s} "
              f"{'[min, max]':>18s} {'own time / step':>16s}  verdicts, checks")
        for n in WATCHES[family]:
            ratios = sorted(statistics.fmean(t[n][b * a.block:(b + 1) * a.block])
                            / statistics.fmean(t["without"][b * a.block:(b + 1) * a.block])
                            for b in range(blocks))
            info = r0["info"].get(n, {})
            # its own time on rank 0: in sentinel.step() (the router and GEMM judges, looks)
            # and in the update watch's optimizer hooks, over the steps' time without it
            # and in the bucket sentinel's comm hook and check
            own = (r0["step_seconds"][n] + r0["hook_seconds"][n] + info.get("ddp_seconds", 0.0)
                   + info.get("packing_seconds", 0.0))
            inside = own / sum(r0["times"]["without"])
            print(f"  {n:10s} {1e3 * statistics.fmean(t[n]):12.2f} {statistics.median(ratios):29.4f} "
                  f"[{ratios[0]:.4f}, {ratios[-1]:.4f}] {inside:16.2%}  "
                  f"{' '.join(info.get('verdicts', []))} {info.get('summary', '')} "
                  f"own errors {info.get('own_errors', '-')} {info.get('errors', '')}")


def rates_rank(rank: int, world: int, seeds: int, steps: int) -> dict:
    """Per seed (model, data, dropout and the sentinel's own seed), each hook at the defaults:
    whether anything was called biased, and at which step a truncating hook stopped the run."""
    from trainprobes.watch.demo import train_task
    out = {"allreduce": [], "rounding_bf16": [], "truncating_bf16": []}
    for seed in range(seeds):
        for hook in out:
            kw = {"seed": seed, "stop_on_finding": hook == "truncating_bf16"}
            r = train_task(rank, world, hook, steps, True, seed, kw)  # 3 buckets
            if hook == "truncating_bf16":
                out[hook].append(r["stopped_at"])
            else:
                out[hook].append(any('"biased": true' in x for x in r["results"]))
    return out


def memory_rank(rank: int, world: int, window: int, steps: int) -> dict:
    """Peak RSS of this rank after `steps` steps, with the sentinel at `window` (0: without)."""
    import resource

    from torch.nn.parallel import DistributedDataParallel
    from trainprobes.watch import Sentinel, attach_ddp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4096, 2048), bucket_cap_mb=64)
    sentinel = None
    if window:
        sentinel = Sentinel(sample=1.0, max_per_step=4, window=window, budget=1 << 40)
        attach_ddp(ddp, sentinel)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(8, 4096, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if sentinel is not None:
            sentinel.step()
    samples = 0
    if sentinel is not None:
        sentinel.close()
        samples = sentinel.streams.streams["all_buckets"].samples
    return {"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "samples": samples}


def memory(a) -> None:
    import os
    # every allocation over 64 KiB its own mmap, unmapped when freed: without it glibc raises
    # its threshold as large blocks are freed and keeps them in the heap, and the peak RSS
    # then says more about fragmentation (measured: +-180 MiB between alike runs) than about
    # the tensors alive at once
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    windows = [0, 1 << 21, 1 << 22, 1 << 23]
    peaks = {}
    for w in windows:  # fresh ranks each: ru_maxrss is a peak over the process's life
        runs = [max(o["maxrss"] for o in launch(memory_rank, a.world, args=(w, 6), timeout=600))
                for _ in range(2)]
        peaks[w] = min(runs)
        print(f"window {w}: peak RSS of 2 runs {[round(r / 2**20, 1) for r in runs]} MiB", flush=True)
    base = peaks[0]
    print(f"peak RSS per rank (the larger of {a.world}), Linear(4096, 2048) under DDP, 6 steps, "
          f"every bucket checked; without the sentinel {base / 2**20:.1f} MiB")
    print(f"{'window':>10s} {'fp64 window':>12s} {'extra peak':>11s} {'extra / fp64 window':>20s}")
    for w in windows[1:]:
        extra = peaks[w] - base
        print(f"{w:10d} {8 * w / 2**20:10.1f} M {extra / 2**20:9.1f} M {extra / (8 * w):20.2f}")
    import tracemalloc

    from trainprobes.watch.stream import Stream
    tracemalloc.start()
    s = Stream("b", 1, 4096)
    for i in range(4096):
        s.add(100_000 + i, 1e-3 + i * 1e-9)
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(f"a stream's kept errors at keep=4096: {kept / 1024:.0f} KiB (per bucket, plus all_buckets)")


def rates(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _rates import rate
    out = launch(rates_rank, a.world, args=(a.rates, a.rate_steps), timeout=3600)[0]
    print(f"{a.rates} seeds, {a.rate_steps} steps each, defaults (alpha 0.01 over the whole run), "
          f"the demo MLP (3 buckets) under DDP on {a.world} gloo ranks")
    for hook in ("allreduce", "rounding_bf16"):
        print(f"  {hook:16s} called biased in {rate(sum(out[hook]), len(out[hook]))} of runs")
    stops = out["truncating_bf16"]
    caught = [s for s in stops if s is not None]
    print(f"  truncating_bf16  caught in {rate(len(caught), len(stops))} of runs; stopped at steps "
          f"{sorted(caught)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rates", type=int, default=0, metavar="SEEDS",
                   help="instead: false-positive and detection rates over this many seeds")
    p.add_argument("--rate-steps", type=int, default=60)
    p.add_argument("--memory", action="store_true", help="instead: the sentinel's peak memory")
    p.add_argument("--watches", action="store_true",
                   help="instead: the router, update and GEMM watches' cost at their defaults")
    p.add_argument("--block", type=int, default=100, help="--watches: steps per block")
    p.add_argument("--family", action="append", choices=list(WATCHES),
                   help="--watches: only this model's rows (repeatable; default: all)")
    a = p.parse_args()
    if a.watches:
        return watches(a)
    if a.memory:
        return memory(a)
    if a.rates:
        return rates(a)
    out = launch(bench_rank, a.world, args=(a.steps, a.seq, a.batch), timeout=1200)
    r0 = out[0]
    base = statistics.fmean(max(o["times"]["without"][i] for o in out) for i in range(a.steps))
    print(f"tiny Llama ({r0['params']:,} parameters), DDP on {a.world} gloo ranks, batch {a.batch}x{a.seq} "
          f"per rank, {a.steps} steps each, interleaved (a shared, loaded machine: read ratios)")
    print(f"{'config':14s} {'mean step ms':>12s} {'vs without':>10s}  paired diff (ms, mean +- 2 se)  samples")
    for name in CONFIGS:
        # a step ends when its slowest rank does
        t = [max(o["times"][name][i] for o in out) for i in range(a.steps)]
        d = [t[i] - max(o["times"]["without"][i] for o in out) for i in range(a.steps)]
        se = statistics.stdev(d) / len(d) ** 0.5 if name != "without" else 0.0
        info = r0["info"].get(name, {})
        print(f"{name:14s} {1e3 * statistics.fmean(t):12.2f} {statistics.fmean(t) / base:10.3f}  "
              f"{1e3 * statistics.fmean(d):+8.3f} +- {2e3 * se:.3f}               "
              f"{info.get('samples', '-')} of {info.get('hook_calls', '-')} bucket calls "
              f"{info.get('verdicts', '')} own errors {info.get('own_errors', '-')}")
    print("buckets (elements):", r0["info"]["defaults"]["bucket_numel"])
    print("the sentinel's own time per step, rank 0 (in the hook and its check, the wait for its "
          "fp64 reduction included; at looks):")
    t_without = statistics.fmean(r0["times"]["without"])
    for name, info in r0["info"].items():
        hook, look = info["own_seconds"] / a.steps, info["look_seconds"] / a.steps
        print(f"  {name:14s} hook {1e3 * hook:.3f} ms + looks {1e3 * look:.3f} ms = "
              f"{(hook + look) / t_without:.2%} of a step without it")
    print("fp64 reference of a 65536-element window, median ms per call (rank 0):")
    for way, s in r0["ways"].items():
        print(f"  {way:32s} {1e3 * s:.3f}")


if __name__ == "__main__":
    main()
