"""Zoo sweep: one fresh process per model type (the first version) against the long-lived
workers of trainprobes.zoo.sweep, on the same model types, one after the other in one run
(so the machine's load is shared), one worker each way.

  python benchmarks/bench_zoo.py --types llama,mixtral,gpt2,qwen3_moe,jamba,gemma2

Prints the wall seconds of each way and their ratio, and where a row's time goes in a fresh
process (imports, the first build, the cells).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def per_process(types) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t = time.perf_counter()
    for mt in types:
        subprocess.run([sys.executable, "-m", "trainprobes.zoo.one", mt], capture_output=True, env=env, check=True)
    return time.perf_counter() - t


def workers(types) -> float:
    from trainprobes.zoo.sweep import sweep
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        sweep(types, Path(d) / "rows.jsonl", workers=1, progress=None)
        return time.perf_counter() - t


def import_profile() -> dict:
    code = ("import time; t = time.perf_counter(); import torch; a = time.perf_counter(); import transformers;"
            "b = time.perf_counter(); from trainprobes.zoo.shrink import build; c = time.perf_counter();"
            "build('llama'); d = time.perf_counter(); build('mistral'); e = time.perf_counter();"
            "import json; print(json.dumps({'torch': a - t, 'transformers': b - a, 'trainprobes.zoo': c - b,"
            "'first build': d - c, 'next build': e - d}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="llama,mixtral,gpt2,qwen3_moe,jamba,gemma2")
    a = p.parse_args()
    types = a.types.split(",")
    load0 = os.getloadavg()[0]
    prof = import_profile()
    old = per_process(types)
    new = workers(types)
    print(json.dumps({"types": types, "per_process_s": round(old, 1), "workers_s": round(new, 1),
                      "ratio": round(new / old, 3), "fresh_process_profile_s": {k: round(v, 2) for k, v in prof.items()},
                      "load_at_start": load0, "load_at_end": os.getloadavg()[0]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
