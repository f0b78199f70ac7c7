"""Sweep the transformers causal-LM zoo and save the map.

  python scripts/zoo_sweep.py                          # every registered type, 2 processes
  python scripts/zoo_sweep.py --models llama,mixtral --jsonl /tmp/z.jsonl --out /tmp/z.json
An existing map at --out is replaced only with --force (docs/zoo_map.json: --force).
Resumable: rows already in --jsonl are skipped. The map (JSON) holds the versions, every
cell, the wall time and the largest peak RSS of one model's process.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from trainprobes.zoo.shrink import causal_lm_types, check_model_type
from trainprobes.zoo.sweep import sweep, to_map


def _has_experts(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING
    try:
        cfg = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - ordering only
        return False
    names = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    subs = [cfg] + [v for v in vars(cfg).values() if hasattr(v, "to_dict")]
    return any(isinstance(getattr(c, n, None), int) and getattr(c, n) > 1 for c in subs for n in names)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated model types (all registered)")
    p.add_argument("--jsonl", default="zoo_rows.jsonl", help="finished rows, appended (resume)")
    p.add_argument("--out", default="docs/zoo_map.json", help="the map")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    p.add_argument("--moe-first", action="store_true", help="MoE model types first")
    p.add_argument("--memory-mb", type=int, default=4096, help="address-space limit per worker process")
    p.add_argument("--recycle", type=int, default=40, help="rows a worker measures before it is replaced")
    p.add_argument("--force", action="store_true", help="replace an existing map at --out")
    a = p.parse_args()
    if Path(a.out).exists() and not a.force:   # checked before minutes of work, never someone else's map
        from trainprobes.errors import OutputExists
        raise OutputExists(f"--out {a.out!r} exists (a map someone made?); pass --force to replace it, "
                           f"or name a new file")
    models = [check_model_type(m.strip(), "--models names") for m in a.models.split(",")] if a.models \
        else causal_lm_types()
    if a.moe_first:  # the routers first, so a sweep cut short still maps them
        models = sorted(models, key=lambda m: not _has_experts(m))
    t = time.perf_counter()
    rows = sweep(models, Path(a.jsonl), workers=a.workers, timeout=a.timeout, memory_mb=a.memory_mb,
                 recycle=a.recycle)
    m = to_map({k: rows[k] for k in models if k in rows}, wall_seconds=round(time.perf_counter() - t, 1))
    Path(a.out).write_text(json.dumps(m, indent=1, allow_nan=False) + "\n")
    print(f"zoo: {m['n_model_types']} model types in {m['wall_seconds']} s (this run), map in {a.out}")
    return 0


if __name__ == "__main__":
    from trainprobes.exits import guarded
    raise SystemExit(guarded("zoo_sweep", main))
