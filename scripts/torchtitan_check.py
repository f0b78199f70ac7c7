"""torchtitan's own parallelisation of its Llama3, judged against the fp64 single-device
step (scripts/torchtitan_steps.py holds the steps and what it takes to run on a CPU).

    scripts/torchtitan_check.sh          # makes its venv (torch, torchtitan), then runs this
    python scripts/torchtitan_check.py [--trials 16] [--out torchtitan_check.json] [--force]

Through the probe's --step path (trainprobes.transforms.UserStep: setup once per rank,
weights restored through the DTensors, gradients read from them), on gloo:
  world 2: FSDP2 (dp 2), TP (tp 2, sequence parallel), FSDP2 reducing in bf16 (declared
           and not), and a local-token normalisation bug beside the correct step;
  world 4: FSDP2 x TP (2 x 2), and the same reducing in bf16 (declared).
Each parallel step is torchtitan's trainer's: set_spmd_backend as the trainer calls it, and
its own CrossEntropyLoss (vocab-parallel under TP) over the global token count.
Writes the verdicts, scales with their CIs and added errors to --out (default
./torchtitan_check.json; tests/test_transforms_torchtitan.py reads the copy in tests/data/,
refreshed with --out tests/data/torchtitan_check.json --force).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = ("equivalent", "transform_verdict", "scale", "scale_ci_low", "scale_ci_high", "max_added_error",
        "max_relative_error", "dtype", "world", "worst_parameter")
# name: (world, setup, step, precisions)
CASES = {
    "fsdp2 dp2": (2, "fsdp", "step", ()),
    "tp2": (2, "tp", "step", ()),
    "fsdp2 dp2 reduce bf16, declared": (2, "fsdp_bf16_reduce", "step", ("bf16",)),
    "fsdp2 dp2 reduce bf16, undeclared": (2, "fsdp_bf16_reduce", "step", ()),
    "fsdp2 dp2 local-token bug": (2, "fsdp", "step_local_tokens", ()),
    "fsdp2 x tp 2x2": (4, "fsdp_tp", "step", ()),
    "fsdp2 x tp 2x2 reduce bf16, declared": (4, "fsdp_tp_bf16_reduce", "step", ("bf16",)),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--out", default="torchtitan_check.json",
                   help="where the verdicts go (default: torchtitan_check.json in the current folder)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    a = p.parse_args()
    if os.path.exists(a.out) and not a.force:
        print(f"{a.out} exists: --force to replace it", file=sys.stderr)
        return 2
    if not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        print(f"--out {a.out}: its folder does not exist", file=sys.stderr)
        return 2
    sys.path.insert(0, HERE)
    from importlib.metadata import version

    import torch
    import torchtitan_steps as tt
    from trainprobes.transforms import Probe, run_probes
    from trainprobes.transforms.user import UserStep
    rows = {}
    for world in (2, 4):
        names = [n for n, c in CASES.items() if c[0] == world]
        probes = [Probe(tt.single(), UserStep(f"torchtitan_steps:{CASES[n][2]}",
                                              setup_fn=f"torchtitan_steps:{CASES[n][1]}",
                                              precisions=CASES[n][3], title=n),
                        trials=a.trials, seed=0, target=n) for n in names]
        for n, r in zip(names, run_probes(probes, world=world, timeout=1200)):
            rows[n] = {"setup": CASES[n][1], "step": CASES[n][2], "precisions": list(CASES[n][3]),
                       **{k: r.metrics.get(k) for k in KEYS}, "message": r.message}
            print(f"{n}: {r.metrics['transform_verdict']} scale {r.metrics['scale']:.6g}", flush=True)
    doc = {"torchtitan": version("torchtitan"), "torch": torch.__version__, "trials": a.trials,
           "parallel_step": {"loss": "torchtitan.components.loss.CrossEntropyLoss (vocab-parallel "
                                     "under TP)", "spmd_backend": "partial_dtensor (set_spmd_backend)"},
           "model": {"dim": tt.DIM, "heads": tt.HEADS, "layers": tt.LAYERS, "vocab": tt.VOCAB,
                     "seq": tt.SEQ, "batch": tt.BATCH,
                     "parameters": sum(q.numel() for q in tt.model().parameters())},
           "cases": rows}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
