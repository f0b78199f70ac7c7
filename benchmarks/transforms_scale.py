"""Peak RSS of rank 0 and the bytes the probe hands to collectives, by world size, with the
statistics summed on the ranks (the default) and with every gradient gathered to rank 0.

    python benchmarks/transforms_scale.py [--worlds 2 4 8] [--trials 8] [--hidden 512]
    python benchmarks/transforms_scale.py --nodes 2 --per-node 8 [--trials 8] [--hidden 512]

Worlds above the local launcher's cap (8 ranks here) run under torch's launcher as `--nodes`
rendezvous'd "nodes" on this host (torch.distributed.run --nnodes N --rdzv-backend c10d,
started N times), each rank running this file's --rank-entry: the same case and counters,
statistics summed on the ranks only.

A fixed model (Linear 4->H, GELU, Linear H->H, GELU, Linear H->2: about H^2 parameters),
DDP on gloo. Each rank counts the bytes of the tensors it passes to torch.distributed's
Python collectives (all_reduce, all_gather, broadcast, send; recv counted as received):
the probe's own traffic (DDP's bucket all-reduces run in its C++ reducer and are not
counted: they are the transform's, the same either way). ru_maxrss of rank 0 at the end.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from trainprobes.distributed.launcher import launch  # noqa: E402
from trainprobes.reference.bugs import data  # noqa: E402
from trainprobes.transforms import DDP, Probe, TrainingStep  # noqa: E402
from trainprobes.transforms.equivalence import finish, prepare  # noqa: E402
from trainprobes.transforms.worker import RankCase, cases_task  # noqa: E402

LAYOUT = data.Layout(tuple([8, 6, 4, 2] * 4), tuple([1.0, 1.5, 2.0, 4.0] * 4), positions=8)


def model(hidden: int) -> torch.nn.Sequential:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(data.D, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
                            torch.nn.GELU(), torch.nn.Linear(hidden, data.O))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return m


def measure_task(rank, world, cases, backend):
    """cases_task with byte counters on the Python collectives, and rank 0's peak RSS."""
    import resource

    import torch.distributed as dist
    count = {"sent": 0, "received": 0}

    def wrap(name, at, key):
        orig = getattr(dist, name)

        def counted(*a, **k):
            t = a[at] if len(a) > at else None
            if isinstance(t, torch.Tensor):
                count[key] += t.numel() * t.element_size()
            elif isinstance(t, list) and name == "all_gather":
                pass
            return orig(*a, **k)
        setattr(dist, name, counted)
    for name, at, key in (("all_reduce", 0, "sent"), ("all_gather", 1, "sent"), ("broadcast", 0, "sent"),
                          ("send", 0, "sent"), ("recv", 0, "received")):
        wrap(name, at, key)
    out = cases_task(rank, world, cases, backend)
    return {"cases": out["cases"], "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "sent": count["sent"], "received": count["received"]}


def run(world: int, gather: bool, trials: int, hidden: int) -> dict:
    step = the_step(hidden)
    p = Probe(step, DDP(), trials=trials)
    prep = prepare(p, world, truth=gather)
    case = RankCase(step, p.transform, prep.seeds, tuple(sys.path), not gather, 0.0)
    outs = launch(measure_task, world, args=([case], "gloo"), timeout=900)
    res = finish(prep, outs[0]["cases"][0], world=world, backend="gloo")
    n = sum(q.numel() for q in step.model().parameters())
    return {"world": world, "mode": "gather" if gather else "local", "verdict": res.metrics["transform_verdict"],
            "scale": res.metrics["scale"], "params": n, "rss0_mib": outs[0]["rss_kib"] / 1024,
            "sent0": outs[0]["sent"], "received0": outs[0]["received"],
            "sent_all": sum(o["sent"] for o in outs)}


def the_step(hidden: int) -> TrainingStep:
    return TrainingStep(model=functools.partial(model, hidden), batch=functools.partial(data.documents, LAYOUT),
                        loss=data.loss, tokens=data.tokens, name=f"mlp{hidden}")


def rank_entry(trials: int, hidden: int) -> int:
    """One rank under torch.distributed.run: the case with the counters; rank 0 prints the
    row as one JSON line."""
    import json
    import os

    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    step = the_step(hidden)
    p = Probe(step, DDP(), trials=trials)
    prep = prepare(p, world, truth=False)
    dist.init_process_group("gloo")
    try:
        out = measure_task(rank, world, [RankCase(step, p.transform, prep.seeds, (), True, 0.0)], "gloo")
        every = [None] * world
        dist.all_gather_object(every, {k: out[k] for k in ("rss_kib", "sent", "received")})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        res = finish(prep, out["cases"][0], world=world, backend="gloo")
        print(json.dumps({"world": world, "mode": "local", "verdict": res.metrics["transform_verdict"],
                          "scale": res.metrics["scale"], "params": sum(q.numel() for q in step.model().parameters()),
                          "rss0_mib": every[0]["rss_kib"] / 1024, "sent0": every[0]["sent"],
                          "received0": every[0]["received"], "sent_all": sum(e["sent"] for e in every),
                          "rss_max_mib": max(e["rss_kib"] for e in every) / 1024}), flush=True)
    return 0


def nodes_run(nodes: int, per_node: int, trials: int, hidden: int) -> dict:
    """`nodes` torchrun agents on this host, rendezvous'd; rank 0's row."""
    import json
    import os
    import subprocess

    from trainprobes.distributed.launcher import free_port
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node",
           str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
           f"scale{port}", str(Path(__file__).resolve()), "--rank-entry", "--trials", str(trials),
           "--hidden", str(hidden)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(nodes)]
    outs = [a.communicate(timeout=1500) for a in agents]
    rows = [json.loads(line) for o, _ in outs for line in o.splitlines() if line.startswith("{")]
    if len(rows) != 1 or any(a.returncode for a in agents):
        raise SystemExit("the nodes did not give one row:\n" + "\n".join(e[-3000:] for _, e in outs))
    return {**rows[0], "mode": f"local, {nodes} nodes x {per_node}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--nodes", type=int, default=0, help="run one world under torch.distributed.run instead")
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--rank-entry", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_entry:
        sys.exit(rank_entry(args.trials, args.hidden))
    print("| world | statistics | verdict | parameters | rank 0 peak RSS (MiB) | rank 0 sent (MB) "
          "| rank 0 received (MB) | all ranks sent (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = ([nodes_run(args.nodes, args.per_node, args.trials, args.hidden)] if args.nodes else
            [run(w, gather, args.trials, args.hidden) for w in args.worlds for gather in (False, True)])
    for r in rows:
        print(f"| {r['world']} | {r['mode']} | {r['verdict']} | {r['params']} | {r['rss0_mib']:.0f} | "
              f"{r['sent0'] / 1e6:.3f} | {r['received0'] / 1e6:.1f} | {r['sent_all'] / 1e6:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
