"""The sweep behind docs/drift.md's localisation figures: noise pairs must blame no stage,
injected faults must be found at their block and op, over families, seeds, shapes and fault
positions (tests/test_drift_localize_sweep.py keeps a subset).

  noise pairs  4 families x 5 seeds x {eager vs sdpa in fp32, eager vs sdpa in bf16, fp32 vs
               the same model in bf16, fp32 vs fp64 (not the MoE: its grouped_mm has no fp64)}
  faults       4 families x 3 seeds x {a bf16 MLP, a bf16 attention, a norm epsilon 1e-6 ->
               1e-5, an o_proj off by 1e-3 of its rms} x {first, a middle, last of 4 blocks}
Prints one line per miss and the totals (with the largest noise ratio); writes nothing.
Usage: python scripts/drift_localize_sweep.py [--seeds 5]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from trainprobes.drift import faults
from trainprobes.drift.engines import Engine
from trainprobes.drift.localize import localize_layers
from trainprobes.isolation.hf import tiny_model

FAMILIES = ("llama", "qwen2", "mistral", "qwen2_moe")
FAULTS = {"mlp": lambda m, k: faults.in_dtype(m.model.layers[k].mlp, torch.bfloat16),
          "attention": lambda m, k: faults.in_dtype(m.model.layers[k].self_attn, torch.bfloat16),
          "norm": lambda m, k: faults.norm_epsilon(m.model.layers[k].input_layernorm, 1e-5),
          "attention (o_proj 1e-3)": lambda m, k: faults.stale(m.model.layers[k].self_attn.o_proj.weight, 1e-3)}


def _ids(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randint(0, 128, (4 + seed % 5, 12 + 4 * (seed % 5)), generator=g)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    noise, blamed, worst = 0, 0, 0.0
    for family in FAMILIES:
        for seed in range(args.seeds):
            a = tiny_model(family, "eager", seed=seed, num_hidden_layers=4)
            sdpa = tiny_model(family, "sdpa", seed=seed, num_hidden_layers=4)
            pairs = {"eager vs sdpa fp32": (a, sdpa),
                     "eager vs sdpa bf16": (copy.deepcopy(a).bfloat16(), copy.deepcopy(sdpa).bfloat16()),
                     "fp32 vs bf16": (a, copy.deepcopy(a).bfloat16())}
            if family != "qwen2_moe":  # transformers' grouped_mm experts take no fp64
                pairs["fp32 vs fp64"] = (a, copy.deepcopy(a).double())
            for name, (x, y) in pairs.items():
                loc = localize_layers(Engine(x), Engine(y), _ids(seed))
                noise += 1
                worst = max(worst, max(r.ratio for r in loc.stages))
                if loc.first_layer is not None:
                    blamed += 1
                    print(f"BLAMED {family} seed {seed} {name}: {loc.first_layer} {loc.op}", flush=True)
    found, missed = 0, 0
    for family in FAMILIES:
        for seed in range(3):
            a = tiny_model(family, "eager", seed=10 + seed, num_hidden_layers=4)
            for op, fault in FAULTS.items():
                for k in (0, 2, 3):
                    b = copy.deepcopy(a)
                    fault(b, k)
                    loc = localize_layers(Engine(a), Engine(b), _ids(seed))
                    want = (f"model.layers.{k}", op.split(" ")[0])
                    if (loc.first_layer, loc.op) == want:
                        found += 1
                    else:
                        missed += 1
                        print(f"MISSED {family} seed {seed} {op} block {k}: {loc.first_layer} {loc.op}", flush=True)
    print(f"noise pairs: {noise}, blamed {blamed}, largest mean ratio {worst:.2f}; faults: {found + missed}, "
          f"found {found}, missed {missed}; {time.perf_counter() - t0:.0f} s")
    return 0 if blamed == missed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
