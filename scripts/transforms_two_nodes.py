"""Two torchrun "nodes" on one host against local ranks: one verdict, bit for bit.

    python scripts/transforms_two_nodes.py [--out tests/data/transforms_two_nodes.json] [--force]

For each case (the FSDP2 local-token bug, the correct FSDP2 module; tests/transforms_user_steps.py),
at world 2 and 16 trials:
  1. the local launcher (trainprobes.transforms.run_probes, 2 ranks);
  2. `python -m trainprobes.transforms.launch --nnodes 2 --nproc-per-node 1 --rdzv-backend
     c10d --rdzv-endpoint 127.0.0.1:PORT` started twice, as two nodes would, each with
     `-- --target ... --step ... --json`: the multi-node rendezvous run for real.
It records each node's exit code (the contract's: the node holding rank 0 says 0 or 1, the
other 0), its wall time, and the verdict's metrics from both; the test
tests/test_transforms_launch.py reads the saved file back. Takes about a minute.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
KEYS = ("equivalent", "transform_verdict", "scale", "scale_ci_low", "scale_ci_high", "max_added_error",
        "worst_parameter", "world")
CASES = {
    "fsdp2 local tokens (bug)": ["--step", "transforms_user_steps:fsdp_local_tokens", "--setup",
                                 "transforms_user_steps:fsdp_setup"],
    "fsdp2 module (correct)": ["--step", "transforms_user_fsdp"],
}
TRIALS = 16


def local(args: list) -> dict:
    sys.path.insert(0, TESTS)
    import transforms_user_steps as u
    from trainprobes.transforms import Probe, run_probes
    from trainprobes.transforms.user import UserStep
    step = args[1]
    setup = args[3] if len(args) > 2 else None
    (r,) = run_probes([Probe(u.step, UserStep(step, setup_fn=setup), trials=TRIALS)], world=2)
    return {k: r.metrics[k] for k in KEYS}


def two_nodes(args: list, rdzv_id: str) -> dict:
    from trainprobes.distributed.launcher import free_port
    port = free_port()
    cmd = [sys.executable, "-m", "trainprobes.transforms.launch", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--",
           "--target", "transforms_user_steps:step", "--backend", "gloo", "--trials", str(TRIALS), "--json",
           *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    nodes = [subprocess.Popen(cmd, cwd=TESTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [n.communicate(timeout=300) for n in nodes]
    wall = time.perf_counter() - start
    printed = [o for o, _ in outs if "{" in o]
    if len(printed) != 1:
        raise SystemExit(f"expected one node to print the Result, got {len(printed)}:\n"
                         + "\n".join(e[-2000:] for _, e in outs))
    doc = json.loads(printed[0][printed[0].index("{"):])
    return {"metrics": {k: doc["metrics"][k] for k in KEYS},
            "exit_codes": sorted(n.returncode for n in nodes), "wall_s": round(wall, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(TESTS, "data", "transforms_two_nodes.json"))
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    a = p.parse_args()
    if os.path.exists(a.out) and not a.force:
        print(f"{a.out} exists: --force to replace it", file=sys.stderr)
        return 2
    import torch
    rows = {}
    for i, (name, args) in enumerate(CASES.items()):
        rows[name] = {"local": local(args), **two_nodes(args, f"two-nodes-{i}")}
        rows[name]["same_verdict"] = rows[name]["local"] == rows[name]["metrics"]
        print(name, rows[name], flush=True)
    doc = {"torch": torch.__version__, "trials": TRIALS, "world": 2,
           "command": "python -m trainprobes.transforms.launch --nnodes 2 --nproc-per-node 1 "
                      "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT -- ... (started twice)",
           "cases": rows}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    return 0 if all(r["same_verdict"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
