#!/usr/bin/env bash
# torchtitan 0.3.0 on the CPU, judged by trainprobes (scripts/torchtitan_check.py), from a
# fresh machine: python3 (3.10+) and network access are all it needs.
#
#   scripts/torchtitan_check.sh [--trials 16] [--out FILE] [--force]
#
# Its own venv: $TITAN_VENV, default ${XDG_CACHE_HOME:-~/.cache}/trainprobes/torchtitan-venv,
# made once with torch 2.13.0 (by default the CPU wheel from download.pytorch.org; set
# TORCH_INDEX_URL to another index, or to "" for the index pip is configured with), then
# torchtitan and the few light packages its imports need, all --no-deps (pip never swaps
# the torch), then this checkout of trainprobes, editable, under constraints.txt.
# The verdicts go to --out, default ./torchtitan_check.json in the current folder, never
# replaced without --force. The copy the tests read is refreshed on purpose:
#   scripts/torchtitan_check.sh --out tests/data/torchtitan_check.json --force
# pip's output and what the ranks print (torchtitan logs) go to stderr; each case's verdict
# to stdout.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
venv="${TITAN_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/trainprobes/torchtitan-venv}"
if ! "$venv/bin/python" -c "import torch, torchtitan, spmd_types, trainprobes" 2>/dev/null; then
  python3 -m venv "$venv" >&2
  index="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
  "$venv/bin/pip" install ${index:+--index-url "$index"} torch==2.13.0 >&2
  # the versions this check was last run with (see tests/data/torchtitan_check.json)
  "$venv/bin/pip" install --no-deps torchtitan==0.3.0 spmd-types==0.3.1 einops==0.8.2 tyro==1.0.17 \
    docstring-parser==0.18.0 typeguard==4.6.1 >&2
  "$venv/bin/pip" install -e "$repo" -c "$repo/constraints.txt" >&2
fi
export OMP_NUM_THREADS=1
exec timeout 3000 "$venv/bin/python" "$here/torchtitan_check.py" "$@"
