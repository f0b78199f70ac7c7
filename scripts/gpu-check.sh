#!/usr/bin/env bash
# Every GPU check of trainprobes, in under 5 minutes on one GPU:
#   1. scripts/gpu_check.py: NCCL collectives (world 1, and every visible GPU), bitwise vs the
#      emulator and error vs fp64; the parallel-transforms probe under NCCL (DDP hooks,
#      accumulation, FSDP2, TP/SP, 1F1B, the zoo; one rank per GPU); accumulator reveal of
#      torch.matmul fp16/bf16 with and without reduced-precision reduction, and fp8
#      torch._scaled_mm where the GPU has it; causality and isolation on CUDA tensors.
#      Report: reports/gpu-check.json (or $1). Also saves real fp8 torch._scaled_mm outputs on
#      crafted inputs to tests/data/scaled_mm_outputs.json (kept if present: commit it; the CPU
#      test tests/test_gemm_pin.py then pins the accumulator presets to this GPU).
#   2. every pytest test marked `gpu` in the repo.
#   3. the default audit on this machine (its GPU families included); report beside $1.
#   4. benchmarks/bench_causality.py on the GPU: full causality certification vs a per-cut
#      loop (the batching gain), its section in reports/causality-benchmark.md.
# Every part runs even when an earlier one fails; the exit status is 1 if any failed.
# Without CUDA it fails (exit 2): nothing is checked, so nothing may pass.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-reports/gpu-check.json}"
timeout 300 python scripts/gpu_check.py --out "$out"
rc=$?
if [ "$rc" -eq 2 ]; then exit 2; fi
timeout 90 python -m pytest -q -m gpu -p no:cacheprovider tests || rc=1
timeout 120 python -m trainprobes audit --no-progress --out "$(dirname "$out")/gpu-audit" || rc=1
timeout 240 python benchmarks/bench_causality.py --device cuda --repeats 3 || rc=1
exit $(( rc != 0 ))
