#!/usr/bin/env bash
# torchtitan 0.3.0 on the CPU, judged by trainprobes (scripts/torchtitan_check.py).
# A separate venv over the system's CPU torch: torchtitan and the few light packages its
# imports need, all --no-deps (pip must never pull a CUDA torch); trainprobes editable.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${TITAN_VENV:-/work/venvs/titan}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install --no-deps torchtitan==0.3.0 spmd-types einops tyro docstring-parser typeguard
  "$venv/bin/pip" install --no-deps -e "$here/.."
fi
export OMP_NUM_THREADS=1
cd "$here"
exec timeout 3000 "$venv/bin/python" torchtitan_check.py "$@"
